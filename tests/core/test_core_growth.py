"""Property tests of a graph that grows by name during a run (``ekit_core.growth``).

A random DAG is split into the graph a run begins with and steps added at a
random moment of the run (each may depend on any step before it, old or
added). The grown run must behave as a run of the whole graph: every step
runs once, never before its dependencies, readiness agrees with
``dependencies_recorded`` after every transition, and its checkpoints resume
under the grown graph (and only under it, unless a change is allowed).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import (
    GraphError,
    GraphMismatchError,
    GraphSpec,
    State,
    Succeeded,
    TransitionError,
    advance,
    checkpoint_of,
    initial_state,
)
from ekit_core.growth import add_steps
from ekit_core.transitions import dependencies_recorded
from tests.support.strategies import dags


def _readiness_holds(state: State) -> None:
    graph, running = state.graph, set(state.running_steps())
    expected = [
        n for n in graph.names
        if n not in state.outputs and n not in running and dependencies_recorded(graph, state.outputs, n)
    ]
    assert list(state.ready_steps()) == expected


def _split(whole: GraphSpec, cut: int) -> tuple[GraphSpec, dict[str, tuple[str, ...]]]:
    """The first ``cut`` steps of a topological order as the graph a run begins
    with, the rest as steps to add (in that order)."""
    order: list[str] = []
    while len(order) < len(whole):
        order += [n for n in whole.names if n not in order and all(d in order for d in whole.deps[n])]
    first = GraphSpec.of([(n, whole.deps[n]) for n in order[:cut]])
    return first, {n: whole.deps[n] for n in order[cut:]}


@settings(max_examples=150, deadline=None)
@given(whole=dags(min_steps=2), data=st.data())
def test_a_run_grown_by_name_runs_every_step_once_in_dependency_order(
    whole: GraphSpec, data: st.DataObject
) -> None:
    cut = data.draw(st.integers(1, len(whole) - 1), label="steps the run begins with")
    first, later = _split(whole, cut)
    state, batch = advance(initial_state(first))
    started = [s.name for s in batch]
    grown = False
    checkpoints = []
    while not state.settled:
        if not grown and data.draw(st.booleans(), label="add now?"):
            state, grown = add_steps(state, later), True
            _readiness_holds(state)
            state, batch = advance(state)
            started += [s.name for s in batch]
            continue
        running = list(state.running_steps())
        assert running, "stalled"
        done = data.draw(st.lists(st.sampled_from(running), min_size=1, unique=True), label="done")
        state, batch = advance(state, [Succeeded(n, n) for n in done])
        for s in batch:
            assert all(d in state.outputs for d in state.graph.deps[s.name]), "started before deps"
        started += [s.name for s in batch]
        _readiness_holds(state)
        checkpoints.append(checkpoint_of(state))
        if state.settled and not grown:  # the run ended before the steps came: they cannot
            with pytest.raises(TransitionError):
                add_steps(state, later)
            return
    assert sorted(started) == sorted(whole.names) and len(started) == len(set(started))
    assert dict(state.outputs) == {n: n for n in whole.names} and state.outcome == "finished"
    grown_graph = state.graph
    assert set(grown_graph.names) == set(whole.names)
    last = checkpoints[-1]
    assert last.fingerprint == grown_graph.fingerprint
    assert initial_state(grown_graph, last).complete
    with pytest.raises(GraphMismatchError):
        initial_state(first, last)


def test_steps_added_must_be_new_known_and_acyclic_and_the_state_is_unchanged() -> None:
    state, _ = advance(initial_state(GraphSpec.of({"a": [], "b": ["a"]})))
    for bad in ({"a": []}, {"c": ["nope"]}, {"c": ["d"], "d": ["c"]}):
        with pytest.raises(GraphError):
            add_steps(state, bad)
    assert state.graph.names == ("a", "b") and state.ready_steps() == ()
    grown = add_steps(state, {"c": [], "d": ["a", "c"]})
    assert grown.graph.names == ("a", "b", "c", "d") and grown.ready_steps() == ("c",)
    assert state.graph.names == ("a", "b")  # the state before is a value: unchanged
    # d waits on two steps, one of them added: it is ready once both are recorded.
    grown, batch = advance(grown, [Succeeded("a", 1)])
    assert batch.names == ("b", "c")
    grown, batch = advance(grown, [Succeeded("c", 3)])
    assert batch.names == ("d",)
