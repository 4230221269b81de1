"""A person's write on a waiting parent that rolls back never swallows its child's wake (PostgreSQL).

What users rely on: a parent waiting for its children is queued again when a
child ends, even if at that moment another transaction held the parent's row
and then rolled back (a rewind whose write failed after it locked the row).
The child's end must not skip the parent for good: once the failed write is
gone, the parent is queued, not left waiting for a child that ended.

The race is forced, not hoped for: the rewind stops inside its transaction,
holding the parent's row, until the child's end either committed or waits for
it (read from ``pg_stat_activity``); only then does the rewind fail.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from ekit_runtime import RunWaiting, Step, Workflow
from ekit_runtime.child_runs import SPAWNER
from ekit_runtime.children import Child
from ekit_runtime.queue import RunQueue
from tests.support.queue_backends import postgres_url, wait_for
from tests.support.queued_children import NeverEnding, claimed, queues

__all__ = ["postgres_url", "queues"]



def _waiting_checkpoint() -> Any:
    kid = Workflow([Step("draft", lambda ctx: "d")])
    parent = Workflow([Step("brief", lambda ctx: "b"),
                       Step("write", depends_on=("brief",), child=Child(kid, queued=True))])
    token = SPAWNER.set(NeverEnding())
    try:
        with pytest.raises(RunWaiting) as waiting:
            parent.run_sync(run_id="p")
    finally:
        SPAWNER.reset(token)
    return waiting.value.checkpoint




def _blocked_on_a_lock(url: str) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND wait_event_type = 'Lock'").fetchone()
    return row is not None and row[0] > 0


def test_a_rewind_rolled_back_while_the_child_ended_leaves_the_parent_queued(
    queues: tuple[RunQueue, RunQueue], postgres_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    one, two = queues
    one.submit("wf", run_id="p")
    parent = claimed(one, "p", "wf")
    one.save(parent, _waiting_checkpoint(), 600)
    one.spawn(parent, "kid", run_id="p/write", step="write")
    assert one.join(parent, ["p/write"]) == "waiting"
    child = claimed(one, "p/write", "kid")

    held, go = threading.Event(), threading.Event()

    def failing_write(rows: Any) -> Any:  # (the rewind's last statement: the parent's row is locked)
        held.set()
        assert go.wait(60)
        raise RuntimeError("the rewind's write failed")

    monkeypatch.setattr(one, "_served", failing_write)
    failures: list[BaseException] = []

    def rewind() -> None:
        try:
            one.rewind("p", "brief")
        except BaseException as exc:  # (asserted below)
            failures.append(exc)

    rewinding = threading.Thread(target=rewind)
    rewinding.start()
    assert held.wait(60)
    ending = threading.Thread(target=two.finish, args=(child, "finished"))
    ending.start()
    # The child's end either committed already (it skipped the parent's row) or waits for the rewind.
    wait_for(lambda: not ending.is_alive() or _blocked_on_a_lock(postgres_url), timeout=60,
             what="the child's end to commit or to wait for the rewind")
    go.set()
    for thread in (rewinding, ending):
        thread.join(60)  # (a deadlock detector only)
        assert not thread.is_alive()
    assert [type(e) for e in failures] == [RuntimeError]
    assert two.status("p/write").status == "finished"
    assert two.status("p").status == "queued", "the child's wake was lost to the rollback"
