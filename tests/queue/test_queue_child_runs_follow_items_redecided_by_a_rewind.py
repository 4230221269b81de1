"""A queued child per item hands on the output of the item the parent maps over now.

What users rely on: a rewind of the step that decides a map's items runs the
map again over the items it decides now. An item's queued child is found by
the item's key (``write[0]``: its place, with no ``item_key``), so a resume
does not pay for an item twice; but an item the rewind changed is another
item: its output must be made from it, not handed on from the child run of
the item that held its key before (decision 022: an item's id, question and
answer are the item's).
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


def _flows(topics: list[str], calls: list[str]) -> dict[str, Workflow]:
    def draft(ctx: Any) -> str:
        calls.append(ctx["topics"])
        return f"draft of {ctx['topics']}"

    writer = Workflow([Step("draft", draft)])
    main = Workflow([
        Step("topics", lambda ctx: list(topics)),
        Step("write", depends_on=("topics",), map_over="topics", child=Child(writer, queued=True)),
        Step("report", lambda ctx: list(ctx["write"]), ("write",)),
    ])
    return {"main": main, "writer": writer}


def _drain(queue: RunQueue, flows: dict[str, Workflow]) -> None:
    asyncio.run(Worker(queue, flows, poll=0.01).run_until_idle())


def test_a_rewind_that_changes_the_items_drafts_the_new_items(queue: RunQueue) -> None:
    topics, calls = ["owls", "bats"], []
    flows = _flows(topics, calls)
    queue.submit("main", run_id="m")
    _drain(queue, flows)
    result = queue.result("m")
    assert result is not None and result.outputs["report"] == ["draft of owls", "draft of bats"]
    topics[:] = ["ants", "bats", "cats"]  # the items decided again: item 0 is another topic
    calls.clear()
    queue.rewind("m", "topics")
    _drain(queue, flows)
    result = queue.result("m")
    assert result is not None, queue.status("m").error
    assert result.outputs["report"] == ["draft of ants", "draft of bats", "draft of cats"]
