"""Stopping a worker gives its runs back and returns promptly, whatever its steps are doing.

A real ``ekit worker`` process whose sync step never returns on its own
exits at SIGTERM (Python cannot stop the step's thread: the run is given
back with what it recorded, and the process leaves the thread behind); a
second signal exits at once even when a step blocks the event loop itself.
In one process: ``Worker.stop()`` while a claim is in flight gives the
claimed run back without starting it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import Step, Workflow
from ekit_runtime.queue import Lease, RunQueue, Worker, open_queue
from tests.support.queue_backends import queue, queue_url, wait_for

__all__ = ["queue", "queue_url"]

ROOT = Path(__file__).resolve().parents[2]
FLOWS = """
import os, threading, time
from ekit_runtime import Step, Workflow

NEVER = threading.Event()


def first(ctx):
    return "first"


def stuck(ctx):  # a sync step in a thread, waiting on something that never comes
    open(os.environ["EKIT_TEST_MARK"], "w").close()
    NEVER.wait()
    return "never"


async def hogs_the_loop(ctx):  # a sync wait inside an async step: the event loop itself is stuck
    open(os.environ["EKIT_TEST_MARK"], "w").close()
    NEVER.wait()
    return "never"


WORKFLOWS = {
    "thread": Workflow([Step("first", first), Step("stuck", stuck, ("first",))]),
    "loop": Workflow([Step("first", first), Step("stuck", hogs_the_loop, ("first",))]),
}
"""


def _worker(tmp_path: Path, url: str) -> subprocess.Popen[str]:
    (tmp_path / "flows.py").write_text(FLOWS)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "EKIT_TEST_MARK": str(tmp_path / "mark")}
    argv = [sys.executable, "-m", "ekit_runtime", "worker", "--queue", url, "--workflows", "flows:WORKFLOWS"]
    return subprocess.Popen(
        [*argv, "--lease", "30", "--heartbeat", "5"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.timeout(60)
def test_sigterm_gives_the_run_back_and_exits_while_a_sync_step_is_stuck(
    queue_url: str, tmp_path: Path
) -> None:
    q = open_queue(queue_url)
    run = q.submit("thread", run_id="stuck")
    proc = _worker(tmp_path, queue_url)
    try:
        wait_for(lambda: (tmp_path / "mark").exists(), timeout=30, what="the stuck step to start")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert json.loads(out.splitlines()[-1])["runs"] == {"released": 1}
    assert "still running in their threads" in err
    info = q.status(run)
    assert (info.status, info.lease_until) == ("queued", None)  # claimable by any worker at once
    checkpoint = q.checkpoint(run)
    assert checkpoint is not None and dict(checkpoint.outputs) == {"first": "first"}
    q.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_exits_at_once_even_when_a_step_blocks_the_loop(
    tmp_path: Path, second: signal.Signals
) -> None:
    url = str(tmp_path / "q.db")
    q = open_queue(url)
    run = q.submit("loop", run_id="hog")
    proc = _worker(tmp_path, url)
    try:
        wait_for(lambda: (tmp_path / "mark").exists(), timeout=30, what="the loop-blocking step to start")
        proc.send_signal(signal.SIGTERM)  # cannot complete: the loop never gets to it
        assert proc.stderr is not None
        first_line = ""
        while "stopping" not in first_line:
            first_line = proc.stderr.readline()
            assert first_line, "the worker exited before the second signal"
        proc.send_signal(second)
        proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == 128 + second
    # Left leased: taken over when its lease expires, from what it recorded.
    assert q.status(run).status == "running"
    checkpoint = q.checkpoint(run)
    assert checkpoint is not None and dict(checkpoint.outputs) == {"first": "first"}
    q.close()


class _SlowClaim:
    """The queue, whose claims wait for the test's go-ahead once they have begun."""

    def __init__(self, inner: RunQueue) -> None:
        self._inner = inner
        self.entered, self.go = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    # The worker claims through claim_many; RunQueue's claims each run with self.claim (this one).
    claim_many = RunQueue.claim_many

    def claim(self, worker: str, workflows: Any, lease_seconds: float) -> Lease | None:
        self.entered.set()
        assert self.go.wait(30)
        return self._inner.claim(worker, workflows, lease_seconds)


def test_stop_during_a_claim_in_flight_gives_the_claimed_run_back_unstarted(queue: RunQueue) -> None:
    run = queue.submit("w", run_id="claimed-late")
    slow = _SlowClaim(queue)
    started: list[str] = []

    async def a(ctx: dict[str, Any]) -> str:
        started.append("a")
        return "A"

    worker = Worker(slow, {"w": Workflow([Step("a", a)])}, poll=0.01)  # type: ignore[arg-type]

    async def main() -> None:
        task = asyncio.create_task(worker.run())
        assert await asyncio.to_thread(slow.entered.wait, 30)
        worker.stop()
        slow.go.set()  # the claim lands after the stop
        await asyncio.wait_for(task, 30)

    asyncio.run(main())
    assert started == []
    assert worker.outcomes == {run: "released"}
    info = queue.status(run)
    assert (info.status, info.epoch) == ("queued", 1) and queue.checkpoint(run) is None


def test_stop_gives_back_every_run_in_flight_and_returns(queue: RunQueue) -> None:
    ids = [queue.submit("w", run_id=f"r{i}") for i in range(3)]
    began = threading.Semaphore(0)

    async def forever(ctx: dict[str, Any]) -> str:
        began.release()
        await asyncio.Event().wait()
        return "never"

    worker = Worker(queue, {"w": Workflow([Step("a", forever)])}, max_runs=3, poll=0.01)

    async def main() -> None:
        task = asyncio.create_task(worker.run())
        for _ in ids:
            assert await asyncio.to_thread(began.acquire, True, 30)
        worker.stop()
        await asyncio.wait_for(task, 30)

    asyncio.run(main())
    assert worker.outcomes == dict.fromkeys(ids, "released")
    assert [queue.status(r).status for r in ids] == ["queued"] * 3
