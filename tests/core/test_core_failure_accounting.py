"""How the pure core counts failures, isolates them, and reads version tags and rewound names.

Each rule here had no test failing when it broke (a hand-made mutant of it
survived the suite), so each is pinned through ``initial_state`` / ``plan`` /
``apply`` alone, with no runner in between:

- with ``isolate_failures``, a step that failed for good stops only what
  depends on it: everything else is still started, and the run ends
  ``"failed"`` once nothing more can run;
- a recorded ``version`` tag that the resuming step no longer declares is a
  change, exactly like a new or bumped tag;
- ``FailureRecord.attempts`` counts failed attempts over every run of a
  checkpoint's history, while a retry policy counts only this run's attempts;
- ``rewind`` reads one string as one step name.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import (
    Failed,
    GraphSpec,
    RetryPolicy,
    State,
    Succeeded,
    TokenUsage,
    WorkflowCheckpoint,
    apply,
    checkpoint_of,
    initial_state,
    plan,
    rewind,
)
from ekit_core.rewind import downstream
from tests.support.strategies import dags

NO_USAGE = TokenUsage(0, 0, 0)


def drive(state: State, fail: set[str], order: st.DataObject | None = None) -> tuple[State, list[str]]:
    """Run ``state`` to its end in the pure core: steps in ``fail`` fail, the rest succeed.

    Returns the last state and every step started, in order. With ``order``,
    finished attempts are folded in a random order, one random subset at a time.
    """
    started: list[str] = []
    in_flight: list[str] = []
    while True:
        batch = plan(state)
        state = apply(state, batch.starts)
        started.extend(batch.names)
        in_flight.extend(batch.names)
        if not in_flight:
            return state, started
        if order is None:
            done, in_flight = in_flight, []
        else:
            shuffled = order.draw(st.permutations(in_flight), label="completion order")
            cut = order.draw(st.integers(1, len(shuffled)), label="finished now")
            done, in_flight = list(shuffled[:cut]), list(shuffled[cut:])
        state = apply(
            state,
            [
                Failed(n, RuntimeError(f"{n} broke")) if n in fail else Succeeded(n, f"out-{n}", NO_USAGE)
                for n in done
            ],
        )


def start(state: State, name: str) -> State:
    """``state`` with ``name`` started, checking that it is exactly what :func:`plan` offers."""
    batch = plan(state)
    assert batch.names == (name,)
    return apply(state, batch.starts)


# -- isolate_failures --------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(dags(min_steps=2, max_steps=12), st.data())
def test_an_isolated_failure_stops_only_its_dependents_and_the_run_ends_failed(
    graph: GraphSpec, data: st.DataObject
) -> None:
    failing = data.draw(st.sets(st.sampled_from(graph.names), min_size=1, max_size=2), label="failing")
    state, started = drive(initial_state(graph, isolate_failures=True), failing, data)
    # What a failing step reaches (not itself): a failing step in another's reach never runs.
    blocked = {n for f in failing for n in downstream(graph, [f]) if n != f}
    # Every step outside the failures' reach ran and is recorded; none inside did.
    assert set(started) == set(graph.names) - blocked
    assert set(state.outputs) == set(graph.names) - blocked - failing
    assert state.outcome == "failed" and state.settled
    assert set(state.failures) == failing - blocked


def test_without_isolation_one_failure_halts_the_run_at_once() -> None:
    graph = GraphSpec.of([("a", ()), ("b", ())])
    state = initial_state(graph, max_concurrency=1)
    state = start(state, "a")
    state = apply(state, [Failed("a", RuntimeError("no"))])
    assert plan(state).names == ()
    assert state.outcome == "failed"
    assert "b" not in state.outputs


def test_an_isolated_failure_leaves_an_independent_step_to_start_after_it() -> None:
    # max_concurrency=1 makes the order certain: b starts only after a failed.
    graph = GraphSpec.of([("a", ()), ("b", ()), ("c", ("a",))])
    state = initial_state(graph, max_concurrency=1, isolate_failures=True)
    state = start(state, "a")
    state = apply(state, [Failed("a", RuntimeError("no"))])
    assert state.outcome is None  # not settled: b can still run
    state = start(state, "b")
    state = apply(state, [Succeeded("b", 2, NO_USAGE)])
    assert plan(state).names == ()
    assert state.outcome == "failed" and dict(state.outputs) == {"b": 2}


# -- version tags ------------------------------------------------------------------


def _recorded(versions: dict[str, str]) -> WorkflowCheckpoint:
    graph = GraphSpec.of([("a", ()), ("b", ("a",)), ("c", ())])
    state, _ = drive(initial_state(graph, versions=versions), set())
    return checkpoint_of(state)


@pytest.mark.parametrize(
    ("before", "after", "rerun"),
    [
        ({"a": "v1"}, {}, ("a", "b")),  # the tag was removed
        ({}, {"a": "v1"}, ("a", "b")),  # a tag was added
        ({"a": "v1"}, {"a": "v2"}, ("a", "b")),  # bumped
        ({"a": "v1"}, {"a": "v1"}, ()),  # unchanged
        ({"c": "x"}, {}, ("c",)),  # removed on a step nothing depends on
        ({}, {}, ()),
    ],
)
def test_any_difference_in_a_recorded_version_tag_reruns_that_step_and_its_dependents(
    before: dict[str, str], after: dict[str, str], rerun: tuple[str, ...]
) -> None:
    checkpoint = _recorded(before)
    assert dict(checkpoint.versions) == before
    graph = GraphSpec.of([("a", ()), ("b", ("a",)), ("c", ())])
    state = initial_state(graph, checkpoint, versions=after)
    _, started = drive(state, set())
    assert tuple(sorted(started)) == rerun


# -- attempts: over the history, and within this run --------------------------------


def test_failure_attempts_count_across_runs_while_the_retry_policy_counts_this_run() -> None:
    graph = GraphSpec.of([("a", ())])
    policy = {"a": RetryPolicy(max_attempts=2, backoff_base=0.0)}
    checkpoint: WorkflowCheckpoint | None = None
    for run in range(1, 4):
        state = initial_state(graph, checkpoint, policies=policy)
        # Each run gets its own two attempts, however many the history holds.
        assert state.attempt_of("a") == 1
        state, started = drive(state, {"a"})
        assert started == ["a", "a"]
        assert state.outcome == "failed"
        checkpoint = checkpoint_of(state)
        assert checkpoint.failures["a"].attempts == 2 * run
    assert checkpoint is not None
    restored = WorkflowCheckpoint.from_dict(checkpoint.to_dict())
    assert restored.failures["a"].attempts == 6


def test_a_success_after_failures_keeps_the_failure_history() -> None:
    graph = GraphSpec.of([("a", ())])
    state = initial_state(graph, policies={"a": RetryPolicy(max_attempts=3, backoff_base=0.0)})
    state = start(state, "a")
    state = apply(state, [Failed("a", RuntimeError("first"))])
    assert state.attempt_of("a") == 2
    state = start(state, "a")
    state = apply(state, [Succeeded("a", 1, NO_USAGE)])
    assert state.outcome == "finished"
    assert checkpoint_of(state).failures["a"].attempts == 1


# -- rewind's names ----------------------------------------------------------------


def _full(graph: GraphSpec) -> WorkflowCheckpoint:
    state, _ = drive(initial_state(graph), set())
    return checkpoint_of(state)


def test_rewind_reads_one_string_as_one_step_name() -> None:
    graph = GraphSpec.of([("a", ()), ("b", ()), ("ab", ())])
    full = _full(graph)
    assert set(rewind(graph, full, "ab").outputs) == {"a", "b"}
    assert set(rewind(graph, full, ["a", "b"]).outputs) == {"ab"}
    with pytest.raises(ValueError, match=r"unknown step\(s\): 'ba'"):
        rewind(graph, full, "ba")


@pytest.mark.parametrize("steps", [None, 3, b"ab", [1], ["a", None]])
def test_rewind_refuses_what_is_not_step_names_with_a_value_error(steps: Any) -> None:
    graph = GraphSpec.of([("a", ()), ("b", ())])
    with pytest.raises(ValueError, match="steps must"):
        rewind(graph, _full(graph), steps)
