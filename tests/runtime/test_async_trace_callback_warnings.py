"""An async trace callback that raises is warned about, never silent, never fatal.

What users rely on: whatever event an ``async def`` trace callback fails
on (a step's partial output included, reported from an async generator, an
async step calling ``partial``, or a sync step's thread), the run goes on
with its outputs intact, the callback's error surfaces as a
``TraceCallbackWarning`` naming the dropped event, and the other callbacks
still receive every event.
"""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

import pytest

from ekit_core import StepFinished, StepPartial
from ekit_runtime import Step, TraceCallbackWarning, Workflow, partial


async def _stream(ctx: Any) -> Any:
    yield "one"
    yield "one two"


async def _calls_partial(ctx: Any) -> str:
    partial("half")
    return "whole"


def _sync_calls_partial(ctx: Any) -> str:
    partial("half")  # from the step's worker thread
    return "whole"


@pytest.mark.parametrize("body", [_stream, _calls_partial, _sync_calls_partial])
def test_an_async_callback_that_raises_on_a_partial_gets_a_warning(body: Any) -> None:
    kept: list[Any] = []

    async def broken(event: Any) -> None:
        await asyncio.sleep(0)
        if isinstance(event, StepPartial):
            raise RuntimeError("display gone")

    with pytest.warns(TraceCallbackWarning, match="StepPartial dropped") as record:
        result = Workflow([Step("write", body)]).run_sync(trace=[broken, kept.append])
    assert "display gone" in str(record[0].message)
    assert result.outputs["write"] in ("one two", "whole")
    partials = [e for e in kept if isinstance(e, StepPartial)]
    assert partials and partials[-1].value in ("one two", "half")
    finished = [i for i, e in enumerate(kept) if isinstance(e, StepFinished)]
    assert finished and max(kept.index(p) for p in partials) < finished[0]


def test_an_async_callback_that_raises_on_any_event_gets_a_warning_per_event() -> None:
    async def broken(event: Any) -> None:
        raise RuntimeError(f"no room for {type(event).__name__}")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = Workflow([Step("write", _calls_partial)]).run_sync(trace=broken)
    assert result.outputs["write"] == "whole"
    dropped = [str(w.message) for w in caught if issubclass(w.category, TraceCallbackWarning)]
    for name in ("RunStarted", "StepStarted", "StepPartial", "StepFinished", "RunSettled"):
        assert any(f"{name} dropped" in text for text in dropped), (name, dropped)


def test_a_partial_callback_failure_loses_no_recorded_output() -> None:
    saved: list[Any] = []

    async def broken(event: Any) -> None:
        if isinstance(event, StepPartial):
            raise RuntimeError("display gone")

    with pytest.warns(TraceCallbackWarning):
        Workflow([Step("a", lambda ctx: 1), Step("write", _calls_partial, ("a",))]).run_sync(
            trace=broken, checkpoint_fn=saved.append)
    assert saved[-1].outputs["a"] == 1 and saved[-1].outputs["write"] == "whole"
