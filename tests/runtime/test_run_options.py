"""Run options a user meets first: timeouts that say what timed out, several
trace callbacks, and arguments that are refused with a clear error."""

from __future__ import annotations

import asyncio
import warnings
from pathlib import Path
from typing import Any

import pytest

from ekit_core import Event, RunSettled, StepStarted
from ekit_runtime import (
    JournalStore,
    RetryPolicy,
    Step,
    StepTimeoutError,
    TraceCallbackWarning,
    Workflow,
    WorkflowCheckpoint,
)


def test_a_timeout_names_the_step_and_its_limit_and_is_retried_as_a_timeout_error() -> None:
    calls: list[int] = []

    async def slow(context: Any) -> str:
        calls.append(1)
        await asyncio.Event().wait()
        return "never"

    policy = RetryPolicy(max_attempts=2, backoff_base=0, retry_on=(TimeoutError,))
    wf = Workflow([Step("slow", slow, timeout=0.01, retry=policy)])
    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(StepTimeoutError, match=r"step 'slow' timed out after 0\.01s") as info:
        wf.run_sync(checkpoint_fn=saved.append)
    assert isinstance(info.value, TimeoutError) and info.value.step == "slow"
    assert len(calls) == 2
    record = saved[-1].failures["slow"]
    assert (record.error_type, record.message) == ("StepTimeoutError", "step 'slow' timed out after 0.01s")


def test_a_steps_own_timeout_error_is_not_taken_for_the_deadline() -> None:
    async def gives_up(context: Any) -> str:
        raise TimeoutError("the API said 504")

    wf = Workflow([Step("s", gives_up, timeout=30)])
    with pytest.raises(TimeoutError, match="504") as info:
        wf.run_sync()
    assert not isinstance(info.value, StepTimeoutError)


def test_trace_takes_a_list_and_a_failing_callback_loses_only_its_own_events() -> None:
    first: list[Event] = []
    second: list[Event] = []

    def broken(event: Event) -> None:
        if isinstance(event, StepStarted):
            raise RuntimeError("exporter down")
        second.append(event)

    wf = Workflow([Step("a", lambda c: 1), Step("b", lambda c: 2, ("a",))])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wf.run_sync(trace=[first.append, broken])
    assert [type(e) for e in first if isinstance(e, StepStarted)] == [StepStarted, StepStarted]
    assert not any(isinstance(e, StepStarted) for e in second)
    assert isinstance(first[-1], RunSettled) and isinstance(second[-1], RunSettled)
    assert sum(issubclass(w.category, TraceCallbackWarning) for w in caught) == 2


def test_bad_options_are_value_errors_that_say_what_to_do(tmp_path: Path) -> None:
    wf = Workflow([Step("a", lambda c: 1)])
    with pytest.raises(ValueError, match=r"unknown run option\(s\): max_concurency"):
        wf.run_sync(max_concurency=2)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match=r"trace\[1\] must be callable"):
        wf.run_sync(trace=[print, 3])  # type: ignore[list-item]
    store = JournalStore(tmp_path / "run.jsonl")
    with pytest.raises(ValueError, match=r"pass store.load\(\), not the store"):
        wf.run_sync(resume_from=store)  # type: ignore[arg-type]
