"""``keep_last`` bounds everything a long loop's checkpoint holds of its iterations.

Compaction let go of the outputs, usage and durations of old iterations, but
not their failure records (an iteration retried once keeps one) nor their
questions and answers: a long-lived agent whose iterations are flaky, or ask
a person, grew its checkpoint by one record per iteration for ever.
"""

from __future__ import annotations

import json
from typing import Any

from ekit_runtime import Done, Repeat, RetryPolicy, RunWaiting, Step, Workflow, WorkflowCheckpoint, ask


def test_compaction_lets_go_of_old_iterations_failure_records() -> None:
    failed: set[int] = set()

    def agent(ctx: Any) -> Any:
        n = ctx["agent"].number
        if n not in failed:
            failed.add(n)
            raise ConnectionError("flaky")
        return Done(n) if n == 30 else n

    workflow = Workflow([Step("agent", agent, repeat=Repeat(40, keep_last=2),
                              retry=RetryPolicy(max_attempts=2, backoff_base=0))])
    final = workflow.run_sync().checkpoint
    assert final.compacted == {"agent": 28}
    assert sorted(final.failures) == ["agent#29", "agent#30"]


def test_compaction_lets_go_of_old_iterations_questions() -> None:
    def agent(ctx: Any) -> Any:
        n = ctx["agent"].number
        reply = ask(f"go on after {n}?")
        return Done(reply) if n == 6 else n

    workflow = Workflow([Step("agent", agent, repeat=Repeat(9, keep_last=1))])
    saved: list[WorkflowCheckpoint] = []
    answers: dict[str, Any] | None = None
    for k in range(1, 8):
        try:
            result = workflow.run_sync(
                resume_from=json.loads(json.dumps(saved[-1].to_dict())) if saved else None,
                answers=answers, checkpoint_fn=saved.append)
            break
        except RunWaiting:
            answers = {f"agent#{k}": "yes"}
    assert result.outputs["agent"] == "yes"
    assert sorted(result.checkpoint.asked) == ["agent#6"]
