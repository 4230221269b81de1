"""A family's endings at the same moment never deadlock on PostgreSQL (many rounds, a barrier).

What users rely on: a parent ending ``failed`` (its close cancels its
children) while a child ends, and a ``cancel`` of a parent (its cascade
down the family) while a grandchild ends, both commit, with no deadlock
for the server to break (a ``DeadlockDetected`` is an error a user's
``cancel`` would see and a worker would pay a second for). The end state is
the same whichever came first: the family ended, the parent not left
waiting.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ekit_runtime.queue import RunQueue
from tests.support.queue_backends import postgres_url
from tests.support.queued_children import claimed, queues

__all__ = ["postgres_url", "queues"]

ROUNDS = 40
FINAL = {"finished", "failed", "cancelled"}




def _together(left: Callable[[], object], right: Callable[[], object]) -> list[BaseException]:
    """Run both at once (released by one barrier); what either raised."""
    barrier = threading.Barrier(2, timeout=60)
    errors: list[BaseException] = []

    def side(call: Callable[[], object]) -> None:
        barrier.wait()
        try:
            call()
        except BaseException as exc:  # (reported by the test)
            errors.append(exc)

    threads = [threading.Thread(target=side, args=(c,)) for c in (left, right)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)  # (a deadlock detector only)
        assert not t.is_alive()
    return errors


def test_a_parent_failing_while_its_child_finishes_deadlocks_no_one(
    queues: tuple[RunQueue, RunQueue],
) -> None:
    one, two = queues
    for n in range(ROUNDS):
        p = f"p{n}"
        one.submit("wf", run_id=p)
        parent = claimed(one, p, "wf")
        one.spawn(parent, "kid", run_id=f"{p}/a", step="a")
        one.spawn(parent, "kid", run_id=f"{p}/b", step="b")
        a = claimed(one, f"{p}/a", "kid")
        b = claimed(one, f"{p}/b", "kid")
        errors = _together(lambda p=parent: one.finish(p, "failed", "boom"),
                           lambda a=a, b=b: (two.finish(a, "finished"), two.finish(b, "failed", "x")))
        assert errors == [], f"round {n}: {errors!r}"
        assert one.status(p).status == "failed"
        assert {one.status(f"{p}/{s}").status for s in "ab"} <= FINAL


def test_a_cancel_of_a_parent_while_its_grandchild_finishes_deadlocks_no_one(
    queues: tuple[RunQueue, RunQueue],
) -> None:
    one, two = queues
    for n in range(ROUNDS):
        p = f"p{n}"
        one.submit("wf", run_id=p)
        parent = claimed(one, p, "wf")
        one.spawn(parent, "kid", run_id=f"{p}/a", step="a")
        assert one.join(parent, [f"{p}/a"]) == "waiting"
        child = claimed(one, f"{p}/a", "kid")
        one.spawn(child, "kid", run_id=f"{p}/a/g", step="g")
        assert one.join(child, [f"{p}/a/g"]) == "waiting"
        grandchild = claimed(one, f"{p}/a/g", "kid")
        errors = _together(lambda p=p: one.cancel(p), lambda g=grandchild: two.finish(g, "finished"))
        assert errors == [], f"round {n}: {errors!r}"
        assert [one.status(r).status for r in (p, f"{p}/a")] == ["cancelled", "cancelled"]
        assert one.status(f"{p}/a/g").status in FINAL


def test_a_join_and_its_childs_end_at_once_never_strand_the_parent(
    queues: tuple[RunQueue, RunQueue],
) -> None:
    # The wake skips a parent's row another transaction holds: a join holding it must still either
    # read the child ended or be woken by it (the parent never waits for a child that ended).
    one, two = queues
    for n in range(ROUNDS):
        p = f"p{n}"
        one.submit("wf", run_id=p)
        parent = claimed(one, p, "wf")
        one.spawn(parent, "kid", run_id=f"{p}/a", step="a")
        child = claimed(one, f"{p}/a", "kid")
        joined: list[str] = []
        errors = _together(lambda p=p, lease=parent, out=joined: out.append(one.join(lease, [f"{p}/a"])),
                           lambda c=child: two.finish(c, "finished"))
        assert errors == [], f"round {n}: {errors!r}"
        assert one.status(f"{p}/a").status == "finished"
        assert one.status(p).status == "queued", f"round {n}: join wrote {joined}"
        one.finish(claimed(one, p, "wf"), "finished")  # (out of the next round's claims)


def test_the_last_two_children_ending_at_once_wake_their_parent(queues: tuple[RunQueue, RunQueue]) -> None:
    # The wake waits for the last child going to end: of two ending at once, each sees the other
    # going in its own snapshot unless the second waits for the first's commit (the join's lock).
    one, two = queues
    for n in range(ROUNDS):
        p = f"p{n}"
        one.submit("wf", run_id=p)
        parent = claimed(one, p, "wf")
        for s in "ab":
            one.spawn(parent, "kid", run_id=f"{p}/{s}", step=s)
        assert one.join(parent, [f"{p}/a", f"{p}/b"]) == "waiting"
        a, b = claimed(one, f"{p}/a", "kid"), claimed(one, f"{p}/b", "kid")
        errors = _together(lambda a=a: one.finish(a, "finished"), lambda b=b: two.finish(b, "finished"))
        assert errors == [], f"round {n}: {errors!r}"
        assert one.status(p).status == "queued", f"round {n}: the parent was left waiting"
        one.finish(claimed(one, p, "wf"), "finished")  # (out of the next round's claims)
