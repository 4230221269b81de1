"""A bump or a rewind of a mapped step lets go of the items an early cutoff had set aside.

What users rely on: after a resume whose new upstream failed (so that the
mapped step's items wait, set aside, for the cutoff), bumping the mapped
step's own ``version``, rewinding it or one of its items, or changing
another input of it, runs its items with the current code: the result is
what a fresh run of the current code gives, never the old code's outputs.
What nothing changed stays set aside, so an unchanged item still costs
nothing.
"""

from __future__ import annotations

from typing import Any

import pytest

from ekit_core import WorkflowCheckpoint, rewind
from ekit_runtime import Step, Workflow


def _build(calls: list[str], *, upstream: str = "1", mapped: str = "1", other: str = "1",
           times: int = 10, fail: bool = False) -> Workflow:
    def split(ctx: Any) -> list[int]:
        if fail:
            raise RuntimeError("the new split is broken")
        return [1, 2, 3]

    def scale(ctx: Any) -> int:
        calls.append(f"m {ctx['u']}")
        return ctx["u"] * times + ctx["x"]

    def chained(ctx: Any) -> int:
        calls.append(f"n {ctx['m']}")
        return ctx["m"] + 1

    return Workflow([
        Step("u", split, version=upstream),
        Step("x", lambda ctx: 0 if other == "1" else 1000, version=other),
        Step("m", scale, ("u", "x"), map_over="u", version=mapped, context="dependencies"),
        Step("n", chained, ("m",), map_over="m", context="dependencies"),
    ])


def _items_set_aside() -> WorkflowCheckpoint:
    """The last checkpoint of a resume whose bumped upstream failed: m's items wait aside."""
    first = _build([]).run_sync()
    assert first.checkpoint is not None
    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(RuntimeError):
        _build([], upstream="2", fail=True).run_sync(resume_from=first.checkpoint.to_dict(),
                                                     checkpoint_fn=saved.append)
    aside = saved[-1]
    assert {"m[0]", "m[1]", "m[2]", "n[0]"} <= set(aside.superseded)
    return WorkflowCheckpoint.from_dict(aside.to_dict())


def test_bumping_the_mapped_step_runs_its_items_with_the_new_code() -> None:
    calls: list[str] = []
    result = _build(calls, upstream="2", mapped="2", times=100).run_sync(
        resume_from=_items_set_aside().to_dict())
    assert result.outputs["m"] == [100, 200, 300]
    assert result.outputs["n"] == [101, 201, 301]
    assert sorted(calls) == ["m 1", "m 2", "m 3", "n 100", "n 200", "n 300"]


def test_changing_another_input_of_the_mapped_step_runs_its_items() -> None:
    calls: list[str] = []
    result = _build(calls, upstream="2", other="2").run_sync(resume_from=_items_set_aside().to_dict())
    assert result.outputs["m"] == [1010, 1020, 1030]
    assert len(calls) == 6


def test_rewinding_the_mapped_step_runs_its_items_with_the_current_code() -> None:
    calls: list[str] = []
    workflow = _build(calls, upstream="2", times=100)  # m's code changed, its tag forgotten
    result = workflow.run_sync(resume_from=rewind(workflow, _items_set_aside(), "m").to_dict())
    assert result.outputs["m"] == [100, 200, 300]
    assert sorted(calls) == ["m 1", "m 2", "m 3", "n 100", "n 200", "n 300"]


def test_rewinding_one_set_aside_item_runs_that_item_and_its_chain_only() -> None:
    calls: list[str] = []
    workflow = _build(calls, upstream="2", times=100)
    result = workflow.run_sync(resume_from=rewind(workflow, _items_set_aside(), "m[1]").to_dict())
    assert result.outputs["m"] == [10, 200, 30]
    assert sorted(calls) == ["m 2", "n 200"]


@pytest.mark.parametrize("chained", ["n", "n[0]"])
def test_rewinding_the_chained_step_keeps_the_first_stage_aside(chained: str) -> None:
    calls: list[str] = []
    workflow = _build(calls, upstream="2")
    result = workflow.run_sync(resume_from=rewind(workflow, _items_set_aside(), chained).to_dict())
    assert result.outputs["n"] == [11, 21, 31]
    assert all(c.startswith("n ") for c in calls) and calls


def test_what_nothing_changed_stays_aside_and_costs_nothing() -> None:
    calls: list[str] = []
    result = _build(calls, upstream="2").run_sync(resume_from=_items_set_aside().to_dict())
    assert result.outputs["n"] == [11, 21, 31] and calls == []
