"""Both backends follow the pure lifecycle rules, on random sequences of operations.

A model of the queue, moved only by the functions of
``ekit_runtime.queue.lifecycle``, is driven alongside a real queue with the
same random operations (submit, claim with a matching or another graph, save,
renew, finish, release, park, cancel, a person's retry and rewind, and expiry of a
lease, by moving its expiry into the past). After every operation, what each call returned and every
run's status, epoch, cancel flag, fingerprint and lease agree.
"""

from __future__ import annotations

import random
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ekit_core import WorkflowCheckpoint
from ekit_runtime import Step, Workflow
from ekit_runtime.queue import FINAL_STATUSES, Lease, LeaseLostError, RunQueue, RunStateError, SqliteQueue
from ekit_runtime.queue import lifecycle as lc
from tests.support.queue_backends import queue, queue_url

__all__ = ["queue", "queue_url"]

NOW = 1000.0  # the model's clock: a live lease ends after it, an expired one before
LIVE, EXPIRED = 2000.0, 0.0
LEASE_SECONDS = 600.0  # nothing expires by itself during a test


async def _noop(ctx: dict[str, Any]) -> str:
    return "ok"


def _checkpoint() -> WorkflowCheckpoint:
    seen: list[WorkflowCheckpoint] = []
    Workflow([Step("s0", _noop)]).run_sync(checkpoint_fn=seen.append)
    return seen[-1]


CHECKPOINT = _checkpoint()
FP = CHECKPOINT.fingerprint


@dataclass
class Run:
    """One run as the model holds it."""

    seq: int
    priority: int
    status: str = "queued"
    epoch: int = 0
    until: float | None = None
    cancel: bool = False
    fingerprint: str | None = None


class Model:
    """The queue as the lifecycle's rules say it must be."""

    def __init__(self) -> None:
        self.runs: dict[str, Run] = {}

    def submit(self, run_id: str, priority: int) -> None:
        self.runs.setdefault(run_id, Run(len(self.runs), priority))

    def claim(self, workflows: dict[str, str | None]) -> tuple[str, int] | None:
        for run in self.runs.values():
            if lc.next_status("claim", run.status, run.until, run.cancel, NOW) == "cancelled":
                run.status, run.epoch, run.until = "cancelled", run.epoch + 1, None
        ready = [
            (-run.priority, run.seq, run_id)
            for run_id, run in self.runs.items()
            if lc.next_status("claim", run.status, run.until, run.cancel, NOW) == "running"
            and lc.matches("w", run.fingerprint, workflows)
        ]
        if not ready:
            return None
        run_id = min(ready)[2]
        run = self.runs[run_id]
        run.status, run.epoch, run.until = "running", run.epoch + 1, LIVE
        return run_id, run.epoch

    def holds(self, lease: Lease) -> bool:
        run = self.runs[lease.run_id]
        return lc.fenced(run.status, run.epoch, run.until, lease.epoch, NOW)

    def cancel(self, run_id: str) -> bool:
        run = self.runs[run_id]
        target = lc.next_status("cancel", run.status, run.until, run.cancel, NOW)
        if target == "running":  # a live lease: flagged, its holder stops the run
            run.cancel = True
        elif target == "cancelled":
            run.status, run.epoch, run.until, run.cancel = "cancelled", run.epoch + 1, None, True
        return target is not None


    def reopen(self, verb: str, run_id: str) -> bool:
        """A person's retry or rewind: whether it is accepted (a rewind needs a saved checkpoint)."""
        run = self.runs[run_id]
        target = lc.next_status(verb, run.status, run.until, run.cancel, NOW)
        if target is None or (verb == "rewind" and run.fingerprint is None):
            return False
        run.status, run.epoch, run.until, run.cancel = target, run.epoch + 1, None, False
        return True


