"""A PostgreSQL worker's writes and claims are awaited on its event loop, and fall back to its thread.

``LoopSession`` (ekit_runtime.queue.postgres_loop) makes a worker's batches
of writes and its quick claims on an asynchronous connection of the
worker's own, instead of handing each call to the worker's database thread
and back. These tests pin what that must not change: every write still
fenced and answered on its own, a batch that fails as a whole made again
write by write on the thread, a session that the server ends or that a
cancellation interrupts replaced, a database that cannot be reached asked on
the thread, outputs of any text stored as they are, an idle claim made once,
and a queue that makes its writes its own way (a subclass, an adopted
connection, ``async_session=False``) called through them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ekit_runtime import Step, Workflow
from ekit_runtime.queue import Lease, LeaseLostError, PostgresQueue, Worker
from ekit_runtime.queue.base import Ending
from ekit_runtime.queue.postgres_loop import LoopSession
from tests.support.queue_backends import (
    chain_checkpoints,
    expire_lease,
    fresh_postgres,
    postgres_url,
    wait_for,
)

__all__ = ["postgres_url"]  # (fixtures)

psycopg = pytest.importorskip("psycopg")


@pytest.fixture(scope="module")
def shared_url() -> Iterator[str]:
    """One fresh database for the many examples of a property (each uses runs of its own)."""
    with fresh_postgres() as url:
        yield url


def _session(queue: PostgresQueue) -> LoopSession:
    session = queue._loop_session()
    assert isinstance(session, LoopSession)
    return session


def _claim(queue: PostgresQueue, workflow: str, count: int) -> list[Lease]:
    run_ids = [queue.submit(workflow) for _ in range(count)]
    leases = [queue.claim("me", {workflow: None}, 60) for _ in run_ids]
    assert all(lease is not None for lease in leases)
    return [lease for lease in leases if lease is not None]


class _CountingThread(concurrent.futures.ThreadPoolExecutor):
    """The worker's database thread, counting what it is handed."""

    handed: ClassVar[list[str]] = []

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        inner = getattr(fn, "func", fn)
        self.handed.append(getattr(inner, "__name__", repr(inner)))
        return super().submit(fn, *args, **kwargs)


