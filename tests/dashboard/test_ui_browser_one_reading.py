"""In a real browser, an open run page shows one reading of the run, all of it, as the run advances.

The promise (docs/dashboard.md, "A run's page"): a live update replaces every
part of the page together, from one reading of the run: the graph's item
counts, the step table, the heading's progress, the record's usage, what a
resume would do, the attempts running now. A screenshot once showed "3/8
items" in the graph beside "7/8" in the table, because the updates replaced
the table but never the graph's text, the usage nor the audit.

A worker in this process runs a mapped step whose items each wait for the
test; the test lets one item finish at a time, waits for the queue to record
it (the run then holds still), and waits for the open page to show exactly
what the dashboard renders for that reading, part by part; every state of
the page seen on the way must agree with itself (graph count = table count).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from selenium.common.exceptions import TimeoutException

from ekit_runtime import PatternResult, Step, TokenUsage, Workflow
from ekit_runtime.queue import SqliteQueue
from ekit_runtime.ui import QueueSource
from ekit_runtime.ui.pages import run_parts
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
from tests.support.ui_flows import WorkerThread

pytestmark = pytest.mark.timeout(120)

ITEMS = 5
GATES = [threading.Event() for _ in range(ITEMS)]


def _work(ctx: Any) -> PatternResult[int]:
    item = int(ctx["split"])
    if not GATES[item].wait(60):
        raise TimeoutError(f"the test never let item {item} finish")
    return PatternResult(item * 10, cost=TokenUsage(10, 5, 1))


COUNTS = Workflow([
    Step("split", lambda ctx: list(range(ITEMS))),
    Step("work", _work, ("split",), map_over="split"),
    Step("total", lambda ctx: sum(ctx["work"]), ("work",)),
])


class _Text(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []

    def handle_data(self, data: str) -> None:
        self.parts.append(data)


def text_of(html: str) -> str:
    """The text a browser's ``textContent`` gives for ``html``, the attempts' ages blanked (they move)."""
    parser = _Text()
    parser.feed(html)
    parser.close()
    return re.sub(r"for \d+[smhd]", "for ...", "".join(parser.parts))


def expected_texts(queue: SqliteQueue, run_id: str) -> dict[str, str]:
    view = QueueSource(queue, "").view(run_id)
    assert view is not None
    return {key: text_of(html) for key, html in run_parts(view, None).items()}


def page_state(driver: Any) -> dict[str, Any]:
    """Every part's text, and the mapped step's counts in the graph and the table, in one script."""
    state: dict[str, Any] = driver.execute_script(
        "var parts = {};"
        "document.querySelectorAll('#run > div.part').forEach(function (p) { parts[p.id] = p.textContent; });"
        "var node = document.querySelector('#graph g.node[data-step=\"work\"] text.items');"
        "var cell = document.querySelector('#steps tr[data-step=\"work\"] td.items');"
        "return {parts: parts, graph: node ? node.textContent : '', table: cell ? cell.textContent : ''};"
    )
    state["parts"] = {k: re.sub(r"for \d+[smhd]", "for ...", v) for k, v in state["parts"].items()}
    return state


def _count(text: str) -> str:
    found = re.match(r"\s*(\d+/\d+)", text)
    return found.group(1) if found else text


def _open_every_gate() -> None:
    for gate in GATES:
        gate.set()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[SqliteQueue, UiServer]]:
    require_browser()
    for gate in GATES:
        gate.clear()
    queue = SqliteQueue(str(tmp_path / "runs.db"))
    queue.submit("counts", {}, run_id="counts-1")
    with WorkerThread(queue, {"counts": COUNTS}, release=_open_every_gate):
        wait_for(lambda: (cp := queue.checkpoint("counts-1")) is not None and "split" in cp.outputs,
                 "the run's first checkpoint")
        with UiServer(["--queue", str(tmp_path / "runs.db"), "--port", "0"]) as server:
            yield queue, server
    queue.close()


def _items_recorded(queue: SqliteQueue) -> int:
    cp = queue.checkpoint("counts-1")
    return 0 if cp is None else sum(1 for name in cp.outputs if name.startswith("work["))


def wait_for_the_reading(driver: Any, queue: SqliteQueue, seen: list[dict[str, Any]], what: str) -> None:
    """Wait until every part of the open page shows what the dashboard renders for the run now."""
    expected: dict[str, str] = {}

    def shows(d: Any) -> bool:
        # The run holds still, but what its worker says it runs lags up to a
        # second: the reading to show is the dashboard's latest.
        expected.clear()
        expected.update(expected_texts(queue, "counts-1"))
        state = page_state(d)
        seen.append(state)
        return bool(state["parts"] == expected)

    try:
        wait_until(driver, shows, 20)
    except TimeoutException:
        last = seen[-1]["parts"] if seen else {}
        differ = {key: (last.get(key), text) for key, text in expected.items() if last.get(key) != text}
        raise AssertionError(f"{what}, parts not showing the run's reading: {differ}") from None


def test_every_part_of_an_open_run_page_shows_the_same_reading(served: tuple[SqliteQueue, UiServer]) -> None:
    queue, server = served
    with chrome() as driver:
        driver.get(run_url(server, "counts-1"))
        seen: list[dict[str, Any]] = []
        for k in range(1, ITEMS + 1):
            GATES[k - 1].set()
            wait_for(lambda k=k: _items_recorded(queue) == k, f"item {k - 1} to be recorded")
            if k == ITEMS:
                wait_for_status(queue, "counts-1", "finished")
            wait_for_the_reading(driver, queue, seen, f"after item {k - 1}")
            assert f"{k}/{ITEMS}" in seen[-1]["graph"], seen[-1]
        # Never, between two polls nor within one, did the graph's count differ from the table's.
        mixed = [s for s in seen if _count(s["graph"]) != _count(s["table"])]
        assert not mixed, mixed[:3]
        assert not severe_console_errors(driver)
