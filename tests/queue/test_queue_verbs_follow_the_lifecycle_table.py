"""The verbs written once in ``RunQueue`` read the lifecycle table: change a row, the verb follows.

Beside ``cancel`` (its own file), ``submit`` stores a new run in its row's
target, a holder's ``finish`` writes only a status a ``finish`` row names,
``release`` and ``park`` write the target of the row for a cancel asked or
not, a cancel that ends a run ends it in its row's target, and a claim
ends a run abandoned after a cancel in its row's target, and a ``join``
writes the target of its row for a child ended or not. Each on
SQLite and PostgreSQL alike: the statements are one text for both.
"""

from __future__ import annotations

import dataclasses

import pytest

from ekit_runtime.queue import Lease, RunQueue
from ekit_runtime.queue import lifecycle as lc
from ekit_runtime.queue.records import RunStatus
from tests.support.queue_backends import expire_lease, queue, queue_url

__all__ = ["queue", "queue_url"]


def _retargeted(
    verb: str, source: str | None, target: RunStatus, cancel: bool | None = None
) -> tuple[lc.Transition, ...]:
    """The table with the target of ``verb``'s row from ``source`` (for ``cancel``, if given) changed."""
    changed = tuple(
        dataclasses.replace(t, target=target)
        if (t.verb, t.source) == (verb, source) and (cancel is None or t.cancel == cancel)
        else t
        for t in lc.TRANSITIONS
    )
    assert changed != lc.TRANSITIONS
    return changed


def _claimed(queue: RunQueue) -> Lease:
    queue.submit("wf", run_id="r")
    lease = queue.claim("w", {"wf": None}, 600)
    assert lease is not None
    return lease


def test_submit_stores_a_new_run_in_its_rows_target(queue: RunQueue, monkeypatch: pytest.MonkeyPatch) -> None:
    queue.submit("wf", run_id="a")
    assert queue.status("a").status == "queued"
    monkeypatch.setattr(lc, "TRANSITIONS", _retargeted("submit", None, "waiting"))
    queue.submit("wf", run_id="b")
    assert queue.status("b").status == "waiting"
    # Without the row no run can be queued: refused, nothing written.
    monkeypatch.setattr(lc, "TRANSITIONS", tuple(t for t in lc.TRANSITIONS if t.verb != "submit"))
    with pytest.raises(ValueError, match="no row for submit"):
        queue.submit("wf", run_id="c")
    monkeypatch.undo()
    assert [r.run_id for r in queue.runs()] == ["a", "b"]


def test_finish_writes_only_a_status_a_finish_row_names(
    queue: RunQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    lease = _claimed(queue)
    kept = tuple(t for t in lc.TRANSITIONS if not (t.verb == "finish" and t.target == "failed"))
    monkeypatch.setattr(lc, "TRANSITIONS", kept)
    with pytest.raises(ValueError, match="status must be one of finished, cancelled; got 'failed'"):
        queue.finish(lease, "failed", "boom")
    assert queue.status("r").status == "running"
    monkeypatch.undo()
    queue.finish(lease, "failed", "boom")
    assert queue.status("r").status == "failed"


def test_release_writes_the_target_of_its_row(queue: RunQueue, monkeypatch: pytest.MonkeyPatch) -> None:
    lease = _claimed(queue)
    monkeypatch.setattr(lc, "TRANSITIONS", _retargeted("release", "running", "failed", cancel=False))
    assert queue.release(lease) is True
    info = queue.status("r")
    assert info.status == "failed" and info.lease_until is None


def test_park_with_a_cancel_asked_writes_the_target_of_that_row(
    queue: RunQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    lease = _claimed(queue)
    assert queue.cancel("r") is True  # (a live lease: flagged)
    monkeypatch.setattr(lc, "TRANSITIONS", _retargeted("park", "running", "waiting", cancel=True))
    queue.park(lease, "waiting for an answer to step 's'")
    info = queue.status("r")
    assert info.status == "waiting" and info.reason == "waiting for an answer to step 's'"
    monkeypatch.undo()
    queue.submit("wf", run_id="r2")
    other = queue.claim("w", {"wf": None}, 600)
    assert other is not None and other.run_id == "r2"
    assert queue.cancel("r2") is True
    queue.park(other, "waiting")
    assert queue.status("r2").status == "cancelled"


def test_a_cancel_that_ends_a_run_ends_it_in_its_rows_target(
    queue: RunQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue.submit("wf", run_id="r")
    monkeypatch.setattr(lc, "TRANSITIONS", _retargeted("cancel", "queued", "failed"))
    assert queue.cancel("r") is True
    info = queue.status("r")
    assert info.status == "failed" and info.epoch == 1 and info.cancel_requested


def test_a_claim_ends_an_abandoned_run_in_its_rows_target(
    queue_url: str, queue: RunQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    _claimed(queue)
    assert queue.cancel("r") is True  # (a live lease: flagged)
    expire_lease(queue_url, "r")  # its worker died
    monkeypatch.setattr(lc, "TRANSITIONS", _retargeted("claim", "running", "failed", cancel=True))
    assert queue.claim("w2", {"wf": None}, 600) is None
    info = queue.status("r")
    assert info.status == "failed" and info.lease_until is None


def test_a_join_writes_the_target_of_its_row_for_a_child_ended_or_not(
    queue: RunQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    lease = _claimed(queue)
    queue.spawn(lease, "kid", run_id="r/a", step="a")
    changed = tuple(
        dataclasses.replace(t, target="failed") if (t.verb, t.target) == ("join", "waiting") else t
        for t in lc.TRANSITIONS
    )
    monkeypatch.setattr(lc, "TRANSITIONS", changed)
    assert queue.join(lease, ["r/a"]) == "failed"
    assert queue.status("r").status == "failed"
    # Without its rows a join cannot decide: refused, nothing written.
    monkeypatch.setattr(lc, "TRANSITIONS", tuple(t for t in lc.TRANSITIONS if t.verb != "join"))
    queue.submit("wf", run_id="r2")
    other = queue.claim("w", {"wf": None}, 600)
    assert other is not None
    with pytest.raises(ValueError, match="no row for a join"):
        queue.join(other, ["r/a"])
    monkeypatch.undo()
    assert queue.status("r2").status == "running"
    assert queue.status("r/a").status == "cancelled"  # (closed when its parent r ended failed)
    assert queue.join(other, ["r/a"]) == "queued"  # (r/a ended: the row for a child ended)
