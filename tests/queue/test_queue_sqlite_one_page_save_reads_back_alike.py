"""A step's output saved through the one-page view reads back exactly as through the general one.

SQLite saves a step's output alone (a delta of one entry and no usage row)
through the view ``ekit_queue_steps_v2``, whose trigger writes the entry alone
(with the run's counts as of that save), and every other write through
``ekit_queue_writes_v2``, which writes the run's row too. A reader takes the
counts from whichever is newer. So the two could drift apart: a different
entry order, stale counts or progress, a cancel flag or a refusal told
otherwise. This property drives two queues through the same random
operations (the next step's save, a save made again after its answer was
lost, two runs' saves in one batch, a run that reports usage, a cancel
asked, a lease that runs out and is taken by another worker, a run finished,
released or parked) on one frozen clock: one queue as it is, one with the
narrow view turned off. Every
outcome, every checkpoint and record a reader sees, and every entry and
usage row must be the same, and each run must read back as the last
checkpoint a save of it was told made. (The lease differs, by design: the
narrow save renews it only when less than half is left; the clock here
moves less than that.)
"""

from __future__ import annotations

import dataclasses
import functools
import time
import types
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ekit_runtime.queue.sqlite as sqlite_queue
from ekit_core import TokenUsage
from ekit_runtime import PatternResult, Step, Workflow, WorkflowCheckpoint
from ekit_runtime.queue import Lease, SqliteQueue
from ekit_runtime.queue.base import progress

RUNS = 3


def _chain(steps: int, *, usage: bool) -> list[WorkflowCheckpoint]:
    def step(i: int) -> Any:
        async def run(ctx: dict[str, Any]) -> Any:
            return PatternResult(f"out{i}", cost=TokenUsage(3, 2, 1)) if usage else f"out{i}"

        return run

    found: list[WorkflowCheckpoint] = []
    flow = Workflow([Step(f"s{i}", step(i), (f"s{i - 1}",) if i else ()) for i in range(steps)])
    flow.run_sync(checkpoint_fn=found.append)
    return found


PLAIN = _chain(6, usage=False)
USED = _chain(6, usage=True)  # (its saves add a usage row: the general view's)

OPS = st.one_of(
    st.tuples(st.just("save"), st.integers(0, RUNS - 1)),
    st.tuples(st.just("again"), st.integers(0, RUNS - 1)),
    st.tuples(st.just("batch"), st.integers(0, RUNS - 1), st.integers(0, RUNS - 1)),
    st.tuples(st.just("cancel"), st.integers(0, RUNS - 1)),
    st.tuples(st.just("expire"), st.integers(0, RUNS - 1)),
    st.tuples(st.just("steal")),
    st.tuples(st.just("end"), st.integers(0, RUNS - 1), st.sampled_from(["finish", "release", "park"])),
    st.tuples(st.just("tick")),
)


