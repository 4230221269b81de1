"""An answer typed into the runs page's form, in real Chromium, resumes the run that waited for it.

The promise (docs/dashboard.md, "Waiting for you"): with ``--allow-actions``
the runs page shows each run waiting for a person first, with a form per
question; what a person types there goes through the run's guarded
``answer`` action, the page comes back, and a worker's next claim resumes
the run with the answer. A live update of the page leaves a form being
typed in as it is. On SQLite, and on PostgreSQL when the test server is
available (``EKIT_TEST_POSTGRES_DSN``). Skipped with no Chromium except
under CI (tests/support/browser.py).
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest

from ekit_runtime.queue import Worker, open_queue
from tests.support import ui_flows
from tests.support.browser import UiServer, chrome, require_browser, severe_console_errors, wait_until
from tests.support.queue_backends import queue_url

__all__ = ["queue_url"]  # a fixture, used by name

pytestmark = pytest.mark.timeout(180)

ASKS = {"asks": ui_flows.WORKFLOWS["asks"]}
TYPED = "A <i>title</i> \"quoted\""
RUN = "asks-1"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    require_browser()
    with chrome() as driver:
        yield driver


def _wait_for(condition: Any, what: str, timeout: float = 60.0) -> None:
    tick = threading.Event()
    for _ in range(int(timeout / 0.05)):
        if condition():
            return
        tick.wait(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _refreshed(driver: Any) -> str:
    return str(driver.execute_script("return document.body.dataset.refreshed || ''"))


def _typed(driver: Any) -> tuple[str, str]:
    """The answer and the name typed into the first run's form."""
    from selenium.webdriver.common.by import By

    form = driver.find_element(By.CSS_SELECTOR, f"#waiting .waiting-run[data-run-id='{RUN}'] form.action")
    return (str(form.find_element(By.NAME, "value").get_attribute("value")),
            str(form.find_element(By.NAME, "by").get_attribute("value")))


def test_an_answer_typed_on_the_runs_page_resumes_the_run(browser: Any, queue_url: str) -> None:
    from selenium.webdriver.common.by import By

    with open_queue(queue_url) as queue:
        run_id = queue.submit("asks", {"doc": "c.txt"}, run_id=RUN)
        queue.submit("simple", {"doc": "a.txt"}, run_id="not-waiting")
        asyncio.run(Worker(queue, ASKS, poll=0.05).run_until_idle())
        assert queue.status(run_id).status == "waiting"
        with UiServer(["--queue", queue_url, "--allow-actions", "--port", "0"]) as server:
            browser.get("about:blank")
            severe_console_errors(browser)  # (what a page of an earlier server logged as it stopped)
            browser.get(server.url + "/")
            assert not severe_console_errors(browser)
            heading = browser.find_element(By.CSS_SELECTOR, "#waiting h2").text
            assert heading == "Waiting for you (1)"
            form = browser.find_element(
                By.CSS_SELECTOR, f"#waiting .waiting-run[data-run-id='{RUN}'] form.action")
            form.find_element(By.NAME, "value").send_keys(TYPED)
            who = form.find_element(By.NAME, "by")
            who.clear()
            who.send_keys("ann")
            # A live update while the person types leaves the form (its part did not change) as it is.
            seen = _refreshed(browser)
            wait_until(browser, lambda d: _refreshed(d) != seen, 20, "the runs page never refreshed")
            assert _typed(browser) == (TYPED, "ann")
            # Another run starts waiting: the part is replaced, and what was typed is put back.
            queue.submit("asks", {"doc": "d.txt"}, run_id="asks-2")
            asyncio.run(Worker(queue, ASKS, poll=0.05).run_until_idle())
            wait_until(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#waiting h2").text
                       == "Waiting for you (2)", 20, "the second waiting run never showed")
            assert _typed(browser) == (TYPED, "ann")
            form = browser.find_element(
                By.CSS_SELECTOR, f"#waiting .waiting-run[data-run-id='{RUN}'] form.action")
            form.find_element(By.CSS_SELECTOR, "button.action-answer").click()
            # The answer leads back to the runs page, where the run no longer waits.
            wait_until(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#waiting h2").text
                       == "Waiting for you (1)", 20, "the answered run still waits")
            assert urllib.parse.urlsplit(browser.current_url).path == "/"
            assert queue.status(run_id).status == "queued"
            checkpoint = queue.checkpoint(run_id)
            assert checkpoint is not None
            answer = checkpoint.asked["title"][-1].answer
            assert answer is not None and answer.value == TYPED and answer.by == "ann"
            # A worker resumes the run: the step's ask returns what was typed.
            with ui_flows.WorkerThread(queue, ASKS):
                _wait_for(lambda: queue.status(run_id).status == "finished", "the resumed run to finish")
            result = queue.checkpoint(run_id)
            assert result is not None and result.outputs["title"] == f"{TYPED}: draft of c.txt"
            # Its page shows who answered what.
            browser.get(f"{server.url}/run/{urllib.parse.quote(run_id, safe='')}")
            answers = browser.find_element(By.ID, "answers").text
            assert "ann" in answers and json.dumps(TYPED) in answers  # (as JSON, as the checkpoint holds it)
            assert not severe_console_errors(browser)
