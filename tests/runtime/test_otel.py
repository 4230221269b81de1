"""The OpenTelemetry adapter: never imported by default, spans mapped from events."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from typing import Any

import pytest

from ekit_core import TokenUsage
from ekit_runtime import OtelTracer, PatternResult, RetryPolicy, Step, Workflow
from tests.support.fake_tracer import FakeTracer

HAS_OTEL = importlib.util.find_spec("opentelemetry") is not None


def test_importing_ekit_does_not_import_opentelemetry() -> None:
    code = "import sys, ekit_runtime, ekit_core; print('opentelemetry' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "False"


@pytest.mark.skipif(HAS_OTEL, reason="opentelemetry is installed here")
def test_without_opentelemetry_a_default_tracer_is_a_clear_import_error() -> None:
    with pytest.raises(ImportError, match="pip install opentelemetry-api"):
        OtelTracer()


def test_a_tracer_without_start_span_is_refused() -> None:
    with pytest.raises(ValueError, match="tracer"):
        OtelTracer(tracer=object())


def test_spans_follow_the_run() -> None:
    tries = {"n": 0}

    def flaky(context: dict[str, Any]) -> str:
        tries["n"] += 1
        if tries["n"] == 1:
            raise TimeoutError("slow")
        return "ok"

    wf = Workflow(
        [
            Step("a", lambda c: PatternResult("A", cost=TokenUsage(7, 3, 1))),
            Step("b", flaky, depends_on=("a",), retry=RetryPolicy(2, backoff_base=0.0)),
        ]
    )
    tracer = FakeTracer()
    first = wf.run_sync(trace=OtelTracer(tracer), checkpoint_fn=lambda cp: None)
    run, *steps = tracer.spans
    assert run.name == "ekit.run" and run.ended == 1
    assert run.attributes["ekit.steps.total"] == 2
    assert run.attributes["ekit.outcome"] == "finished"
    assert run.attributes["ekit.usage.total_tokens"] == 10
    assert [s.name for s in steps] == ["ekit.step a", "ekit.step b", "ekit.step b"]
    assert all(s.ended == 1 for s in steps)
    assert steps[0].attributes["ekit.usage.input_tokens"] == 7
    assert steps[1].attributes["error.type"] == "TimeoutError"
    assert steps[1].attributes["ekit.retried"] is True
    assert steps[2].attributes["ekit.attempt"] == 2
    # Every checkpoint handed over is a span event, the final one included (the
    # failed attempt of b is recorded too, as a failure, at step_index 1).
    saved = [e for e in run.events if e[0] == "ekit.checkpoint.saved"]
    assert [attrs["ekit.step_index"] for _, attrs in saved] == [1, 1, 2]

    # A resume that skips everything: skip events on the run span, no step span.
    tracer = FakeTracer()
    wf.run_sync(trace=OtelTracer(tracer), resume_from=first.checkpoint)
    (run,) = tracer.spans
    assert [attrs["ekit.step"] for name, attrs in run.events if name == "ekit.step.skipped"] == [
        "a",
        "b",
    ]
    assert run.ended == 1


def test_a_cancelled_run_ends_every_span() -> None:
    import asyncio

    async def main() -> FakeTracer:
        tracer = FakeTracer()
        started = asyncio.Event()

        async def forever(context: dict[str, Any]) -> None:
            started.set()
            await asyncio.Event().wait()

        wf = Workflow([Step("slow", forever)])
        run = asyncio.create_task(wf.run(trace=OtelTracer(tracer)))
        await started.wait()
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        return tracer

    tracer = asyncio.run(main())
    run, step = tracer.spans
    assert step.attributes["ekit.outcome"] == "interrupted" and step.ended == 1
    assert run.attributes["ekit.outcome"] == "cancelled" and run.attributes["error.type"] == "cancelled"
    assert run.ended == 1


def test_each_item_of_a_mapped_step_has_a_span_of_its_own() -> None:
    wf = Workflow([
        Step("split", lambda c: ["x", "y", "z"]),
        Step("each", lambda c: c["split"].upper(), ("split",), map_over="split",
             context="dependencies"),
    ])
    tracer = FakeTracer()
    result = wf.run_sync(trace=OtelTracer(tracer))
    assert result.outputs["each"] == ["X", "Y", "Z"]
    run, *steps = tracer.spans
    assert sorted(s.name for s in steps) == [
        "ekit.step each[0]", "ekit.step each[1]", "ekit.step each[2]", "ekit.step split"]
    assert all(s.ended == 1 for s in steps) and run.ended == 1
    assert run.attributes["ekit.outcome"] == "finished"
