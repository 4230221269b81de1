"""A loop that does not end is stopped by the run's budget with a reason naming the loop.

The core's halt names the loop whose iteration reached the budget; the
``BudgetExceeded`` a user reads said only "token budget reached ... N step(s)
completed" (iterations counted as steps), so a user could not tell which step
ran away. A resume with a larger budget pays for no recorded iteration again.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from ekit_core import TokenUsage
from ekit_runtime import BudgetExceeded, Done, PatternResult, Repeat, Step, Workflow, WorkflowCheckpoint


def test_a_budget_reached_mid_loop_names_the_loop_and_a_resume_pays_no_iteration_again() -> None:
    calls: list[int] = []

    def agent(ctx: Any) -> Any:
        n = ctx["agent"].number
        calls.append(n)
        result = PatternResult(n, cost=TokenUsage(10, 0, 1))
        return Done(result) if n == 6 else result

    workflow = Workflow([Step("a", lambda ctx: 0),
                         Step("agent", agent, ("a",), repeat=Repeat(50, keep_last=2))])
    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(BudgetExceeded, match=r"'agent'") as caught:
        workflow.run_sync(budget=TokenUsage(35, 0, 0), checkpoint_fn=saved.append)
    assert caught.value.step == "agent"
    assert calls == [1, 2, 3, 4]
    result = workflow.run_sync(resume_from=json.loads(json.dumps(saved[-1].to_dict())),
                               budget=TokenUsage(1000, 0, 0))
    assert calls == [1, 2, 3, 4, 5, 6]
    assert result.outputs["agent"] == 6 and result.checkpoint.cost.input_tokens == 60


def test_a_loop_that_ends_on_the_iteration_reaching_the_budget_is_not_said_to_run_on() -> None:
    def agent(ctx: Any) -> Any:
        n = ctx["agent"].number
        result = PatternResult(n, cost=TokenUsage(10, 0, 1))
        return Done(result) if n == 4 else result

    workflow = Workflow([Step("agent", agent, repeat=Repeat(9)), Step("z", lambda ctx: 1, ("agent",))])
    with pytest.raises(BudgetExceeded) as caught:
        workflow.run_sync(budget=TokenUsage(40, 0, 0))
    assert caught.value.checkpoint.outputs["agent"] == 4
    assert "has not ended" not in str(caught.value)
