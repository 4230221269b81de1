"""``RunInfo`` says how far a run got, what it cost and why it waits, without decoding a checkpoint.

Progress and cost come from columns every fenced save updates; the reason
from what the worker writes while the fleet's usage limits hold a step back
(only when it changes), or, for a queued run, from the workers that
announced which workflows they serve.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ekit_core import TokenUsage
from ekit_runtime import PatternResult, Step, Workflow
from ekit_runtime.queue import Limits, RunQueue, Worker, open_queue
from ekit_runtime.queue.base import progress, queued_reason
from tests.support.queue_backends import queue, queue_url, wait_for
from tests.support.queue_options_child import REGISTRY

__all__ = ["queue", "queue_url"]

ROOT = Path(__file__).resolve().parents[2]
RATE = "rate limit llm_calls_per_minute"


def _worker(url: str, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ekit_runtime", "worker", "--queue", url, "--workflows",
         "tests.support.queue_options_child:REGISTRY", "--lease", "10", "--max-runs", "1", *flags],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )


def _stop(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    return err


@pytest.mark.timeout(120)
def test_progress_and_cost_are_there_after_each_save(queue_url: str) -> None:
    go = asyncio.Event()

    async def first(ctx: Any) -> Any:
        return PatternResult("a", cost=TokenUsage(input_tokens=7, output_tokens=3, llm_calls=1))

    async def second(ctx: Any) -> str:
        await go.wait()
        return "b"

    flow = Workflow([Step("a", first), Step("b", second, ("a",)), Step("c", lambda ctx: "c", ("b",))])

    async def main() -> None:
        with open_queue(queue_url) as q, open_queue(queue_url) as reader:
            q.submit("flow", {}, run_id="r")
            before = reader.status("r")
            assert (before.steps_done, before.steps_total, before.cost) == (0, None, TokenUsage())
            task = asyncio.create_task(Worker(q, {"flow": flow}, poll=0.02).run_until_idle())
            while (info := await asyncio.to_thread(reader.status, "r")).steps_done < 1:
                assert not task.done()
                await asyncio.sleep(0.02)
            assert (info.status, info.steps_done, info.steps_total) == ("running", 1, 3)
            assert info.cost == TokenUsage(input_tokens=7, output_tokens=3, llm_calls=1)
            go.set()
            assert await task == 1
            assert (reader.status("r").steps_done, reader.status("r").steps_total) == (3, 3)

    asyncio.run(main())


def test_progress_counts_the_items_of_a_mapped_step_once_known() -> None:
    seen: list[tuple[int, int | None]] = []
    REGISTRY["mapped"].run_sync({}, checkpoint_fn=lambda cp: seen.append(progress(cp)), max_concurrency=1)
    # split (3 items then known), each item, the mapped step's join, t: never more done than in all.
    assert seen == [(1, 6), (2, 6), (3, 6), (5, 6), (6, 6)]


def test_a_queued_run_says_which_version_no_worker_has() -> None:
    assert queued_reason("w", None, {}) == "no worker has workflow w"
    assert queued_reason("w", None, {"w": {"sha256:abc"}}) is None
    assert queued_reason("w", "sha256:0123456789abcdef", {"w": {"sha256:abc"}}) == (
        "no worker has this version of workflow w (graph fingerprint sha256:0123456789ab)"
    )


@pytest.mark.timeout(180)
def test_a_queued_run_of_a_workflow_no_live_worker_serves_says_so(queue_url: str, tmp_path: Path) -> None:
    with open_queue(queue_url) as q:
        q.submit("ghost", {}, run_id="ghost")
        q.submit("spend", {"logdir": str(tmp_path)}, run_id="early")
        assert q.status("ghost").reason == "no worker has workflow ghost"
        assert q.status("early").reason == "no worker has workflow spend"
        proc = _worker(queue_url)
        try:
            wait_for(lambda: q.status("early").status == "finished", timeout=60, what="the run to finish")
            assert q.status("early").reason is None
            assert [r.reason for r in q.runs("queued")] == ["no worker has workflow ghost"]
        finally:
            err = _stop(proc)
        assert proc.returncode == 0, err
        # A worker that stopped no longer serves anything.
        q.submit("spend", {"logdir": str(tmp_path)}, run_id="late")
        assert q.status("late").reason == "no worker has workflow spend"


@pytest.mark.timeout(180)
def test_a_run_held_by_the_fleet_s_call_limit_says_so_until_its_step_goes_on(
    queue_url: str, tmp_path: Path
) -> None:
    with open_queue(queue_url, limits=Limits(llm_calls_per_minute=1, window=2.0)) as q:
        q.submit("spend", {"logdir": str(tmp_path), "hold": True}, run_id="r")
        proc = _worker(queue_url, "--heartbeat", "0.5")
        log = tmp_path / "r.log"
        try:
            # s1 reported a call: s2 waits for the window to let it start.
            info = wait_for(lambda: (i := q.status("r")).reason == RATE and i, timeout=60, what="the reason")
            assert info.status == "running" and info.steps_done == 1
            assert "start:s2" not in (log.read_text() if log.exists() else "")
            wait_for(lambda: "start:s2" in log.read_text(), timeout=60, what="s2 to start")
            assert q.status("r").reason is None  # cleared before the step started
            (tmp_path / "go").write_text("")
            wait_for(lambda: q.status("r").status == "finished", timeout=60, what="the run to finish")
            assert q.status("r").reason is None
        finally:
            err = _stop(proc)
        assert proc.returncode == 0, err


class _Counting:
    """A queue that records each reason written and how often the usage window was asked."""

    def __init__(self, inner: RunQueue) -> None:
        self._inner = inner
        self.reasons: list[str | None] = []
        self.asked = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def set_reason(self, lease: Any, reason: str | None) -> None:
        self.reasons.append(reason)
        self._inner.set_reason(lease, reason)

    def usage_hold(self) -> tuple[float, str | None]:
        self.asked += 1
        return self._inner.usage_hold()


@pytest.mark.timeout(120)
def test_the_reason_is_written_only_when_it_changes(queue: RunQueue, tmp_path: Path) -> None:
    queue.set_limits(Limits(llm_calls_per_minute=1, window=0.5))
    queue.submit("spend", {"logdir": str(tmp_path)}, run_id="r")
    counting = _Counting(queue)
    worker = Worker(counting, REGISTRY, poll=0.02, lease_seconds=2.0, heartbeat=0.02)  # type: ignore[arg-type]
    assert asyncio.run(worker.run_until_idle()) == 1
    assert queue.status("r").status == "finished"
    # s2, s3 and s4 each waited for the window: set once, cleared once, however often it was asked.
    assert counting.reasons == [RATE, None] * 3
    assert counting.asked > 3 * 2 + 4
