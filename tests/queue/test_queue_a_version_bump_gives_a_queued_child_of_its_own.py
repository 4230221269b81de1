"""A version bump above a queued child's step runs a new child, on SQLite and PostgreSQL.

What users rely on: a child run's identity follows the work (decision 022). A
parent waiting for a person after its ``write`` step's queued child finished is
resumed by a worker whose ``topic`` (what ``write`` reads) is a new version with
a new output: ``write``'s recorded work is outdated, so it runs again as a new
attempt, whose child is a run of its own (``m/write/2``). The old child's output
is not handed on for the new work, the old child is not run again, and the new
one is paid once. (A step with a child takes no ``version=``: its child's steps
do, and an upstream bump is how new code reaches it.)
"""

from __future__ import annotations

import asyncio
from typing import Any

from ekit_core import TokenUsage
from ekit_runtime import PatternResult, Step, Workflow, ask
from ekit_runtime.children import Child
from ekit_runtime.queue import RunQueue, Worker
from tests.support.queue_backends import queue, queue_url

__all__ = ["queue", "queue_url"]


def _flows(version: str, calls: list[str]) -> dict[str, Workflow]:
    async def draft(ctx: Any) -> Any:
        calls.append(f"draft of {ctx['topic']}")
        return PatternResult(f"draft of {ctx['topic']}", cost=TokenUsage(10, 5, 1))

    writer = Workflow([Step("draft", draft)])
    main = Workflow([
        Step("topic", lambda ctx: "owls" if version == "1" else "bats", version=version),
        Step("write", depends_on=("topic",), child=Child(writer, output="draft", queued=True)),
        Step("approve", lambda ctx: ask("publish it?", details={"draft": ctx["write"]}), ("write",)),
        Step("report", lambda ctx: f"{ctx['write']} ({ctx['approve']})", ("approve",)),
    ])
    return {"main": main, "writer": writer}


def _drain(queue: RunQueue, flows: dict[str, Workflow]) -> None:
    asyncio.run(Worker(queue, flows, poll=0.01).run_until_idle())


def test_a_bumped_step_runs_a_new_child_and_never_hands_on_the_old_ones_output(queue: RunQueue) -> None:
    calls: list[str] = []
    queue.submit("main", run_id="m")
    _drain(queue, _flows("1", calls))
    assert queue.status("m").status == "waiting" and list(queue.questions("m")) == ["approve"]
    assert calls == ["draft of owls"] and queue.status("m/write").status == "finished"

    queue.answer("m", "approve", "yes")
    _drain(queue, _flows("2", calls))  # the code changed while the run waited: topic is version 2
    for _ in range(3):  # (a bump lets go of what followed: approve asks again, of the new draft)
        if queue.status("m").status != "waiting":
            break
        assert queue.questions("m")["approve"].details == {"draft": "draft of bats"}
        queue.answer("m", "approve", "yes")
        _drain(queue, _flows("2", calls))

    assert queue.status("m").status == "finished", queue.status("m").error
    result = queue.result("m")
    assert result is not None and result.outputs["report"] == "draft of bats (yes)"
    assert calls == ["draft of owls", "draft of bats"]  # each child paid once, the old one not again
    new = [child for child, step in queue.family("m")[1] if child != "m/write"]
    assert new and all(child.startswith("m/write/") for child in new), queue.family("m")
    assert [queue.status(child).status for child in new] == ["finished"]
    old = queue.result("m/write")
    assert old is not None and old.outputs["draft"] == "draft of owls"  # kept, not overwritten
