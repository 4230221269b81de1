"""A streaming step reports partial output as events, and only its final value is recorded.

What users rely on: an ``async def`` step with ``yield`` (or a step calling
``ekit_runtime.partial``) reaches the run's ``trace`` callbacks with each
piece while it runs, numbered, on the loop's thread, before the step's own
``StepFinished``; its output is the last value it yielded; the checkpoint
never holds a partial value, so a resume runs an unfinished streaming step
from its start; nothing is reported (and nothing breaks) without a trace.
"""

from __future__ import annotations

import asyncio
import io
import threading
from typing import Any

import pytest

from ekit_core import (
    RunStarted,
    StepFinished,
    StepPartial,
    StepStarted,
    WorkflowCheckpoint,
)
from ekit_runtime import ProgressPrinter, Step, TraceCallbackWarning, Workflow, partial


async def grow(ctx: dict[str, Any]) -> Any:
    text = ""
    for word in ("tides", " rise", " twice"):
        text += word
        yield text


def test_an_async_generator_step_reports_each_yield_and_outputs_the_last() -> None:
    events: list[Any] = []
    saved: list[WorkflowCheckpoint] = []
    wf = Workflow([Step("write", grow), Step("shout", lambda ctx: ctx["write"].upper(), ("write",))])
    result = wf.run_sync(trace=events.append, checkpoint_fn=saved.append)
    assert dict(result.outputs) == {"write": "tides rise twice", "shout": "TIDES RISE TWICE"}
    partials = [e for e in events if isinstance(e, StepPartial)]
    assert [(e.name, e.value, e.index) for e in partials] == [
        ("write", "tides", 0), ("write", "tides rise", 1), ("write", "tides rise twice", 2)]
    finished = next(i for i, e in enumerate(events) if isinstance(e, StepFinished) and e.name == "write")
    assert max(events.index(e) for e in partials) < finished
    # Only the final value is ever in a checkpoint.
    assert all(cp.outputs.get("write") in (None, "tides rise twice") for cp in saved)


async def revise(ctx: dict[str, Any]) -> Any:
    yield "tides"
    yield "tides rise"
    yield "tidal"  # does not extend "tides rise": replaces it
    yield {"not": "text"}
    yield "tidal bore"


def test_each_text_yield_carries_what_it_adds_and_the_text_rebuilds_from_those_alone() -> None:
    events: list[Any] = []
    Workflow([Step("write", revise)]).run_sync(trace=events.append)
    partials = [e for e in events if isinstance(e, StepPartial)]
    assert [(e.delta, e.replaces) for e in partials] == [
        ("tides", False), (" rise", False), ("tidal", True), (None, False), (" bore", False)]
    text = ""
    for e in partials:
        if e.delta is not None:
            text = e.delta if e.replaces else text + e.delta
            assert text == e.value  # the old field, whole, for callbacks that read it
    assert text == "tidal bore"


def test_partial_calls_carry_no_delta() -> None:
    events: list[Any] = []

    async def pieces(ctx: dict[str, Any]) -> str:
        partial("a")
        partial("ab")
        return "aab"

    Workflow([Step("s", pieces)]).run_sync(trace=events.append)
    assert [(e.value, e.delta) for e in events if isinstance(e, StepPartial)] == [("a", None), ("ab", None)]


def test_partial_from_a_sync_step_reaches_the_callbacks_on_the_loops_thread() -> None:
    seen: list[tuple[object, int]] = []

    def count(ctx: dict[str, Any]) -> str:
        assert threading.current_thread() is not threading.main_thread()  # a worker thread
        for i in range(5):
            partial(i)
        return "counted"

    def trace(event: Any) -> None:
        if isinstance(event, StepPartial):
            seen.append((event.value, threading.get_ident()))

    result = Workflow([Step("count", count)]).run_sync(trace=trace)
    assert result.outputs["count"] == "counted"
    assert [v for v, _ in seen] == [0, 1, 2, 3, 4]
    assert {t for _, t in seen} == {threading.main_thread().ident}


def test_without_a_trace_partial_does_nothing_and_streaming_steps_still_run() -> None:
    def noisy(ctx: dict[str, Any]) -> int:
        partial("ignored")
        return 1

    partial("outside any step")  # no run, no trace: nothing happens
    result = Workflow([Step("write", grow), Step("noisy", noisy)]).run_sync()
    assert dict(result.outputs) == {"write": "tides rise twice", "noisy": 1}