def test_a_postgres_workers_saves_endings_and_claims_cross_to_no_thread(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ekit_runtime.queue.worker as worker_module

    handed: list[str] = []
    monkeypatch.setattr(_CountingThread, "handed", handed)
    monkeypatch.setattr(worker_module, "ThreadPoolExecutor", _CountingThread)
    queue = PostgresQueue(postgres_url)
    # What the thread asks of the queue: its calls, and the runs its claims leased.
    leased_on_thread: list[str] = []
    claim_many = queue.claim_many

    def claims(*args: Any) -> list[Lease]:
        got = claim_many(*args)
        leased_on_thread.extend(lease.run_id for lease in got)
        return got

    monkeypatch.setattr(queue, "claim_many", claims)
    steps = [Step(f"s{i}", lambda ctx, i=i: f"out{i}", (f"s{i - 1}",) if i else ()) for i in range(3)]
    run_ids = [queue.submit("chain") for _ in range(40)]
    worker = Worker(queue, {"chain": Workflow(steps)}, max_runs=4, poll=0.01)
    assert asyncio.run(worker.run_until_idle()) == 40
    for run_id in run_ids:
        assert queue.status(run_id).status == "finished"
        result = queue.result(run_id)
        assert result is not None and dict(result.outputs) == {f"s{i}": f"out{i}" for i in range(3)}
    # 120 saves and 40 endings: none on the thread.
    assert not {"write_many", "save", "finish", "write", "alone"} & set(handed), handed
    # At least 10 claims leased the 40 runs: on the thread, only the first (a
    # claim in full, which reads the fleet's limits) and those that found the
    # queue empty.
    assert len(leased_on_thread) <= 4, leased_on_thread
    queue.close()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["held", "expired", "taken"]),
            st.booleans(),  # a cancel asked
            st.integers(0, 3),  # steps saved before
            st.booleans(),  # ended in the batch, not saved
        ),
        min_size=1,
        max_size=6,
    )
)
def test_a_batch_on_the_loop_fences_and_answers_each_write_as_on_the_thread(
    shared_url: str, runs: list[tuple[str, bool, int, bool]]
) -> None:
    """Any mix of held, expired and taken-over leases, cancels, deltas, saves in full and endings."""
    cps = chain_checkpoints(5)
    workflow = f"w{uuid.uuid4().hex[:8]}"
    queue, rival = PostgresQueue(shared_url), PostgresQueue(shared_url)
    try:
        leases = _claim(queue, workflow, len(runs))
        for lease, (_how, _cancel, saved, _end) in zip(leases, runs, strict=True):
            if saved:
                assert queue.save(lease, cps[saved - 1], 60) is False
        for lease, (how, cancel, _saved, _end) in zip(leases, runs, strict=True):
            if how != "held":
                expire_lease(shared_url, lease.run_id)
            if how == "taken":
                assert rival.claim("rival", {workflow: cps[0].fingerprint}, 60) is not None  # (of its graph)
            if cancel:
                queue.cancel(lease.run_id)
        before = {lease.run_id: queue.checkpoint(lease.run_id) for lease in leases}
        saves = [(lease, cps[4]) for lease, run in zip(leases, runs, strict=True) if not run[3]]
        endings = [Ending(lease, "finished") for lease, run in zip(leases, runs, strict=True) if run[3]]

        async def write() -> tuple[list[bool | Exception], list[Exception | None]]:
            session = _session(queue)
            with concurrent.futures.ThreadPoolExecutor(1) as thread:
                try:
                    return await session.write_many(saves, endings, 60, thread)
                finally:
                    await session.aclose()

        saved, ended = asyncio.run(write())
        outcomes = iter(saved)
        endings_told = iter(ended)
        for lease, (how, cancel, _saved, end) in zip(leases, runs, strict=True):
            info = queue.status(lease.run_id)
            stored = queue.checkpoint(lease.run_id)
            if end:
                told = next(endings_told)
                if how == "held":  # (a cancel asked or not: an ending ends the run as asked)
                    assert told is None and info.status == "finished"
                else:
                    assert isinstance(told, LeaseLostError) and info.status != "finished"
                continue
            outcome = next(outcomes)
            if how == "held":
                assert outcome is cancel
                assert stored is not None and dict(stored.outputs) == {f"s{i}": f"out{i}" for i in range(5)}
            else:
                assert isinstance(outcome, LeaseLostError)
                old = before[lease.run_id]
                assert (None if stored is None else dict(stored.outputs)) == (
                    None if old is None else dict(old.outputs)
                )
    finally:
        queue.close()
        rival.close()


def test_a_batch_whose_loop_session_dies_in_its_statement_is_made_again_write_by_write(
    postgres_url: str,
) -> None:
    queue = PostgresQueue(postgres_url)
    cps = chain_checkpoints(3)
    leases = _claim(queue, "w", 3)
    victim = f"ekit-loop-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres_url, autocommit=True) as admin, psycopg.connect(postgres_url) as locker:

        async def main() -> tuple[list[bool | Exception], list[Exception | None]]:
            session = LoopSession(queue, postgres_url + f"&application_name={victim}", None)
            with concurrent.futures.ThreadPoolExecutor(1) as thread:
                # Hold one run's row: the batch's statement waits for it.
                held = "SELECT 1 FROM ekit_queue_runs WHERE run_id = %s FOR UPDATE"
                locker.execute(held, (leases[0].run_id,))
                saves = [(lease, cps[0]) for lease in leases[:2]]
                writing = asyncio.ensure_future(
                    session.write_many(saves, [Ending(leases[2], "failed", "x")], 60, thread)
                )
                waiting = (
                    "SELECT pid FROM pg_stat_activity WHERE application_name = %s "
                    "AND wait_event_type = 'Lock'"
                )
                pids = await asyncio.to_thread(
                    wait_for, lambda: admin.execute(waiting, (victim,)).fetchall(), timeout=10,
                    what="the batch to wait for the row",
                )
                admin.execute("SELECT pg_terminate_backend(%s)", (pids[0][0],))
                locker.commit()  # (the writes made again alone on the thread do not wait)
                told = await writing
                assert session._conn is None  # closed after the failure
                await session.aclose()
                return told

        saved, ended = asyncio.run(main())
    assert saved == [False, False] and ended == [None]
    for lease in leases[:2]:
        stored = queue.checkpoint(lease.run_id)
        assert stored is not None and dict(stored.outputs) == {"s0": "out0"}
    assert queue.status(leases[2].run_id).status == "failed"
    queue.close()


