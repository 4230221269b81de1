"""A recorded step's output is never taken for an iteration of a loop.

A graph without run-time shapes may declare ``agent`` and ``agent#1`` side
by side (names are only checked against items and iterations once a graph
has shapes). Made a loop later (``allow_graph_change``), ``agent``'s
iteration 1 is not that old step: a resume took its output for iteration 1
recorded, never ran iteration 1, and handed the old step's output to
iteration 2 as the state the loop carries.
"""

from __future__ import annotations

import json
from typing import Any

from ekit_runtime import Done, Repeat, Step, Workflow


def test_an_old_step_named_like_an_iteration_is_not_taken_for_one_after_a_graph_change() -> None:
    before = Workflow([Step("agent", lambda ctx: "plain"),
                       Step("agent#1", lambda ctx: "old step", ("agent",))])
    recorded = json.loads(json.dumps(before.run_sync().checkpoint.to_dict()))
    seen: list[tuple[int, Any]] = []

    def agent(ctx: Any) -> Any:
        it = ctx["agent"]
        seen.append((it.number, it.previous))
        return Done(it.number) if it.number == 3 else it.number

    after = Workflow([Step("agent", agent, repeat=Repeat(5))])
    result = after.run_sync(resume_from=recorded, allow_graph_change=True)
    assert seen == [(1, None), (2, 1), (3, 2)]
    assert result.outputs["agent"] == 3
