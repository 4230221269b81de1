"""In real Chromium, the timeline's held bars name the limit that held each attempt.

The promise (docs/dashboard.md, "Attempts over time"; the checkpoint's
``held``): a run records which limit held each attempt before it began and
for how long, and its page draws one ``held`` bar per limit, ending when the
attempt began, labelled with the limit's name (its title says how long).
Two queued runs on one SQLite queue: one with ``max_concurrency=2`` whose
two steps share a resource capped at one slot (the second waits for the
slot, the third for the run's cap), driven by a worker in this process; and
one held by a fleet usage limit (``llm_calls_per_minute``), driven by a real
``ekit worker`` process. Each bar's label is checked against what held it,
and against the checkpoint's record.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ekit_core import TokenUsage, WorkflowCheckpoint
from ekit_runtime import PatternResult, Step, Workflow
from ekit_runtime.queue import Limits, SqliteQueue, Worker
from tests.support.browser import (
    UiServer,
    chrome,
    require_browser,
    run_url,
    severe_console_errors,
    wait_until,
)

pytestmark = pytest.mark.timeout(180)

SECONDS = 0.5
WINDOW = 1.5  # the usage limit's window: how long the second step of the limited run is held


async def _call(ctx: Any) -> str:
    await asyncio.sleep(SECONDS)
    return "answer"


async def _paid(ctx: Any) -> PatternResult[str]:
    return PatternResult("paid", cost=TokenUsage(10, 5, 1))  # one LLM call: the fleet's limit is 1


REGISTRY = {
    "capped": Workflow([Step("a", _call, resource="api"), Step("b", _call, resource="api"),
                        Step("c", _call)]),
    "limited": Workflow([Step("first", _paid), Step("second", _paid, ("first",))]),
}
"""What both workers serve (``ekit worker --workflows``)."""

HELD = """
var labels = {};
document.querySelectorAll('#timeline-chart text.held-label').forEach(function (t) {
  var box = t.getBoundingClientRect();
  labels[t.dataset.name + '|' + t.dataset.limit] = {text: t.textContent, width: box.width};
});
return Array.from(document.querySelectorAll('#timeline-chart rect.outcome-held')).map(function (r) {
  var box = r.getBoundingClientRect(), key = r.dataset.name + '|' + (r.dataset.limit || '');
  return {name: r.dataset.name, limit: r.dataset.limit || '', began: Number(r.dataset.began),
          ended: Number(r.dataset.ended), width: box.width, title: r.querySelector('title').textContent,
          label: labels[key] || null};
});
"""


def _held_bars(driver: Any, server: UiServer, run_id: str) -> list[dict[str, Any]]:
    driver.get(run_url(server, run_id))
    wait_until(driver, lambda d: d.find_elements("css selector", "#timeline-chart rect.outcome-held"),
               message="no held bar drawn")
    bars: list[dict[str, Any]] = driver.execute_script(HELD)
    assert severe_console_errors(driver) == []
    return bars


def _check(bars: list[dict[str, Any]], cp: WorkflowCheckpoint, want: dict[str, str]) -> None:
    """Each recorded hold is one drawn, labelled bar ending when its attempt began; ``want`` is
    step -> the limit that held it, as this test arranged."""
    assert {name: list(holds) for name, holds in cp.held.items()} == {n: [lim] for n, lim in want.items()}
    named = sorted((b["name"], b["limit"]) for b in bars if b["limit"])
    assert named == sorted(want.items())
    for b in bars:
        if not b["limit"]:
            continue  # (a wait no limit was recorded for: a loaded machine's dispatch)
        seconds = cp.held[b["name"]][b["limit"]]
        assert b["ended"] == cp.began[b["name"]]
        assert abs(b["ended"] - b["began"] - seconds) < 1e-5
        assert b["width"] >= 20, b  # drawn, not merely in the document
        assert f"held {seconds:,.3f} s by {b['limit']}" in b["title"]
        assert b["label"] is not None and b["label"]["text"] == b["limit"] and b["label"]["width"] > 0, b


def test_held_bars_name_max_concurrency_a_resource_and_a_fleet_usage_limit(tmp_path: Path) -> None:
    require_browser()
    db = str(tmp_path / "runs.db")
    queue = SqliteQueue(db, limits=Limits(resources={"api": 1}, llm_calls_per_minute=1, window=WINDOW))
    capped = queue.submit("capped", {}, options={"max_concurrency": 2})
    asyncio.run(Worker(queue, REGISTRY, name="inproc", poll=0.01).run_until_idle())
    limited = queue.submit("limited", {})
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", os.getcwd())}
    worker = subprocess.run(
        [sys.executable, "-m", "ekit_runtime", "worker", "--queue", db, "--workflows", f"{__name__}:REGISTRY",
         "--name", "fleet-worker", "--until-idle", "-q"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, timeout=120, check=False)
    assert worker.returncode == 0, worker.stderr.decode()
    assert queue.status(capped).status == queue.status(limited).status == "finished"
    capped_cp, limited_cp = queue.checkpoint(capped), queue.checkpoint(limited)
    assert capped_cp is not None and limited_cp is not None
    queue.close()
    # The arranged holds, as the checkpoints record them: b waited for a's slot, c for a's
    # place under max_concurrency=2, both about as long as a ran; second for the window.
    assert min(capped_cp.held["b"]["resource:api"], capped_cp.held["c"]["max_concurrency"]) >= SECONDS * 0.8
    assert limited_cp.held["second"]["limit:llm_calls_per_minute"] >= WINDOW * 0.5
    with UiServer(["--queue", db, "--port", "0"]) as server, chrome() as driver:
        _check(_held_bars(driver, server, capped), capped_cp, {"b": "resource:api", "c": "max_concurrency"})
        _check(_held_bars(driver, server, limited), limited_cp, {"second": "limit:llm_calls_per_minute"})