def test_a_cancelled_write_on_the_loop_closes_its_session_and_the_next_write_lands_in_full(
    postgres_url: str,
) -> None:
    queue = PostgresQueue(postgres_url)
    cps = chain_checkpoints(3)
    (lease,) = _claim(queue, "w", 1)
    assert queue.save(lease, cps[0], 60) is False
    with psycopg.connect(postgres_url) as locker, psycopg.connect(postgres_url, autocommit=True) as admin:

        async def main() -> bool | Exception:
            session = _session(queue)
            with concurrent.futures.ThreadPoolExecutor(1) as thread:
                locker.execute("SELECT 1 FROM ekit_queue_runs WHERE run_id = %s FOR UPDATE", (lease.run_id,))
                writing = asyncio.ensure_future(session.write_many([(lease, cps[1])], [], 60, thread))
                await asyncio.to_thread(
                    wait_for,
                    # (Not on the locker: a transaction sees one snapshot of pg_stat_activity.)
                    lambda: admin.execute(
                        "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND datname = current_database()"
                    ).fetchall(),
                    timeout=10,
                    what="the write to wait for the row",
                )
                writing.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await writing
                assert session._conn is None
                locker.commit()
                session._paused_until = 0.0  # (the pause after a failure is pinned below)
                (told,), _ = await session.write_many([(lease, cps[2])], [], 60, thread)
                assert session._conn is not None  # a new session made it
                await session.aclose()
                return told

        told = asyncio.run(main())
    assert told is False
    stored = queue.checkpoint(lease.run_id)
    assert stored is not None and dict(stored.outputs) == {f"s{i}": f"out{i}" for i in range(3)}
    queue.close()


def test_a_database_the_loop_cannot_reach_is_asked_on_the_thread_and_not_again_for_a_while(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = PostgresQueue(postgres_url)
    cps = chain_checkpoints(2)
    leases = _claim(queue, "w", 2)
    connects: list[str] = []
    real = psycopg.AsyncConnection.connect

    async def refused(conninfo: str, **kwargs: Any) -> Any:
        connects.append(conninfo)
        raise psycopg.OperationalError("connection refused")

    async def main() -> None:
        session = _session(queue)
        with concurrent.futures.ThreadPoolExecutor(1) as thread:
            monkeypatch.setattr(psycopg.AsyncConnection, "connect", refused)
            saved, _ = await session.write_many([(leases[0], cps[0])], [], 60, thread)
            assert saved == [False] and len(connects) == 1
            # Within the pause: not asked again; the thread makes the calls.
            saved, _ = await session.write_many([(leases[1], cps[0])], [], 60, thread)
            got = await session.claim_many("me", {"w": None}, 60, 2, thread)
            assert saved == [False] and got == [] and len(connects) == 1
            monkeypatch.setattr(psycopg.AsyncConnection, "connect", real)
            session._paused_until = 0.0  # (the pause over)
            saved, _ = await session.write_many([(leases[0], cps[1])], [], 60, thread)
            assert saved == [False] and session._conn is not None
            await session.aclose()

    asyncio.run(main())
    for lease in leases:
        stored = queue.checkpoint(lease.run_id)
        assert stored is not None and "s0" in stored.outputs
    queue.close()


def test_a_session_the_server_ended_while_idle_is_replaced_before_the_next_claim(postgres_url: str) -> None:
    queue = PostgresQueue(postgres_url)
    for run_id in ("a", "b", "c"):
        queue.submit("w", run_id=run_id)
    queue.claim("warm", {"w": None}, 60)  # (a claim in full: later claims are quick)
    victim = f"ekit-loop-{uuid.uuid4().hex[:8]}"

    async def main() -> list[Lease]:
        session = LoopSession(queue, postgres_url + f"&application_name={victim}", None)
        with concurrent.futures.ThreadPoolExecutor(1) as thread, psycopg.connect(
            postgres_url, autocommit=True
        ) as admin:
            assert await session.claim_many("me", {"w": None}, 60, 1, thread) != []  # opens the session
            first = session._conn
            assert first is not None
            pid = admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (victim,)
            ).fetchone()[0]
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            gone = "SELECT 1 FROM pg_stat_activity WHERE pid = %s"
            await asyncio.to_thread(
                wait_for, lambda: not admin.execute(gone, (pid,)).fetchall(), timeout=10, what="it to go"
            )
            got = await session.claim_many("me", {"w": None}, 60, 1, thread)
            assert session._conn is not None and session._conn is not first  # replaced, not paused
            await session.aclose()
            return got

    got = asyncio.run(main())
    assert [lease.run_id for lease in got] == ["c"]
    assert queue.status("c").status == "running"
    queue.close()


