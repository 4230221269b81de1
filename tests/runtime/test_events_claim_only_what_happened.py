"""Trace events tell only what happened: no attempt that never began, nothing after the run's end.

What users rely on: a ``StepStarted`` means an attempt's work began, so a
step (or an item) that its condition skipped, or whose condition raised,
never gets one, while a step whose condition held gets exactly one before
its outcome; ``RunSettled`` is the last event of a run, so partial output
that an attempt reports after it ended (a sync step still running in its
thread after its timeout, a task the step left behind) is dropped, never
delivered late.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from ekit_core import (
    Event,
    RunSettled,
    StepFailed,
    StepFinished,
    StepPartial,
    StepSkipped,
    StepStarted,
)
from ekit_runtime import RetryPolicy, Step, Workflow, partial


def _started(events: list[Event]) -> list[str]:
    return [e.name for e in events if isinstance(e, StepStarted)]


def test_a_step_its_condition_skips_never_starts() -> None:
    events: list[Event] = []
    wf = Workflow([
        Step("route", lambda ctx: "calm"),
        Step("escalate", lambda ctx: "paged", ("route",), when=lambda ctx: ctx["route"] == "urgent"),
        Step("reply", lambda ctx: "hello", ("route",), when=lambda ctx: ctx["route"] == "calm"),
    ])
    wf.run_sync(trace=events.append)
    assert _started(events) == ["route", "reply"]
    assert [e.name for e in events if isinstance(e, StepSkipped)] == ["escalate"]
    # The step that ran started once, before it finished.
    names = [(type(e).__name__, getattr(e, "name", None)) for e in events]
    assert names.index(("StepStarted", "reply")) < names.index(("StepFinished", "reply"))


def test_items_their_condition_skips_never_start() -> None:
    events: list[Event] = []
    wf = Workflow([
        Step("numbers", lambda ctx: [1, 2, 3, 4]),
        Step("double", lambda ctx: ctx["numbers"] * 2, ("numbers",), map_over="numbers",
             when=lambda ctx: ctx["numbers"] % 2 == 0),
    ])
    result = wf.run_sync(trace=events.append)
    assert result.outputs["double"] == [4, 8]
    assert _started(events) == ["numbers", "double[1]", "double[3]"]
    finished = {e.name for e in events if isinstance(e, StepFinished)}
    assert set(_started(events)) <= finished


def test_a_condition_that_raises_starts_no_attempt() -> None:
    def broken(ctx: Any) -> bool:
        raise KeyError("no such field")

    events: list[Event] = []
    with pytest.raises(KeyError):
        Workflow([Step("a", lambda ctx: 1, when=broken)]).run_sync(trace=events.append)
    assert _started(events) == []
    assert [e.name for e in events if isinstance(e, StepFailed)] == ["a"]


def test_a_condition_that_holds_with_approval_starts_after_the_approval() -> None:
    events: list[Event] = []
    approved: list[str] = []

    def approve(name: str, metadata: Any) -> bool:
        approved.append(name)
        events_before = _started(events)
        assert name not in events_before  # not started while it waits for the approval
        return True

    wf = Workflow([Step("a", lambda ctx: 1, when=lambda ctx: True),
                   Step("b", lambda ctx: 2, when=lambda ctx: False)])
    wf.run_sync(trace=events.append, approval=approve)
    assert approved == ["a"]  # the skipped step asks nobody
    assert _started(events) == ["a"]


async def _late_partial_of_a_timed_out_thread() -> list[Event]:
    events: list[Event] = []
    loop = asyncio.get_running_loop()
    go = threading.Event()
    sent = asyncio.Event()

    def slow(ctx: Any) -> str:
        partial("early")
        go.wait(timeout=60)
        partial("late")  # its attempt timed out long ago
        # Handed to the loop after the late partial's own delivery: once it
        # is set, that delivery has run (or was dropped).
        loop.call_soon_threadsafe(sent.set)
        return "too late"

    wf = Workflow([Step("slow", slow, timeout=0.05, retry=RetryPolicy(max_attempts=1))])
    with pytest.raises(TimeoutError):
        await wf.run(trace=events.append)
    go.set()
    await sent.wait()
    return events


def test_a_timed_out_sync_steps_late_partial_is_dropped() -> None:
    events = asyncio.run(_late_partial_of_a_timed_out_thread())
    assert isinstance(events[-1], RunSettled)
    assert [e.value for e in events if isinstance(e, StepPartial)] == ["early"]


async def _late_partial_of_a_left_task() -> tuple[list[Event], Any]:
    events: list[Event] = []
    go = asyncio.Event()
    left: list[asyncio.Task[None]] = []

    async def behind() -> None:
        await go.wait()
        partial("after the end")

    async def step(ctx: Any) -> str:
        partial("during")
        left.append(asyncio.create_task(behind()))  # inherits the attempt's context
        return "done"

    result = await Workflow([Step("s", step)]).run(trace=events.append)
    go.set()
    await left[0]
    return events, result


def test_a_partial_from_a_task_the_step_left_behind_is_dropped() -> None:
    events, result = asyncio.run(_late_partial_of_a_left_task())
    assert result.outputs["s"] == "done"
    assert isinstance(events[-1], RunSettled)
    assert [e.value for e in events if isinstance(e, StepPartial)] == ["during"]
