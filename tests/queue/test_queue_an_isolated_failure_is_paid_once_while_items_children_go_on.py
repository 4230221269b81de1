"""Under ``isolate_failures``, a step that failed while items' children go on is not paid again.

What users rely on: a parent that failed under ``isolate_failures`` while
some items still wait for their queued children parks and is woken once they
ended (decision 022: isolation means the other items go on). That wake is
the queue's, not a retry the user asked for: the step that failed already
must not run (and be paid) again on it; the run then ends ``failed``, naming
it, with the children's outputs kept, and ``retry`` is how a user pays for
it again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ekit_runtime import Step, Workflow
from ekit_runtime.children import Child
from ekit_runtime.queue import RunQueue, Worker
from tests.support.queue_backends import queue, queue_url

__all__ = ["queue", "queue_url"]

pytestmark = pytest.mark.timeout(120)


def _flows(calls: list[str]) -> dict[str, Workflow]:
    def draft(ctx: Any) -> str:
        calls.append(ctx["topics"])
        return f"draft of {ctx['topics']}"

    def side(ctx: Any) -> str:
        calls.append("side")  # (a costly call that fails)
        raise RuntimeError("side broke")

    writer = Workflow([Step("draft", draft)])
    main = Workflow([
        Step("topics", lambda ctx: ["owls", "bats"]),
        Step("write", depends_on=("topics",), map_over="topics", child=Child(writer, queued=True)),
        Step("side", side, ("topics",)),
        Step("report", lambda ctx: list(ctx["write"]), ("write",)),
    ])
    return {"main": main, "writer": writer}


def test_a_failed_step_is_not_run_again_when_the_children_wake_the_parent(queue: RunQueue) -> None:
    calls: list[str] = []
    queue.submit("main", run_id="m", options={"isolate_failures": True})
    asyncio.run(Worker(queue, _flows(calls), poll=0.01).run_until_idle())
    info = queue.status("m")
    assert info.status == "failed" and "side broke" in str(info.error)
    assert [queue.status(f"m/write[{k}]").status for k in range(2)] == ["finished", "finished"]
    checkpoint = queue.checkpoint("m")
    assert checkpoint is not None
    kept = [checkpoint.outputs["write[0]"], checkpoint.outputs["write[1]"]]
    assert kept == ["draft of owls", "draft of bats"]
    assert sorted(calls) == ["bats", "owls", "side"]  # side paid once