def test_only_a_queue_that_owns_its_connection_and_its_writes_is_given_a_loop_session(
    postgres_url: str,
) -> None:
    queue = PostgresQueue(postgres_url)
    assert isinstance(queue._loop_session(), LoopSession)

    class Mine(PostgresQueue):
        def write_many(self, *args: Any, **kwargs: Any) -> Any:
            return super().write_many(*args, **kwargs)

    mine = Mine(postgres_url)
    assert mine._loop_session() is None  # its writes are its own: made through write_many
    counted = PostgresQueue(postgres_url, async_session=False)
    assert counted._loop_session() is None  # one connection per worker, as asked
    with pytest.raises(ValueError, match="async_session must be True or False, got str"):
        PostgresQueue(postgres_url, async_session="no")  # type: ignore[arg-type]
    counted.close()
    with psycopg.connect(postgres_url) as conn:
        adopted = PostgresQueue(conn)
        assert adopted._loop_session() is None  # its owner decides what connects
        adopted.close()
    mine.close()
    queue.close()


def test_outputs_of_any_text_survive_a_batch_on_the_loop_and_on_the_thread(postgres_url: str) -> None:
    """The rows travel as one JSON text: quotes, backslashes, braces, newlines, any script, big texts."""
    hostile = [
        'a "quoted" \\ back\\slash', "{\"not\": [\"json\"]}", "line\nbreak\ttab\r", "naïve 日本語 🙂",
        "'); DROP TABLE ekit_queue_runs; --", "\\u0041 is not A", "x" * 200_000, "", "[1, 2]",
    ]
    steps = [
        Step(f"s{i}", lambda ctx, i=i: hostile[i], (f"s{i - 1}",) if i else ()) for i in range(len(hostile))
    ]
    cps: list[Any] = []
    Workflow(steps).run_sync(checkpoint_fn=cps.append)
    queue = PostgresQueue(postgres_url)
    on_loop, on_thread = _claim(queue, "w", 2)

    async def main() -> None:
        session = _session(queue)
        with concurrent.futures.ThreadPoolExecutor(1) as thread:
            for cp in cps:  # the first in full, then deltas
                saved, _ = await session.write_many([(on_loop, cp)], [], 60, thread)
                assert saved == [False]
            await session.aclose()

    asyncio.run(main())
    for cp in cps:
        ending = [Ending(on_loop, "finished")] if cp is cps[-1] else []
        saved, _ = queue.write_many([(on_thread, cp)], ending, 60)
        assert saved == [False]
    expected = {f"s{i}": text for i, text in enumerate(hostile)}
    for lease in (on_loop, on_thread):
        stored = queue.checkpoint(lease.run_id)
        assert stored is not None and dict(stored.outputs) == expected
    assert queue.status(on_loop.run_id).status == "finished"
    queue.close()


def test_an_idle_claim_on_the_loop_asks_the_quick_claim_once_then_the_claim_in_full(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = PostgresQueue(postgres_url)
    queue.submit("w", run_id="only")
    assert queue.claim("warm", {"w": None}, 60) is not None  # (the queue is now empty; claims are quick)
    asked: list[str] = []
    in_full = queue._claim_in_full

    def full(*args: Any) -> Lease | None:
        asked.append("in full")
        return in_full(*args)

    def never(*args: Any) -> Any:
        asked.append("quick again")  # claim and claim_many both begin with the quick claim
        raise AssertionError("the quick claim made twice")

    monkeypatch.setattr(queue, "_claim_in_full", full)
    monkeypatch.setattr(queue, "claim", never)
    monkeypatch.setattr(queue, "claim_many", never)

    async def main() -> list[Lease]:
        session = _session(queue)
        with concurrent.futures.ThreadPoolExecutor(1) as thread:
            try:
                return await session.claim_many("me", {"w": None}, 60, 4, thread)
            finally:
                await session.aclose()

    assert asyncio.run(main()) == []
    assert asked == ["in full"]
    queue.close()
