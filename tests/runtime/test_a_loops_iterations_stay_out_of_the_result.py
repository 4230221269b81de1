"""A result's outputs are its steps': a loop's iterations stay in the checkpoint.

So it was once a loop ran; but resumed with ``only=`` naming other steps (the
loop held, never grown), the iterations it had recorded showed in
``result.outputs`` as if ``agent#2`` were a step. A mapped step's items never
do.
"""

from __future__ import annotations

import json
from typing import Any

from ekit_runtime import Done, Repeat, Step, Workflow, WorkflowCheckpoint


def test_a_held_loops_recorded_iterations_stay_out_of_the_result() -> None:
    def agent(ctx: Any) -> Any:
        n = ctx["agent"].number
        return Done(n) if n == 5 else n

    workflow = Workflow([Step("a", lambda ctx: 0), Step("b", lambda ctx: 1),
                         Step("agent", agent, ("a",), repeat=Repeat(9))])
    saved: list[WorkflowCheckpoint] = []
    workflow.run_sync(checkpoint_fn=saved.append, max_concurrency=1)
    middle = next(cp for cp in saved if "agent#3" in cp.outputs and "agent" not in cp.outputs)
    result = workflow.run_sync(resume_from=json.loads(json.dumps(middle.to_dict())), only=["b"])
    assert not [n for n in result.outputs if "#" in n], dict(result.outputs)
    assert "agent#3" in result.checkpoint.outputs