class Driver:
    """Applies one random operation to the queue and the model, and checks they agree."""

    def __init__(self, queue: RunQueue, url: str, rng: random.Random) -> None:
        self.queue, self.url, self.rng = queue, url, rng
        self.model = Model()
        self.leases: list[Lease] = []
        self.seen: set[tuple[str, object]] = set()

    def step(self) -> None:
        ops = [self.submit, self.claim, self.claim, self.cancel, self.expire, self.retry, self.rewind]
        if self.leases:
            ops += [self.save, self.renew, self.finish, self.release, self.park, self.save, self.renew]
        self.rng.choice(ops)()
        self.check()

    def submit(self) -> None:
        run_id = f"r{self.rng.randrange(5)}"
        priority = self.rng.randrange(2)
        assert self.queue.submit("w", {}, run_id=run_id, priority=priority) == run_id
        self.model.submit(run_id, priority)

    def claim(self) -> None:
        workflows: dict[str, str | None] = {"w": self.rng.choice([FP, "another graph"])}
        lease = self.queue.claim("worker", workflows, LEASE_SECONDS)
        expected = self.model.claim(workflows)
        assert (None if lease is None else (lease.run_id, lease.epoch)) == expected
        if lease is not None:
            self.leases.append(lease)

    def _holder_write(self, write: Any, on_success: Any = None) -> Any:
        lease = self.rng.choice(self.leases)
        held = self.model.holds(lease)
        self.seen.add(("holder write", held))
        if not held:
            with pytest.raises(LeaseLostError):
                write(lease)
            return
        result = write(lease)
        run = self.model.runs[lease.run_id]
        if on_success is not None:
            on_success(run)
        return result, run

    def save(self) -> None:
        def stored(run: Run) -> None:
            run.fingerprint = FP

        done = self._holder_write(lambda lease: self.queue.save(lease, CHECKPOINT, LEASE_SECONDS), stored)
        if done is not None:
            assert done[0] is done[1].cancel

    def renew(self) -> None:
        done = self._holder_write(lambda lease: self.queue.renew(lease, LEASE_SECONDS))
        if done is not None:
            assert done[0] is done[1].cancel

    def finish(self) -> None:
        status = self.rng.choice(sorted(FINAL_STATUSES))

        def ended(run: Run) -> None:
            run.status, run.until = status, None

        self._holder_write(lambda lease: self.queue.finish(lease, status, None), ended)

    def release(self) -> None:
        lease = self.rng.choice(self.leases)
        held = self.model.holds(lease)
        assert self.queue.release(lease) is held
        if held:
            run = self.model.runs[lease.run_id]
            run.status, run.until = lc.RELEASED_AS[run.cancel], None

    def park(self) -> None:
        def parked(run: Run) -> None:
            run.status, run.until = lc.PARKED_AS[run.cancel], None

        self._holder_write(lambda lease: self.queue.park(lease, "waiting for an answer to step 's0'"), parked)

    def cancel(self) -> None:
        if not self.model.runs:
            return
        run_id = self.rng.choice(sorted(self.model.runs))
        assert self.queue.cancel(run_id) is self.model.cancel(run_id)

    def _reopen(self, verb: str, call: Any) -> None:
        if not self.model.runs:
            return
        run_id = self.rng.choice(sorted(self.model.runs))
        accepted = self.model.reopen(verb, run_id)
        self.seen.add((verb, accepted))
        if not accepted:
            with pytest.raises(RunStateError, match=run_id):
                call(run_id)
            return
        call(run_id)

    def retry(self) -> None:
        self._reopen("retry", self.queue.retry)

    def rewind(self) -> None:
        self._reopen("rewind", lambda run_id: self.queue.rewind(run_id, "s0"))

    def expire(self) -> None:
        live = [r for r, run in self.model.runs.items() if lc.live(run.status, run.until, NOW)]
        if not live:
            return
        run_id = self.rng.choice(sorted(live))
        _age_lease(self.url, run_id)
        self.model.runs[run_id].until = EXPIRED

    def check(self) -> None:
        now = time.time()
        for run_id, run in self.model.runs.items():
            info = self.queue.status(run_id)
            stored = (info.status, info.epoch, info.cancel_requested, info.fingerprint)
            assert stored == (run.status, run.epoch, run.cancel, run.fingerprint), run_id
            self.seen.add(("status", run.status))
            lease = None if info.lease_until is None else info.lease_until > now
            assert lease == (None if run.until is None else run.until > NOW), run_id


def _age_lease(url: str, run_id: str) -> None:
    """Move a run's lease expiry an hour into the past: expiry by the clock, without waiting."""
    sql = "UPDATE ekit_queue_runs SET lease_until = lease_until - 3600 - {extra} WHERE run_id = {p}"
    if url.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.format(extra=LEASE_SECONDS, p="%s"), (run_id,))
        return
    conn2 = sqlite3.connect(url, timeout=30, isolation_level=None)
    try:
        conn2.execute(sql.format(extra=LEASE_SECONDS, p="?"), (run_id,))
    finally:
        conn2.close()


@pytest.mark.parametrize("seed", range(6))
def test_a_backend_follows_the_lifecycle_rules(queue: RunQueue, queue_url: str, seed: int) -> None:
    driver = Driver(queue, queue_url, random.Random(seed))
    for _ in range(80):
        driver.step()
    # Each sequence went through accepted and refused writes and reached a final status.
    assert {("holder write", True), ("holder write", False), ("status", "running")} <= driver.seen
    assert any(("status", s) in driver.seen for s in FINAL_STATUSES)
    # ... and refused retries and rewinds (accepted ones and parked runs: the test below).
    assert {("retry", False), ("rewind", False)} <= driver.seen


def test_the_sequences_go_through_accepted_retries_and_rewinds_and_parked_runs(tmp_path: Path) -> None:
    seen: set[tuple[str, object]] = set()
    for seed in range(6):
        with SqliteQueue(tmp_path / f"q{seed}.db") as queue:
            driver = Driver(queue, str(tmp_path / f"q{seed}.db"), random.Random(seed))
            for _ in range(80):
                driver.step()
            seen |= driver.seen
    assert {("retry", True), ("rewind", True), ("status", "waiting")} <= seen

