"""Per-step usage is sparse: a step that spent nothing has no ``step_usage`` entry."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import TokenUsage, WorkflowCheckpoint, replay
from ekit_core.ledger import Ledger
from ekit_runtime import PatternResult, Step, Workflow


def _spending(usages: dict[str, TokenUsage | None]) -> Workflow:
    """A chain whose step ``n`` returns ``PatternResult`` with ``usages[n]``, or a bare value for None."""

    def make(name: str, usage: TokenUsage | None) -> Any:
        async def run(context: Any) -> Any:
            return name if usage is None else PatternResult(name, cost=usage)

        return run

    names = list(usages)
    return Workflow([
        Step(n, make(n, usages[n]), (names[i - 1],) if i else ()) for i, n in enumerate(names)
    ])


usage_values = st.none() | st.builds(
    TokenUsage, st.integers(0, 3), st.integers(0, 3), st.integers(0, 2)
)


@settings(max_examples=60, deadline=None)
@given(st.lists(usage_values, min_size=1, max_size=8))
def test_only_steps_that_spent_something_have_an_entry_and_they_add_up(
    spent: list[TokenUsage | None],
) -> None:
    usages = {f"s{i}": u for i, u in enumerate(spent)}
    saved: list[WorkflowCheckpoint] = []
    result = _spending(usages).run_sync(checkpoint_fn=saved.append)
    final = saved[-1]
    expected = {n: u for n, u in usages.items() if u is not None and not u.is_zero()}
    assert dict(final.step_usage) == expected
    total = TokenUsage()
    for usage in expected.values():
        total = total + usage
    assert final.cost == result.cost == total
    # Written and read back, the checkpoint is the same value, and still sparse.
    data = json.loads(json.dumps(final.to_dict()))
    assert data["step_usage"] == {n: u.to_dict() for n, u in expected.items()}
    assert WorkflowCheckpoint.from_dict(data) == final


def test_a_checkpoint_with_zero_entries_keeps_them_on_resume() -> None:
    # Checkpoints written before usage was sparse list every step, zeros included:
    # a resume keeps those entries, so checkpoints of one run only grow.
    usages: dict[str, TokenUsage | None] = {"a": None, "b": TokenUsage(5, 1, 1), "c": None}
    workflow = _spending(usages)
    first: list[WorkflowCheckpoint] = []
    workflow.run_sync(checkpoint_fn=first.append)
    old = first[1].to_dict()
    old["step_usage"] = {"a": TokenUsage().to_dict(), "b": TokenUsage(5, 1, 1).to_dict()}
    resumed: list[WorkflowCheckpoint] = []
    workflow.run_sync(resume_from=old, checkpoint_fn=resumed.append)
    assert dict(resumed[-1].step_usage) == {"a": TokenUsage(), "b": TokenUsage(5, 1, 1)}
    loaded = [WorkflowCheckpoint.from_dict(old), *resumed]
    assert replay(workflow.graph, loaded).ok


def test_a_ledger_built_from_a_mapping_or_pairs_refuses_a_duplicate() -> None:
    built = Ledger({"a": 1, "b": 2})
    assert list(built.items()) == [("a", 1), ("b", 2)]
    assert Ledger([("a", 1), ("b", 2)]) == built
    longer = built.with_item("c", 3)
    assert built.as_dict() == {"a": 1, "b": 2} and longer.as_dict() == {"a": 1, "b": 2, "c": 3}
    branch = built.with_item("d", 4)  # another child of the same parent: its own copy
    assert branch.as_dict() == {"a": 1, "b": 2, "d": 4} and longer.as_dict()["c"] == 3
    try:
        Ledger([("a", 1), ("b", 2), ("a", 3)])
    except ValueError as err:
        assert "'a'" in str(err)
    else:
        raise AssertionError("a duplicate key was accepted")