class _Side:
    """One queue and what its worker holds: a lease and the step reached, per run."""

    def __init__(self, path: Path, *, narrow: bool) -> None:
        # (Not durable: what is compared is what the views write, not what survives a power
        # cut; a durable queue's fsyncs made each example seconds long on a loaded machine.)
        self.queue = SqliteQueue(path, durable=False)
        if not narrow:
            self.queue._step_args = lambda conn, rows, now, until: None  # type: ignore[method-assign]
        self.leases: dict[str, Lease] = {}
        self.reached: dict[str, int] = {}
        # The checkpoint of each run's last save told made (its outcome not an error).
        self.stored: dict[str, WorkflowCheckpoint] = {}

    def checkpoints(self, run_id: str) -> list[WorkflowCheckpoint]:
        return USED if run_id == "r1" else PLAIN

    def outcome(
        self, call: Any, run_id: str | None = None, checkpoint: WorkflowCheckpoint | None = None
    ) -> Any:
        try:
            said = call()
        except Exception as exc:  # (compared by kind on both sides)
            return type(exc).__name__
        if run_id is not None and checkpoint is not None:
            self.stored[run_id] = checkpoint
        return said

    def apply(self, op: tuple[Any, ...], clock: list[float]) -> Any:
        queue, kind = self.queue, op[0]
        if kind == "tick":
            clock[0] += 1.0
            return None
        if kind == "steal":
            lease = queue.claim("thief", {"w": None}, 60)
            if lease is None:
                return None
            self.leases[lease.run_id] = lease  # (the worker now saves under the thief's lease)
            return lease.run_id, lease.epoch
        run_id = f"r{op[1]}"
        if kind == "cancel":
            return self.outcome(lambda: queue.cancel(run_id))
        if kind == "expire":
            queue.conn.execute(
                "UPDATE ekit_queue_runs SET lease_until = ? WHERE run_id = ? AND status = 'running'",
                (clock[0] - 1.0, run_id),
            )
            return None
        lease, k = self.leases[run_id], self.reached[run_id]
        if kind == "end":  # (the run leaves running: its row must then hold its counts alone)
            if op[2] == "finish":
                return self.outcome(lambda: queue.finish(lease, "finished"))
            if op[2] == "release":
                return self.outcome(lambda: queue.release(lease))
            return self.outcome(lambda: queue.park(lease, "waiting for an answer to step s9"))
        cps = self.checkpoints(run_id)
        if kind == "again" and k >= 1:
            # The last save's answer was lost: this object believes the one before is stored.
            queue._saved[run_id] = (lease.epoch, cps[k - 1], cps[k - 1].cost)
            return self.outcome(lambda: queue.save(lease, cps[k], 60), run_id, cps[k])
        if kind == "batch" and op[2] != op[1]:
            other = f"r{op[2]}"
            pairs = [(run_id, lease, k), (other, self.leases[other], self.reached[other])]
            saves = [(held, self.checkpoints(rid)[min(at + 1, 5)]) for rid, held, at in pairs]
            for rid, _held, at in pairs:
                self.reached[rid] = min(at + 1, 5)
            said = queue.save_many(saves, 60)
            for (rid, _held, _at), (_lease, cp), outcome in zip(pairs, saves, said, strict=True):
                if not isinstance(outcome, Exception):
                    self.stored[rid] = cp
            return [type(s).__name__ if isinstance(s, Exception) else s for s in said]
        self.reached[run_id] = min(k + 1, 5)
        cp = cps[self.reached[run_id]]
        return self.outcome(lambda: queue.save(lease, cp, 60), run_id, cp)

    def seen(self) -> dict[str, Any]:
        """What a reader sees: each run's record (but its lease's end), checkpoint and outputs'
        order, and the stored entries and usage rows (but what only the narrow view writes)."""
        queue, conn = self.queue, self.queue.conn
        infos = [
            dataclasses.replace(queue.status(f"r{i}"), lease_until=None, updated_at=0.0) for i in range(RUNS)
        ]
        checkpoints = [queue.checkpoint(f"r{i}") for i in range(RUNS)]
        return {
            "infos": infos,
            "checkpoints": checkpoints,
            "order": [list(cp.outputs) if cp is not None else None for cp in checkpoints],
            "entries": conn.execute(
                "SELECT run_id, kind, name, value, epoch FROM ekit_queue_entries ORDER BY run_id, ord"
            ).fetchall(),
            "usage": conn.execute("SELECT * FROM ekit_queue_usage ORDER BY rowid").fetchall(),
            "runs": conn.execute(
                "SELECT run_id, status, epoch, owner, cancel_requested, error "
                "FROM ekit_queue_runs ORDER BY seq"
            ).fetchall(),
        }


# The timeout is for the whole property, all its examples: a deadlock detector, sized for a
# loaded machine, not a speed check.
@pytest.mark.timeout(600)
@settings(max_examples=80, deadline=None)
@given(ops=st.lists(OPS, max_size=25))
def test_either_view_reads_back_alike_and_tells_the_same_outcomes(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[Any, ...]]
) -> None:
    folder = tmp_path_factory.mktemp("views")
    clock = [1_000_000.0]
    frozen = types.SimpleNamespace(time=lambda: clock[0], monotonic=time.monotonic)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sqlite_queue, "time", frozen)
        sides = [_Side(folder / "narrow.db", narrow=True), _Side(folder / "general.db", narrow=False)]
        try:
            _check(sides, ops, clock)
        finally:  # (a failing example must not leave its connections open for the next ones)
            for side in sides:
                side.queue.close()


