"""A step's child as a queued run of its own (``Child(wf, queued=True)``), on SQLite and PostgreSQL.

What users rely on: the child is a run with its own id (``parent/step``),
status and checkpoint, linked both ways; the parent parks holding no lease
until a child ends, and every way a child ends (its holder's finish, a
worker's batch, a cancel, a claim that sweeps it) queues the waiting parent
in the same transaction; a join that meets a child already ended queues the
parent rather than park it for ever; the parent's step hands on the child's
output and usage, or fails with it; a cancel cascades down the family, a
retry takes the failed children along, a prune keeps a family together.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ekit_core import TokenUsage
from ekit_runtime import PatternResult, RunWaiting, Step, Workflow
from ekit_runtime.child_runs import SPAWNER
from ekit_runtime.children import Child
from ekit_runtime.queue import Ending, Lease, LeaseLostError, RunQueue, RunStateError, Worker
from tests.support.queue_backends import expire_lease, live_leases, queue, queue_url
from tests.support.queued_children import NeverEnding, claimed

__all__ = ["queue", "queue_url"]



def _parked(queue: RunQueue, children: tuple[str, ...] = ("p/a", "p/b")) -> Lease:
    """A parent ``p`` that spawned ``children`` (runs of ``kid``) and joined them: waiting."""
    queue.submit("wf", run_id="p")
    lease = claimed(queue, "p")
    for child in children:
        assert queue.spawn(lease, "kid", {"n": 1}, run_id=child, step=child.split("/")[-1]) is True
    assert queue.join(lease, list(children)) == "waiting"
    return lease


def test_a_parent_parks_holding_no_lease_and_the_link_reads_both_ways(
    queue: RunQueue, queue_url: str
) -> None:
    _parked(queue)
    info = queue.status("p")
    assert (info.status, info.lease_until, info.owner) == ("waiting", None, None)
    assert info.reason == "waiting for child runs 'p/a', 'p/b'"
    assert live_leases(queue_url) == 0
    assert queue.family("p") == (None, [("p/a", "a"), ("p/b", "b")])
    assert queue.family("p/a") == ("p", [])
    assert queue.status("p/a").status == "queued" and queue.status("p/a").workflow == "kid"


@pytest.mark.parametrize("how", ["finish", "write_many", "cancel", "claim_sweep"])
def test_every_way_a_child_ends_queues_its_waiting_parent_in_the_same_transaction(
    queue: RunQueue, queue_url: str, how: str
) -> None:
    _parked(queue, ("p/a",))
    epoch = queue.status("p").epoch
    if how == "cancel":
        assert queue.cancel("p/a") is True  # a queued child: cancelled at once
    else:
        child = claimed(queue, "p/a", "kid")
        assert queue.status("p").status == "waiting"  # (a claim of the child wakes nobody)
    if how == "finish":
        queue.finish(child, "finished")
    elif how == "write_many":
        assert queue.write_many([], [Ending(child, "failed", "boom")], 600)[1] == [None]
    elif how == "claim_sweep":
        queue.cancel("p/a")
        expire_lease(queue_url, "p/a")
        assert queue.claim("w", {"wf": None}, 600) is not None  # (another workflow's claim sweeps it)
    parent = queue.status("p")
    assert queue.status("p/a").status in {"finished", "failed", "cancelled"}
    if how == "claim_sweep":
        assert parent.status == "running" and parent.epoch == epoch + 2  # woken, then claimed
    else:
        assert (parent.status, parent.epoch) == ("queued", epoch + 1)


def test_a_join_that_meets_a_child_ended_already_queues_the_parent(queue: RunQueue) -> None:
    queue.submit("wf", run_id="p")
    lease = claimed(queue, "p")
    queue.spawn(lease, "kid", run_id="p/a", step="a")
    child = claimed(queue, "p/a", "kid")
    queue.finish(child, "finished")  # before the parent parks: its status is running, nothing to wake
    assert queue.status("p").status == "running"
    assert queue.join(lease, ["p/a"]) == "queued"
    info = queue.status("p")
    assert (info.status, info.lease_until, info.owner) == ("queued", None, None)


def test_a_join_with_a_cancel_asked_cancels_and_a_stale_join_or_spawn_writes_nothing(
    queue: RunQueue, queue_url: str
) -> None:
    queue.submit("wf", run_id="p")
    lease = claimed(queue, "p")
    queue.spawn(lease, "kid", run_id="p/a", step="a")
    assert queue.cancel("p") is True  # the parent's lease is live: flagged; the child cancelled at once
    assert queue.status("p/a").status == "cancelled"
    assert queue.join(lease, ["p/a"]) == "cancelled"
    queue.submit("wf", run_id="q")
    stale = claimed(queue, "q")
    expire_lease(queue_url, "q")
    with pytest.raises(LeaseLostError):
        queue.spawn(stale, "kid", run_id="q/a", step="a")
    with pytest.raises(LeaseLostError):
        queue.join(stale, ["q/a"])
    assert [r.run_id for r in queue.runs()] == ["p", "p/a", "q"]


def test_spawn_is_idempotent_and_refuses_an_id_that_is_no_child_of_its_parent(queue: RunQueue) -> None:
    queue.submit("kid", run_id="taken")
    queue.submit("wf", run_id="p")
    lease = claimed(queue, "p")
    assert queue.spawn(lease, "kid", run_id="p/a", step="a") is True
    assert queue.spawn(lease, "kid", run_id="p/a", step="a") is False  # a worker that died, again
    with pytest.raises(ValueError, match="not a child of run 'p'"):
        queue.spawn(lease, "kid", run_id="taken", step="b")
    assert [r.run_id for r in queue.runs()] == ["taken", "p", "p/a"]


def test_a_cancel_cascades_down_the_family_and_a_retry_takes_failed_children_along(
    queue: RunQueue,
) -> None:
    _parked(queue, ("p/a",))
    child = claimed(queue, "p/a", "kid")
    queue.spawn(child, "kid", run_id="p/a/g", step="g")  # a grandchild
    queue.finish(child, "failed", "boom")
    assert queue.status("p/a/g").status == "cancelled"  # its parent's failure closed it
    parent = claimed(queue, "p")  # woken by its child's end
    queue.finish(parent, "failed", "ChildRunFailed: child run 'p/a' failed: boom")
    assert queue.cancel("p") is False  # the parent had ended: the call finds nothing left to stop
    queue.retry("p")
    assert [queue.status(r).status for r in ("p", "p/a", "p/a/g")] == ["queued"] * 3
    finished = claimed(queue, "p")
    queue.finish(finished, "finished")
    with pytest.raises(RunStateError):
        queue.retry("p")  # (a finished parent is not retried, nor are its children)


def test_a_prune_keeps_a_child_while_its_parent_is_kept(queue: RunQueue) -> None:
    queue.submit("wf", run_id="p")
    lease = claimed(queue, "p")
    queue.spawn(lease, "kid", run_id="p/a", step="a")
    queue.finish(claimed(queue, "p/a", "kid"), "finished")
    assert queue.prune(0) == 0  # the child ended, its parent is running: kept
    queue.finish(lease, "finished")
    queue.submit("wf", run_id="alone")
    assert queue.prune(0) == 2 and [r.run_id for r in queue.runs()] == ["alone"]
    assert queue.family("p") == (None, [])


# -- through a worker ---------------------------------------------------------


def _flows(calls: list[str], fail: bool = False) -> dict[str, Workflow]:
    async def draft(ctx: Any) -> Any:
        calls.append(f"draft:{ctx['topic']}")
        if fail:
            raise RuntimeError("no draft")
        return PatternResult(f"draft of {ctx['topic']}", cost=TokenUsage(10, 5, 1))

    async def polish(ctx: Any) -> str:
        calls.append("polish")
        return str(ctx["draft"]).upper()

    writer = Workflow([Step("draft", draft), Step("polish", polish, ("draft",))])

    def topic(ctx: Any) -> str:
        return "owls"

    main = Workflow([
        Step("topic", topic),
        Step("write", depends_on=("topic",), child=Child(writer, queued=True)),
        Step("again", depends_on=("topic",), child=Child(writer, output="draft", queued=True)),
        Step("report", lambda ctx: [ctx["write"], ctx["again"]], ("write", "again")),
    ])
    return {"main": main, "writer": writer}


def test_a_worker_runs_each_child_as_a_run_and_the_parent_hands_on_its_output_and_usage(
    queue: RunQueue,
) -> None:
    calls: list[str] = []
    queue.submit("main", run_id="m")
    assert asyncio.run(Worker(queue, _flows(calls), poll=0.01).run_until_idle()) == 3
    result = queue.result("m")
    assert result is not None and result.outputs["report"] == ["DRAFT OF OWLS", "draft of owls"]
    assert result.cost == TokenUsage(20, 10, 2)  # each child's usage, rolled up into its step's
    assert queue.family("m") == (None, [("m/again", "again"), ("m/write", "write")])
    assert queue.result("m/write") is not None and calls.count("polish") == 2
    # A parent finishes only once no child of it is left unended (so its end closes none).
    ended = {r.run_id: r.status for r in queue.runs()}
    assert ended == dict.fromkeys(("m", "m/again", "m/write"), "finished")
    # A rewind of the parent's step is other work (its attempt's key is new): a child of its own
    # runs, as a rewound step runs again; the other step's child is not paid again.
    calls.clear()
    queue.rewind("m", "write")
    assert asyncio.run(Worker(queue, _flows(calls), poll=0.01).run_until_idle()) == 2
    assert calls == ["draft:owls", "polish"] and queue.status("m").status == "finished"
    assert queue.status("m/write/2").status == "finished"


def test_a_child_failure_fails_its_parent_step_and_a_retry_resumes_both(queue: RunQueue) -> None:
    calls: list[str] = []
    queue.submit("main", run_id="m", options={"isolate_failures": True})
    asyncio.run(Worker(queue, _flows(calls, fail=True), poll=0.01).run_until_idle())
    info = queue.status("m")
    assert info.status == "failed" and "child run 'm/write' failed" in str(info.error)
    assert queue.status("m/write").status == "failed" and queue.status("m/write").options == {
        "isolate_failures": True}
    checkpoint = queue.checkpoint("m")
    assert checkpoint is not None and "topic" in checkpoint.outputs  # (isolated: the rest kept)
    calls.clear()
    queue.retry("m")
    asyncio.run(Worker(queue, _flows(calls), poll=0.01).run_until_idle())
    assert queue.status("m").status == "finished", queue.status("m").error
    assert sorted(calls) == ["draft:owls", "draft:owls", "polish", "polish"]


def test_without_a_queue_the_child_runs_inline_and_a_worker_refuses_an_unregistered_child() -> None:
    calls: list[str] = []
    flows = _flows(calls)
    result = flows["main"].run_sync()
    assert result.outputs["report"] == ["DRAFT OF OWLS", "draft of owls"] and result.cost.llm_calls == 2
    with pytest.raises(ValueError, match="step 'write' runs its child as a queued run"):
        Worker(object(), {"main": flows["main"]})  # type: ignore[arg-type]
    failing = _flows(calls, fail=True)["main"].run_sync(isolate_failures=True)
    assert str(failing.failed["write"]) == "no draft"  # (the child's own error, as a step's)



def test_no_person_answers_a_wait_for_a_child(queue: RunQueue) -> None:
    token = SPAWNER.set(NeverEnding())
    try:
        with pytest.raises(RunWaiting) as waiting:
            _flows([])["main"].run_sync(run_id="p")
    finally:
        SPAWNER.reset(token)
    queue.submit("main", run_id="p")
    lease = claimed(queue, "p", "main")
    queue.save(lease, waiting.value.checkpoint, 600)
    assert queue.join(lease, ["p/write", "p/again"]) == "waiting"
    assert set(queue.questions("p")) == {"write", "again"}
    with pytest.raises(RunStateError, match="'write' waits for its child run 'p/write', not for a person"):
        queue.answer("p", "write", "a forged draft")
    assert queue.status("p").status == "waiting"


def _ekit(*args: str) -> str:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "ekit_runtime", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_ekit_queue_status_and_list_show_the_link_both_ways(queue: RunQueue, queue_url: str) -> None:
    _parked(queue, ("p/a",))
    queue.submit("wf", run_id="alone")
    status = json.loads(_ekit("queue", "--queue", queue_url, "status", "p"))
    assert status["children"] == {"a": "p/a"} and "parent" not in status
    assert json.loads(_ekit("queue", "--queue", queue_url, "status", "p/a"))["parent"] == "p"
    listed = json.loads(_ekit("queue", "--queue", queue_url, "list", "--json"))
    assert [r.get("parent") for r in listed] == [None, "p", None]
    table = _ekit("queue", "--queue", queue_url, "list").splitlines()
    assert table[0].split()[:3] == ["RUN", "PARENT", "WORKFLOW"]
    assert [line.split()[:2] for line in table[1:]] == [["p", "-"], ["p/a", "p"], ["alone", "-"]]
