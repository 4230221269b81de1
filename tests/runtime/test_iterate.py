"""Driving a run step by step with ``iterate()``, and ``run_sync`` from plain code."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import warnings
from typing import Any

import pytest

from ekit_core import State, TokenUsage, WorkflowCheckpoint
from ekit_runtime import PatternResult, Step, Workflow


class Pipeline:
    """a -> b -> c, plus a root ``side`` that blocks until released (or cancelled)."""

    def __init__(self) -> None:
        self.release_side = asyncio.Event()
        self.cancelled: list[str] = []
        self.calls: list[str] = []

    def step(self, name: str, *, blocks: bool = False) -> Any:
        async def run(context: dict[str, Any]) -> PatternResult[str]:
            self.calls.append(name)
            try:
                if blocks:
                    await self.release_side.wait()
                else:
                    await asyncio.sleep(0)
            except asyncio.CancelledError:
                self.cancelled.append(name)
                raise
            return PatternResult(name.upper(), cost=TokenUsage(5, 5, 1))

        return run

    def workflow(self) -> Workflow:
        return Workflow(
            [
                Step("a", self.step("a")),
                Step("b", self.step("b"), depends_on=("a",)),
                Step("c", self.step("c"), depends_on=("b",)),
                Step("side", self.step("side", blocks=True)),
            ]
        )


def _others() -> set[asyncio.Task[Any]]:
    return asyncio.all_tasks() - {asyncio.current_task()}  # type: ignore[operator]


def test_iterate_yields_each_new_state_after_its_checkpoint() -> None:
    async def main() -> tuple[list[State], list[WorkflowCheckpoint]]:
        p = Pipeline()
        p.release_side.set()
        saved: list[WorkflowCheckpoint] = []
        states: list[State] = []
        async with contextlib.aclosing(p.workflow().iterate(checkpoint_fn=saved.append)) as run:
            async for state in run:
                # The checkpoint of this state was handed over before it was yielded.
                assert saved[-1].step_index == state.completed
                states.append(state)
        assert not _others()
        return states, saved

    states, saved = asyncio.run(main())
    completed = [s.completed for s in states]
    assert completed == sorted(completed) and completed[-1] == 4
    assert states[-1].outcome == "finished"
    assert len(saved) == len(states)


def test_breaking_out_cancels_cleanly_with_a_final_checkpoint() -> None:
    async def main() -> None:
        p = Pipeline()
        saved: list[WorkflowCheckpoint] = []
        async with contextlib.aclosing(p.workflow().iterate(checkpoint_fn=saved.append)) as run:
            async for state in run:
                if state.is_done("b"):
                    handed_before_stop = len(saved)
                    break
        # Leaving the loop: the blocked step was cancelled, nothing is left
        # running, and one more checkpoint was handed over.
        assert not _others()
        assert "side" in p.cancelled and set(p.cancelled) <= {"c", "side"}
        assert len(saved) == handed_before_stop + 1
        final = saved[-1]
        assert set(final.outputs) >= {"a", "b"} and "side" not in final.outputs
        assert final.step_index == len(final.outputs)
        # The final checkpoint resumes where the stop left off.
        p.release_side.set()
        p.calls.clear()
        result = await p.workflow().run(resume_from=final)
        assert sorted(p.calls) == sorted({"c", "side"} - set(final.outputs))
        assert dict(result.outputs) == {"a": "A", "b": "B", "c": "C", "side": "SIDE"}

    asyncio.run(main())


def test_an_exception_in_the_loop_body_also_winds_down() -> None:
    async def main() -> None:
        p = Pipeline()
        saved: list[WorkflowCheckpoint] = []
        with pytest.raises(KeyError, match="stop here"):
            async with contextlib.aclosing(p.workflow().iterate(checkpoint_fn=saved.append)) as run:
                async for _ in run:
                    raise KeyError("stop here")
        assert not _others()
        assert "side" in p.cancelled
        assert saved[-1].step_index >= 1

    asyncio.run(main())


def test_break_without_aclosing_still_saves_before_asyncio_run_returns() -> None:
    saved: list[WorkflowCheckpoint] = []
    p: Pipeline | None = None

    async def main() -> None:
        nonlocal p
        p = Pipeline()
        async for state in p.workflow().iterate(checkpoint_fn=saved.append):
            if state.is_done("a"):
                break

    asyncio.run(main())
    # asyncio.run finalises the abandoned generator before it returns.
    assert p is not None and "side" in p.cancelled and set(p.cancelled) <= {"b", "side"}
    assert "a" in saved[-1].outputs and "side" not in saved[-1].outputs


def test_run_sync_runs_from_plain_code() -> None:
    p = Pipeline()
    wf = Workflow([Step("a", p.step("a")), Step("b", lambda c: c["a"] + "!", depends_on=("a",))])
    result = wf.run_sync({"lang": "en"})
    assert dict(result.outputs) == {"a": "A", "b": "A!"}
    assert result.checkpoint is not None and result.checkpoint.context == {"lang": "en"}


def test_run_sync_refuses_inside_a_running_loop_without_leaking_a_coroutine() -> None:
    wf = Workflow([Step("a", lambda c: 1)])

    async def main() -> None:
        with pytest.raises(RuntimeError, match=r"running event loop.*await workflow\.run"):
            wf.run_sync({"x": 1}, max_concurrency=2)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(main())
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [
        str(w.message) for w in caught
    ]


def test_run_sync_passes_bad_arguments_through_as_value_errors() -> None:
    wf = Workflow([Step("a", lambda c: 1)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="max_concurrency"):
            wf.run_sync(max_concurrency=0)
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
