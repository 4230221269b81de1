"""Wide frontiers: the fold applies a batch's bits with one mask, and must agree with one at a time.

A fan-out of hundreds of children puts hundreds of steps in flight at once,
past the width where the fold changes its bit sets in place: finished steps
and newly ready ones are then collected and applied together. These tests
drive such runs in random completion orders and batch sizes and compare every
state with the one-input-at-a-time fold, and check that bad reports are still
refused, naming the step, with the state left as it was.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import (
    Failed,
    GraphSpec,
    State,
    Succeeded,
    TransitionError,
    advance,
    apply,
    initial_state,
    plan,
)

WIDTH = 700  # well past the width at which the fold switches to masks


def _layers(width: int) -> GraphSpec:
    """root -> width children -> a join over every second child, then a tail step."""
    steps: dict[str, list[str]] = {"root": []}
    children = [f"c{i}" for i in range(width)]
    steps.update((c, ["root"]) for c in children)
    steps["join"] = children[::2]
    steps["tail"] = ["join", children[-1]]
    return GraphSpec.of(steps)


def _view(state: State) -> tuple[object, ...]:
    return (
        dict(state.outputs), state.completed, sorted(state.running_steps()),
        sorted(state.ready_steps()), state.outcome,
    )


def _one_at_a_time(state: State, names: list[str]) -> State:
    """The reference: each success folded alone, then everything plan() says started."""
    for name in names:
        state = apply(state, [Succeeded(name, name.upper())])
    return apply(state, plan(state).starts)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32))
def test_batched_completions_in_a_wide_window_match_one_at_a_time(seed: int) -> None:
    # One seed drives the whole run: hypothesis keeps its examples small.
    rnd = random.Random(seed)
    graph = _layers(WIDTH)
    state, _ = advance(initial_state(graph))
    reference = state
    while not state.settled:
        names = sorted(state.running_steps())
        rnd.shuffle(names)
        del names[rnd.randint(1, len(names)):]
        state, _ = advance(state, [Succeeded(n, n.upper()) for n in names])
        reference = _one_at_a_time(reference, names)
        assert _view(state) == _view(reference)
    assert state.outcome == "finished" and len(state.outputs) == len(graph)


def _wide_state() -> State:
    state, _ = advance(initial_state(_layers(WIDTH)))
    state, _ = advance(state, [Succeeded("root", 0)])
    assert state.running_count == WIDTH
    return state


@pytest.mark.parametrize("bad", ["join", "tail", "root"])
def test_a_success_of_a_step_not_in_flight_is_refused_in_a_wide_window(bad: str) -> None:
    state = _wide_state()
    before = _view(state)
    inputs = [Succeeded("c5", 1), Succeeded("c600", 1), Succeeded(bad, 1), Succeeded("c7", 1)]
    with pytest.raises(TransitionError, match=repr(bad)):
        advance(state, inputs)
    assert _view(state) == before
    # The state still folds as if the refused batch had never been offered.
    after, _ = advance(state, [Succeeded("c5", 1)])
    assert "c5" in after.outputs and "c600" not in after.outputs


def test_a_success_reported_twice_in_one_wide_batch_is_refused() -> None:
    state = _wide_state()
    with pytest.raises(TransitionError, match="'c9'"):
        advance(state, [Succeeded("c9", 1), Succeeded("c650", 1), Succeeded("c9", 1)])


def test_a_failure_after_pending_successes_sees_them_applied() -> None:
    # A rare input in the middle of a batch applies what the batch collected first.
    state = _wide_state()
    inputs = [Succeeded(f"c{i}", i) for i in range(0, 400, 2)] + [Failed("c1", ValueError("x"))]
    folded, _ = advance(state, inputs)
    reference = state
    for item in inputs:
        reference = apply(reference, [item])
    reference = apply(reference, plan(reference).starts)
    assert _view(folded) == _view(reference)
    assert folded.outcome == reference.outcome
    with pytest.raises(TransitionError, match="'c2'"):
        advance(state, [*inputs[:3], Failed("c2", ValueError("finished already"))])
