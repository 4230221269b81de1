"""Under ``isolate_failures``, a step that failed while items' children go on is not paid again.

What users rely on: a step that failed is never run (and paid) again unless
the user asks, by ``retry``. A parent with a failed step ends ``failed`` at
once, isolated or not (decision 022): were it parked for its other items'
children, their end would resume it, and the resume would run the failed
step again. Its children still going are closed with it (the close
trigger), and ``retry`` runs again exactly what did not finish: the failed
step and the items' children, each once.
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


def _flows(calls: list[str], broken: bool = True) -> dict[str, Workflow]:
    def draft(ctx: Any) -> str:
        calls.append(ctx["topics"])
        return f"draft of {ctx['topics']}"

    def side(ctx: Any) -> str:
        calls.append("side")  # (a costly call, which fails the first time)
        if broken:
            raise RuntimeError("side broke")
        return "side"

    writer = Workflow([Step("draft", draft)])
    main = Workflow([
        Step("topics", lambda ctx: ["owls", "bats"]),
        Step("write", depends_on=("topics",), map_over="topics", child=Child(writer, queued=True)),
        Step("side", side, ("topics",)),
        Step("report", lambda ctx: list(ctx["write"]), ("write",)),
    ])
    return {"main": main, "writer": writer}


def test_a_failed_step_is_not_run_again_by_its_items_children(queue: RunQueue) -> None:
    calls: list[str] = []
    queue.submit("main", run_id="m", options={"isolate_failures": True})
    asyncio.run(Worker(queue, _flows(calls), poll=0.01).run_until_idle())
    info = queue.status("m")
    assert info.status == "failed" and "side broke" in str(info.error)
    assert calls.count("side") == 1  # side paid once
    _, children = queue.family("m")
    # (no child left going for a parent that ended: each ended, or was never spawned)
    assert all(queue.status(child).status in ("finished", "cancelled") for child, _ in children)
    calls.clear()
    queue.retry("m")
    asyncio.run(Worker(queue, _flows(calls, broken=False), poll=0.01).run_until_idle())
    assert queue.status("m").status == "finished", queue.status("m").error
    assert calls.count("side") == 1 and calls.count("owls") <= 1 and calls.count("bats") <= 1
    result = queue.result("m")
    assert result is not None and result.outputs["report"] == ["draft of owls", "draft of bats"]
