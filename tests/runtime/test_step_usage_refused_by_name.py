"""A step's reported usage is counts a checkpoint can hold, or the step fails saying so.

A ``PatternResult`` whose ``cost`` held NaN, a negative count, a float, a
bool or text was accepted: the run finished (a NaN budget is never
reached), and then its own checkpoint was refused on resume ("must be a
non-negative int"), stranding everything it paid for; text crashed the
run with a bare ``TypeError``. Such a result is now refused where it is
made, with a ``ValueError`` naming the field, so the attempt fails like any
step error (the run raises it); an object merely shaped like a ``PatternResult`` whose counts
are not usage is an output like any other. Every checkpoint the run saves
loads again.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from ekit_runtime import PatternResult, Step, TokenUsage, Workflow, WorkflowCheckpoint

BAD = [
    TokenUsage(float("nan"), 0, 0),  # type: ignore[arg-type]
    TokenUsage(0, -5, 0),
    TokenUsage(0, 0, 1.5),  # type: ignore[arg-type]
    TokenUsage(True, 0, 0),
    TokenUsage(0, float("inf"), 0),  # type: ignore[arg-type]
    TokenUsage("3", 0, 0),  # type: ignore[arg-type]
    None,
    {"input_tokens": 1},
]


@pytest.mark.parametrize("cost", BAD, ids=repr)
def test_a_pattern_result_with_a_bad_cost_is_refused_naming_the_field(cost: Any) -> None:
    with pytest.raises(ValueError, match=r"PatternResult\.cost"):
        PatternResult("x", cost=cost)


def _reloads(saved: list[WorkflowCheckpoint]) -> None:
    for checkpoint in saved:
        WorkflowCheckpoint.from_dict(json.loads(json.dumps(checkpoint.to_dict())))


@pytest.mark.parametrize("cost", BAD, ids=repr)
def test_a_step_reporting_a_bad_cost_fails_and_every_checkpoint_loads(cost: Any) -> None:
    def spend(context: Any) -> Any:
        return PatternResult("x", cost=cost)

    saved: list[WorkflowCheckpoint] = []
    workflow = Workflow([Step("a", lambda ctx: 1), Step("b", spend, ("a",))])
    with pytest.raises(ValueError, match=r"PatternResult\.cost"):  # the step's own error, as any
        asyncio.run(workflow.run({}, checkpoint_fn=saved.append))
    assert saved and saved[-1].outputs["a"] == 1
    _reloads(saved)


class _Counts:
    def __init__(self, input_tokens: Any) -> None:
        self.input_tokens, self.output_tokens, self.llm_calls = input_tokens, 0, 0


class _Shaped:
    """Shaped like ExecutionKit's PatternResult: a ``value`` and a ``cost``."""

    def __init__(self, input_tokens: Any) -> None:
        self.value, self.cost = "v", _Counts(input_tokens)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Shaped) and vars(other) == vars(self)


def test_an_object_shaped_like_a_pattern_result_with_negative_counts_is_no_usage() -> None:
    from ekit_runtime.step import split_result

    assert split_result(_Shaped(7)) == ("v", TokenUsage(7, 0, 0))
    shaped = _Shaped(-7)
    assert split_result(shaped) == (shaped, TokenUsage())


def test_a_good_cost_is_still_counted() -> None:
    saved: list[WorkflowCheckpoint] = []
    workflow = Workflow([Step("a", lambda ctx: PatternResult("x", cost=TokenUsage(3, 4, 1)))])
    result = asyncio.run(workflow.run({}, checkpoint_fn=saved.append))
    assert result.cost == TokenUsage(3, 4, 1)
    _reloads(saved)
