"""In real Chromium, a queued run's page draws its timeline: one visible bar per recorded attempt.

The run (a retried step, a question answered by a person, a mapped step,
recording durations) is saved to a queue by a worker that still holds it:
its page shows ``svg#timeline-chart`` with one drawn ``recorded`` bar per
timed output, the failed attempt and the wait as bars of their own, each on
the row of its step (an item's under its step), naming the worker; a live
update that replaces every part draws the same bars again. Skipped with no
Chromium except under CI (tests/support/browser.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ekit_core import WorkflowCheckpoint
from ekit_runtime.queue import SqliteQueue
from tests.dashboard.test_timeline_bars_match_the_recorded_attempts import finished_run
from tests.support.browser import (
    UiServer,
    chrome,
    require_browser,
    run_url,
    severe_console_errors,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

BARS = """
return Array.from(document.querySelectorAll('#timeline-chart rect.attempt')).map(function (r) {
  var box = r.getBoundingClientRect();
  return {name: r.dataset.name, outcome: r.dataset.outcome, worker: r.dataset.worker || '',
          step: r.closest('g.step').dataset.step, width: box.width, height: box.height,
          fill: getComputedStyle(r).fill};
});
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UiServer, Any, WorkflowCheckpoint]]:
    require_browser()
    tmp = tmp_path_factory.mktemp("timeline")
    cp, _ = finished_run()
    queue = SqliteQueue(str(tmp / "runs.db"))
    queue.submit("report", {}, run_id="timed")
    lease = queue.claim("worker-7", {"report": None}, 600)
    assert lease is not None
    queue.save(lease, cp, 600)
    queue.close()
    with UiServer(["--queue", str(tmp / "runs.db"), "--port", "0"]) as server, chrome() as driver:
        yield server, driver, cp


def _drawn(driver: Any) -> list[dict[str, Any]]:
    bars: list[dict[str, Any]] = driver.execute_script(BARS)
    return bars


def _check(bars: list[dict[str, Any]], cp: WorkflowCheckpoint) -> None:
    recorded = sorted(b["name"] for b in bars if b["outcome"] == "recorded")
    assert recorded == sorted(cp.durations)  # one bar per recorded attempt
    assert sorted((b["outcome"], b["name"]) for b in bars if b["outcome"] != "recorded") == [
        ("failed", "fetch"), ("waiting", "name_it")]
    for b in bars:
        assert b["width"] >= 1 and b["height"] >= 1, b  # drawn, not merely in the document
        assert b["step"] == ("check" if b["name"].startswith("check[") else b["name"])
        # An attempt names its worker (the owner: the checkpoint records no drives); a wait none.
        assert b["worker"] == ("worker-7" if b["outcome"] in ("recorded", "failed") else "")
    fills = {b["outcome"]: b["fill"] for b in bars}
    assert len(set(fills.values())) == 3, fills  # coloured by outcome


def test_the_run_page_draws_one_bar_per_recorded_attempt(
    served: tuple[UiServer, Any, WorkflowCheckpoint],
) -> None:
    server, driver, cp = served
    driver.get(run_url(server, "timed"))
    wait_until(driver, lambda d: _drawn(d), 20, "the timeline was never drawn")
    _check(_drawn(driver), cp)
    assert "worker-7" in driver.execute_script("return document.getElementById('attempts').textContent")
    # A live update that replaces every part draws the same bars.
    driver.execute_script("document.querySelectorAll('div.part')"
                          ".forEach(function (p) { p.dataset.version = 'stale'; });")
    wait_until(driver, lambda d: d.execute_script(
        "return Array.from(document.querySelectorAll('div.part'))"
        ".every(function (p) { return p.dataset.version !== 'stale'; });"), 20, "a part was never replaced")
    _check(_drawn(driver), cp)
    assert not severe_console_errors(driver)
