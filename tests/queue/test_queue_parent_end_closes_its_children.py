"""A queued parent that ends failed or cancelled leaves no child running, on SQLite and PostgreSQL.

What users rely on: whichever verb ends the parent (its holder's finish, a
worker's batch of endings, a cancel, a claim sweeping it abandoned), its
children not yet ended are stopped in that same transaction by the cancel's
rows: a queued or waiting child (or one whose lease expired) is cancelled at
once, and its own children with it; a child a worker drives is flagged, and
its worker ends it ``cancelled``, which stops its children in turn. A child
that ended already keeps its status.
"""

from __future__ import annotations

import pytest

from ekit_runtime.queue import Ending, Lease, RunQueue
from tests.support.queue_backends import expire_lease, queue, queue_url, update_run
from tests.support.queued_children import claimed

__all__ = ["queue", "queue_url"]



def _ask_cancel(url: str, run_id: str) -> None:
    """Flag a cancel on the run only (as ``cancel`` would, without its own cascade down the family)."""
    update_run(url, "UPDATE ekit_queue_runs SET cancel_requested = TRUE WHERE run_id = {p}", run_id)


def _family(queue: RunQueue, queue_url: str) -> tuple[Lease, Lease, Lease]:
    """Parent ``p`` (running) with children: ``p/a`` waiting for its own ``p/a/g``, ``p/b`` driven
    by a live worker (with ``p/b/g`` queued), ``p/c`` whose worker died, ``p/d`` finished."""
    queue.submit("wf", run_id="p")
    parent = claimed(queue, "p")
    for step in "abcd":
        queue.spawn(parent, "kid", run_id=f"p/{step}", step=step)
    a = claimed(queue, "p/a", "kid")
    queue.spawn(a, "kid", run_id="p/a/g", step="g")
    assert queue.join(a, ["p/a/g"]) == "waiting"
    b = claimed(queue, "p/b", "kid")
    queue.spawn(b, "kid", run_id="p/b/g", step="g")
    claimed(queue, "p/c", "kid")
    queue.finish(claimed(queue, "p/d", "kid"), "finished")
    expire_lease(queue_url, "p/c")
    return parent, b, a


@pytest.mark.parametrize("how", ["finish_failed", "finish_cancelled", "write_many", "claim_sweep"])
def test_every_way_a_parent_ends_early_stops_its_children_in_the_same_transaction(
    queue: RunQueue, queue_url: str, how: str
) -> None:
    parent, b, _a = _family(queue, queue_url)
    if how == "finish_failed":
        queue.finish(parent, "failed", "another step failed")
    elif how == "finish_cancelled":
        queue.finish(parent, "cancelled")
    elif how == "write_many":
        assert queue.write_many([], [Ending(parent, "failed", "boom")], 600)[1] == [None]
    else:
        _ask_cancel(queue_url, "p")
        expire_lease(queue_url, "p")
        assert queue.claim("w", {"other": None}, 600) is None  # (a claim sweeps the abandoned parent)
        assert queue.status("p").status == "cancelled"
    status = {r.run_id: (r.status, r.cancel_requested) for r in queue.runs()}
    assert status == {
        "p": status["p"],
        "p/a": ("cancelled", True),  # waiting for its child: cancelled at once...
        "p/a/g": ("cancelled", True),  # ...and its own child with it
        "p/b": ("running", True),  # a live worker's: flagged, its worker stops it
        "p/b/g": ("queued", False),
        "p/c": ("cancelled", True),  # its worker died: cancelled at once
        "p/d": ("finished", False),  # ended already: kept
    }
    assert queue.renew(b, 600) is True  # the worker of p/b sees the cancel at its next heartbeat
    queue.finish(b, "cancelled")
    assert queue.status("p/b/g").status == "cancelled"


def test_a_finished_or_ended_child_is_not_touched_and_a_retry_takes_the_family_back(
    queue: RunQueue, queue_url: str
) -> None:
    parent, b, _a = _family(queue, queue_url)
    epochs = {r.run_id: r.epoch for r in queue.runs()}
    queue.finish(parent, "failed", "boom")
    after = {r.run_id: r.epoch for r in queue.runs()}
    # Closed at once: epoch + 1 (a stale holder of p/c is fenced out); flagged or ended: unchanged.
    assert {k for k in after if after[k] != epochs[k]} == {"p/a", "p/a/g", "p/c"}
    queue.finish(b, "cancelled")
    queue.retry("p")
    assert {r.run_id: r.status for r in queue.runs()} == {
        "p": "queued", "p/a": "queued", "p/a/g": "queued", "p/b": "queued", "p/b/g": "queued",
        "p/c": "queued", "p/d": "finished",
    }


def test_a_plain_run_ending_failed_touches_no_other_run(queue: RunQueue) -> None:
    queue.submit("wf", run_id="x")
    queue.submit("kid", run_id="y")
    queue.finish(claimed(queue, "x"), "failed", "boom")
    assert queue.status("y").status == "queued" and not queue.status("y").cancel_requested
