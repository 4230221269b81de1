"""The timeline names the worker that ran each attempt, also when another worker finished the run.

The promise (docs/dashboard.md, "Attempts over time"; docs/checkpoint-format.md,
``drives``): every drive of a run records its worker and when it began, one
entry per drive, none per step; an attempt ran on the worker of the last drive
that began at or before it. A run whose worker is SIGKILLed mid-run and that
another worker finishes shows both, each on the attempts it ran. Parsed SVG
here, and the same bars in real Chromium.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ekit_core import DriveRecord
from ekit_runtime import Step, Workflow
from ekit_runtime.queue import SqliteQueue, Worker
from ekit_runtime.ui import QueueSource
from ekit_runtime.ui.pages import run_page
from ekit_runtime.ui.timeline_svg import timeline_svg, worker_at
from tests.dashboard.test_timeline_bars_match_the_recorded_attempts import bars_of, finished_run
from tests.support.browser import UiServer, chrome, require_browser, run_url, wait_until

STEPS = 6


async def _slow(ctx: Any) -> str:
    await asyncio.sleep(0.3)  # (the work a test can kill its worker in the middle of)
    return "done"


REGISTRY = {"chain": Workflow([Step(f"s{i}", _slow, (f"s{i - 1}",) if i else ()) for i in range(STEPS)])}
"""What the killed worker process serves (``ekit worker --workflows``)."""


def _svg(page: str) -> str:
    start = page.index('<svg xmlns="http://www.w3.org/2000/svg" id="timeline-chart"')
    return page[start:page.index("</svg>", start) + len("</svg>")]


@pytest.mark.timeout(180)
def test_a_run_finished_by_another_worker_after_a_sigkill_shows_both(tmp_path: Path) -> None:
    db = str(tmp_path / "q.db")
    queue = SqliteQueue(db)
    run_id = queue.submit("chain", {})
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", os.getcwd())}
    alpha = subprocess.Popen(
        [sys.executable, "-m", "ekit_runtime", "worker", "--queue", db, "--workflows", f"{__name__}:REGISTRY",
         "--name", "alpha", "--lease", "2", "--until-idle", "-q"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    def recorded() -> int:
        cp = queue.checkpoint(run_id)
        return 0 if cp is None else len(cp.outputs)

    try:
        deadline = time.monotonic() + 120  # (a deadlock detector: the steps take 0.3 s each)
        while recorded() < 2:
            assert alpha.poll() is None, alpha.stderr.read() if alpha.stderr else ""
            assert time.monotonic() < deadline, "alpha never recorded two steps"
            time.sleep(0.02)
    finally:
        alpha.send_signal(signal.SIGKILL)
        alpha.wait(timeout=30)
    kept = set(queue.checkpoint(run_id).outputs)  # type: ignore[union-attr]
    assert 2 <= len(kept) < STEPS
    # Its lease runs out (2 s); then beta takes the run over and finishes it.
    while queue.status(run_id).lease_until > time.time():  # type: ignore[operator]
        time.sleep(0.05)
    asyncio.run(Worker(queue, REGISTRY, name="beta", poll=0.01).run_until_idle())
    assert queue.status(run_id).status == "finished"

    view = QueueSource(queue, "q").view(run_id)
    assert view is not None and view.checkpoint is not None
    cp = view.checkpoint
    assert [d.worker for d in cp.drives] == ["alpha", "beta"]  # one entry per drive, none per step
    bars = [b for b in bars_of(_svg(run_page("q", view, None))) if b["data-outcome"] == "recorded"]
    assert sorted(b["data-name"] for b in bars) == sorted(cp.durations) == [f"s{i}" for i in range(STEPS)]
    by = {b["data-name"]: b["data-worker"] for b in bars}
    assert {by[name] for name in kept} == {"alpha"}  # what alpha saved before it died
    assert {by[name] for name in set(by) - kept} == {"beta"}
    for b in bars:
        assert b["data-worker"] == worker_at(cp.drives, float(b["data-began"]))
    queue.close()


def test_a_checkpoint_without_drives_names_the_owner_and_a_wait_no_worker() -> None:
    cp, _ = finished_run()
    assert not cp.drives
    drawn = bars_of(timeline_svg(cp, "owner-1"))
    assert {b.get("data-worker") for b in drawn if b["data-outcome"] in ("recorded", "failed")} == {"owner-1"}
    assert all("data-worker" not in b for b in drawn if b["data-outcome"] == "waiting")


@pytest.mark.timeout(120)
def test_chromium_draws_each_attempt_with_the_worker_of_its_drive(tmp_path: Path) -> None:
    require_browser()
    cp, _ = finished_run()
    starts = sorted(cp.began.values())
    switch = starts[len(starts) // 2]  # a second drive began halfway through
    drives = (DriveRecord("worker-7", starts[0] - 1), DriveRecord("worker-9", switch))
    cp = dataclasses.replace(cp, drives=drives)
    queue = SqliteQueue(str(tmp_path / "runs.db"))
    queue.submit("report", {}, run_id="two")
    lease = queue.claim("worker-9", {"report": None}, 600)
    assert lease is not None
    queue.save(lease, cp, 600)
    queue.close()
    script = ("return Array.from(document.querySelectorAll('#timeline-chart rect.attempt'))"
              ".filter(function (r) { return r.dataset.outcome === 'recorded'; })"
              ".map(function (r) { var box = r.getBoundingClientRect(); return [r.dataset.name, "
              "r.dataset.worker, Number(r.dataset.began), box.width]; });")
    with UiServer(["--queue", str(tmp_path / "runs.db"), "--port", "0"]) as server, chrome() as driver:
        driver.get(run_url(server, "two"))
        wait_until(driver, lambda d: d.execute_script(script), 20, "the timeline was never drawn")
        drawn = driver.execute_script(script)
        said = driver.execute_script("return document.getElementById('drives').textContent")
    assert "worker-7 from " in said and "worker-9 from " in said
    assert len(drawn) == len(cp.durations) and all(width >= 1 for *_, width in drawn)
    assert {w for _, w, began, _ in drawn if began < switch} == {"worker-7"}
    assert {w for _, w, began, _ in drawn if began >= switch} == {"worker-9"}
