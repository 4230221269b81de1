"""A checkpoint's ``skipped`` is checked against the graph, with run-time shapes or without.

A resume acts on recorded skips, so each is a claim a run must be able to
have made: it names a declared step, or an item the recorded outputs make;
the step has no output, no recorded step or item needs it, and something
caused it (its condition, decided once its inputs were settled, or a skipped
step it needs). A claim no run could make is refused with a
``CheckpointError`` naming the field and the step, before any step runs.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from ekit_core import CheckpointError
from ekit_runtime import Step, Workflow

ran: list[str] = []


def _note(name: str, output: Any = None) -> Any:
    def body(ctx: Any) -> Any:
        ran.append(name)
        return name if output is None else output

    return body


def _no(ctx: Any) -> bool:
    return False


CHAIN = Workflow([Step("a", _note("a")), Step("b", _note("b"), ("a",)), Step("c", _note("c"), ("b",))])


def _recorded(workflow: Workflow) -> dict[str, Any]:
    result = workflow.run_sync()
    assert result.checkpoint is not None
    ran.clear()
    return copy.deepcopy(result.checkpoint.to_dict())


def _refused(workflow: Workflow, data: dict[str, Any], match: str) -> None:
    with pytest.raises(CheckpointError, match=match) as caught:
        workflow.run_sync(resume_from=data)
    assert caught.value.field == "skipped"
    assert ran == []


def test_a_graph_without_shapes_refuses_a_step_both_recorded_and_skipped() -> None:
    data = _recorded(CHAIN)
    data["skipped"] = {"b": "forged"}
    _refused(CHAIN, data, "'b' as skipped and its output too")


def test_a_graph_without_shapes_refuses_a_skip_of_no_step() -> None:
    data = _recorded(CHAIN)
    data["skipped"] = {"ghost": "forged"}
    _refused(CHAIN, data, "'ghost', which is no step or item")


def test_a_graph_without_shapes_refuses_a_deleted_output_marked_skipped() -> None:
    # Accepted, b would run after c, which needs it, was recorded.
    data = _recorded(CHAIN)
    del data["outputs"]["b"]
    data["skipped"] = {"b": "forged"}
    _refused(CHAIN, data, "'b' as skipped, yet the output of 'c'")


def test_a_graph_without_conditions_refuses_any_skip() -> None:
    data = _recorded(CHAIN)
    del data["outputs"]["b"], data["outputs"]["c"]
    data["skipped"] = {"b": "forged", "c": "forged"}
    _refused(CHAIN, data, "'b' as skipped, yet it has no condition")


def test_the_same_holds_for_a_checkpoint_with_no_fingerprint() -> None:
    data = _recorded(CHAIN)
    for key in ("fingerprint", "graph_steps", "graph_needs"):
        data.pop(key, None)
    data["skipped"] = {"b": "forged"}
    _refused(CHAIN, data, "'b' as skipped and its output too")


# u's output is mapped by m, which also needs g (its condition, asked after u, is false):
# m's items are made, then skipped with m.
UNDER_A_SKIP = Workflow([
    Step("u", _note("u", [1, 2])),
    Step("g", _note("g"), ("u",), when=_no),
    Step("m", _note("m"), ("u", "g"), map_over="u"),
])


def test_forged_item_skips_under_a_skipped_mapped_step_are_refused() -> None:
    data = _recorded(UNDER_A_SKIP)
    assert "m" in data["skipped"]
    data["skipped"]["m[7]"] = "forged"
    _refused(UNDER_A_SKIP, data, "'m\\[7\\]', which is no step or item")
    data = _recorded(UNDER_A_SKIP)
    data["outputs"]["u"] = "no list"  # no items at all, then
    data["skipped"]["m[5]"] = "forged"
    _refused(UNDER_A_SKIP, data, "'m\\[[015]\\]', which is no step or item")


# Every item of m is skipped by m's condition; m collects [].
ALL_ITEMS_SKIPPED = Workflow([
    Step("u", _note("u", [1, 2, 3])),
    Step("m", _note("m"), ("u",), map_over="u", when=_no),
    Step("d", _note("d"), ("m",)),
])


def test_an_upstream_shrunk_under_items_recorded_only_as_skipped_is_refused() -> None:
    data = _recorded(ALL_ITEMS_SKIPPED)
    assert set(data["skipped"]) == {"m[0]", "m[1]", "m[2]"} and data["outputs"]["m"] == []
    data["outputs"]["u"] = [1]
    _refused(ALL_ITEMS_SKIPPED, data, "'m\\[1\\]', which is no step or item")
    # The same under a mapped step skipped as a whole, whose items a resume lets go.
    data = _recorded(UNDER_A_SKIP)
    assert {"m", "m[0]", "m[1]"} <= set(data["skipped"])
    data["outputs"]["u"] = [1]
    _refused(UNDER_A_SKIP, data, "'m\\[1\\]', which is no step or item")


def test_a_skip_by_a_condition_whose_inputs_are_not_recorded_is_refused() -> None:
    workflow = Workflow([Step("a", _note("a")), Step("b", _note("b"), ("a",), when=_no)])
    data = _recorded(workflow)
    del data["outputs"]["a"]
    _refused(workflow, data, "'b' as skipped by its condition, yet not the output of 'a'")


def test_an_unconditional_step_skipped_beside_recorded_inputs_is_refused() -> None:
    workflow = Workflow([Step("a", _note("a")), Step("g", _note("g"), when=_no),
                         Step("b", _note("b"), ("a",))])
    data = _recorded(workflow)
    del data["outputs"]["b"]
    data["skipped"]["b"] = "forged"
    _refused(workflow, data, "'b' as skipped, yet it has no condition")


@pytest.mark.parametrize("workflow", [UNDER_A_SKIP, ALL_ITEMS_SKIPPED], ids=["under-a-skip", "all-skipped"])
def test_the_runs_own_checkpoints_resume_running_nothing(workflow: Workflow) -> None:
    data = _recorded(workflow)
    result = workflow.run_sync(resume_from=data)
    assert ran == [] and result.checkpoint is not None
    again = result.checkpoint.to_dict()
    assert again["outputs"] == data["outputs"]
    # (The items of a mapped step skipped as a whole are let go by a resume.)
    assert {k for k in data["skipped"] if "[" not in k} <= set(again["skipped"])
