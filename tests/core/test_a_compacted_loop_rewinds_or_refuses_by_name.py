"""Rewinding a run whose loop compacted its oldest iterations (``keep_last``).

A rewind of any step of such a run (one downstream of the loop, the loop, what
it needs, a kept iteration) lets go of what it names and what needs it, and a
resume runs exactly that again (the first iteration kept, whose input was
compacted, runs again with the whole loop). A compacted iteration has no
output to let go of: a rewind to it is a ``ValueError`` naming it and the
loop, never a ``KeyError`` from inside the core.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from ekit_core import WorkflowCheckpoint, rewind
from ekit_runtime import Done, Repeat, Step, Workflow


def _run() -> tuple[Workflow, list[int], WorkflowCheckpoint]:
    calls: list[int] = []

    def agent(ctx: Any) -> Any:
        n = ctx["agent"].number
        calls.append(n)
        return Done(n * 10) if n == 5 else n * 10

    workflow = Workflow([
        Step("a", lambda ctx: 1),
        Step("agent", agent, ("a",), repeat=Repeat(9, keep_last=2)),
        Step("z", lambda ctx: ["saw", ctx["agent"]], ("agent",)),
    ])
    final = workflow.run_sync().checkpoint
    assert final.compacted == {"agent": 3}
    assert sorted(n for n in final.outputs if "#" in n) == ["agent#4", "agent#5"]
    calls.clear()
    return workflow, calls, final


def _json(cp: WorkflowCheckpoint) -> dict[str, Any]:
    return json.loads(json.dumps(cp.to_dict()))


@pytest.mark.parametrize(("target", "runs_again"), [
    ("z", []),
    ("agent#5", [5]),
    ("agent#4", [1, 2, 3, 4, 5]),  # (its input, agent#3, was compacted: the loop starts again)
    ("agent", [1, 2, 3, 4, 5]),
    ("a", [1, 2, 3, 4, 5]),
])
def test_a_rewind_in_a_compacted_run_runs_exactly_what_it_let_go_of(
        target: str, runs_again: list[int]) -> None:
    workflow, calls, final = _run()
    rewound = rewind(workflow, final, target)
    assert target not in rewound.outputs
    result = workflow.run_sync(resume_from=_json(rewound))
    assert calls == runs_again
    assert result.outputs["z"] == ["saw", 50]


@pytest.mark.parametrize("target", ["agent#1", "agent#3"])
def test_a_rewind_to_a_compacted_iteration_is_refused_by_name(
        target: str) -> None:
    workflow, _calls, final = _run()
    with pytest.raises(ValueError, match=rf"{target}.*compacted.*loop 'agent'"):
        rewind(workflow, final, target)
