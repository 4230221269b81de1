"""Lease rules that hold on both backends, each pinned so that breaking it in the SQL fails a test.

- Every write of a holder whose lease expired is refused, even when nobody
  took the run over (expiry alone ends the lease).
- A run with a cancel request stays with its live worker; once that
  worker's lease has expired, the run is cancelled, not resumed.
- The fleet's call and token limits hold back a step exactly once the
  window's usage reaches them, and not a step before.
- A delta save made by the old holder's own queue object, after another
  connection took the run over, is refused and writes nothing.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from typing import Any

import pytest

from ekit_core import WorkflowCheckpoint
from ekit_runtime import PatternResult, Step, TokenUsage, Workflow
from ekit_runtime.queue import Ending, LeaseLostError, Limits, RunQueue, Worker, open_queue
from tests.support.queue_backends import entry_epochs, queue, queue_url, wait_for

__all__ = ["queue", "queue_url"]


def _chain(steps: int, usage: TokenUsage, log: list[tuple[str, float, float]] | None = None) -> Workflow:
    """``steps`` no-op steps in a chain, each costing ``usage``; ``log`` gets (name, start, end)."""

    def step(name: str) -> Any:
        async def run(ctx: dict[str, Any]) -> Any:
            began = time.time()
            await asyncio.sleep(0)
            if log is not None:
                log.append((name, began, time.time()))
            return PatternResult(name, cost=usage)

        return run

    return Workflow([Step(f"s{i}", step(f"s{i}"), (f"s{i - 1}",) if i else ()) for i in range(steps)])


_CALL = TokenUsage(10, 5, 1)


def _checkpoints(steps: int, usage: TokenUsage = _CALL) -> list[WorkflowCheckpoint]:
    seen: list[WorkflowCheckpoint] = []
    _chain(steps, usage).run_sync(checkpoint_fn=seen.append)
    by_index = {cp.step_index: cp for cp in seen}
    return [by_index[i] for i in sorted(by_index)][-steps:]


def _expired(queue: RunQueue, run: str) -> bool:
    until = queue.status(run).lease_until
    return until is not None and until < time.time()


def _stored(url: str, run: str) -> tuple[Any, ...]:
    """What a write could have changed: the run row's status, epoch, save count and counts, the usage
    and the entries."""
    where = "FROM ekit_queue_runs WHERE run_id = "
    # (SQLite's row holds the number of the last save that wrote it, PostgreSQL's a save count.)
    saves = "saves" if url.startswith("postgresql://") else "counted"
    row_sql = f"SELECT status, epoch, {saves}, step_index, llm_calls, lease_until {where}"
    usage_sql = "SELECT coalesce(sum(llm_calls), 0) FROM ekit_queue_usage"
    if url.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute(row_sql + "%s", (run,)).fetchone()
            usage = conn.execute(usage_sql).fetchone()
    else:
        conn2 = sqlite3.connect(url, timeout=30)
        try:
            row = conn2.execute(row_sql + "?", (run,)).fetchone()
            usage = conn2.execute(usage_sql).fetchone()
        finally:
            conn2.close()
    assert row is not None and usage is not None
    return (*row, usage[0], tuple(sorted(entry_epochs(url, run).items())))


# -- expiry alone ends a lease ---------------------------------------------------------


@pytest.mark.parametrize(
    "write",
    [
        "delta save", "full save", "renew", "release", "finish",
        # In a worker's batch (write_many's one statement), beside a live run's write that lands.
        "batched delta save", "batched full save", "batched finish",
    ],
)
def test_every_holder_write_after_a_plain_expiry_is_refused(
    queue: RunQueue, queue_url: str, write: str
) -> None:
    first, second = _checkpoints(2)
    run = queue.submit("w", run_id="expired")
    lease = queue.claim("w1", {"w": None}, 0.3)
    assert lease is not None
    queue.save(lease, first, 0.3)
    queue.submit("w", run_id="live")
    live = queue.claim("w1", {"w": None}, 60)
    assert live is not None and live.run_id == "live"
    wait_for(lambda: _expired(queue, run), timeout=10, what="the lease to expire")
    before = _stored(queue_url, run)
    other = Workflow([Step("z", lambda ctx: "z")]).run_sync().checkpoint
    assert other is not None

    def batched(saves: list[Any], endings: list[Ending]) -> None:
        # (The live run's checkpoint records no usage: the fleet's usage window is one for all runs.)
        saved, ended = queue.write_many([*saves, (live, other)], endings, 30)
        assert saved[-1] is False and queue.checkpoint("live") == other  # landed in the same statement
        (refused,) = saved[:-1] + ended
        assert isinstance(refused, Exception)
        raise refused

    calls = {
        "delta save": lambda: queue.save(lease, second, 30),
        "full save": lambda: queue.save(lease, other, 30),  # not an extension of `first`: a rewrite
        "renew": lambda: queue.renew(lease, 30),
        "finish": lambda: queue.finish(lease, "finished"),
        "batched delta save": lambda: batched([(lease, second)], []),
        "batched full save": lambda: batched([(lease, other)], []),
        "batched finish": lambda: batched([], [Ending(lease, "finished")]),
    }
    if write == "release":
        assert queue.release(lease) is False
    else:
        with pytest.raises(LeaseLostError, match="epoch 1"):
            calls[write]()
    assert _stored(queue_url, run) == before  # nothing of the refused write reached the database
    assert queue.checkpoint(run) == first and queue.status(run).status == "running"
    taken = queue.claim("w2", {"w": first.fingerprint}, 30)  # and the run is there for the next worker
    assert taken is not None and taken.run_id == run and taken.epoch == 2 and taken.checkpoint == first


# -- cancel requests -----------------------------------------------------------------------


def test_a_live_run_with_a_cancel_request_stays_with_its_worker(queue: RunQueue, queue_url: str) -> None:
    (first,) = _checkpoints(1)
    run = queue.submit("w", run_id="wanted-stopped")
    lease = queue.claim("w1", {"w": None}, 30)
    assert lease is not None
    assert queue.cancel(run) is True
    others = [open_queue(queue_url) for _ in range(2)]
    try:
        for other in others:
            assert other.claim("w2", {"w": None}, 30) is None  # nobody else takes it, nor cancels it
        assert queue.save(lease, first, 30) is True
        for other in others:
            assert other.claim("w2", {"w": first.fingerprint}, 30) is None
        info = queue.status(run)
        assert (info.status, info.epoch, info.owner, info.cancel_requested) == ("running", 1, "w1", True)
        # Its worker learns at its next write, saves what it has, and ends it.
        assert queue.renew(lease, 30) is True
        queue.finish(lease, "cancelled")
        assert queue.status(run).status == "cancelled" and queue.checkpoint(run) == first
    finally:
        for other in others:
            other.close()


def test_a_run_given_back_after_a_cancel_its_worker_had_not_seen_is_cancelled(
    queue: RunQueue, queue_url: str
) -> None:
    # A worker stopping (SIGTERM) releases its runs; a cancel asked just before,
    # which it never saw, must not send the run back to be claimed and paid for.
    (first,) = _checkpoints(1)
    run = queue.submit("w", run_id="stopped-and-cancelled")
    queue.submit("w", run_id="other")
    lease = queue.claim("w1", {"w": None}, 30)
    assert lease is not None and lease.run_id == run
    assert queue.save(lease, first, 30) is False  # no cancel asked yet
    assert queue.cancel(run) is True  # flagged: the lease is live
    assert queue.release(lease) is True
    info = queue.status(run)
    assert (info.status, info.lease_until, info.epoch) == ("cancelled", None, 1)
    assert queue.checkpoint(run) == first
    taker = open_queue(queue_url)
    try:
        taken = taker.claim("w2", {"w": first.fingerprint}, 30)
        assert taken is not None and taken.run_id == "other"
        assert taker.claim("w2", {"w": first.fingerprint}, 30) is None
    finally:
        taker.close()
    # Without a cancel, a release gives the run back to be claimed.
    again = queue.submit("w", run_id="plain")
    plain = queue.claim("w1", {"w": None}, 30)
    assert plain is not None and plain.run_id == again
    assert queue.release(plain) is True
    assert queue.status(again).status == "queued"


def test_a_dead_workers_cancelled_run_is_cancelled_not_resumed(queue: RunQueue, queue_url: str) -> None:
    (first,) = _checkpoints(1)
    run = queue.submit("w", run_id="orphan")
    queue.submit("w", run_id="next")
    lease = queue.claim("dead", {"w": None}, 0.3)
    assert lease is not None and lease.run_id == run
    queue.save(lease, first, 0.3)
    assert queue.cancel(run) is True  # asked while its worker lived: flagged
    wait_for(lambda: _expired(queue, run), timeout=10, what="the dead worker's lease to expire")
    taker = open_queue(queue_url)
    try:
        taken = taker.claim("alive", {"w": first.fingerprint}, 30)
        assert taken is not None and taken.run_id == "next"  # the orphan is not resumed
        info = taker.status(run)
        assert info.status == "cancelled" and info.epoch == 2 and info.lease_until is None
        assert taker.checkpoint(run) == first  # what it had recorded stays
        assert taker.claim("alive", {"w": first.fingerprint}, 30) is None
    finally:
        taker.close()
    with pytest.raises(LeaseLostError):
        queue.save(lease, first, 30)


# -- the fleet's usage limits -------------------------------------------------------------


@pytest.mark.parametrize(
    ("limits", "per_step"),
    [
        (Limits(llm_calls_per_minute=3), TokenUsage(0, 0, 1)),
        (Limits(tokens_per_minute=45), TokenUsage(10, 5, 0)),  # 15 tokens a step
    ],
)
def test_usage_wait_starts_exactly_when_the_window_reaches_the_limit(
    queue: RunQueue, limits: Limits, per_step: TokenUsage
) -> None:
    queue.set_limits(limits)
    checkpoints = _checkpoints(4, per_step)
    queue.submit("w", run_id="spender")
    lease = queue.claim("w1", {"w": None}, 30)
    assert lease is not None
    assert queue.usage_wait() == 0
    queue.save(lease, checkpoints[0], 30)
    queue.save(lease, checkpoints[1], 30)
    assert queue.usage_wait() == 0  # two steps' usage: one below the limit, a step may start
    queue.save(lease, checkpoints[2], 30)
    wait = queue.usage_wait()
    assert 0 < wait <= limits.window  # three: the limit is reached, no step starts
    queue.save(lease, checkpoints[3], 30)
    assert queue.usage_wait() > 0


def test_usage_wait_ends_when_the_window_moves_past_the_usage(queue: RunQueue) -> None:
    queue.set_limits(Limits(llm_calls_per_minute=1, window=0.5))
    (first,) = _checkpoints(1, TokenUsage(0, 0, 1))
    queue.submit("w")
    lease = queue.claim("w1", {"w": None}, 30)
    assert lease is not None
    queue.save(lease, first, 30)
    assert 0 < queue.usage_wait() <= 0.5
    wait_for(lambda: queue.usage_wait() == 0, timeout=10, what="the call to age out of the window")


def test_a_worker_starts_no_step_once_the_windows_calls_reach_the_limit(queue: RunQueue) -> None:
    window = 1.0
    queue.set_limits(Limits(llm_calls_per_minute=2, window=window))
    log: list[tuple[str, float, float]] = []
    queue.submit("w", run_id="counted")
    worker = Worker(queue, {"w": _chain(4, TokenUsage(0, 0, 1), log)}, poll=0.01)
    assert asyncio.run(worker.run_until_idle()) == 1
    assert [name for name, _, _ in log] == ["s0", "s1", "s2", "s3"]  # each step started once
    (_, _, e0), (_, s1, e1), (_, s2, _), (_, s3, _) = log
    assert s1 < e0 + window  # one call in the window: the second step starts at once
    # Two calls in the window: the next step waits until the older ages out.
    assert s2 >= e0 + window - 0.05
    assert s3 >= e1 + window - 0.05


# -- fencing the old holder's delta save --------------------------------------------------


def test_the_old_holders_delta_save_after_a_takeover_is_refused_and_writes_nothing(
    queue: RunQueue, queue_url: str
) -> None:
    first, second, third = _checkpoints(3)
    run = queue.submit("w", run_id="taken")
    old = queue.claim("old", {"w": None}, 0.3)
    assert old is not None
    queue.save(old, first, 0.3)
    wait_for(lambda: _expired(queue, run), timeout=10, what="the old lease to expire")
    taker = open_queue(queue_url)
    try:
        new = taker.claim("new", {"w": first.fingerprint}, 30)
        assert new is not None and new.epoch == 2 and new.checkpoint == first
        taker.save(new, second, 30)
        before = _stored(queue_url, run)
        # The old holder's object still remembers `first` under epoch 1, so this
        # save is a delta (only s1 and s2), on its own connection.
        assert queue._encode(old, third).full is False  # type: ignore[attr-defined]
        with pytest.raises(LeaseLostError, match="epoch 1"):
            queue.save(old, third, 30)
        assert _stored(queue_url, run) == before
        assert taker.checkpoint(run) == second
        # s0 as the old holder saved it before the takeover, s1 by the new one: nothing of the refused save.
        assert entry_epochs(queue_url, run) == {"s0": 1, "s1": 2}
        taker.save(new, third, 30)
        taker.finish(new, "finished")
        assert taker.checkpoint(run) == third
    finally:
        taker.close()
