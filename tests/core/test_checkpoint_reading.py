"""Reading a checkpoint: what a malformed one says is wrong, what a read keeps, deltas, usage counts.
"""

from __future__ import annotations

import pytest

from ekit_core import (
    TokenUsage,
    WorkflowCheckpoint,
)
from ekit_core.checkpoint import CheckpointError, describe_error, same_output

# -- reading checkpoints ----------------------------------------------------------------

_BASE = {
    "step_index": 1, "outputs": {"a": 1}, "cost": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0},
}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([1], "checkpoint field '<checkpoint>': must be a dict, got list"),
        ({"outputs": {}, "cost": {}}, "checkpoint field 'step_index': missing"),
        ({**_BASE, "step_index": "1"}, "checkpoint field 'step_index': must be a non-negative int, got str"),
        ({**_BASE, "step_index": -2}, "checkpoint field 'step_index': must be a non-negative int, got -2"),
        ({**_BASE, "format_version": 0}, "checkpoint field 'format_version': must be at least 1, got 0"),
        ({**_BASE, "outputs": [1]}, "checkpoint field 'outputs': must be a dict, got list"),
        ({**_BASE, "outputs": {3: 1}}, "checkpoint field 'outputs': keys must be strings, got int 3"),
        ({**_BASE, "fingerprint": 7}, "checkpoint field 'fingerprint': must be a string, got int"),
        ({**_BASE, "graph": {"a": [1]}}, "checkpoint field 'graph.a': must hold step names, got int"),
        ({**_BASE, "graph": {"a": 5}}, "checkpoint field 'graph.a': must be a list of step names, got int"),
        ({**_BASE, "graph": [1]}, "checkpoint field 'graph': must be a dict, got list"),
        ({**_BASE, "step_usage": []}, "checkpoint field 'step_usage': must be a dict, got list"),
        ({**_BASE, "step_usage": {"a": 5}}, "checkpoint field 'step_usage.a': must be a dict, got int"),
        ({**_BASE, "step_usage": {"a": [1, 2, 3]}},
         "checkpoint field 'step_usage.a': must be a dict, got list"),
        ({**_BASE, "failures": 3}, "checkpoint field 'failures': must be a dict, got int"),
        ({**_BASE, "versions": ()}, "checkpoint field 'versions': must be a dict, got tuple"),
        ({**_BASE, "versions": {"a": 2}}, "checkpoint field 'versions.a': must be a string, got int"),
    ],
)
def test_a_malformed_checkpoint_says_what_is_wrong_with_which_field(data: object, message: str) -> None:
    with pytest.raises(CheckpointError) as info:
        WorkflowCheckpoint.from_dict(data)
    assert str(info.value) == message
    assert info.value.problem == message.split(": ", 1)[1]


def test_a_checkpoint_keeps_its_versions_format_and_graph_as_read() -> None:
    data = {**_BASE, "versions": {"a": "2"}, "graph": {"a": [], "b": ("a",)}, "format_version": 1}
    cp = WorkflowCheckpoint.from_dict(data)
    assert dict(cp.versions) == {"a": "2"} and cp.format_version == 1
    assert dict(cp.graph or {}) == {"a": (), "b": ("a",)}


def test_the_full_delta_of_a_checkpoint_holds_everything() -> None:
    cp = WorkflowCheckpoint.from_dict({
        **_BASE, "context": {"topic": "owls"},
        "step_usage": {"a": {"input_tokens": 1, "output_tokens": 2, "llm_calls": 1}},
        "failures": {"b": {"error_type": "E", "message": "m", "attempts": 1}},
    })
    delta = cp.delta_since(None)
    assert delta.extends and delta.context_changed and delta.outputs == (("a", 1),)
    assert delta.step_usage == (("a", TokenUsage(1, 2, 1)),)
    assert dict(delta.failures) == dict(cp.failures) and delta.cost == cp.cost
    unrelated = WorkflowCheckpoint.from_dict({**_BASE, "outputs": {"z": 0}})
    assert not cp.delta_since(unrelated).extends and cp.delta_since(unrelated).outputs == (("a", 1),)
    assert not WorkflowCheckpoint.from_dict(_BASE).delta_since(None).context_changed


def test_equal_outputs_are_the_same_output_even_when_json_cannot_encode_them() -> None:
    class Point:
        def __init__(self, x: int) -> None:
            self.x = x

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Point) and other.x == self.x

        __hash__ = None  # type: ignore[assignment]

    assert same_output(Point(1), Point(1)) and not same_output(Point(1), Point(2))


def test_an_unprintable_error_is_described_by_both_types() -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise KeyError("no")

    assert describe_error(Unprintable()) == (
        "test_an_unprintable_error_is_described_by_both_types.<locals>.Unprintable",
        "<unprintable Unprintable: str() raised KeyError>",
    )


@pytest.mark.parametrize("counts", [(1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 0, 0), (4, 5, 6)])
def test_each_usage_count_is_read_as_written(counts: tuple[int, int, int]) -> None:
    usage = dict(zip(("input_tokens", "output_tokens", "llm_calls"), counts, strict=True))
    cp = WorkflowCheckpoint.from_dict({**_BASE, "step_usage": {"a": usage}, "cost": usage})
    assert cp.step_usage["a"] == TokenUsage(*counts) == cp.cost


@pytest.mark.parametrize("field", ["input_tokens", "output_tokens", "llm_calls"])
def test_a_usage_count_of_another_type_is_named(field: str) -> None:
    usage: dict[str, object] = {"input_tokens": 1, "output_tokens": 2, "llm_calls": 3, field: "2"}
    with pytest.raises(CheckpointError) as info:
        WorkflowCheckpoint.from_dict({**_BASE, "step_usage": {"a": usage}})
    assert info.value.field == f"step_usage.a.{field}"
