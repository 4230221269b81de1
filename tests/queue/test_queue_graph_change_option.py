"""A queued run whose options allow a graph change is resumed by a worker of the new graph.

``submit(..., options={"allow_graph_change": True})`` asks that the run may
resume a checkpoint recorded by another version of its workflow. A run
begun (and failed) under version 1 and retried is then claimed by a worker
that has only version 2, on both backends, and finishes there without
paying again for what version 1 recorded; its status names no missing
version. A run without the option still waits for a worker of its own
version, saying why; a fork that turns the option on is claimed too.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from ekit_runtime import Step, Workflow
from ekit_runtime.queue import RunQueue, Worker
from ekit_runtime.queue.base import queued_reason
from ekit_runtime.queue.lifecycle import matches
from tests.support.queue_backends import queue, queue_url

__all__ = ["queue", "queue_url"]


def _versions(paid: list[str]) -> tuple[Workflow, Workflow]:
    """Version 1 (``b`` raises) and version 2 (``b`` mended, ``c`` added) of workflow ``w``."""

    def a(ctx: dict[str, Any]) -> str:
        paid.append("a")
        return "A"

    def broken(ctx: dict[str, Any]) -> str:
        raise RuntimeError("b is broken in version 1")

    def b(ctx: dict[str, Any]) -> str:
        paid.append("b")
        return ctx["a"] + "B"

    def c(ctx: dict[str, Any]) -> str:
        paid.append("c")
        return ctx["b"] + "C"

    one = Workflow([Step("a", a), Step("b", broken, ("a",))])
    two = Workflow([Step("a", a), Step("b", b, ("a",)), Step("c", c, ("b",))])
    assert one.graph.fingerprint != two.graph.fingerprint
    return one, two


def _drain(queue: RunQueue, workflow: Workflow, name: str) -> dict[str, str]:
    """Run a real worker that has ``workflow`` as ``w`` until the queue is idle; its outcomes."""
    worker = Worker(queue, {"w": workflow}, name=name, lease_seconds=30, poll=0.05)
    asyncio.run(worker.run_until_idle())
    return dict(worker.outcomes)


@pytest.mark.timeout(120)
def test_a_run_failed_under_v1_and_retried_is_resumed_by_a_v2_worker(queue: RunQueue) -> None:
    paid: list[str] = []
    one, two = _versions(paid)
    queue.submit("w", run_id="allowed", options={"allow_graph_change": True})
    queue.submit("w", run_id="strict")
    assert _drain(queue, one, "v1") == {"allowed": "failed", "strict": "failed"}
    assert paid == ["a", "a"]
    queue.retry("allowed")
    queue.retry("strict")
    queue.announce("v2-announced", {"w": two.graph.fingerprint}, 30)
    assert queue.status("allowed").reason is None
    assert "no worker has this version of workflow w" in (queue.status("strict").reason or "")

    paid.clear()
    assert _drain(queue, two, "v2") == {"allowed": "finished"}
    assert paid == ["b", "c"]  # a, recorded under version 1, is not paid again
    result = queue.result("allowed")
    assert result is not None and result.outputs == {"a": "A", "b": "AB", "c": "ABC"}
    assert queue.status("strict").status == "queued"

    # A fork of the strict run that turns the option on is claimable by version 2 as well.
    forked = queue.fork("strict", options={"allow_graph_change": True}, new_run_id="forked")
    paid.clear()
    assert _drain(queue, two, "v2") == {forked: "finished"}
    assert paid == ["b", "c"]


@pytest.mark.parametrize("allowed", [False, True])
@pytest.mark.parametrize("recorded", [None, "f1", "f2"])
def test_the_match_rule_and_the_waiting_reason_agree(allowed: bool, recorded: str | None) -> None:
    claimable = matches("w", recorded, {"w": "f1"}, graph_change=allowed)
    assert claimable is (allowed or recorded in (None, "f1"))
    reason = queued_reason("w", recorded, {"w": {"f1"}}, graph_change=allowed)
    assert (reason is None) is claimable
    assert queued_reason("w", recorded, {}, graph_change=allowed) == "no worker has workflow w"


def test_until_idle_does_not_blame_the_version_of_a_run_that_allows_the_change(queue: RunQueue) -> None:
    from ekit_runtime.queue.cli import _why_left

    _one, two = _versions([])
    queue.submit("w", run_id="allowed", options={"allow_graph_change": True})
    info = dataclasses.replace(queue.status("allowed"), fingerprint="sha256:" + "0" * 64)
    worker = Worker(queue, {"w": two}, name="v2")
    assert "another version" not in _why_left(info, worker, 0.0)
    strict = dataclasses.replace(info, options={})
    assert "another version" in _why_left(strict, worker, 0.0)
