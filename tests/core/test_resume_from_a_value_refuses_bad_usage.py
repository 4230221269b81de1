"""A checkpoint resumed as a value (not parsed from a dict) holds only numbers its dict may hold.

``resume_from=WorkflowCheckpoint(..., cost=TokenUsage(nan))`` (or a negative,
float or bool count, in ``cost`` or in ``step_usage``) skipped the parser:
the run went on paying with a NaN cost, which no budget is ever reached by,
and saved checkpoints that ``from_dict`` then refuses. So did a failure's
``attempts`` and a ``durations`` entry that no dict may hold. Such a value is
refused before any step runs, with a ``ValueError`` naming the field, as its
dict is.
"""

from __future__ import annotations

import asyncio
import dataclasses
from types import MappingProxyType
from typing import Any

import pytest

from ekit_runtime import Step, TokenUsage, Workflow, WorkflowCheckpoint

BAD_COUNTS: list[Any] = [float("nan"), float("inf"), -1, 1.5, True, "3"]


def _workflow(ran: list[str]) -> Workflow:
    def b(context: Any) -> int:
        ran.append("b")
        return 2

    return Workflow([Step("a", lambda ctx: 1), Step("b", b, ("a",))])


def _recorded() -> WorkflowCheckpoint:
    saved: list[WorkflowCheckpoint] = []
    asyncio.run(Workflow([Step("a", lambda ctx: 1)]).run({}, checkpoint_fn=saved.append))
    return dataclasses.replace(saved[-1], graph=None, fingerprint=None)


@pytest.mark.parametrize("bad", BAD_COUNTS, ids=repr)
@pytest.mark.parametrize("where", ["cost", "step_usage"])
def test_a_value_checkpoint_with_a_bad_count_is_refused_before_any_step(where: str, bad: Any) -> None:
    usage = TokenUsage(1, bad, 0)
    if where == "cost":
        checkpoint = dataclasses.replace(_recorded(), cost=usage)
        field = r"cost\.output_tokens"
    else:
        checkpoint = dataclasses.replace(_recorded(), step_usage=MappingProxyType({"a": usage}))
        field = r"step_usage\.a\.output_tokens"
    ran: list[str] = []
    with pytest.raises(ValueError, match=field):
        asyncio.run(_workflow(ran).run({}, resume_from=checkpoint))
    assert ran == []


def test_a_value_checkpoint_whose_cost_is_no_usage_is_refused() -> None:
    checkpoint = dataclasses.replace(_recorded(), cost={"input_tokens": 1})  # type: ignore[arg-type]
    ran: list[str] = []
    with pytest.raises(ValueError, match="cost"):
        asyncio.run(_workflow(ran).run({}, resume_from=checkpoint))
    assert ran == []


def test_a_good_value_checkpoint_still_resumes() -> None:
    checkpoint = dataclasses.replace(_recorded(), cost=TokenUsage(3, 4, 1))
    ran: list[str] = []
    result = asyncio.run(_workflow(ran).run({}, resume_from=checkpoint))
    assert ran == ["b"] and result.cost == TokenUsage(3, 4, 1)


@pytest.mark.parametrize("bad", [float("nan"), -1, 1.5, True], ids=repr)
def test_a_value_checkpoint_whose_failure_has_no_count_of_attempts_is_refused(bad: Any) -> None:
    from ekit_core.checkpoint import FailureRecord

    failures = MappingProxyType({"b": FailureRecord("RuntimeError", "busy", bad)})
    ran: list[str] = []
    with pytest.raises(ValueError, match=r"failures\.b\.attempts"):
        asyncio.run(_workflow(ran).run({}, resume_from=dataclasses.replace(_recorded(), failures=failures)))
    assert ran == []


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 10**400, True, "1"], ids=repr)
def test_a_value_checkpoint_whose_duration_is_no_number_of_seconds_is_refused(bad: Any) -> None:
    ran: list[str] = []
    checkpoint = dataclasses.replace(_recorded(), durations=MappingProxyType({"a": bad}))
    with pytest.raises(ValueError, match=r"durations\.a"):
        asyncio.run(_workflow(ran).run({}, resume_from=checkpoint))
    assert ran == []
