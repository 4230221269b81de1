"""Rules of the core that a mutation run (``python -m tools.mutation``) found unguarded.

Each test pins behaviour a user relies on: the arguments a retry policy
refuses and the delays it gives, what a budget counts as reached, the
message of a graph mismatch, how ledgers compare and print, and that the
fast constructors build the same values as the ordinary ones.
"""

from __future__ import annotations

from typing import Any

import pytest

from ekit_core import (
    Began,
    Cancelled,
    CycleError,
    Denied,
    Failed,
    GraphError,
    GraphMismatchError,
    GraphSpec,
    Interrupted,
    RetryPolicy,
    State,
    StepDenied,
    StepFailed,
    StepInterrupted,
    StepRetried,
    Succeeded,
    TokenUsage,
    TransitionError,
    WorkflowCheckpoint,
    apply,
    initial_state,
    plan,
)
from ekit_core.checkpoint import CheckpointError, describe_error, same_output
from ekit_core.ledger import Ledger
from ekit_core.results import Start, first_start, succeeded
from ekit_core.state import Halt
from ekit_core.transitions import context_outputs

# -- retry policies ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"max_attempts": 0}, "max_attempts"),
        ({"max_attempts": True}, "max_attempts"),
        ({"max_attempts": 2.0}, "max_attempts"),
        ({"backoff_base": -0.1}, "backoff_base"),
        ({"backoff_base": True}, "backoff_base"),
        ({"backoff_base": "1"}, "backoff_base"),
        ({"backoff_cap": -1}, "backoff_cap"),
        ({"backoff_cap": False}, "backoff_cap"),
        ({"backoff_factor": 0.99}, "backoff_factor"),
        ({"backoff_factor": True}, "backoff_factor"),
        ({"backoff_factor": None}, "backoff_factor"),
        ({"retry_on": ValueError()}, "retry_on"),
        ({"retry_on": (ValueError, int)}, "retry_on"),
        ({"retry_on": [ValueError]}, "retry_on"),
    ],
)
def test_a_retry_policy_refuses_each_bad_argument_by_name(arguments: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^RetryPolicy\.{field} must"):
        RetryPolicy(**arguments)


def test_a_retry_policy_accepts_every_boundary_value() -> None:
    policy = RetryPolicy(max_attempts=1, backoff_base=0, backoff_cap=0, backoff_factor=1)
    assert (policy.max_attempts, policy.backoff_base, policy.backoff_cap, policy.backoff_factor) == (
        1, 0, 0, 1,
    )
    single = RetryPolicy(retry_on=KeyError)  # one type: made a tuple
    assert single.retry_on == (KeyError,)
    assert single.retries(KeyError("k"), 1) and not single.retries(ValueError("v"), 1)
    assert RetryPolicy(retry_on=(KeyboardInterrupt,)).retry_on == (KeyboardInterrupt,)


def test_retry_delays_follow_the_documented_formula() -> None:
    policy = RetryPolicy(max_attempts=9, backoff_base=0.5, backoff_cap=3.0, backoff_factor=3)
    assert [policy.delay(k) for k in (-1, 0, 1, 2, 3, 4)] == [0.0, 0.0, 0.5, 1.5, 3.0, 3.0]
    assert isinstance(policy.delay(1), float)
    assert RetryPolicy(backoff_base=2, backoff_factor=1).delay(5) == 2.0
    assert not policy.retries(ValueError(), 9) and policy.retries(ValueError(), 8)


# -- usage and budgets ----------------------------------------------------------------


@pytest.mark.parametrize("field", ["input_tokens", "output_tokens", "llm_calls"])
def test_a_budget_of_one_is_reached_by_one_in_its_own_field(field: str) -> None:
    budget = TokenUsage(**{field: 1})
    assert budget.reached(TokenUsage(**{field: 1}))
    assert not budget.reached(TokenUsage())
    others = {f: 5 for f in ("input_tokens", "output_tokens", "llm_calls") if f != field}
    assert not budget.reached(TokenUsage(**others))  # a zero field places no limit
    assert not TokenUsage(**{field: 1}).is_zero()
    assert TokenUsage().is_zero()


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


# -- ledgers --------------------------------------------------------------------------


def test_a_ledger_extends_an_equal_prefix_of_another_store_but_not_a_changed_one() -> None:
    base = Ledger([("a", [1]), ("b", 2)])
    copy = Ledger([("a", [1]), ("b", 2), ("c", 3)])  # equal values, other objects
    assert copy.extends(base) and copy.extends(Ledger()) and base.extends(base)
    assert not base.extends(copy)  # longer
    assert not Ledger([("a", [1]), ("b", 3)]).extends(base)  # a value changed
    assert not Ledger([("x", [1]), ("b", 2)]).extends(base)  # a key changed
    shared = base.with_item("c", 3)
    assert shared.extends(base) and not base.extends(shared)


def test_a_ledger_slices_and_prints_a_bounded_view() -> None:
    ledger = Ledger([(f"k{i}", i) for i in range(10)])
    prefix = Ledger([("k0", 0), ("k1", 1)])
    assert ledger.items_from(8) == [("k8", 8), ("k9", 9)]
    assert ledger.items_from(-3) == ledger.items_from(0) and len(ledger.items_from(0)) == 10
    assert ledger.items_from(11) == []
    assert repr(prefix) == "Ledger({'k0': 0, 'k1': 1})"
    shown = ", ".join(f"'k{i}': {i}" for i in range(8))
    assert repr(ledger) == f"Ledger({{{shown}, ... (10 entries)}})"
    assert repr(Ledger()) == "Ledger({})"


# -- fast constructors ------------------------------------------------------------------


def test_the_fast_constructors_build_the_ordinary_values() -> None:
    usage = TokenUsage(3, 2, 1)
    fast = succeeded("s", {"x": 1}, usage, 0.25)
    assert fast == Succeeded("s", {"x": 1}, usage, 0.25)
    assert (fast.name, fast.output, fast.usage, fast.duration) == ("s", {"x": 1}, usage, 0.25)
    assert type(fast) is Succeeded and hash(first_start("s")) == hash(Start("s"))
    start = first_start("s")
    assert start == Start("s", 1, 0.0, False) and not start.gated
    with pytest.raises(AttributeError):
        fast.name = "other"  # type: ignore[misc]


# -- the rare transitions: denials, interruptions, refusals, their events ------------------


def _three_ready(**options: Any) -> State:
    """a, b, c independent; a and b started (max_concurrency=2), c ready."""
    graph = GraphSpec.of({"a": [], "b": [], "c": []})
    state = initial_state(graph, max_concurrency=2, **options)
    return apply(state, plan(state).starts)


def test_a_denied_or_interrupted_step_is_ready_again_beside_the_others() -> None:
    gated = _three_ready(approval=True)
    assert sorted(gated.running_steps()) == ["a", "b"] and list(gated.ready_steps()) == ["c"]
    denied = apply(gated, [Denied("a", "no budget left")])
    assert sorted(denied.ready_steps()) == ["a", "c"] and list(denied.running_steps()) == ["b"]
    assert denied.halt == Halt("denied", "a", "no budget left")
    assert denied.events[-1] == StepDenied("a", "no budget left")
    interrupted = apply(_three_ready(), [Interrupted("b")])
    assert sorted(interrupted.ready_steps()) == ["b", "c"]
    assert list(interrupted.running_steps()) == ["a"]
    assert interrupted.events[-1] == StepInterrupted("b")
    cancelled = apply(_three_ready(), [Cancelled("user pressed Ctrl-C")])
    assert cancelled.halt == Halt("cancelled", reason="user pressed Ctrl-C")


@pytest.mark.parametrize(
    ("report", "message"),
    [
        (Failed("c", ValueError("x")), "failed result for step 'c', which is not in flight"),
        (Denied("c", "no"), "denied result for step 'c', which is not in flight"),
        (Interrupted("c"), "interrupted result for step 'c', which is not in flight"),
        (Succeeded("c", 1), "success reported for step 'c', which is not in flight"),
        (Began("a"), "attempt of step 'a' began, but it is not a gated attempt in flight"),
        (Failed("zz", ValueError("x")), "unknown step 'zz'"),
    ],
)
def test_a_report_that_does_not_fit_the_state_says_which_and_why(report: Any, message: str) -> None:
    state = _three_ready()
    with pytest.raises(TransitionError) as info:
        apply(state, [report])
    assert str(info.value) == message


def test_a_start_beyond_the_limit_or_after_a_halt_is_refused() -> None:
    state = _three_ready()
    with pytest.raises(TransitionError, match=r"^cannot start step 'c': max_concurrency=2 in flight$"):
        apply(state, [Start("c")])
    halted = apply(state, [Cancelled()])
    with pytest.raises(TransitionError, match=r"^cannot start step 'c': the run is halted \(cancelled\)$"):
        apply(halted, [Start("c")])
    freed = apply(state, [Succeeded("a", 1)])
    assert "c" in apply(freed, [Start("c")]).running_steps()


def test_retry_and_failure_events_carry_the_attempt_the_error_and_the_timing() -> None:
    graph = GraphSpec.of({"a": []})
    policy = RetryPolicy(max_attempts=2, backoff_base=0.25)
    state = initial_state(graph, policies={"a": policy})
    state = apply(state, plan(state).starts)
    retried = apply(state, [Failed("a", KeyError("k"), 0.5)])
    assert retried.events[-1] == StepRetried("a", 1, "KeyError", "'k'", 0.25, 0.5)
    again = apply(retried, plan(retried).starts)
    again = apply(again, [Began("a")])
    failed = apply(again, [Failed("a", KeyError("k2"), 0.75)])
    assert failed.events[0] == StepFailed("a", 2, "KeyError", "'k2'", 0.75)
    assert failed.halt == Halt("failed", "a", "KeyError: 'k2'")


def test_a_subclass_of_an_input_folds_like_its_base() -> None:
    class Refused(Failed):
        pass

    state = _three_ready()
    folded = apply(state, [Refused("a", ValueError("x"))])
    assert folded.halt is not None and folded.halt.kind == "failed"


def test_context_outputs_are_the_recorded_outputs_that_are_not_steps() -> None:
    graph = GraphSpec.of({"a": []})
    assert context_outputs(graph, {"a": 1, "topic": "tides"}) == {"topic": "tides"}


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
