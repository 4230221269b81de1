"""The dashboard (``ekit ui``) in a real browser: headless Chromium driven by selenium.

One queue holds a run in every status (tests/support/ui_flows.py builds it): queued,
running (a worker in this process holds its lease, its first step blocked on
an event), waiting (a step asked a person), finished, failed, cancelled, and
a run whose id, step name and context are markup. ``ekit ui`` serves it from
a real subprocess, and the browser checks what a user sees:

- the pages load with no SEVERE console error (no script error, no failed load);
- the runs table shows every status, and a run's graph nodes carry the right
  ``state-*`` classes;
- live updates arrive with no reload: once the worker finishes the blocked
  step, its node turns ``state-recorded`` in the open run page; a run
  cancelled by another client turns ``cancelled`` in the open runs table;
- markup in names and values renders as text: no ``<img>`` is created and no
  alert opens;
- an action (cancel) works through the page's button with --allow-actions,
  and a POST without the page's token (or its cookie, or from another
  Origin) is refused (403) and changes nothing; an answer typed into the
  waiting run's form requeues it;
- approve, deny and retry work through their buttons, each refused first
  (403, nothing written) over HTTP without the token or the cookie and in
  the page with its form's token forged or removed: an approved run is
  queued again and, once a worker claims it, its step runs approved and the
  run finishes; a denied one ends ``failed`` with ``ApprovalDenied`` and the
  reason typed, its step never run; a retried failed run is queued again;
- a store file (JournalStore) opens as a source too, read-only (a POST is 405).

Skipped when no Chromium is installed, except under CI (see tests/support/browser.py).
"""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import ui_flows
from tests.support.browser import (
    UiServer,
    chrome,
    require_browser,
    run_url,
    severe_console_errors,
    wait_for,
    wait_for_status,
    wait_until,
)

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    require_browser()
    with chrome() as driver:
        yield driver


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A populated queue, the live worker, and ``ekit ui --allow-actions`` on it."""
    require_browser()
    from ekit_runtime.queue import SqliteQueue

    db = tmp_path_factory.mktemp("ui") / "runs.db"
    queue = SqliteQueue(str(db))
    ids = ui_flows.populate(queue)
    with ui_flows.LiveWorker(queue) as live:
        wait_for(live.started, "the live run's first checkpoint")
        with UiServer(["--queue", str(db), "--allow-actions", "--port", "0"]) as server:
            yield {"queue": queue, "ids": ids, "server": server, "live": live, "db": db}


def node_class(driver: Any, step: str) -> str:
    """The class attribute of the graph node of ``step`` ('' when there is none)."""
    return str(
        driver.execute_script(
            "var step = arguments[0];"
            "var n = Array.from(document.querySelectorAll('#graph g.node'))"
            ".find(function (g) { return g.dataset.step === step; });"
            "return n ? n.getAttribute('class') : '';",
            step,
        )
    )


def row_statuses(driver: Any) -> dict[str, str]:
    """Each row of the runs table: run id -> the first word of its status cell.

    Read in one script: the page replaces the table's body on every poll, so
    elements found one call earlier may already be gone.
    """
    return dict(
        driver.execute_script(
            "var out = {};"
            "document.querySelectorAll('#runs tr[data-run-id]').forEach(function (tr) {"
            "  var cell = tr.querySelector('.status');"
            "  out[tr.dataset.runId] = cell ? cell.textContent.trim().split(/\\s+/)[0] : '';"
            "});"
            "return out;"
        )
    )


def row_text(driver: Any, run_id: str) -> str:
    """The whole text of the runs table's row of ``run_id`` ('' when there is none)."""
    return str(
        driver.execute_script(
            "var id = arguments[0];"
            "var tr = Array.from(document.querySelectorAll('#runs tr[data-run-id]'))"
            ".find(function (r) { return r.dataset.runId === id; });"
            "return tr ? tr.textContent : '';",
            run_id,
        )
    )


def load(driver: Any, url: str) -> None:
    driver.get(url)
    errors = severe_console_errors(driver)
    assert not errors, f"console errors on {url}: {errors}"


