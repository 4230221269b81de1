"""A worker's claims and run endings share commits, and each is still fenced and answered on its own.

``RunQueue.write_many`` saves several runs' checkpoints and ends other runs
in ONE statement (SQLite and PostgreSQL alike), first saves in full among
them; ``RunQueue.claim_many`` leases several runs in one statement while the
fleet has no limit a claim counts, and claims one by one (each counted) when
it has. These tests count the statements, so that a batch statement that
fails and is quietly made again write by write (the fallback for a dropped
session) cannot pass for one statement, and try to break the fence, the
per-write answers and the limits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from ekit_runtime.queue import Ending, Lease, LeaseLostError, Limits, RunQueue, open_queue
from tests.support.queue_backends import (
    chain_checkpoints,
    claim_runs,
    postgres_url,
    queue,
    queue_url,
    statements,
)

__all__ = ["postgres_url", "queue", "queue_url", "statements"]  # (fixtures)


def test_first_saves_and_endings_of_a_batch_are_one_statement_each_fenced(
    queue: RunQueue, statements: list[str]
) -> None:
    cps = chain_checkpoints(2)
    leases = claim_runs(queue, 5)
    statements.clear()
    # The runs' first saves (each in full: its header and entries) in one statement.
    saved, ended = queue.write_many([(lease, cps[0]) for lease in leases], [], 60)
    assert (saved, ended) == ([False] * 5, []) and len(statements) == 1, statements
    statements.clear()
    stale = dataclasses.replace(leases[4], epoch=leases[4].epoch + 7)  # a lease the run no longer has
    saved, ended = queue.write_many(
        [(leases[0], cps[1])],
        [
            Ending(leases[1], "finished"),
            Ending(leases[2], "failed", "boom\x00"),
            Ending(leases[3], "cancelled"),
            Ending(stale, "finished"),
        ],
        60,
    )
    assert len(statements) == 1, statements
    assert saved == [False] and ended[:3] == [None, None, None]
    assert isinstance(ended[3], LeaseLostError) and ended[3].run_id == "r4"
    assert [queue.status(f"r{i}").status for i in range(5)] == [
        "running", "finished", "failed", "cancelled", "running"
    ]
    assert queue.status("r2").error == "boom\\x00"  # (a NUL escaped, as finish stores it)
    stored = queue.checkpoint("r0")
    assert stored is not None and dict(stored.outputs) == {"s0": "out0", "s1": "out1"}
    # Each ended run is ended once: its lease is spent.
    _saved, again = queue.write_many([], [Ending(leases[1], "finished"), Ending(leases[4], "finished")], 60)
    assert isinstance(again[0], LeaseLostError) and again[1] is None
    assert queue.status("r4").status == "finished"


def test_an_ending_that_is_not_final_fails_alone(queue: RunQueue) -> None:
    cps = chain_checkpoints(1)
    leases = claim_runs(queue, 3)
    bad = Ending(leases[1], "running")  # type: ignore[arg-type]
    saved, ended = queue.write_many([(leases[0], cps[0])], [bad, Ending(leases[2], "finished")], 60)
    assert saved == [False] and isinstance(ended[0], ValueError) and ended[1] is None
    assert "status must be one of finished, failed, cancelled" in str(ended[0])
    assert [queue.status(f"r{i}").status for i in range(3)] == ["running", "running", "finished"]


def test_a_run_with_two_writes_in_one_batch_is_refused_before_any_write(queue: RunQueue) -> None:
    cps = chain_checkpoints(1)
    (lease,) = claim_runs(queue, 1)
    with pytest.raises(ValueError, match="two writes"):
        queue.write_many([(lease, cps[0])], [Ending(lease, "finished")], 60)
    with pytest.raises(ValueError, match="must be an Ending"):
        queue.write_many([], [(lease, "finished", None)], 60)  # type: ignore[list-item]
    assert queue.status("r0").status == "running" and queue.checkpoint("r0") is None


def test_claim_many_leases_several_runs_in_one_statement_in_claim_order(
    queue: RunQueue, statements: list[str]
) -> None:
    for i in range(6):
        queue.submit("w", run_id=f"r{i}", priority=1 if i == 4 else 0)
    queue.submit("other", run_id="x")
    first = queue.claim("me", {"w": None}, 60)  # (the claim in full: later ones are quick)
    assert first is not None and first.run_id == "r4"  # the highest priority first
    statements.clear()
    leases = queue.claim_many("me", {"w": None}, 60, 3)
    # The claim is one statement (besides a tidy-up at most once a second, and
    # a read of what each run holds).
    claims = [s for s in statements if "SET status = 'running'" in s]
    assert len(claims) == 1, statements
    # Then the oldest, handed over oldest first.
    assert [lease.run_id for lease in leases] == ["r0", "r1", "r2"]
    assert all(lease.epoch == 1 and queue.status(lease.run_id).status == "running" for lease in leases)
    rest = queue.claim_many("me", {"w": None}, 60, 10)
    assert [lease.run_id for lease in rest] == ["r3", "r5"]
    assert queue.claim_many("me", {"w": None}, 60, 10) == []
    assert queue.status("x").status == "queued"  # another workflow's run is left alone
    with pytest.raises(ValueError, match="limit must be a whole number"):
        queue.claim_many("me", {"w": None}, 60, 0)


def test_claim_many_keeps_max_in_flight(queue: RunQueue) -> None:
    queue.set_limits(Limits(max_in_flight=3))
    for i in range(6):
        queue.submit("w", run_id=f"r{i}")
    first = queue.claim_many("me", {"w": None}, 60, 5)
    assert len(first) == 3
    assert queue.claim_many("me", {"w": None}, 60, 5) == []
    queue.finish(first[0], "finished")
    assert len(queue.claim_many("me", {"w": None}, 60, 5)) == 1


def test_claim_many_of_two_claimers_never_shares_a_run(queue_url: str) -> None:
    a, b = open_queue(queue_url), open_queue(queue_url)
    try:
        for i in range(20):
            a.submit("w", run_id=f"r{i}")
        assert a.claim("me", {"w": None}, 60) is not None and b.claim("you", {"w": None}, 60) is not None
        taken: list[str] = ["r0", "r1"]
        while True:
            got = a.claim_many("me", {"w": None}, 60, 3) + b.claim_many("you", {"w": None}, 60, 4)
            if not got:
                break
            taken += [lease.run_id for lease in got]
        assert sorted(taken) == sorted(f"r{i}" for i in range(20))  # each run once
    finally:
        a.close()
        b.close()


def test_a_resumed_run_claimed_among_others_carries_its_checkpoint(queue: RunQueue) -> None:
    cps = chain_checkpoints(2)
    (lease,) = claim_runs(queue, 1)
    queue.save(lease, cps[0], 60)
    queue.release(lease)
    for i in range(1, 3):
        queue.submit("w", run_id=f"r{i}")
    claimed = queue.claim_many("me", {"w": cps[0].fingerprint}, 60, 5)
    leases = {lease.run_id: lease for lease in claimed}
    assert set(leases) == {"r0", "r1", "r2"}
    resumed = leases["r0"].checkpoint
    assert resumed is not None and dict(resumed.outputs) == {"s0": "out0"}
    assert leases["r1"].checkpoint is None and leases["r0"].epoch == 2


def test_claim_many_hands_over_the_runs_it_could_read_and_gives_the_rest_back(queue: RunQueue) -> None:
    for i in range(5):
        queue.submit("w", run_id=f"r{i}")
    assert queue.claim("me", {"w": None}, 60) is not None  # (the claim in full: later ones are quick)
    real = queue._granted_quick  # type: ignore[attr-defined]
    calls: list[str] = []

    def flaky(row: Any, limits: Any) -> Lease:
        # A session dropped while reading the second run (PostgreSQL reads each
        # resumed run's entries after the claim's commit), or a run that cannot be read.
        calls.append(row[0])
        if len(calls) == 2:
            raise ConnectionError("the session dropped while reading the run")
        return real(row, limits)  # type: ignore[no-any-return]

    queue._granted_quick = flaky  # type: ignore[attr-defined]
    got = queue.claim_many("me", {"w": None}, 60, 3)
    queue._granted_quick = real  # type: ignore[attr-defined]
    # The first is handed over; the two it could not hand over are queued again, not left leased to nobody.
    assert [lease.run_id for lease in got] == ["r1"]
    assert [queue.status(f"r{i}").status for i in range(1, 5)] == ["running", "queued", "queued", "queued"]
    again = queue.claim_many("me", {"w": None}, 60, 5)
    assert [lease.run_id for lease in again] == ["r2", "r3", "r4"]
    # A failure on the first run: nothing to hand over, so the error is raised, and every run given back.
    for i in range(5, 7):
        queue.submit("w", run_id=f"r{i}")

    def broken(row: Any, limits: Any) -> Lease:
        raise ConnectionError("the session dropped while reading the run")

    queue._granted_quick = broken  # type: ignore[attr-defined]
    with pytest.raises(ConnectionError):
        queue.claim_many("me", {"w": None}, 60, 2)
    queue._granted_quick = real  # type: ignore[attr-defined]
    assert [queue.status(f"r{i}").status for i in range(5, 7)] == ["queued", "queued"]


def test_claim_many_hands_runs_over_in_claim_order(queue: RunQueue) -> None:
    queue.submit("w", run_id="first")
    assert queue.claim("me", {"w": None}, 60) is not None  # (the claim in full: later ones are quick)
    queue.submit("w", run_id="old")
    queue.submit("w", run_id="urgent", priority=5)
    queue.submit("w", run_id="new")
    leases = queue.claim_many("me", {"w": None}, 60, 3)
    assert [lease.run_id for lease in leases] == ["urgent", "old", "new"]  # priority, then age


def test_claimers_racing_on_their_own_connections_lease_each_run_once(queue_url: str) -> None:
    # Four claimers, each its own connection (PostgreSQL: its own session), released
    # at once by a barrier and claiming batches until the queue is empty: a run
    # leased twice would come back to two of them, or show an epoch above 1.
    import threading

    setup = open_queue(queue_url)
    for i in range(160):
        setup.submit("w", run_id=f"r{i:03d}")
    claimers = [open_queue(queue_url) for _ in range(4)]
    for c in claimers:  # (a claim in full first, so that the race is between quick claims)
        assert c.claim_many("warm-up", {"w": None}, 60, 1)
    gate = threading.Barrier(len(claimers))
    taken: list[list[Lease]] = [[] for _ in claimers]

    def claim(k: int) -> None:
        gate.wait(30)
        while got := claimers[k].claim_many(f"w{k}", {"w": None}, 60, 3):
            taken[k].extend(got)

    threads = [threading.Thread(target=claim, args=(k,)) for k in range(len(claimers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    leased = [lease.run_id for got in taken for lease in got]
    try:
        assert len(leased) == len(set(leased)) == 156, sorted(leased)
        assert all(lease.epoch == 1 for got in taken for lease in got)
        assert {setup.status(r).epoch for r in leased} == {1}
    finally:
        for c in [setup, *claimers]:
            c.close()
