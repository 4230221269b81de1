"""A queued child per item (``map_over=``) and per loop iteration (``repeat=``), on SQLite and PostgreSQL.

What users rely on: each item, and each iteration, is a child run of its own,
with an id derived from the parent's, the step and the item's key or the
iteration's number (``m/write[0]``, ``m/agent#2``), so a resume finds it rather
than paying for it again; the parent parks until the children it waits for
have all ended and is woken once (not once per child), or at once when one
fails; each child's output (or failure) is its item's or iteration's, under
the parent's rules; without a queue the same steps run each child inline.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ekit_core import TokenUsage
from ekit_runtime import PatternResult, Repeat, Step, Workflow
from ekit_runtime.children import Child
from ekit_runtime.queue import Lease, RunQueue, Worker
from tests.support.queue_backends import queue, queue_url

__all__ = ["queue", "queue_url"]

DRAFTS = ["DRAFT OF OWLS", "DRAFT OF BATS", "DRAFT OF CATS"]


def _flows(calls: list[str], fail_on: str | None = None) -> dict[str, Workflow]:
    async def draft(ctx: Any) -> Any:
        topic = ctx["topics"]
        calls.append(f"draft:{topic}")
        if topic == fail_on:
            raise RuntimeError(f"no draft of {topic}")
        return PatternResult(f"draft of {topic}", cost=TokenUsage(10, 5, 1))

    polish = Step("polish", lambda ctx: str(ctx["draft"]).upper(), ("draft",))
    writer = Workflow([Step("draft", draft), polish])

    def turn(ctx: Any) -> Any:
        it = ctx["agent"]  # {"number": k, "previous": output}, as the child run's JSON context keeps it
        calls.append(f"turn:{it['number']}")
        return [*(it["previous"] or []), it["number"]]

    turner = Workflow([Step("turn", turn)])
    main = Workflow([
        Step("topics", lambda ctx: ["owls", "bats", "cats"]),
        Step("write", depends_on=("topics",), map_over="topics", child=Child(writer, queued=True)),
        Step("report", lambda ctx: list(ctx["write"]), ("write",)),
    ])
    looping = Workflow([
        Step("agent", child=Child(turner, queued=True),
             repeat=Repeat(max_iterations=5, until=lambda out: len(out) == 3)),
    ])
    return {"main": main, "looping": looping, "writer": writer, "turner": turner}


def _drain(queue: RunQueue, flows: dict[str, Workflow]) -> int:
    return asyncio.run(Worker(queue, flows, poll=0.01).run_until_idle())


def test_each_item_is_a_child_run_and_the_parent_is_woken_once_for_all(queue: RunQueue) -> None:
    calls: list[str] = []
    queue.submit("main", run_id="m")
    assert _drain(queue, _flows(calls)) == 4  # the runs it ended: the parent and its 3 children
    result = queue.result("m")
    assert result is not None and result.outputs["report"] == DRAFTS
    assert result.cost == TokenUsage(30, 15, 3)  # each child's usage, rolled up into its item's
    assert queue.family("m") == (None, [(f"m/write[{i}]", f"write[{i}]") for i in range(3)])
    assert sorted(calls) == ["draft:bats", "draft:cats", "draft:owls"]
    # claimed (1), parked, woken once (2), claimed (3): one wake for three children (2: they all
    # ended before it parked, and its join queued it at once)
    assert queue.status("m").epoch in (2, 3)
    # A rewind of one item runs a child of its own for it (its attempt's key is new); the other
    # items are not paid again.
    calls.clear()
    queue.rewind("m", "write[1]")
    assert _drain(queue, _flows(calls)) == 2 and calls == ["draft:bats"]
    assert queue.status("m/write[1]/2").status == "finished"
    assert queue.status("m").status == "finished"


def test_each_iteration_is_a_child_run_that_sees_its_number_and_the_previous_output(
    queue: RunQueue,
) -> None:
    calls: list[str] = []
    queue.submit("looping", run_id="m")
    _drain(queue, _flows(calls))
    result = queue.result("m")
    assert result is not None and result.outputs["agent"] == [1, 2, 3], queue.status("m").error
    assert calls == ["turn:1", "turn:2", "turn:3"]
    assert queue.family("m") == (None, [(f"m/agent#{k}", f"agent#{k}") for k in (1, 2, 3)])
    assert [queue.status(f"m/agent#{k}").status for k in (1, 2, 3)] == ["finished"] * 3


def test_an_items_failure_is_that_items_under_isolate_failures(queue: RunQueue) -> None:
    calls: list[str] = []
    queue.submit("main", run_id="m", options={"isolate_failures": True})
    _drain(queue, _flows(calls, fail_on="bats"))
    info = queue.status("m")
    assert info.status == "failed" and "child run 'm/write[1]' failed" in str(info.error)
    # A failed item ends its parent at once, isolated or not (decision 022): the other items'
    # children ended (a running one may finish before its flag is read) or were closed with it.
    checkpoint = queue.checkpoint("m")
    assert checkpoint is not None and "write[1]" not in checkpoint.outputs
    assert {queue.status(f"m/write[{k}]").status for k in (0, 2)} <= {"finished", "cancelled"}
    assert sorted(calls).count("draft:bats") == 1
    calls.clear()
    queue.retry("m")  # the failed child is queued again with its parent; the others are not paid again
    _drain(queue, _flows(calls))
    assert queue.status("m").status == "finished" and calls.count("draft:bats") == 1
    assert all(calls.count(c) <= 1 for c in calls)
    result = queue.result("m")
    assert result is not None and result.outputs["report"] == DRAFTS


def _parked(queue: RunQueue, children: int) -> list[str]:
    queue.submit("wf", run_id="p")
    lease = queue.claim("w", {"wf": None}, 600)
    assert lease is not None
    ids = [f"p/s[{i}]" for i in range(children)]
    for i, child in enumerate(ids):
        queue.spawn(lease, "kid", run_id=child, step=f"s[{i}]")
    assert queue.join(lease, ids) == "waiting"
    return ids


def _claim(queue: RunQueue, run_id: str) -> Lease:
    lease = queue.claim("w", {"kid": None}, 600)
    assert lease is not None and lease.run_id == run_id
    return lease


def test_the_last_child_to_end_wakes_the_parent_and_a_failure_wakes_it_at_once(queue: RunQueue) -> None:
    first, second, _third = _parked(queue, 3)
    epoch = queue.status("p").epoch
    queue.finish(_claim(queue, first), "finished")
    assert queue.status("p").status == "waiting"  # two children still going: nothing to do yet
    queue.finish(_claim(queue, second), "failed", "boom")
    assert (queue.status("p").status, queue.status("p").epoch) == ("queued", epoch + 1)  # at once


@pytest.mark.parametrize("second", ["finished", "failed", None])
def test_a_join_queues_the_parent_once_all_ended_or_one_failed(queue: RunQueue, second: str | None) -> None:
    queue.submit("wf", run_id="p")
    lease = queue.claim("w", {"wf": None}, 600)
    assert lease is not None
    for i in range(3):
        queue.spawn(lease, "kid", run_id=f"p/s[{i}]", step=f"s[{i}]")
    queue.finish(_claim(queue, "p/s[0]"), "finished")
    if second is not None:
        queue.finish(_claim(queue, "p/s[1]"), second, None if second == "finished" else "boom")
    if second == "finished":
        queue.finish(_claim(queue, "p/s[2]"), "finished")
    expected = "waiting" if second is None else "queued"  # (one finished, two going: it waits)
    assert queue.join(lease, ["p/s[0]", "p/s[1]", "p/s[2]"]) == expected


def test_the_last_of_several_children_wakes_the_parent(queue: RunQueue) -> None:
    ids = _parked(queue, 2)
    queue.finish(_claim(queue, ids[0]), "finished")
    assert queue.status("p").status == "waiting"
    queue.finish(_claim(queue, ids[1]), "finished")
    assert queue.status("p").status == "queued"


@pytest.mark.parametrize("name", ["main", "looping"])
def test_without_a_queue_each_item_and_iteration_runs_its_child_inline(name: str) -> None:
    calls: list[str] = []
    result = _flows(calls)[name].run_sync()
    if name == "main":
        assert result.outputs["report"] == DRAFTS
        assert result.cost.llm_calls == 3
    else:
        assert result.outputs["agent"] == [1, 2, 3] and calls == ["turn:1", "turn:2", "turn:3"]