def test_runs_page_shows_a_run_in_every_status(browser: Any, dashboard: dict[str, Any]) -> None:
    load(browser, dashboard["server"].url + "/")
    rows = row_statuses(browser)
    ids = dashboard["ids"]
    assert rows[ids["queued"]] == "queued"
    assert rows[ids["running"]] == "running"
    assert rows[ids["waiting"]] == "waiting"
    assert rows[ids["finished"]] == "finished"
    assert rows[ids["failed"]] == "failed"
    assert rows[ids["cancelled"]] == "cancelled"
    assert rows[ui_flows.HOSTILE] == "finished"
    # The page polls /api/runs: wait for one refresh, which must not log an error either.
    wait_until(browser, lambda d: d.execute_script("return document.body.dataset.refreshed"), 10)
    assert not severe_console_errors(browser)


def test_run_pages_draw_each_node_state(browser: Any, dashboard: dict[str, Any]) -> None:
    server, ids = dashboard["server"], dashboard["ids"]
    expected = {
        ids["finished"]: {"draft": "recorded", "publish": "recorded", "extra": "skipped"},
        ids["failed"]: {"draft": "recorded", "explode": "failed"},
        ids["waiting"]: {"draft": "recorded", "title": "waiting"},
        ids["running"]: {"start": "recorded", "gate": "running", "after": "not-started"},
        ids["queued"]: {},
    }
    for run_id, states in expected.items():
        load(browser, run_url(server, run_id))
        assert browser.find_elements("css selector", "#graph g.node") or not states
        for step, state in states.items():
            # A running node is what its worker announced (at most a second old): the page's poll brings it.
            wait_until(
                browser,
                lambda d, step=step, state=state: f"state-{state}" in node_class(d, step).split(),
                20,
                f"run {run_id}: node {step} never turned state-{state} ({node_class(browser, step)})",
            )


def test_a_finished_step_turns_recorded_without_a_reload(browser: Any, dashboard: dict[str, Any]) -> None:
    server, ids = dashboard["server"], dashboard["ids"]
    load(browser, run_url(server, ids["running"]))
    wait_until(browser, lambda d: "state-running" in node_class(d, "gate").split(), 20)
    # Read in one script: the page replaces this part on every poll (its ages move).
    assert "on worker" in browser.execute_script("return document.getElementById('in-flight').textContent")
    browser.execute_script("window.__ekitMarker = 'same page';")
    ui_flows.GATE.set()  # the worker finishes 'gate' and saves; the page's poll must show it
    wait_until(
        browser,
        lambda d: "state-recorded" in node_class(d, "gate").split(),
        20,
        "the gate node never turned state-recorded in the open page",
    )
    assert browser.execute_script("return window.__ekitMarker") == "same page"
    assert browser.execute_script("return performance.getEntriesByType('navigation').length") == 1
    wait_until(browser, lambda d: "state-running" in node_class(d, "after").split(), 20)
    assert not severe_console_errors(browser)


def assert_inert(driver: Any) -> None:
    from selenium.common.exceptions import NoAlertPresentException

    assert (
        driver.execute_script("return document.querySelectorAll('img[src=x], script:not([src])').length") == 0
    )
    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert.text  # noqa: B018


def test_markup_in_names_and_values_renders_as_text(browser: Any, dashboard: dict[str, Any]) -> None:
    server = dashboard["server"]
    load(browser, server.url + "/")
    assert ui_flows.HOSTILE in row_text(browser, ui_flows.HOSTILE), "the run with a markup id has no row"
    assert_inert(browser)

    load(browser, run_url(server, ui_flows.HOSTILE))
    text = browser.execute_script("return document.body.textContent")
    assert ui_flows.HOSTILE in text  # the run id, and the step's full name
    assert "state-recorded" in node_class(browser, ui_flows.HOSTILE).split()
    assert_inert(browser)

    load(browser, run_url(server, dashboard["ids"]["failed"]))
    text = browser.execute_script("return document.body.textContent")
    assert "the model refused: <b>not bold</b>" in text  # a step's error message, shown as text
    assert_inert(browser)


