"""A parent parked for some of its children is woken once those have ended, whatever its others do.

What users rely on: ``join`` parks a parent on the children it names (the
items it waits for now) and the wake follows the same rule (decision 022).
A parent can be linked to a child it no longer waits for: a rewind of a
waiting parent to the step that decides a map's items, whose items then
differ, leaves the dropped item's child going (the rewind itself cancels no child).
That child, still going or waiting for a person nobody will answer, must not
hold the parent once the children it waits for have ended: the join unlinks
it and cancels it (its work was dropped with its item).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ekit_runtime import Step, Workflow, human
from ekit_runtime.children import Child
from ekit_runtime.queue import Lease, RunQueue, Worker
from tests.support.queue_backends import queue, queue_url

__all__ = ["queue", "queue_url"]

pytestmark = pytest.mark.timeout(120)


def _claim(queue: RunQueue, run_id: str) -> Lease:
    lease = queue.claim("w", {"kid": None}, 600)
    assert lease is not None and lease.run_id == run_id
    return lease


def test_a_child_the_parent_no_longer_waits_for_does_not_hold_it(queue: RunQueue) -> None:
    queue.submit("wf", run_id="p")
    lease = queue.claim("w", {"wf": None}, 600)
    assert lease is not None
    for i in range(3):  # (items 0, 1, 2 as first decided: each a child, linked)
        queue.spawn(lease, "kid", run_id=f"p/s[{i}]", step=f"s[{i}]")
    dropped = _claim(queue, "p/s[0]")  # item 0's child is going on a worker, and stays so
    # The items re-decided: the parent now waits for items 1 and 2 only.
    assert queue.join(lease, ["p/s[1]", "p/s[2]"]) == "waiting"
    queue.finish(_claim(queue, "p/s[1]"), "finished")
    assert queue.status("p").status == "waiting"  # (item 2 still going)
    queue.finish(_claim(queue, "p/s[2]"), "finished")
    # Its last child going ended: a join now would queue it (the join reads only those it
    # names), and so must the wake, not wait for item 0's child.
    assert queue.status("p").status == "queued"
    assert queue.status(dropped.run_id).status == "running"


def _flows(topics: list[str]) -> dict[str, Workflow]:
    def draft(ctx: Any) -> Any:
        name = ctx["topics"]["name"]
        return human.ask(f"{name}?") if name == "bats" else f"draft of {name}"

    writer = Workflow([Step("draft", draft)])
    main = Workflow([
        Step("topics", lambda ctx: [{"name": t} for t in topics]),
        Step("write", depends_on=("topics",), map_over="topics", item_key="name",
             child=Child(writer, queued=True)),
        Step("report", lambda ctx: list(ctx["write"]), ("write",)),
    ])
    return {"main": main, "writer": writer}


def test_a_rewound_parent_whose_items_changed_is_not_held_by_a_dropped_items_child(queue: RunQueue) -> None:
    topics = ["owls", "bats"]
    flows = _flows(topics)
    queue.submit("main", run_id="m")
    asyncio.run(Worker(queue, flows, poll=0.01).run_until_idle())
    assert queue.status("m/write[bats]").status == "waiting"  # (its child asks a person)
    assert queue.status("m").status == "waiting"
    topics[:] = ["owls", "cats"]  # bats dropped: nobody will answer its child's question
    queue.rewind("m", "topics")
    asyncio.run(Worker(queue, flows, poll=0.01).run_until_idle())
    assert queue.status("m/write[cats]").status == "finished"
    # The dropped item's child is closed and unlinked: its work is no longer wanted.
    assert queue.status("m/write[bats]").status == "cancelled"
    assert "m/write[bats]" not in [child for child, _ in queue.family("m")[1]]
    info = queue.status("m")
    assert info.status == "finished", (info.status, info.reason)
    result = queue.result("m")
    assert result is not None and result.outputs["report"] == ["draft of owls", "draft of cats"]
