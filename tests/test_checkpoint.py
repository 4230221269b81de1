"""The checkpoint format: plain-data round trip, and a parser that only ever raises ValueError."""

from __future__ import annotations

import json
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ekit_core import (
    CheckpointError,
    FailureRecord,
    TokenUsage,
    UnsupportedFormatError,
    WorkflowCheckpoint,
)

EXECUTIONKIT_DICT = {
    "step_index": 2,
    "outputs": {"topic": "owls", "outline": ["a", "b"], "draft": "text"},
    "cost": {"input_tokens": 120, "output_tokens": 80, "llm_calls": 2},
}


def test_three_positional_fields_construct_like_executionkit() -> None:
    cp = WorkflowCheckpoint(step_index=2, outputs=MappingProxyType({"a": 1}), cost=TokenUsage())
    assert cp.step_index == 2 and cp.outputs["a"] == 1 and cp.cost == TokenUsage()
    assert cp.fingerprint is None and cp.failures == {} and cp.context == {}


def test_to_dict_is_plain_json_and_round_trips() -> None:
    cp = WorkflowCheckpoint(
        step_index=1,
        outputs=MappingProxyType({"a": {"x": [1, "ü"]}}),
        cost=TokenUsage(3, 4, 1),
        context=MappingProxyType({"topic": "t"}),
        step_usage=MappingProxyType({"a": TokenUsage(3, 4, 1)}),
        failures=MappingProxyType({"b": FailureRecord("ValueError", "bad", 2)}),
        fingerprint="sha256:abc",
        graph=MappingProxyType({"a": (), "b": ("a",)}),
    )
    data = cp.to_dict()
    text = json.dumps(data)
    back = WorkflowCheckpoint.from_dict(json.loads(text))
    assert back == cp
    assert isinstance(back.outputs, MappingProxyType)
    assert back.to_dict() == data


def test_executionkit_three_key_dict_loads() -> None:
    cp = WorkflowCheckpoint.from_dict(EXECUTIONKIT_DICT)
    assert cp.step_index == 2
    assert dict(cp.outputs) == EXECUTIONKIT_DICT["outputs"]
    assert cp.cost == TokenUsage(120, 80, 2)
    assert cp.fingerprint is None and cp.graph is None


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.pop("step_index"), "step_index"),
        (lambda d: d.pop("outputs"), "outputs"),
        (lambda d: d.pop("cost"), "cost"),
        (lambda d: d.update(step_index=-1), "step_index"),
        (lambda d: d.update(step_index=True), "step_index"),
        (lambda d: d.update(step_index="2"), "step_index"),
        (lambda d: d.update(step_index=2.0), "step_index"),
        (lambda d: d.update(outputs=[]), "outputs"),
        (lambda d: d.update(outputs={1: "x"}), "outputs"),
        (lambda d: d.update(cost=None), "cost"),
        (lambda d: d["cost"].pop("llm_calls"), "cost.llm_calls"),
        (lambda d: d["cost"].update(input_tokens=False), "cost.input_tokens"),
        (lambda d: d["cost"].update(output_tokens=-5), "cost.output_tokens"),
        (lambda d: d.update(context="x"), "context"),
        (lambda d: d.update(step_usage={"a": {}}), "step_usage.a.input_tokens"),
        (lambda d: d.update(failures={"a": {"message": "m"}}), "failures.a.error_type"),
        (lambda d: d.update(failures={"a": {"error_type": "E", "message": "m", "attempts": 0}}),
         "failures.a.attempts"),
        (lambda d: d.update(fingerprint=5), "fingerprint"),
        (lambda d: d.update(graph={"a": "b"}), "graph.a"),
        (lambda d: d.update(format_version="1"), "format_version"),
        (lambda d: d.update(format_version=0), "format_version"),
    ],
)
def test_malformed_fields_are_named(mutate: Any, field: str) -> None:
    data = json.loads(json.dumps(EXECUTIONKIT_DICT))
    mutate(data)
    with pytest.raises(CheckpointError) as info:
        WorkflowCheckpoint.from_dict(data)
    assert isinstance(info.value, ValueError)
    assert info.value.field == field
    assert repr(field) in str(info.value)


@pytest.mark.parametrize("data", [None, [], "cp", 3, ("step_index", 1)])
def test_non_dicts_are_refused(data: object) -> None:
    with pytest.raises(CheckpointError, match="must be a dict"):
        WorkflowCheckpoint.from_dict(data)


def test_newer_format_is_refused_not_misread() -> None:
    data = dict(EXECUTIONKIT_DICT, format_version=99)
    with pytest.raises(UnsupportedFormatError, match="newer ekit"):
        WorkflowCheckpoint.from_dict(data)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4),
    max_leaves=20,
)
keys = st.sampled_from(
    ["step_index", "outputs", "cost", "context", "step_usage", "failures", "fingerprint",
     "graph", "format_version", "input_tokens", "output_tokens", "llm_calls", "error_type",
     "message", "attempts", "a"]
)
checkpointish = st.recursive(
    json_values,
    lambda children: st.dictionaries(keys, children, max_size=9),
    max_leaves=30,
)


@given(checkpointish)
def test_parser_raises_only_checkpoint_errors(data: object) -> None:
    try:
        cp = WorkflowCheckpoint.from_dict(data)
    except CheckpointError as exc:
        assert exc.field
    else:
        assert WorkflowCheckpoint.from_dict(cp.to_dict()) == cp


@given(
    st.dictionaries(st.text(), json_values, max_size=5),
    st.integers(0, 10**6),
    st.tuples(st.integers(0, 10**9), st.integers(0, 10**9), st.integers(0, 10**6)),
)
def test_any_json_safe_checkpoint_round_trips_through_json(
    outputs: dict[str, Any], index: int, counts: tuple[int, int, int]
) -> None:
    cp = WorkflowCheckpoint(index, MappingProxyType(outputs), TokenUsage(*counts))
    assert WorkflowCheckpoint.from_dict(json.loads(json.dumps(cp.to_dict()))) == cp


def test_token_usage_arithmetic_and_budget_rule() -> None:
    a, b = TokenUsage(1, 2, 3), TokenUsage(10, 20, 30)
    assert a + b == TokenUsage(11, 22, 33) and b - a == TokenUsage(9, 18, 27)
    assert (a + b).total_tokens == 33
    budget = TokenUsage(output_tokens=20)
    assert not budget.reached(TokenUsage(10**6, 19, 10**6))
    assert budget.reached(TokenUsage(0, 20, 0))
    assert not TokenUsage().reached(TokenUsage(10**9, 10**9, 10**9))
    with pytest.raises(AttributeError):
        a.input_tokens = 5  # type: ignore[misc]