def post(url: str, data: dict[str, str], headers: dict[str, str] | None = None) -> int:
    request = urllib.request.Request(
        url, data=urllib.parse.urlencode(data).encode(), method="POST", headers=headers or {}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def test_cancel_works_from_the_page_and_is_refused_without_the_token(
    browser: Any, dashboard: dict[str, Any]
) -> None:
    from selenium.webdriver.common.by import By

    server, queue, ids = dashboard["server"], dashboard["queue"], dashboard["ids"]
    target = ids["to_cancel"]
    action = run_url(server, target) + "/cancel"
    load(browser, run_url(server, target))
    token = (
        browser.find_element(By.CSS_SELECTOR, "#action-cancel")
        .find_element(By.XPATH, "./ancestor::form//input[@name='token']")
        .get_attribute("value")
    )
    cookie = "; ".join(f"{c['name']}={c['value']}" for c in browser.get_cookies())
    assert token and cookie
    # Refused (403), and the run untouched: no token, a wrong one, the token
    # without the page's cookie, the cookie without the token, another site's Origin.
    assert post(action, {}) == 403
    assert post(action, {"token": "not-the-token"}, {"Cookie": cookie}) == 403
    assert post(action, {"token": token}) == 403
    assert post(action, {}, {"Cookie": cookie}) == 403
    assert post(action, {"token": token}, {"Cookie": cookie, "Origin": "http://evil.example"}) == 403
    assert queue.status(target).status == "queued"

    browser.find_element(By.CSS_SELECTOR, "#action-cancel").click()
    wait_for_status(queue, target, "cancelled")
    wait_until(
        browser,
        lambda d: (
            d.find_elements(By.ID, "run-status") and d.find_element(By.ID, "run-status").text == "cancelled"
        ),
        20,
        "the page never showed the run cancelled",
    )
    assert not severe_console_errors(browser)


def test_a_journal_store_file_opens_as_a_read_only_source(browser: Any, tmp_path: Path) -> None:
    import asyncio

    from selenium.webdriver.common.by import By

    from ekit_runtime.stores import JournalStore

    path = tmp_path / "run.journal"
    store = JournalStore(str(path))
    asyncio.run(ui_flows.SIMPLE.run({"doc": "z.txt"}, checkpoint_fn=store.save))
    with UiServer([str(path), "--workflow", "tests.support.ui_flows:SIMPLE", "--port", "0"]) as server:
        load(browser, server.url + "/")
        assert row_statuses(browser) == {"run.journal": "finished"}
        load(browser, run_url(server, "run.journal"))
        assert "state-recorded" in node_class(browser, "publish").split()
        assert "state-skipped" in node_class(browser, "extra").split()
        assert not browser.find_elements(By.CSS_SELECTOR, "form.action")  # no actions on a file
        assert post(run_url(server, "run.journal") + "/cancel", {}) == 405


def test_an_answer_typed_in_the_page_requeues_the_waiting_run(
    browser: Any, dashboard: dict[str, Any]
) -> None:
    from selenium.webdriver.common.by import By

    server, queue, ids = dashboard["server"], dashboard["queue"], dashboard["ids"]
    load(browser, run_url(server, ids["waiting"]))
    form = browser.find_element(By.CSS_SELECTOR, "#questions .question[data-step='title'] form.action")
    form.find_element(By.NAME, "value").send_keys("A <i>title</i>")
    form.find_element(By.CSS_SELECTOR, "#action-answer").click()
    # No worker has 'asks' now: the answered run waits in the queue, the answer recorded.
    wait_for_status(queue, ids["waiting"], "queued")
    wait_until(browser, lambda d: d.find_element(By.ID, "run-status").text == "queued", 20)
    assert not severe_console_errors(browser)


def test_the_runs_table_follows_the_queue_without_a_reload(browser: Any, dashboard: dict[str, Any]) -> None:
    server, queue, ids = dashboard["server"], dashboard["queue"], dashboard["ids"]
    load(browser, server.url + "/")
    browser.execute_script("window.__ekitMarker = 'same page';")

    def status_in_page(d: Any) -> str:
        return row_statuses(d).get(ids["queued"], "")

    assert status_in_page(browser) == "queued"
    queue.cancel(ids["queued"])  # another client acts on the queue; the open page must show it
    wait_until(
        browser, lambda d: status_in_page(d) == "cancelled", 20, "the runs table never showed the cancel"
    )
    assert browser.execute_script("return window.__ekitMarker") == "same page"
    assert browser.execute_script("return performance.getEntriesByType('navigation').length") == 1
    assert not severe_console_errors(browser)


def page_form(driver: Any, verb: str) -> tuple[str, str]:
    """The token of the page's ``verb`` form and the page's cookies, as a client would send them."""
    from selenium.webdriver.common.by import By

    token = (
        driver.find_element(By.CSS_SELECTOR, f"#action-{verb}")
        .find_element(By.XPATH, "./ancestor::form//input[@name='token']")
        .get_attribute("value")
    )
    cookie = "; ".join(f"{c['name']}={c['value']}" for c in driver.get_cookies())
    assert token and cookie
    return token, cookie


def click_with_a_forged_token(driver: Any, verb: str, forged: str | None) -> None:
    """Click ``verb``'s button after setting its form's token to ``forged`` (``None``: removing it);
    the browser must land on the 403 page."""
    from selenium.webdriver.common.by import By

    driver.execute_script(
        "var field = document.querySelector('#action-' + arguments[0])"
        ".closest('form').querySelector('input[name=token]');"
        "if (arguments[1] === null) { field.remove(); } else { field.value = arguments[1]; }",
        verb,
        forged,
    )
    driver.find_element(By.CSS_SELECTOR, f"#action-{verb}").click()
    wait_until(
        driver,
        lambda d: d.find_elements(By.CSS_SELECTOR, "h2.error-code")
        and d.find_element(By.CSS_SELECTOR, "h2.error-code").text == "403",
        20,
        f"a {verb} with a forged token did not land on the 403 page",
    )
    assert "token" in driver.find_element(By.ID, "error").text
    # The refused POST is the one failed load the console reports, and nothing else.
    errors = severe_console_errors(driver)
    assert errors and all(f"/{verb} - " in e["message"] and "403" in e["message"] for e in errors), errors


def assert_refused_without_the_token(driver: Any, server: UiServer, run_id: str, verb: str,
                                     form: dict[str, str]) -> None:
    """Every forged form of ``verb`` on ``run_id`` is a 403: over HTTP, and clicked in the page."""
    token, cookie = page_form(driver, verb)
    action = run_url(server, run_id) + "/" + verb
    assert post(action, form) == 403  # no token, no cookie
    assert post(action, {**form, "token": "not-the-token"}, {"Cookie": cookie}) == 403
    assert post(action, {**form, "token": token}) == 403  # the token without the page's cookie
    assert post(action, form, {"Cookie": cookie}) == 403  # the cookie without the token
    assert post(action, {**form, "token": token}, {"Cookie": cookie, "Origin": "http://evil.example"}) == 403
    click_with_a_forged_token(driver, verb, "not-the-token")
    load(driver, run_url(server, run_id))
    click_with_a_forged_token(driver, verb, None)
    load(driver, run_url(server, run_id))


def drain(queue: Any, workflow: str) -> None:
    """Run a worker for ``workflow`` in this process until nothing is left for it."""
    import asyncio

    from ekit_runtime.queue import Worker

    asyncio.run(Worker(queue, {workflow: ui_flows.WORKFLOWS[workflow]}, poll=0.05).run_until_idle())


def test_approve_from_the_page_requeues_the_run_and_the_step_receives_the_approval(
    browser: Any, dashboard: dict[str, Any]
) -> None:
    from selenium.webdriver.common.by import By

    server, queue, ids = dashboard["server"], dashboard["queue"], dashboard["ids"]
    target = ids["to_approve"]
    assert queue.status(target).status == "waiting"
    load(browser, run_url(server, target))
    assert_refused_without_the_token(browser, server, target, "approve", {"step": "ship"})
    assert queue.status(target).status == "waiting"
    assert queue.checkpoint(target).asked["ship"][-1].answer is None

    form = browser.find_element(By.CSS_SELECTOR, "#questions .question[data-step='ship'] form.action")
    by = form.find_element(By.NAME, "by")
    by.clear()
    by.send_keys("ann")
    browser.find_element(By.CSS_SELECTOR, "#action-approve").click()
    wait_for_status(queue, target, "queued")  # claimable again: no worker serves 'approves' yet
    wait_until(browser, lambda d: d.find_element(By.ID, "run-status").text == "queued", 20)
    answer = queue.checkpoint(target).asked["ship"][-1].answer
    assert answer is not None and answer.approved is True and answer.by == "ann"

    drain(queue, "approves")  # a worker claims it; the step runs again and this time is approved
    assert queue.status(target).status == "finished"
    assert queue.result(target).outputs["ship"] == "shipped: draft of h.txt"
    wait_until(browser, lambda d: d.find_element(By.ID, "run-status").text == "finished", 20,
               "the open page never showed the approved run finished")
    assert not severe_console_errors(browser)


def test_deny_from_the_page_ends_the_run_failed_with_the_reason_given(
    browser: Any, dashboard: dict[str, Any]
) -> None:
    from selenium.webdriver.common.by import By

    server, queue, ids = dashboard["server"], dashboard["queue"], dashboard["ids"]
    target = ids["to_deny"]
    load(browser, run_url(server, target))
    assert_refused_without_the_token(browser, server, target, "deny", {"step": "ship", "reason": "no"})
    assert queue.status(target).status == "waiting"
    assert queue.checkpoint(target).asked["ship"][-1].answer is None

    form = browser.find_element(By.CSS_SELECTOR, "#questions .question[data-step='ship'] form.action "
                                                 "input[name='reason']")
    form.send_keys("not this week")
    browser.find_element(By.CSS_SELECTOR, "#action-deny").click()
    wait_for_status(queue, target, "queued")
    answer = queue.checkpoint(target).asked["ship"][-1].answer
    assert answer is not None and answer.approved is False and answer.by == "dashboard"
    assert answer.reason == "not this week"

    # As documented: the next worker to claim it ends it failed, without running the step.
    drain(queue, "approves")
    info = queue.status(target)
    assert info.status == "failed"
    assert info.error == "ApprovalDenied: step 'ship' was denied approval: not this week"
    assert "ship" not in queue.checkpoint(target).outputs
    wait_until(browser, lambda d: d.find_element(By.ID, "run-status").text == "failed", 20,
               "the open page never showed the denied run failed")
    assert not severe_console_errors(browser)


def test_retry_from_the_page_queues_the_failed_run_again(browser: Any, dashboard: dict[str, Any]) -> None:
    from selenium.webdriver.common.by import By

    server, queue, ids = dashboard["server"], dashboard["queue"], dashboard["ids"]
    target = ids["to_retry"]
    before = queue.status(target)
    assert before.status == "failed"
    load(browser, run_url(server, target))
    assert_refused_without_the_token(browser, server, target, "retry", {})
    assert queue.status(target) == before  # refused: nothing written

    browser.find_element(By.CSS_SELECTOR, "#action-retry").click()
    wait_for_status(queue, target, "queued")  # no worker serves 'broken' now: it stays queued
    wait_until(browser, lambda d: d.find_element(By.ID, "run-status").text == "queued", 20,
               "the page never showed the retried run queued")
    after = queue.status(target)
    assert after.error is None and after.epoch == before.epoch + 1
    assert not browser.find_elements(By.CSS_SELECTOR, "#action-retry")  # a queued run offers cancel
    assert browser.find_elements(By.CSS_SELECTOR, "#action-cancel")
    assert not severe_console_errors(browser)
