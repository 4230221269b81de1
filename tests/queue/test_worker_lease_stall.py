"""A worker that may have lost its lease starts no attempt, on SQLite and PostgreSQL.

Fencing keeps a stale worker's writes out of the queue; this keeps its paid
work from starting twice. Real worker processes (tests/support/queue_worker_child.py)
stall past their lease, by a sync call blocking the event loop inside a step
or by SIGSTOP, while a second worker takes the run over; every step start is
a line in a file, and the stalled worker, once awake, must start nothing
beyond the step that was in flight when it stalled. In one process: a retry
whose delay ran out during a stall is not started either.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ekit_core import RetryPolicy
from ekit_runtime import Step, Workflow
from ekit_runtime.queue import Lease, RunQueue, Worker, open_queue
from tests.support.queue_backends import live_leases, pause_outside_writes, queue, queue_url, wait_for
from tests.support.worker_fleet import Fleet

__all__ = ["queue", "queue_url"]


@pytest.fixture
def fleet(queue_url: str, tmp_path: Path) -> Iterator[Fleet]:
    logs = tmp_path / "logs"
    logs.mkdir()
    f = Fleet(queue_url, logs)
    yield f
    f.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["loop", "sigstop"])
def test_a_worker_stalled_past_its_lease_starts_no_step_once_awake(
    queue_url: str, fleet: Fleet, how: str
) -> None:
    q = open_queue(queue_url)
    stale = fleet.start(lease=1.0, heartbeat=0.2, max_runs=1)
    (fleet.logdir / f"stall-{stale.pid}").write_text(how)
    run = q.submit("stall", run_id="stalled")
    wait_for(lambda: fleet.lines("stalled"), timeout=30, what="the first worker to stall inside a")
    if how == "sigstop":
        pause_outside_writes(stale.pid, queue_url)
    wait_for(lambda: live_leases(queue_url) == 0, timeout=30, what="the stalled worker's lease to expire")
    taker = fleet.start(lease=1.0, heartbeat=0.2, max_runs=1)
    wait_for(lambda: q.status(run).status == "finished", timeout=30, what="the taker to finish the run")
    # Wake the stalled worker: its a returns at once, and b, c and d are ready to start.
    (fleet.logdir / "go").write_text("")
    if how == "sigstop":
        os.kill(stale.pid, signal.SIGCONT)
    wait_for(
        lambda: "was lost" in fleet.stderr(0), timeout=30, what="the stalled worker to give the run up"
    )
    starts = Counter((ln[2], ln[-1]) for ln in fleet.lines("steps") if ln[0] == "start")
    assert {step for step, pid in starts if pid == str(stale.pid)} == {"a"}, starts
    assert all(starts[(step, str(taker.pid))] == 1 for step in "abcd"), starts
    result = q.result(run)
    assert result is not None
    assert dict(result.outputs) == {s: f"{s}@{taker.pid}" for s in "abcd"}
    assert q.status(run).epoch == 2 and stale.poll() is None
    q.close()


class _Watched:
    """The queue, granting one lease only; ``on_save(checkpoint)`` is called after each save."""

    def __init__(self, inner: RunQueue) -> None:
        self._inner = inner
        self.on_save: Any = None
        self.claims = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def claim(self, worker: str, workflows: Any, lease_seconds: float) -> Lease | None:
        self.claims += 1
        return self._inner.claim(worker, workflows, lease_seconds) if self.claims == 1 else None

    # The worker claims, saves and ends runs through claim_many and write_many;
    # RunQueue's make each claim and save with self.claim and self.save (these).
    claim_many = RunQueue.claim_many
    save_many = RunQueue.save_many
    write_many = RunQueue.write_many

    def save(self, lease: Lease, checkpoint: Any, lease_seconds: float) -> bool:
        cancel = self._inner.save(lease, checkpoint, lease_seconds)
        if self.on_save is not None:
            self.on_save(checkpoint)
        return cancel


@pytest.mark.timeout(60)
def test_a_retry_due_after_a_stall_past_the_lease_is_not_started(
    queue: RunQueue, caplog: pytest.LogCaptureFixture
) -> None:
    run = queue.submit("w", run_id="retry-stall")
    watched = _Watched(queue)
    lease = 0.5
    attempts: list[int] = []

    async def main() -> dict[str, str]:
        loop = asyncio.get_running_loop()
        failure_saved = asyncio.Event()

        def on_save(checkpoint: Any) -> None:
            if "flaky" in checkpoint.failures:
                loop.call_soon_threadsafe(failure_saved.set)

        watched.on_save = on_save

        async def flaky(ctx: dict[str, Any]) -> str:
            attempts.append(len(attempts) + 1)
            if len(attempts) == 1:
                raise RuntimeError("the first attempt fails")
            return "paid twice"

        async def staller(ctx: dict[str, Any]) -> str:
            # Once the failure is saved (no save pending), the loop stalls past the
            # lease, and the retry's delay runs out meanwhile.
            await failure_saved.wait()
            until = time.monotonic() + lease * 1.5
            while time.monotonic() < until:
                time.sleep(0.01)  # noqa: ASYNC251 - a sync call in an async step: the loop stalls
            await asyncio.Event().wait()  # no save of its own to meet the retry first
            return "never"

        wf = Workflow(
            [
                Step("flaky", flaky, retry=RetryPolicy(max_attempts=2, backoff_base=lease * 0.6)),
                Step("staller", staller),
            ]
        )
        worker = Worker(
            watched,  # type: ignore[arg-type]
            {"w": wf},
            lease_seconds=lease,
            heartbeat=lease / 5,
            poll=0.01,
        )
        await worker.run_until_idle()
        return worker.outcomes

    with caplog.at_level(logging.WARNING, logger="ekit.worker"):
        outcomes = asyncio.run(main())
    assert attempts == [1], "the retry started after the lease may have run out"
    assert outcomes == {run: "lost"}
    messages = [r.getMessage() for r in caplog.records if r.name == "ekit.worker"]
    assert any("may have run out by this worker's clock" in m for m in messages), messages
    checkpoint = queue.checkpoint(run)
    assert checkpoint is not None and checkpoint.failures["flaky"].attempts == 1


def test_a_healthy_worker_never_refuses_a_start(queue: RunQueue) -> None:
    # Many short steps under a short lease: the margin never stops a worker that renews in time.
    names = [f"s{i}" for i in range(60)]

    async def step(ctx: dict[str, Any]) -> int:
        await asyncio.sleep(0.005)
        return 1

    wf = Workflow([Step(n, step, (names[i - 1],) if i else ()) for i, n in enumerate(names)])
    run = queue.submit("w")
    worker = Worker(queue, {"w": wf}, lease_seconds=0.5, heartbeat=0.1, poll=0.01)
    assert asyncio.run(worker.run_until_idle()) == 1
    assert worker.outcomes == {run: "finished"}
