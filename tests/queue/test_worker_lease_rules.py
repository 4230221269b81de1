"""The worker's lease rules, each pinned by a test that fails when the rule breaks.

- ``heartbeat`` must be shorter than the lease: equal is refused.
- A renewal that fails (without a refusal) is retried only while the lease
  may still be valid, and the lease is given up once it may have run out.
- A cancel asked through the queue is noticed at a save, not only at a
  renewal: with no renewal due, the next step never starts.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from typing import Any

import pytest

from ekit_runtime import Step, Workflow
from ekit_runtime.queue import Lease, RunQueue, Worker
from tests.support.queue_backends import queue, queue_url

__all__ = ["queue", "queue_url"]


def _one() -> Workflow:
    async def a(ctx: dict[str, Any]) -> str:
        return "A"

    return Workflow([Step("a", a)])


@pytest.mark.parametrize(("lease", "heartbeat"), [(1.0, 1.0), (30, 30), (2.5, 2.5), (1.0, 1.5)])
def test_a_heartbeat_as_long_as_the_lease_or_longer_is_refused(
    queue: RunQueue, lease: float, heartbeat: float
) -> None:
    with pytest.raises(ValueError, match="heartbeat must be shorter than lease_seconds"):
        Worker(queue, {"w": _one()}, lease_seconds=lease, heartbeat=heartbeat)
    assert Worker(queue, {"w": _one()}, lease_seconds=lease, heartbeat=lease * 0.99).heartbeat < lease


class _RenewalsFail:
    """The queue, granting one lease; every renewal fails (the database cannot be asked)."""

    def __init__(self, inner: RunQueue) -> None:
        self._inner = inner
        self.renewals: list[float] = []
        self.claims = 0
        # The worker counts its lease from a moment between these two.
        self.before_claim = self.after_claim = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    # The worker claims through claim_many; RunQueue's claims each run with self.claim (this one).
    claim_many = RunQueue.claim_many

    def limits(self) -> Any:
        if not self.claims:
            self.before_claim = time.monotonic()  # asked right before the claim
        return self._inner.limits()

    def claim(self, worker: str, workflows: Any, lease_seconds: float) -> Lease | None:
        self.claims += 1
        if self.claims > 1:
            return None
        lease = self._inner.claim(worker, workflows, lease_seconds)
        self.after_claim = time.monotonic()
        return lease

    def renew(self, lease: Lease, lease_seconds: float) -> bool:
        self.renewals.append(time.monotonic())
        raise sqlite3.OperationalError("database is locked")


@pytest.mark.timeout(30)
def test_failed_renewals_are_retried_while_the_lease_may_hold_and_no_longer(queue: RunQueue) -> None:
    flaky = _RenewalsFail(queue)
    run = queue.submit("w", run_id="beats")
    lease, heartbeat = 0.8, 0.1

    async def forever(ctx: dict[str, Any]) -> str:
        await asyncio.Event().wait()  # only the worker's cancel ends it
        return "never"

    worker = Worker(
        flaky,  # type: ignore[arg-type]
        {"w": Workflow([Step("s", forever)])},
        lease_seconds=lease,
        heartbeat=heartbeat,
        poll=0.01,
    )
    assert asyncio.run(worker.run_until_idle()) == 1
    ended = time.monotonic()
    assert worker.outcomes == {run: "lost"}
    renewals = flaky.renewals
    # Retried: more than one renewal was tried while the lease could hold ...
    assert len(renewals) >= 2
    # ... for as long as it could: the one that gave up came once it may have run out ...
    assert renewals[-1] >= flaky.before_claim + lease
    # ... and no longer: none was tried again after the lease had surely run out.
    assert len([t for t in renewals if t > flaky.after_claim + lease]) <= 1, renewals
    assert len(renewals) <= int(lease / heartbeat) + 1, renewals  # each a heartbeat after the last
    assert ended - renewals[-1] < lease  # given up at that renewal


class _SavesSeeCancels:
    """The queue, with a cancel asked once the first step has begun (on the test's request)."""

    def __init__(self, inner: RunQueue) -> None:
        self._inner = inner
        self.renewals = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def renew(self, lease: Lease, lease_seconds: float) -> bool:
        self.renewals += 1
        return self._inner.renew(lease, lease_seconds)


@pytest.mark.timeout(30)
def test_a_cancel_is_noticed_at_a_save_when_no_renewal_comes(queue: RunQueue) -> None:
    watched = _SavesSeeCancels(queue)
    run = queue.submit("w", run_id="cancel-at-save")
    started: list[str] = []

    async def main() -> dict[str, str]:
        a_running, a_may_end = asyncio.Event(), asyncio.Event()

        async def a(ctx: dict[str, Any]) -> str:
            started.append("a")
            a_running.set()
            await a_may_end.wait()
            return "A"

        async def b(ctx: dict[str, Any]) -> str:
            started.append("b")
            return "B"

        wf = Workflow([Step("a", a), Step("b", b, ("a",))])
        # A heartbeat far beyond the test: only the save of a can carry the cancel.
        worker = Worker(watched, {"w": wf}, lease_seconds=60, heartbeat=50, poll=0.01)  # type: ignore[arg-type]
        task = asyncio.create_task(worker.run_until_idle())
        await a_running.wait()
        assert await asyncio.to_thread(queue.cancel, run) is True
        a_may_end.set()
        await task
        return worker.outcomes

    outcomes = asyncio.run(main())
    assert outcomes == {run: "cancelled"} and watched.renewals == 0
    assert started == ["a"], "b started although the save of a said the run was cancelled"
    assert queue.status(run).status == "cancelled"
    checkpoint = queue.checkpoint(run)
    assert checkpoint is not None and dict(checkpoint.outputs) == {"a": "A"}
