"""The checkpoint format: plain-data round trip, and a parser that only ever raises ValueError."""

from __future__ import annotations

import json
import math
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
        (lambda d: d.update(graph={"a": [], "b": ["a", 3]}), "graph.b"),
        (lambda d: d.update(graph={"a": [], "b": None}), "graph.b"),
        (lambda d: d.update(graph={"a": [], 2: []}), "graph"),
        (lambda d: d.update(graph=["a"]), "graph"),
        (lambda d: d["outputs"].update({"b": 1, 7: 2}), "outputs"),
        (lambda d: d.update(context={"k": 1, None: 2}), "context"),
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
     "graph", "graph_steps", "graph_needs", "format_version", "input_tokens", "output_tokens",
     "llm_calls", "error_type",
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
        return
    try:
        cp.graph  # noqa: B018  # recorded texts are decoded when first read
    except CheckpointError as exc:  # only a step named twice is left to that read
        assert (exc.field, "twice") == ("graph_steps", exc.problem.split()[-1])
        return
    assert WorkflowCheckpoint.from_dict(cp.to_dict()) == cp


@given(
    st.dictionaries(st.text(), json_values, max_size=5),
    st.integers(0, 10**6),
    st.tuples(st.integers(0, 10**9), st.integers(0, 10**9), st.integers(0, 10**6)),
    st.lists(st.one_of(st.floats(0, 1e12), st.integers(0, 10**9)), max_size=5),
)
def test_any_json_safe_checkpoint_round_trips_through_json(
    outputs: dict[str, Any], index: int, counts: tuple[int, int, int], seconds: list[float]
) -> None:
    # Durations for some of the outputs (a non-empty name each), any finite number >= 0.
    durations = dict(zip([k for k in outputs if k], seconds, strict=False))
    cp = WorkflowCheckpoint(index, MappingProxyType(outputs), TokenUsage(*counts),
                            durations=MappingProxyType(durations))
    data = json.loads(json.dumps(cp.to_dict()))
    assert data.get("durations", {}) == durations
    assert WorkflowCheckpoint.from_dict(data) == cp


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


# delta_since: an output is unchanged when it is the same object, an equal
# one, or one stored alike; == alone is not reflexive for NaN.

ZERO_COST = {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0}


def _loaded(outputs_json: str, context_json: str = "{}") -> WorkflowCheckpoint:
    """A checkpoint parsed from JSON text, as a reader of a file gets it: fresh objects."""
    text = f'{{"step_index": 0, "outputs": {outputs_json}, "cost": {json.dumps(ZERO_COST)}, ' \
        f'"context": {context_json}}}'
    return WorkflowCheckpoint.from_dict(json.loads(text))


def test_a_nan_output_read_back_twice_is_not_a_change() -> None:
    before = _loaded('{"a": NaN, "m": {"x": [NaN, Infinity]}}', '{"k": NaN}')
    after = _loaded('{"a": NaN, "m": {"x": [NaN, Infinity]}, "b": 1}', '{"k": NaN}')
    delta = after.delta_since(before)
    assert delta.extends
    assert delta.outputs == (("b", 1),)
    assert delta.context_changed is False
    # A NaN a step computed is another object than the one json.loads makes.
    computed = float("inf") - float("inf")
    in_memory = WorkflowCheckpoint(
        1, MappingProxyType({"a": computed, "m": {"x": [computed, math.inf]}}),
        context=MappingProxyType({"k": computed}),
    )
    assert in_memory.outputs["a"] is not after.outputs["a"]
    delta = after.delta_since(in_memory)
    assert delta.extends and delta.outputs == (("b", 1),) and not delta.context_changed


def test_an_output_whose_eq_is_not_reflexive_or_raises_is_itself() -> None:
    class NeverEqual:
        def __eq__(self, other: object) -> bool:
            return False

        __hash__ = object.__hash__

    class Ambiguous:  # as a numpy array: == gives something without a truth value
        def __eq__(self, other: object) -> Any:
            return self

        def __bool__(self) -> bool:
            raise ValueError("truth value is ambiguous")

        __hash__ = object.__hash__

    never, ambiguous = NeverEqual(), Ambiguous()
    before = WorkflowCheckpoint(1, MappingProxyType({"a": never, "b": ambiguous}))
    after = WorkflowCheckpoint(2, MappingProxyType({"a": never, "b": ambiguous, "c": 3}))
    delta = after.delta_since(before)
    assert delta.extends and delta.outputs == (("c", 3),)
    # Another object of the same kind is a different output.
    other = WorkflowCheckpoint(2, MappingProxyType({"a": NeverEqual(), "b": ambiguous}))
    assert not other.delta_since(before).extends


def test_a_value_stored_alike_is_not_a_change_but_a_different_one_is() -> None:
    in_memory = WorkflowCheckpoint(1, MappingProxyType({"a": (1, 2), "n": float("nan")}))
    read_back = WorkflowCheckpoint.from_dict(json.loads(json.dumps(in_memory.to_dict())))
    assert read_back.outputs["a"] == [1, 2]
    assert read_back.delta_since(in_memory).extends
    for changed in ('{"a": [1, 2], "n": 1.0}', '{"a": [1, 3], "n": NaN}', '{"a": [1, 2]}'):
        assert not _loaded(changed).delta_since(in_memory).extends, changed


non_finite = st.sampled_from([math.nan, math.inf, -math.inf])
json_values_with_nan = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | non_finite | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4),
    max_leaves=20,
)


@given(
    st.dictionaries(st.text(), non_finite | json_values_with_nan, max_size=5),
    st.text(),
    json_values_with_nan,
)
def test_a_checkpoint_read_back_extends_its_own_copy(
    outputs: dict[str, Any], new_key: str, new_value: Any
) -> None:
    # Any JSON-safe outputs, NaN and infinities included: a checkpoint read
    # from a file adds nothing to another read of the same file, and adding an
    # output adds exactly that output.
    cp = WorkflowCheckpoint(len(outputs), MappingProxyType(outputs))
    text = json.dumps(cp.to_dict())
    first, second = (WorkflowCheckpoint.from_dict(json.loads(text)) for _ in range(2))
    delta = second.delta_since(first)
    assert delta.extends and delta.outputs == () and not delta.context_changed
    if new_key not in outputs:
        grown = WorkflowCheckpoint.from_dict(
            {**json.loads(text), "outputs": {**json.loads(text)["outputs"], new_key: new_value}}
        )
        grown_delta = grown.delta_since(first)
        assert grown_delta.extends
        assert [k for k, _ in grown_delta.outputs] == [new_key]
