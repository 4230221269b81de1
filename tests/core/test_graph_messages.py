"""What a graph error says: a mismatch with the recorded graph, unknown dependencies, cycles.

And that a graph round-trips through its dict form.
"""

from __future__ import annotations

import pytest

from ekit_core import (
    CycleError,
    GraphError,
    GraphMismatchError,
    GraphSpec,
    WorkflowCheckpoint,
    initial_state,
)

# -- graph mismatch ------------------------------------------------------------------


def _recorded(steps: dict[str, list[str]]) -> WorkflowCheckpoint:
    graph = GraphSpec.of(steps)
    return WorkflowCheckpoint(
        1, {"a": 1}, fingerprint=graph.fingerprint,  # type: ignore[arg-type]
        graph={k: tuple(v) for k, v in steps.items()},  # type: ignore[arg-type]
    )


def test_a_graph_mismatch_names_what_was_added_removed_and_rewired() -> None:
    recorded = _recorded({"a": [], "b": ["a"], "gone": ["a"]})
    current = GraphSpec.of({"a": [], "b": [], "new": ["a"]})
    with pytest.raises(GraphMismatchError) as info:
        initial_state(current, recorded)
    message = str(info.value)
    assert message == (
        "checkpoint was recorded from a different workflow graph (added: 'new'; "
        "removed: 'gone'; dependencies changed: 'b'); pass allow_graph_change=True to resume anyway"
    )
    changes = info.value.changes
    assert (changes.added, changes.removed, changes.changed) == (("new",), ("gone",), ("b",))
    assert changes.recorded_fingerprint == recorded.fingerprint
    assert changes.current_fingerprint == current.fingerprint


def test_a_mismatch_without_a_recorded_graph_names_both_fingerprints() -> None:
    current = GraphSpec.of({"a": []})
    recorded = WorkflowCheckpoint(1, {"a": 1}, fingerprint="sha256:" + "0" * 64)  # type: ignore[arg-type]
    with pytest.raises(GraphMismatchError) as info:
        initial_state(current, recorded)
    assert f"recorded fingerprint sha256:{'0' * 64} is not {current.fingerprint}" in str(info.value)
    assert info.value.changes.added == () and info.value.changes.removed == ()


# -- graph messages --------------------------------------------------------------------


def test_unknown_dependencies_get_one_suggestion_each_for_the_first_three() -> None:
    steps = {"alpha": [], "beta": [], "x": ["alpah", "betta", "alpa", "bet"]}
    with pytest.raises(GraphError) as info:
        GraphSpec.of(steps)
    assert str(info.value) == (
        "step 'x' depends on unknown step(s): 'alpah' (did you mean 'alpha'?), "
        "'betta' (did you mean 'beta'?), 'alpa' (did you mean 'alpha'?), 'bet'"
    )
    assert info.value.steps == ("x", "alpah", "betta", "alpa", "bet")


@pytest.mark.parametrize("count", [11, 12])
def test_a_list_of_unknown_steps_is_cut_past_eleven(count: int) -> None:
    missing = [f"m{i:02d}" for i in range(count)]
    with pytest.raises(GraphError) as info:
        GraphSpec.of({"x": missing})
    message = str(info.value)
    if count == 11:
        assert "left out" not in message and all(repr(m) in message for m in missing)
    else:
        assert "... (2 names left out) ..." in message and "'m05'" not in message
    assert info.value.steps == ("x", *missing)


@pytest.mark.parametrize(
    ("size", "label"), [(10, "dependency cycle:"), (11, "dependency cycle of 11 steps:")]
)
def test_a_cycle_message_names_its_size_once_it_is_cut(size: int, label: str) -> None:
    names = [f"c{i:02d}" for i in range(size)]
    steps = {name: [names[i - 1]] for i, name in enumerate(names)}
    with pytest.raises(CycleError) as info:
        GraphSpec.of(steps)
    assert str(info.value).startswith(label)
    assert len(info.value.cycle) == size + 1


def test_a_graph_round_trips_through_its_dict_form() -> None:
    graph = GraphSpec.of({"a": [], "b": ["a"]})
    data = graph.to_dict()
    assert data == {"steps": [{"name": "a", "depends_on": []}, {"name": "b", "depends_on": ["a"]}],
                    "fingerprint": graph.fingerprint}
    assert GraphSpec.from_dict({"steps": [{"name": "a"}, {"name": "b", "depends_on": ["a"]}]}) == graph
    with pytest.raises(GraphError, match=r"^graph must be a JSON object, got list$"):
        GraphSpec.from_dict([])
    with pytest.raises(GraphError, match=r"^graph field 'steps' must be a list$"):
        GraphSpec.from_dict({"steps": 3})