def _check(sides: list[_Side], ops: list[tuple[Any, ...]], clock: list[float]) -> None:
    """Drive both sides through ``ops`` and compare what they tell and hold."""
    for side in sides:
        for i in range(RUNS):
            side.queue.submit("w", run_id=f"r{i}")
            lease = side.queue.claim("worker", {"w": None}, 60)
            assert lease is not None
            side.leases[lease.run_id], side.reached[lease.run_id] = lease, 0
            side.queue.save(lease, side.checkpoints(lease.run_id)[0], 60)  # (in full: the general view)
    seen = [0, 0]
    for i, side in enumerate(sides):
        side.queue.conn.set_trace_callback(functools.partial(_count, seen, i))
    for op in ops:
        narrow, general = (side.apply(op, clock) for side in sides)
        assert narrow == general, op
    narrow_seen, general_seen = (side.seen() for side in sides)
    assert narrow_seen == general_seen
    assert seen[1] == 0  # the general side never went through the narrow view
    for side in sides:  # each run reads back as its last save told made
        for run_id, checkpoint in side.stored.items():
            assert side.queue.checkpoint(run_id) == checkpoint
            assert side.queue.status(run_id).steps_done == progress(checkpoint)[0]


def _count(seen: list[int], side: int, sql: str) -> None:
    if sql.startswith("INSERT INTO ekit_queue_steps"):
        seen[side] += 1


def test_the_narrow_view_is_what_the_usual_save_goes_through(tmp_path: Path) -> None:
    # (Else the property above would compare the general view with itself.)
    queue = SqliteQueue(tmp_path / "q.db")
    queue.submit("w", run_id="r0")
    lease = queue.claim("worker", {"w": None}, 60)
    assert lease is not None
    queue.save(lease, PLAIN[0], 60)
    seen: list[str] = []
    queue.conn.set_trace_callback(seen.append)
    assert queue.save(lease, PLAIN[1], 60) is False
    assert seen and all(s.startswith("INSERT INTO ekit_queue_steps") for s in seen)
    seen.clear()
    queue.submit("w", run_id="r1")
    other = queue.claim("worker", {"w": None}, 60)
    assert other is not None
    queue.save(other, USED[0], 60)
    seen.clear()
    assert queue.save(other, USED[1], 60) is False  # a usage row: the general view
    assert seen and all(s.startswith("INSERT INTO ekit_queue_writes") for s in seen)
    queue.close()


@pytest.mark.timeout(600)  # (for all the examples: a deadlock detector on a loaded machine)
@settings(max_examples=40, deadline=None)
@given(by=st.lists(st.integers(0, 2), min_size=5, max_size=5))
def test_a_lease_saved_through_several_queue_objects_reads_back_as_its_last_save(
    tmp_path_factory: pytest.TempPathFactory, by: list[int]
) -> None:
    # Each save's number orders the entries and says whose counts are newest. The numbers live
    # in the process, shared by the queue objects open on the file: were they each object's, a
    # save through one object after saves through another would sort before them and read back
    # the other's counts.
    path = tmp_path_factory.mktemp("objects") / "q.db"
    queues = [SqliteQueue(path, durable=False) for _ in range(3)]  # (see _Side)
    queues[0].submit("w", run_id="r")
    lease = queues[0].claim("worker", {"w": None}, 60)
    assert lease is not None
    queues[0].save(lease, PLAIN[0], 60)
    for k, i in enumerate(by, start=1):
        assert queues[i].save(lease, PLAIN[k], 60) is False
        for queue in queues:
            assert queue.checkpoint("r") == PLAIN[k]
            assert list(queue.checkpoint("r").outputs) == list(PLAIN[k].outputs)  # type: ignore[union-attr]
            assert queue.status("r").steps_done == progress(PLAIN[k])[0]
    for queue in queues:
        queue.close()
