"""``cancel`` is written once, over both backends, and the lifecycle table decides what it does.

``RunQueue.cancel`` reads the run, asks :func:`ekit_runtime.queue.lifecycle.follows`
for the row of ``TRANSITIONS`` that moves it, and writes that row's outcome
through the backend's statements. So changing a row changes the verb, on
SQLite and PostgreSQL alike: a row taken away makes the cancel a no-op
(``False``, the run as it was), and a row whose target keeps the status turns
an immediate cancel into a flag for the holder.
"""

from __future__ import annotations

import dataclasses

import pytest

from ekit_runtime.queue import RunQueue
from ekit_runtime.queue import lifecycle as lc
from tests.support.queue_backends import queue, queue_url

__all__ = ["queue", "queue_url"]


def _without(verb: str, source: str) -> tuple[lc.Transition, ...]:
    return tuple(t for t in lc.TRANSITIONS if not (t.verb == verb and t.source == source))


def test_the_table_as_it_is_cancels_a_queued_run_at_once(queue: RunQueue) -> None:
    queue.submit("wf", run_id="r")
    assert queue.cancel("r") is True
    info = queue.status("r")
    assert info.status == "cancelled" and info.epoch == 1


def test_without_the_row_a_cancel_of_a_queued_run_changes_nothing(
    queue: RunQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue.submit("wf", run_id="r")
    monkeypatch.setattr(lc, "TRANSITIONS", _without("cancel", "queued"))
    assert queue.cancel("r") is False
    info = queue.status("r")
    assert info.status == "queued" and info.epoch == 0 and not info.cancel_requested


def test_a_row_that_keeps_the_status_makes_the_cancel_a_flag(
    queue: RunQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue.submit("wf", run_id="r")
    kept = tuple(
        dataclasses.replace(t, target="queued") if (t.verb, t.source) == ("cancel", "queued") else t
        for t in lc.TRANSITIONS
    )
    monkeypatch.setattr(lc, "TRANSITIONS", kept)
    assert queue.cancel("r") is True
    info = queue.status("r")
    assert info.status == "queued" and info.epoch == 0 and info.cancel_requested


def test_a_running_run_is_flagged_or_ended_by_the_row_of_its_lease(
    queue: RunQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue.submit("wf", run_id="r")
    lease = queue.claim("w", {"wf": None}, 600)
    assert lease is not None
    # The live lease's row taken away: a cancel of a running run finds no row, and does nothing.
    live_row = next(t for t in lc.TRANSITIONS if t.verb == "cancel" and t.lease == "live")
    monkeypatch.setattr(lc, "TRANSITIONS", tuple(t for t in lc.TRANSITIONS if t is not live_row))
    assert queue.cancel("r") is False
    assert not queue.status("r").cancel_requested
    monkeypatch.undo()
    assert queue.cancel("r") is True
    info = queue.status("r")
    assert info.status == "running" and info.cancel_requested and info.epoch == lease.epoch
