"""A worker's saves that meet are committed together, and each is still fenced and answered on its own.

``RunQueue.save_many`` stores several runs' checkpoints (SQLite: one
statement, one commit); a lease that is no longer held refuses its save alone,
a cancel asked on one run is told to that run alone, an output that cannot be
encoded fails its save alone, and a statement that fails for any other reason
is made again save by save, so that each caller meets its own error.
``GroupCommit`` sends the saves a worker's runs ask while a write is in flight
together in the next one, and a save whose caller was cancelled before its
write began is not made. These tests try to break each of those promises.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_runtime import Step, Workflow, WorkflowCheckpoint
from ekit_runtime.queue import Lease, LeaseLostError, RunQueue, SqliteQueue, Worker, open_queue
from ekit_runtime.queue.base import Ending, More
from ekit_runtime.queue.group_commit import GroupCommit
from ekit_runtime.stores.errors import UnencodableError
from tests.support.queue_backends import (
    chain_checkpoints,
    claim_runs,
    expire_lease,
    naps,
    postgres_url,
    queue,
    queue_url,
    wait_for,
)

__all__ = ["naps", "postgres_url", "queue", "queue_url"]  # (fixtures)


def _outputs(queue: RunQueue, run_id: str) -> dict[str, Any]:
    stored = queue.checkpoint(run_id)
    return {} if stored is None else dict(stored.outputs)


def test_each_save_of_a_batch_is_fenced_and_answered_on_its_own(queue: RunQueue, queue_url: str) -> None:
    cps = chain_checkpoints(3)
    leases = claim_runs(queue, 4)
    assert queue.save_many([(lease, cps[0]) for lease in leases], 60) == [False] * 4
    expire_lease(queue_url, "r1")  # r1's worker is presumed dead: its lease has run out
    queue.cancel("r2")
    outcomes = queue.save_many([(lease, cps[1]) for lease in leases], 60)
    assert outcomes[0] is False and outcomes[3] is False
    assert isinstance(outcomes[1], LeaseLostError) and outcomes[1].run_id == "r1"
    assert outcomes[2] is True  # made, and its run was asked to cancel
    assert _outputs(queue, "r1") == {"s0": "out0"}  # the refused save wrote nothing
    for run_id in ("r0", "r2", "r3"):
        assert _outputs(queue, run_id) == {"s0": "out0", "s1": "out1"}
    # The refused lease refuses again; the others go on from their deltas.
    outcomes = queue.save_many([(lease, cps[2]) for lease in leases], 60)
    assert isinstance(outcomes[1], LeaseLostError) and outcomes[0] is False and outcomes[2] is True
    assert _outputs(queue, "r3") == {f"s{i}": f"out{i}" for i in range(3)}


def test_a_batch_mixes_saves_in_full_and_deltas(queue: RunQueue) -> None:
    cps = chain_checkpoints(4)
    leases = claim_runs(queue, 3)
    queue.save_many([(leases[0], cps[0]), (leases[1], cps[1])], 60)
    # r0: a delta; r1: a delta; r2: its first save, in full.
    assert queue.save_many([(leases[0], cps[2]), (leases[1], cps[3]), (leases[2], cps[3])], 60) == [False] * 3
    assert _outputs(queue, "r0") == {f"s{i}": f"out{i}" for i in range(3)}
    assert _outputs(queue, "r1") == _outputs(queue, "r2") == {f"s{i}": f"out{i}" for i in range(4)}
    assert queue.status("r2").steps_done == 4


def test_an_output_that_cannot_be_encoded_fails_its_save_alone(queue: RunQueue) -> None:
    leases = claim_runs(queue, 2)
    good = chain_checkpoints(1)[0]
    bad: list[WorkflowCheckpoint] = []
    Workflow([Step("s0", lambda ctx: object())]).run_sync(checkpoint_fn=bad.append)
    outcomes = queue.save_many([(leases[0], bad[-1]), (leases[1], good)], 60)
    assert isinstance(outcomes[0], UnencodableError) and "s0" in str(outcomes[0])
    assert outcomes[1] is False and _outputs(queue, "r1") == {"s0": "out0"}
    assert queue.checkpoint("r0") is None


def test_two_saves_of_one_run_in_a_batch_are_refused_before_anything_is_written(queue: RunQueue) -> None:
    cps = chain_checkpoints(2)
    (lease,) = claim_runs(queue, 1)
    with pytest.raises(ValueError, match="two saves of run 'r0'"):
        queue.save_many([(lease, cps[0]), (lease, cps[1])], 60)
    with pytest.raises(ValueError, match=r"saves\[0\] must be a \(Lease, WorkflowCheckpoint\) pair"):
        queue.save_many([("r0", cps[0])], 60)  # type: ignore[list-item]
    assert queue.checkpoint("r0") is None


def test_an_sqlite_batch_is_one_statement_and_no_transaction(tmp_path: Path) -> None:
    queue = SqliteQueue(tmp_path / "q.db")
    cps = chain_checkpoints(3)
    leases = claim_runs(queue, 130)
    queue.save_many([(lease, cps[0]) for lease in leases], 60)
    seen: list[str] = []
    queue.conn.set_trace_callback(lambda sql: None if seen and seen[-1] == sql else seen.append(sql))
    assert queue.save_many([(lease, cps[1]) for lease in leases[:7]], 60) == [False] * 7
    # (Each adds a step's output alone: the narrow view.)
    assert len(seen) == 1 and seen[0].startswith("INSERT INTO ekit_queue_steps"), seen
    seen.clear()
    # More saves than one statement binds: a statement per 60, each its own commit.
    assert queue.save_many([(lease, cps[2]) for lease in leases], 60)[-1] is False
    # (Most of them add two steps' outputs to what was stored: the general view.)
    assert [s[:29] for s in seen] == ["INSERT INTO ekit_queue_writes"] * 3
    assert not any(s.upper().startswith(("BEGIN", "COMMIT")) for s in seen)
    assert _outputs(queue, "r129") == {f"s{i}": f"out{i}" for i in range(3)}
    queue.close()


def test_a_failed_sqlite_statement_is_made_again_save_by_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = SqliteQueue(tmp_path / "q.db")
    cps = chain_checkpoints(2)
    leases = claim_runs(queue, 3)
    real = SqliteQueue._write_rows

    def fail_batches(self: SqliteQueue, conn: sqlite3.Connection, items: list[Any], seconds: float) -> Any:
        if len(items) > 1:
            raise sqlite3.DataError("string or blob too big")  # as one save's value might make it
        return real(self, conn, items, seconds)

    monkeypatch.setattr(SqliteQueue, "_write_rows", fail_batches)
    assert queue.save_many([(lease, cps[1]) for lease in leases], 60) == [False] * 3
    assert all(_outputs(queue, f"r{i}") == {"s0": "out0", "s1": "out1"} for i in range(3))
    queue.close()


def test_a_locked_sqlite_batch_gives_each_save_its_own_error_without_waiting_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, naps: list[float]
) -> None:
    import ekit_runtime.queue.sqlite as sqlite_queue
    from ekit_runtime.queue.transient import is_transient

    path = tmp_path / "q.db"
    queue = SqliteQueue(path)
    cps = chain_checkpoints(1)
    leases = claim_runs(queue, 3)
    monkeypatch.setattr(sqlite_queue, "_BUSY_TIMEOUT", 0.2)
    alone: list[str] = []
    real_save = SqliteQueue.save

    def save(self: SqliteQueue, lease: Lease, checkpoint: WorkflowCheckpoint, seconds: float) -> bool:
        alone.append(lease.run_id)
        return real_save(self, lease, checkpoint, seconds)

    monkeypatch.setattr(SqliteQueue, "save", save)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # held past the timeout
    outcomes = queue.save_many([(lease, cps[0]) for lease in leases], 60)
    holder.execute("ROLLBACK")
    holder.close()
    assert naps  # it waited for the lock, once, for the whole batch
    assert all(isinstance(o, sqlite3.OperationalError) and is_transient(o) for o in outcomes)
    assert len({id(o) for o in outcomes}) == 3  # three callers, three exceptions
    # No save made again alone, which would wait for the lock once more each.
    assert alone == [] and all(queue.checkpoint(f"r{i}") is None for i in range(3))
    assert queue.save_many([(lease, cps[0]) for lease in leases], 60) == [False] * 3  # retried: lands
    queue.close()


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["held", "expired", "taken"]), st.booleans(), st.integers(0, 3)),
        min_size=1,
        max_size=6,
    )
)
def test_a_batch_does_what_each_save_alone_would(runs: list[tuple[str, bool, int]]) -> None:
    """Any mix of held, expired and taken-over leases, cancels, and deltas or saves in full."""
    import tempfile

    cps = chain_checkpoints(5)
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/q.db"
        queue, rival = SqliteQueue(path), SqliteQueue(path)
        leases = claim_runs(queue, len(runs))
        for lease, (_how, _cancel, saved) in zip(leases, runs, strict=True):
            if saved:
                assert queue.save(lease, cps[saved - 1], 60) is False
        for lease, (how, cancel, _saved) in zip(leases, runs, strict=True):
            if how != "held":
                expire_lease(path, lease.run_id)
            if how == "taken":
                # (A run with a checkpoint goes to a worker of its graph.)
                assert rival.claim("rival", {"w": cps[0].fingerprint}, 60) is not None
            if cancel:
                queue.cancel(lease.run_id)
        before = {lease.run_id: _outputs(queue, lease.run_id) for lease in leases}
        outcomes = queue.save_many([(lease, cps[4]) for lease in leases], 60)
        for lease, (how, cancel, _saved), outcome in zip(leases, runs, outcomes, strict=True):
            if how == "held":
                assert outcome is cancel
                assert _outputs(queue, lease.run_id) == {f"s{i}": f"out{i}" for i in range(5)}
            else:
                assert isinstance(outcome, LeaseLostError)
                assert _outputs(queue, lease.run_id) == before[lease.run_id]
        queue.close()
        rival.close()


# -- GroupCommit -------------------------------------------------------------


class _Gated(SqliteQueue):
    """A queue whose first ``save_many`` waits for ``go`` (set from the test), to hold a write in flight.

    ``calls`` records each call's runs: those it was handed saves of, then
    those that joined it through ``more``, then (as ``end:<run>``) those it ended.
    """

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.go = threading.Event()
        self.entered = threading.Event()
        self.calls: list[list[str]] = []

    def write_many(
        self,
        saves: Sequence[tuple[Lease, WorkflowCheckpoint]],
        endings: Sequence[Ending],
        lease_seconds: float,
        more: More | None = None,
    ) -> tuple[list[bool | Exception], list[Exception | None]]:
        runs = [lease.run_id for lease, _ in saves]
        self.calls.append(runs)
        if len(self.calls) == 1:
            self.entered.set()
            assert self.go.wait(60)

        def joined(limit: int) -> Sequence[tuple[Lease, WorkflowCheckpoint]]:
            assert more is not None
            got = more(limit)
            runs.extend(lease.run_id for lease, _ in got)
            return got

        try:
            return super().write_many(saves, endings, lease_seconds, None if more is None else joined)
        finally:
            runs.extend(f"end:{end.lease.run_id}" for end in endings)


@pytest.fixture
def gated(tmp_path: Path) -> Iterator[_Gated]:
    queue = _Gated(tmp_path / "q.db")
    yield queue
    queue.go.set()
    queue.close()


async def _held_first_write(
    group: GroupCommit, gated: _Gated, lease: Lease, checkpoint: WorkflowCheckpoint
) -> asyncio.Future[bool]:
    """Ask a save and return once its write is in flight, held inside the gated queue."""
    first = asyncio.ensure_future(group.save(lease, checkpoint))
    await asyncio.get_running_loop().run_in_executor(None, gated.entered.wait, 60)
    return first


def test_saves_asked_together_go_in_one_write(gated: _Gated) -> None:
    gated.go.set()
    cps = chain_checkpoints(1)
    leases = claim_runs(gated, 4)

    async def main() -> list[bool]:
        with _executor() as pool:
            group = GroupCommit(gated, pool, 60)
            return await asyncio.gather(*(group.save(lease, cps[0]) for lease in leases))

    assert asyncio.run(main()) == [False] * 4
    assert gated.calls == [["r0", "r1", "r2", "r3"]]


def test_saves_asked_while_a_write_waits_for_its_turn_join_it(gated: _Gated) -> None:
    cps = chain_checkpoints(2)
    leases = claim_runs(gated, 3)

    async def main() -> None:
        with _executor() as pool:
            group = GroupCommit(gated, pool, 60)
            first = await _held_first_write(group, gated, leases[0], cps[0])
            later = [asyncio.ensure_future(group.save(lease, cps[0])) for lease in leases[1:]]
            # r0's next save cannot join: a run's saves are made in order, one per write.
            again = asyncio.ensure_future(group.save(leases[0], cps[1]))
            await asyncio.sleep(0)  # (one turn of the loop: each task asks its save)
            assert len(group._waiting) == 3 and not first.done() and len(gated.calls) == 1
            gated.go.set()
            assert await asyncio.gather(first, *later) == [False] * 3
            assert await again is False
            await group.drain()

    asyncio.run(main())
    assert gated.calls == [["r0", "r1", "r2"], ["r0"]]
    assert _outputs(gated, "r0") == {"s0": "out0", "s1": "out1"}
    assert _outputs(gated, "r2") == {"s0": "out0"}


def test_runs_ended_while_a_write_is_in_flight_end_with_the_next_saves_each_answered(gated: _Gated) -> None:
    cps = chain_checkpoints(2)
    leases = claim_runs(gated, 4)
    for lease in leases:
        assert gated.save(lease, cps[0], 60) is False  # (not write_many: the gate holds its first call)
    stale = dataclasses.replace(leases[3], epoch=leases[3].epoch + 9)

    async def main() -> None:
        with _executor() as pool:
            group = GroupCommit(gated, pool, 60)
            first = await _held_first_write(group, gated, leases[0], cps[1])
            # Asked while r0's save is in flight: r1's save, r2's ending, a stale lease's
            # ending, and r0's own ending, which must not be written before r0's save.
            saving = asyncio.ensure_future(group.save(leases[1], cps[1]))
            ending = asyncio.ensure_future(group.finish(leases[2], "finished"))
            refused = asyncio.ensure_future(group.finish(stale, "failed", "boom"))
            last = asyncio.ensure_future(group.finish(leases[0], "finished"))
            await asyncio.sleep(0)  # (one turn of the loop: each task asks its write)
            assert len(group._waiting) == 4 and not first.done()
            gated.go.set()
            assert await first is False and await saving is False
            assert await ending is None and await last is None
            with pytest.raises(LeaseLostError):
                await refused
            await group.drain()
            assert (group.batches, group.saves, group.endings) == (2, 2, 3)

    asyncio.run(main())
    # r1's save joined the write in flight (``more``); the endings waited for the next.
    assert gated.calls == [["r0", "r1"], ["end:r2", "end:r3", "end:r0"]]
    assert [gated.status(f"r{i}").status for i in range(4)] == ["finished", "running", "finished", "running"]
    assert _outputs(gated, "r0") == {"s0": "out0", "s1": "out1"}
    assert _outputs(gated, "r1") == {"s0": "out0", "s1": "out1"}


def test_an_sqlite_batch_takes_in_the_saves_handed_over_while_it_waits_for_the_lock(
    tmp_path: Path, naps: list[float]
) -> None:
    path = tmp_path / "q.db"
    queue = SqliteQueue(path)
    cps = chain_checkpoints(1)
    leases = claim_runs(queue, 3)
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")  # another process's write lock
    asked: list[int] = []

    def more(limit: int) -> list[tuple[Lease, WorkflowCheckpoint]]:
        asked.append(limit)
        # The first attempt finds nothing new; after a wait for the lock, r1 and r2 join.
        return [(lease, cps[0]) for lease in leases[1:]] if len(asked) == 2 else []

    outcomes: list[Any] = []
    seen: list[str] = []
    queue.conn.set_trace_callback(lambda sql: None if seen and seen[-1] == sql else seen.append(sql))
    saver = threading.Thread(
        target=lambda: outcomes.extend(queue.save_many([(leases[0], cps[0])], 60, more))
    )
    saver.start()
    wait_for(lambda: len(asked) >= 3 and len(naps) >= 2, timeout=30, what="the batch to wait for the lock")
    holder.execute("ROLLBACK")
    saver.join(30)
    holder.close()
    assert outcomes == [False, False, False]  # the one it was handed, then the two that joined
    assert asked[0] == 59 and asked[1] == 59 and asked[2] == 57  # what could still join, each time
    assert all(_outputs(queue, f"r{i}") == {"s0": "out0"} for i in range(3))
    # Each attempt at the lock is one statement (traced with its values): the first
    # held r0 alone, the one that went through all three rows, in one commit.
    made = [s for s in seen if s.startswith("INSERT INTO ekit_queue_writes")]
    assert len(made) >= 2 and "'r1'" not in made[0] and "'r1'" in made[-1] and "'r2'" in made[-1]
    queue.close()


def test_a_save_cancelled_before_its_write_began_is_not_made(gated: _Gated) -> None:
    cps = chain_checkpoints(1)
    leases = claim_runs(gated, 2)

    async def main() -> None:
        with _executor() as pool:
            group = GroupCommit(gated, pool, 60)
            first = await _held_first_write(group, gated, leases[0], cps[0])
            dropped = asyncio.ensure_future(group.save(leases[1], cps[0]))
            await asyncio.sleep(0)  # (one turn of the loop: the task asks its save)
            assert len(group._waiting) == 1
            dropped.cancel()
            gated.go.set()
            assert await first is False
            await group.drain()
            assert dropped.cancelled()

    asyncio.run(main())
    assert gated.calls == [["r0"]]
    assert gated.checkpoint("r1") is None


def test_each_caller_of_a_batch_meets_its_own_outcome(queue: RunQueue, queue_url: str) -> None:
    cps = chain_checkpoints(1)
    leases = claim_runs(queue, 3)
    expire_lease(queue_url, "r1")
    queue.cancel("r2")

    async def main() -> list[Any]:
        with _executor() as pool:
            group = GroupCommit(queue, pool, 60)
            saving = (group.save(lease, cps[0]) for lease in leases)
            return await asyncio.gather(*saving, return_exceptions=True)

    first, second, third = asyncio.run(main())
    assert first is False and third is True and isinstance(second, LeaseLostError)


def test_a_worker_commits_its_runs_saves_together_and_every_run_ends_whole(tmp_path: Path) -> None:
    url = str(tmp_path / "q.db")
    queue = open_queue(url)
    steps = 4
    for i in range(12):
        queue.submit("chain", {"n": i}, run_id=f"r{i}")
    chain = Workflow(
        [Step(f"s{i}", lambda ctx, i=i: f"{ctx['n']}-{i}", (f"s{i - 1}",) if i else ()) for i in range(steps)]
    )
    worker = Worker(queue, {"chain": chain}, max_runs=4, poll=0.01)
    assert asyncio.run(worker.run_until_idle()) == 12
    assert worker.outcomes == dict.fromkeys((f"r{i}" for i in range(12)), "finished")
    for i in range(12):
        assert _outputs(queue, f"r{i}") == {f"s{k}": f"{i}-{k}" for k in range(steps)}
    group = worker._group
    assert group is not None and group.saves >= 12 * steps
    # Runs in flight together saved together: fewer writes than saves.
    assert group.batches < group.saves
    queue.close()


class _executor:
    """A one-thread executor (the worker's database thread), shut down on exit."""

    def __enter__(self) -> Any:
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(1)
        return self.pool

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(wait=True)


def test_a_postgres_batch_of_deltas_is_one_statement(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psycopg

    queue = open_queue(postgres_url)
    cps = chain_checkpoints(2)
    leases = claim_runs(queue, 5)
    queue.save_many([(lease, cps[0]) for lease in leases], 60)  # first saves: in full (a batch of their own)
    seen: list[str] = []
    real = psycopg.Connection.execute

    def execute(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(str(query))
        return real(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Connection, "execute", execute)
    assert queue.save_many([(lease, cps[1]) for lease in leases], 60) == [False] * 5
    assert len(seen) == 1 and seen[0].startswith("WITH i AS (SELECT d->>0 AS rid"), seen
    assert all(_outputs(queue, f"r{i}") == {"s0": "out0", "s1": "out1"} for i in range(5))
    queue.close()


def test_a_postgres_batch_whose_session_was_dropped_is_made_again_save_by_save(postgres_url: str) -> None:
    import psycopg

    queue = open_queue(postgres_url)
    cps = chain_checkpoints(2)
    leases = claim_runs(queue, 3)
    queue.save_many([(lease, cps[0]) for lease in leases], 60)
    pid = queue.db.conn.info.backend_pid  # type: ignore[attr-defined]
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    # The batch's statement meets the dropped session; made again alone, the
    # first reconnects and each save lands.
    assert queue.save_many([(lease, cps[1]) for lease in leases], 60) == [False] * 3
    assert queue.db.conn.info.backend_pid != pid  # type: ignore[attr-defined]
    assert all(_outputs(queue, f"r{i}") == {"s0": "out0", "s1": "out1"} for i in range(3))
    # The same for a batch with runs ended in it: each ending is made again alone.
    pid = queue.db.conn.info.backend_pid  # type: ignore[attr-defined]
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    endings = [Ending(leases[1], "finished"), Ending(leases[2], "failed")]
    saved, ended = queue.write_many([(leases[0], cps[1])], endings, 60)
    assert (saved, ended) == ([False], [None, None])
    assert [queue.status(f"r{i}").status for i in range(3)] == ["running", "finished", "failed"]
    queue.close()


def test_a_backend_answering_the_wrong_number_of_saves_fails_each_caller_instead_of_hanging(
    tmp_path: Path,
) -> None:
    class Short(SqliteQueue):
        def write_many(
            self,
            saves: Sequence[tuple[Lease, WorkflowCheckpoint]],
            endings: Sequence[Ending],
            lease_seconds: float,
            more: More | None = None,
        ) -> tuple[list[bool | Exception], list[Exception | None]]:
            saved, ended = super().write_many(saves, endings, lease_seconds)
            return saved[:-1], ended

    queue = Short(tmp_path / "q.db")
    cps = chain_checkpoints(1)
    leases = claim_runs(queue, 2)

    async def main() -> list[Any]:
        with _executor() as pool:
            group = GroupCommit(queue, pool, 60)
            saving = (group.save(lease, cps[0]) for lease in leases)
            return await asyncio.gather(*saving, return_exceptions=True)

    outcomes = asyncio.run(main())
    assert [type(o) for o in outcomes] == [RuntimeError, RuntimeError]
    assert "write_many returned tuple for 2 saves and 0 endings" in str(outcomes[0])
    queue.close()
