"""Trace events: one deterministic sequence per completion order, and the callback rule.

Completions are driven by ``asyncio.Event`` gates: the test opens one
step's gate, waits until the trace has seen that step's checkpoint handed
over, then opens the next. No sleep decides any order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import (
    CheckpointSaved,
    Event,
    RunSettled,
    RunStarted,
    StepFailed,
    StepFinished,
    StepInterrupted,
    StepRetried,
    StepSkipped,
    StepStarted,
    TokenUsage,
    WorkflowCheckpoint,
)
from ekit_runtime import (
    PatternResult,
    RetryPolicy,
    Step,
    TraceCallbackWarning,
    Workflow,
)

# a, b, c are roots; d needs a and b; e needs c and d.
DEPS: dict[str, tuple[str, ...]] = {
    "a": (),
    "b": (),
    "c": (),
    "d": ("a", "b"),
    "e": ("c", "d"),
}


def _usage(name: str) -> TokenUsage:
    return TokenUsage(10 * (ord(name) - 96), ord(name) - 96, 1)


def _normalise(events: Sequence[Event]) -> list[Event]:
    # Durations are measurements of the wall clock; everything else is decided
    # by the core and must repeat exactly.
    return [
        dataclasses.replace(e, duration=None) if hasattr(e, "duration") else e  # type: ignore[type-var]
        for e in events
    ]


async def _gated_run(
    order: Sequence[str], resume_from: WorkflowCheckpoint | None = None
) -> tuple[list[Event], list[WorkflowCheckpoint]]:
    """Run the DAG, letting steps finish one at a time in ``order``."""
    gates = {n: asyncio.Event() for n in DEPS}
    saved_after = {n: asyncio.Event() for n in DEPS}
    events: list[Event] = []
    checkpoints: list[WorkflowCheckpoint] = []
    last_finished: list[str] = []

    def make(name: str) -> Any:
        async def run(context: dict[str, Any]) -> PatternResult[str]:
            await gates[name].wait()
            return PatternResult(name.upper(), cost=_usage(name))

        return run

    def trace(event: Event) -> None:
        events.append(event)
        if isinstance(event, StepFinished):
            last_finished.append(event.name)
        elif isinstance(event, CheckpointSaved):
            for name in last_finished:
                saved_after[name].set()
            last_finished.clear()

    wf = Workflow([Step(n, make(n), depends_on=d) for n, d in DEPS.items()])
    run = asyncio.create_task(
        wf.run({"topic": "t"}, checkpoint_fn=checkpoints.append, trace=trace, resume_from=resume_from)
    )
    for name in order:
        gates[name].set()
        await saved_after[name].wait()
    result = await run
    assert dict(result.outputs) == {n: n.upper() for n in DEPS}
    return events, checkpoints


def _topological_orders() -> st.SearchStrategy[list[str]]:
    @st.composite
    def build(draw: st.DrawFn) -> list[str]:
        done: list[str] = []
        while len(done) < len(DEPS):
            ready = [n for n, d in DEPS.items() if n not in done and all(x in done for x in d)]
            done.append(draw(st.sampled_from(ready)))
        return done

    return build()


@settings(max_examples=25, deadline=None)
@given(order=_topological_orders())
def test_same_completion_order_gives_the_same_events(order: list[str]) -> None:
    first, _ = asyncio.run(_gated_run(order))
    second, _ = asyncio.run(_gated_run(order))
    assert _normalise(first) == _normalise(second)
    finished = [e.name for e in first if isinstance(e, StepFinished)]
    assert finished == order


def test_event_sequence_of_one_order_in_full() -> None:
    events, checkpoints = asyncio.run(_gated_run(["b", "a", "c", "d", "e"]))
    core = [e for e in _normalise(events) if not isinstance(e, CheckpointSaved)]
    assert core == [
        RunStarted(5, 0),
        StepStarted("a", 1, 0.0),
        StepStarted("b", 1, 0.0),
        StepStarted("c", 1, 0.0),
        StepFinished("b", 1, _usage("b"), None),
        StepFinished("a", 1, _usage("a"), None),
        StepStarted("d", 1, 0.0),
        StepFinished("c", 1, _usage("c"), None),
        StepFinished("d", 1, _usage("d"), None),
        StepStarted("e", 1, 0.0),
        StepFinished("e", 1, _usage("e"), None),
        RunSettled("finished", 5, 5, sum(map(_usage, "abcde"), TokenUsage())),
    ]
    # Each checkpoint is handed over after the completion it records and
    # before the next completion is reported.
    finished_so_far = 0
    for event in events:
        if isinstance(event, StepFinished):
            finished_so_far += 1
        elif isinstance(event, CheckpointSaved):
            assert event.step_index == finished_so_far
    assert [c.step_index for c in checkpoints] == [1, 2, 3, 4, 5]
    assert [e.step_index for e in events if isinstance(e, CheckpointSaved)] == [1, 2, 3, 4, 5]
    durations = [e.duration for e in events if isinstance(e, StepFinished)]
    assert all(d is not None and d >= 0 for d in durations)


def test_a_resumed_run_reports_its_skips_first() -> None:
    _, checkpoints = asyncio.run(_gated_run(["b", "a", "c", "d", "e"]))
    after_two = checkpoints[1]
    events, _ = asyncio.run(_gated_run(["c", "d", "e"], resume_from=after_two))
    assert _normalise(events)[:3] == [RunStarted(5, 2), StepSkipped("a"), StepSkipped("b")]
    assert [e.name for e in events if isinstance(e, StepStarted)] == ["c", "d", "e"]


def test_retries_and_failures_are_traced() -> None:
    calls = {"n": 0}

    def flaky(context: dict[str, Any]) -> str:
        calls["n"] += 1
        if calls["n"] < 2:
            raise TimeoutError("slow model")
        return "ok"

    def broken(context: dict[str, Any]) -> str:
        raise ValueError("bad prompt")

    wf = Workflow(
        [
            Step("flaky", flaky, retry=RetryPolicy(max_attempts=2, backoff_base=0.0)),
            Step("broken", broken, depends_on=("flaky",)),
        ]
    )
    events: list[Event] = []
    with pytest.raises(ValueError, match="bad prompt"):
        wf.run_sync(trace=events.append)
    kinds = [type(e).__name__ for e in events]
    assert kinds == [
        "RunStarted",
        "StepStarted",
        "StepRetried",
        "StepStarted",
        "StepFinished",
        "StepStarted",
        "StepFailed",
        "RunSettled",
    ]
    retried = next(e for e in events if isinstance(e, StepRetried))
    assert (retried.name, retried.attempt, retried.error_type) == ("flaky", 1, "TimeoutError")
    failed = next(e for e in events if isinstance(e, StepFailed))
    assert (failed.name, failed.error_type, failed.message) == ("broken", "ValueError", "bad prompt")
    assert events[-1] == RunSettled("failed", 1, 2, TokenUsage())


def test_cancellation_traces_the_interrupted_steps() -> None:
    async def main() -> list[Event]:
        events: list[Event] = []
        started = asyncio.Event()

        async def forever(context: dict[str, Any]) -> None:
            started.set()
            await asyncio.Event().wait()

        wf = Workflow([Step("slow", forever)])
        run = asyncio.create_task(wf.run(trace=events.append))
        await started.wait()
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        return events

    events = asyncio.run(main())
    assert events[-2:] == [StepInterrupted("slow"), RunSettled("cancelled", 0, 1, TokenUsage())]


def test_run_finished_is_the_last_event_and_follows_the_final_checkpoint() -> None:
    async def main() -> tuple[list[Event], list[Event]]:
        finished: list[Event] = []
        await Workflow([Step("a", lambda c: 1)]).run(
            trace=finished.append, checkpoint_fn=lambda cp: None
        )
        cancelled: list[Event] = []
        started = asyncio.Event()

        async def forever(context: dict[str, Any]) -> None:
            started.set()
            await asyncio.Event().wait()

        wf = Workflow([Step("a", lambda c: 1), Step("slow", forever, depends_on=("a",))])
        run = asyncio.create_task(wf.run(trace=cancelled.append, checkpoint_fn=lambda cp: None))
        await started.wait()
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        return finished, cancelled

    finished, cancelled = asyncio.run(main())
    assert [type(e) for e in finished[-3:]] == [StepFinished, CheckpointSaved, RunSettled]
    # Winding down reports like any transition: what happened, the save, the end.
    assert cancelled[-3:] == [
        StepInterrupted("slow"),
        CheckpointSaved(1),
        RunSettled("cancelled", 1, 2, TokenUsage()),
    ]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_raising_trace_callback_does_not_corrupt_the_run(kind: str) -> None:
    seen: list[Event] = []

    def sync_trace(event: Event) -> None:
        seen.append(event)
        if isinstance(event, StepStarted | CheckpointSaved):
            raise RuntimeError("broken dashboard")

    async def async_trace(event: Event) -> None:
        sync_trace(event)

    saved: list[WorkflowCheckpoint] = []
    wf = Workflow(
        [
            Step("a", lambda c: PatternResult(1, cost=TokenUsage(1, 1, 1))),
            Step("b", lambda c: c["a"] + 1, depends_on=("a",)),
        ]
    )
    with pytest.warns(TraceCallbackWarning, match="broken dashboard") as record:
        result = wf.run_sync(
            trace=sync_trace if kind == "sync" else async_trace, checkpoint_fn=saved.append
        )
    assert dict(result.outputs) == {"a": 1, "b": 2}
    assert result.cost == TokenUsage(1, 1, 1)
    assert [c.step_index for c in saved] == [1, 2]
    # Every event still reached the callback; each raising one gave one warning.
    assert [type(e) for e in seen].count(RunSettled) == 1
    raised = [e for e in seen if isinstance(e, StepStarted | CheckpointSaved)]
    assert len(record) == len(raised) == 4
    assert "StepStarted dropped" in str(record[0].message)


def test_a_quiet_trace_callback_gives_no_warning() -> None:
    wf = Workflow([Step("a", lambda c: 1)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wf.run_sync(trace=lambda e: None)


def test_trace_must_be_callable() -> None:
    wf = Workflow([Step("a", lambda c: 1)])
    with pytest.raises(ValueError, match="trace"):
        wf.run_sync(trace="print")