def test_async_callbacks_take_every_partial_before_the_step_finishes() -> None:
    order: list[str] = []

    async def slow_reader(event: Any) -> None:
        if isinstance(event, StepPartial):
            for _ in range(3):
                await asyncio.sleep(0)  # a callback that takes a few loop turns
            order.append(f"partial {event.value}")
        elif isinstance(event, StepFinished):
            order.append(f"finished {event.name}")

    Workflow([Step("write", grow)]).run_sync(trace=slow_reader)
    assert order == ["partial tides", "partial tides rise", "partial tides rise twice", "finished write"]


def test_a_failing_callback_loses_only_its_partial_event() -> None:
    kept: list[Any] = []

    def broken(event: Any) -> None:
        if isinstance(event, StepPartial):
            raise RuntimeError("display gone")

    with pytest.warns(TraceCallbackWarning, match="StepPartial dropped"):
        result = Workflow([Step("write", grow)]).run_sync(trace=[broken, kept.append])
    assert result.outputs["write"] == "tides rise twice"
    assert len([e for e in kept if isinstance(e, StepPartial)]) == 3


def test_an_interrupted_streaming_step_runs_again_from_its_start_on_resume() -> None:
    starts: list[int] = []
    release = asyncio.Event()

    async def stream(ctx: dict[str, Any]) -> Any:
        starts.append(1)
        yield "first piece"
        if len(starts) == 1:
            await release.wait()  # the first run is cancelled here, mid-stream
        yield "first piece, and the rest"

    wf = Workflow([Step("prep", lambda ctx: "p"), Step("stream", stream, ("prep",))])
    saved: list[WorkflowCheckpoint] = []

    async def first_run() -> None:
        task = asyncio.current_task()
        assert task is not None

        def trace(event: Any) -> None:
            if isinstance(event, StepPartial):
                task.cancel()  # Ctrl-C, as soon as the step has said something

        await wf.run(trace=trace, checkpoint_fn=saved.append)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(first_run())
    last = saved[-1]
    assert dict(last.outputs) == {"prep": "p"}  # the partial piece is nowhere
    pieces: list[object] = []
    result = wf.run_sync(
        resume_from=last,
        trace=lambda e: pieces.append(e.value) if isinstance(e, StepPartial) else None,
    )
    assert result.outputs["stream"] == "first piece, and the rest"
    assert len(starts) == 2  # from its start
    assert pieces == ["first piece", "first piece, and the rest"]


def test_a_streaming_steps_timeout_closes_its_generator() -> None:
    closed = threading.Event()
    never = asyncio.Event()

    async def stuck(ctx: dict[str, Any]) -> Any:
        try:
            yield "started"
            await never.wait()
            yield "never"
        finally:
            closed.set()

    with pytest.raises(TimeoutError):
        Workflow([Step("stuck", stuck, timeout=0.05)]).run_sync()
    assert closed.is_set()


def test_items_of_a_mapped_step_stream_under_their_own_names() -> None:
    async def pieces(ctx: dict[str, Any]) -> list[str]:
        return ["a", "b"]

    async def echo(ctx: dict[str, Any]) -> Any:
        yield ctx["pieces"]
        yield ctx["pieces"] * 2

    events: list[Any] = []
    wf = Workflow([Step("pieces", pieces), Step("echo", echo, ("pieces",), map_over="pieces")])
    result = wf.run_sync(trace=events.append)
    assert result.checkpoint is not None
    by_name: dict[str, list[object]] = {}
    for e in events:
        if isinstance(e, StepPartial):
            by_name.setdefault(e.name, []).append(e.value)
    assert sorted(by_name.values()) == [["a", "aa"], ["b", "bb"]]
    assert all(name.startswith("echo[") for name in by_name)


def test_the_dask_executor_refuses_a_streaming_step_before_anything_runs() -> None:
    pytest.importorskip("distributed")
    from ekit_runtime import DaskExecutor

    ran: list[str] = []
    wf = Workflow([Step("first", lambda ctx: ran.append("first")), Step("write", grow)])
    with pytest.raises(ValueError, match="'write' is an async generator"):
        wf.run_sync(executor=DaskExecutor("tcp://127.0.0.1:1"))  # never connected: refused first
    assert ran == []


def test_progress_shows_the_end_of_a_running_steps_latest_partial_output() -> None:
    out = io.StringIO()
    p = ProgressPrinter(out, clock=lambda: 100.0, tty=True)
    p(RunStarted(total=1, recorded=0))
    p(StepStarted("write", 1, 0.0))
    p(StepPartial("write", "a long answer\nthat keeps on growing, word by word", 0))
    p.tick()
    assert 'write 0.0s "on growing, word by word"' in out.getvalue().split("\r")[-1]
    p(StepStarted("write", 2, 0.0))  # a retry starts its output afresh
    assert '"' not in p.status()
