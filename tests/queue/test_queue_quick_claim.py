"""A claim is one statement while the fleet has no limit a claim counts, and keeps every claim rule.

Once a queue object has read the fleet's limits (its first claim, in full),
its later claims are one statement, guarded by the limits' text as read: a
limit set meanwhile by another process makes that statement match nothing,
and the claim in full runs and applies it. These tests pin the statement
count, and try to break the rules the claim in full kept: a cap set by
another process holds at the very next claim, a run whose dead worker had
been asked to cancel is never resumed (and is cancelled), a resumed run
comes with its checkpoint, and the lease carries the limits the claim read.
"""

from __future__ import annotations

import time

from ekit_runtime import Step, Workflow, WorkflowCheckpoint
from ekit_runtime.queue import Limits, RunQueue, open_queue
from tests.support.queue_backends import expire_lease, queue, queue_url, statements, wait_for

__all__ = ["queue", "queue_url", "statements"]  # (fixtures)


def _checkpoints(steps: int) -> list[WorkflowCheckpoint]:
    seen: list[WorkflowCheckpoint] = []
    chain = [Step(f"s{i}", lambda ctx, i=i: f"out{i}", (f"s{i - 1}",) if i else ()) for i in range(steps)]
    Workflow(chain).run_sync(checkpoint_fn=seen.append)
    return seen


def test_a_claim_after_the_first_is_one_statement(queue: RunQueue, statements: list[str]) -> None:
    for i in range(3):
        queue.submit("w", run_id=f"r{i}")
    assert queue.claim("me", {"w": None}, 30) is not None  # in full: it reads the limits
    statements.clear()
    lease = queue.claim("me", {"w": None}, 30)
    assert lease is not None and lease.run_id == "r1" and lease.epoch == 1
    # One statement leases the run, in no transaction of its own (SQLite may also sweep
    # abandoned runs and trim the usage window, once a second, a statement each).
    leasing = [s for s in statements if "SET status = 'running'" in s]
    assert len(leasing) == 1, statements
    assert not any(s.upper().startswith(("BEGIN", "COMMIT")) for s in statements), statements
    assert lease.limits == Limits()
    assert queue.status("r1").status == "running" and queue.status("r2").status == "queued"


def test_a_cap_set_by_another_process_holds_at_the_very_next_claim(queue: RunQueue, queue_url: str) -> None:
    for i in range(4):
        queue.submit("w", run_id=f"r{i}")
    first = queue.claim("me", {"w": None}, 30)
    second = queue.claim("me", {"w": None}, 30)  # quick: the limits it read had no cap
    assert first is not None and second is not None
    with open_queue(queue_url) as other:
        other.set_limits(Limits(max_in_flight=2))
    assert queue.claim("me", {"w": None}, 30) is None  # two live leases: at the cap
    queue.finish(first, "finished")
    third = queue.claim("me", {"w": None}, 30)
    assert third is not None and third.run_id == "r2" and third.limits == Limits(max_in_flight=2)
    assert queue.claim("me", {"w": None}, 30) is None
    # The cap lifted elsewhere: claims take runs again (and are quick again).
    with open_queue(queue_url) as other:
        other.set_limits(Limits())
    fourth = queue.claim("me", {"w": None}, 30)
    assert fourth is not None and fourth.run_id == "r3" and fourth.limits == Limits()


def test_a_run_abandoned_after_the_first_claim_is_cancelled_never_resumed(
    queue: RunQueue, queue_url: str
) -> None:
    (first,) = _checkpoints(1)
    queue.submit("w", run_id="orphan")
    for i in range(8):
        queue.submit("w", run_id=f"next{i}")
    with open_queue(queue_url) as dead:
        lease = dead.claim("dead", {"w": None}, 30)
        assert lease is not None and lease.run_id == "orphan"
        dead.save(lease, first, 30)
        taker = queue
        assert taker.claim("alive", {"w": first.fingerprint}, 30) is not None  # in full: quick from now on
        # (and a quick one, which on SQLite sweeps now and then not again for a second:
        # the claims below must leave the orphan alone by themselves)
        assert taker.claim("alive", {"w": first.fingerprint}, 30) is not None
        assert dead.cancel("orphan") is True  # asked while its worker lived: flagged
        expire_lease(queue_url, "orphan")  # then the worker died
    taken: list[str] = []

    def cancelled() -> bool:
        lease = taker.claim("alive", {"w": first.fingerprint}, 30)
        if lease is not None:
            taken.append(lease.run_id)
        return taker.status("orphan").status == "cancelled"

    wait_for(cancelled, timeout=20, what="a claim to cancel the abandoned run")
    assert "orphan" not in taken
    info = taker.status("orphan")
    assert info.epoch == 2 and info.lease_until is None
    assert taker.checkpoint("orphan") == first


def test_a_quick_claim_hands_over_the_checkpoint_of_a_run_it_resumes(queue: RunQueue, queue_url: str) -> None:
    checkpoints = _checkpoints(3)
    queue.submit("w", run_id="warm-up")
    queue.submit("w", run_id="crashed")
    assert queue.claim("alive", {"w": checkpoints[-1].fingerprint}, 30) is not None  # in full
    with open_queue(queue_url) as dead:
        lease = dead.claim("dead", {"w": None}, 30)
        assert lease is not None and lease.run_id == "crashed"
        for cp in checkpoints[:2]:
            dead.save(lease, cp, 30)
    expire_lease(queue_url, "crashed")
    resumed = queue.claim("alive", {"w": checkpoints[-1].fingerprint}, 30)
    assert resumed is not None and resumed.run_id == "crashed" and resumed.epoch == 2
    assert resumed.checkpoint is not None
    assert dict(resumed.checkpoint.outputs) == dict(checkpoints[1].outputs) == {"s0": "out0", "s1": "out1"}
    # And the lease is the run's: a save under it is a delta on that checkpoint.
    assert queue.save(resumed, checkpoints[2], 30) is False
    loaded = queue.checkpoint("crashed")
    assert loaded is not None and dict(loaded.outputs) == dict(checkpoints[2].outputs)
    assert time.time() < resumed.expires
