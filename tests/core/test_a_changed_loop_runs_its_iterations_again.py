"""A loop whose work changed while it ran starts again from its first iteration.

A resume from the middle of a loop (some iterations recorded, the loop not)
after a version bump of the loop, or of a step it needs (which so runs again
with a new output), must not keep the iterations the old code or the old
input made: an uninterrupted run of the new code would have made none of
them, and the loop's output would mix the two. As a mapped step's items
(``test_version_bump_beside_skips``), they go, compacted ones too.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from ekit_core import LoopError, WorkflowCheckpoint
from ekit_runtime import Done, Repeat, Step, Workflow


def _workflow(calls: list[tuple[int, int]], *, a_version: str = "1", a_output: int = 1,
              loop_version: str | None = None, keep: int | None = None) -> Workflow:
    def agent(ctx: Any) -> Any:
        n = ctx["agent"].number
        calls.append((n, ctx["a"]))
        state = (ctx["agent"].previous or 0) + ctx["a"]
        return Done(state) if n == 5 else state

    return Workflow([
        Step("a", lambda ctx: a_output, version=a_version),
        Step("agent", agent, ("a",), repeat=Repeat(9, keep_last=keep), version=loop_version),
        Step("z", lambda ctx: ["saw", ctx["agent"]], ("agent",)),
    ])


def _middle(keep: int | None) -> dict[str, Any]:
    """The checkpoint saved once iteration 4 is recorded (the loop is not), through JSON."""
    saved: list[WorkflowCheckpoint] = []
    _workflow([], keep=keep).run_sync(checkpoint_fn=saved.append)
    middle = next(cp for cp in saved if "agent#4" in cp.outputs)
    assert "agent" not in middle.outputs
    return json.loads(json.dumps(middle.to_dict()))


@pytest.mark.parametrize("keep", [None, 2])
def test_a_version_bump_of_the_loop_mid_loop_runs_every_iteration_again(keep: int | None) -> None:
    calls: list[tuple[int, int]] = []
    result = _workflow(calls, loop_version="2", keep=keep).run_sync(resume_from=_middle(keep))
    assert [n for n, _a in calls] == [1, 2, 3, 4, 5], "iterations the old code made were kept"
    assert result.outputs["z"] == ["saw", 5]


@pytest.mark.parametrize("keep", [None, 2])
def test_a_step_the_loop_needs_running_again_mid_loop_runs_every_iteration_again(
        keep: int | None) -> None:
    calls: list[tuple[int, int]] = []
    result = _workflow(calls, a_version="2", a_output=3, keep=keep).run_sync(
        resume_from=_middle(keep))
    assert calls == [(k, 3) for k in range(1, 6)], "iterations made from the old input were kept"
    assert result.outputs["z"] == ["saw", 15]


@pytest.mark.parametrize("keep", [None, 2])
def test_an_unchanged_resume_mid_loop_runs_only_the_rest(keep: int | None) -> None:
    calls: list[tuple[int, int]] = []
    result = _workflow(calls, keep=keep).run_sync(resume_from=_middle(keep))
    assert calls == [(5, 1)]
    assert result.outputs["z"] == ["saw", 5]


@pytest.mark.parametrize("keep", [None, 2])
def test_raising_the_cap_after_a_loop_error_pays_for_no_iteration_again(keep: int | None) -> None:
    calls: list[tuple[int, int]] = []

    def agent(ctx: Any) -> Any:
        n = ctx["agent"].number
        calls.append((n, ctx["a"]))
        return Done(n) if n == 5 else n

    def workflow(cap: int) -> Workflow:
        return Workflow([Step("a", lambda ctx: 1),
                         Step("agent", agent, ("a",), repeat=Repeat(cap, keep_last=keep))])

    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(LoopError):
        workflow(3).run_sync(checkpoint_fn=saved.append)
    failed = json.loads(json.dumps(saved[-1].to_dict()))
    result = workflow(9).run_sync(resume_from=failed, allow_graph_change=True)
    assert [n for n, _a in calls] == [1, 2, 3, 4, 5]
    assert result.outputs["agent"] == 5
