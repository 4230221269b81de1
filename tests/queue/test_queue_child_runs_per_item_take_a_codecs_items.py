"""A queued child per item takes an item of the parent codec's own type, as inline.

What users rely on: one definition works inline and through the queue
(decision 022). A map over a step's output of a type the parent's
``Codec`` stores (a dataclass) hands each item to its child inline; through
the queue the child run's input is stored as JSON, so the item must reach it
in a form the queue holds (the codec's), not fail every item with an
``UnencodableError`` that the inline run never meets.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest

from ekit_runtime import Codec, Step, Workflow
from ekit_runtime.children import Child
from ekit_runtime.queue import RunQueue, Worker
from tests.support.queue_backends import queue, queue_url

__all__ = ["queue", "queue_url"]

pytestmark = pytest.mark.timeout(120)


@dataclass
class Topic:
    name: str


def _topics(ctx: Any) -> list[Topic]:
    return [Topic("owls"), Topic("bats")]


def _draft(ctx: Any) -> str:
    topic = ctx["topics"]
    return f"draft of {topic.name if isinstance(topic, Topic) else topic}"  # (its stored form too)


def _main() -> tuple[Workflow, Workflow]:
    writer = Workflow([Step("draft", _draft)])
    main = Workflow([
        Step("topics", _topics),
        Step("write", depends_on=("topics",), map_over="topics", child=Child(writer, queued=True)),
        Step("report", lambda ctx: list(ctx["write"]), ("write",)),
    ], codec=Codec(Topic))
    return main, writer


def test_a_codecs_items_reach_their_queued_children_as_they_reach_inline_ones(queue: RunQueue) -> None:
    main, writer = _main()
    assert main.run_sync().outputs["report"] == ["draft of owls", "draft of bats"]
    queue.submit("main", run_id="m")
    asyncio.run(Worker(queue, {"main": main, "writer": writer}, poll=0.01).run_until_idle())
    info = queue.status("m")
    assert info.status == "finished", info.error
    result = queue.result("m")
    assert result is not None
    owls, bats = result.outputs["report"]
    assert "owls" in owls and "bats" in bats
