"""A loop whose body is a child workflow and never says it is done stops, by name, never hangs.

What users rely on: its cap fails it with ``LoopError`` naming the loop; the
run's budget, reached by the body's model calls, stops it with
``BudgetExceeded`` naming the loop; a resume with a larger budget pays for no
recorded body step again.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from ekit_core import LoopError, TokenUsage
from ekit_runtime import BudgetExceeded, Done, PatternResult, Repeat, Step, Workflow, WorkflowCheckpoint


def _agent(calls: list[str], ends_at: int | None) -> Workflow:
    def model(ctx: Any) -> Any:
        k = ctx["agent"].number
        calls.append(f"model#{k}")
        return PatternResult([k, k], cost=TokenUsage(10, 0, 1))

    def tool(ctx: Any) -> int:
        calls.append(f"tool#{ctx['agent'].number}")
        return int(ctx["model"]) + 1

    def fold(ctx: Any) -> Any:
        k = ctx["agent"].number
        calls.append(f"fold#{k}")
        return Done(k) if k == ends_at else sum(ctx["tool"])

    body = Workflow([Step("model", model), Step("tool", tool, ("model",), map_over="model"),
                     Step("fold", fold, ("tool",))])
    return Workflow([Step("agent", child=body, repeat=Repeat(4, keep_last=2)),
                     Step("z", lambda ctx: ctx["agent"], ("agent",))])


def test_a_body_loop_past_its_cap_fails_naming_it() -> None:
    calls: list[str] = []
    with pytest.raises(LoopError, match=r"'agent' did not end within repeat=4 iterations"):
        _agent(calls, None).run_sync()
    assert calls[-1] == "fold#4" and "model#5" not in calls


def test_a_budget_stops_a_body_loop_by_name_and_a_resume_pays_nothing_again() -> None:
    calls: list[str] = []
    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(BudgetExceeded, match="'agent'") as caught:
        _agent(calls, 4).run_sync(budget=TokenUsage(25, 0, 0), checkpoint_fn=saved.append)
    assert caught.value.step == "agent"
    assert "model#4" not in calls
    before = list(calls)
    calls.clear()
    result = _agent(calls, 4).run_sync(resume_from=json.loads(json.dumps(saved[-1].to_dict())),
                                       budget=TokenUsage(1000, 0, 0))
    assert result.outputs["z"] == 4
    assert not set(calls) & set(before), f"paid again: {sorted(set(calls) & set(before))}"
    assert result.checkpoint is not None and result.checkpoint.cost.input_tokens == 40
