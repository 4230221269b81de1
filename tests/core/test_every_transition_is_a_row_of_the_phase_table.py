"""The phase table is what the fold does: every move of every step is one of its rows.

Random graphs with run-time shapes (maps, item-wise chains, conditions, joins
over alternatives, loops), random options (approval, retries, isolated failures,
``only``) and random inputs, as a shell would send them and as it would not:

- each input the shell may send moves its own step by the row of (its phase
  before, the input), to a phase that row allows, both read with ``phase_of``;
- every other step that moves, moves by a row of one of the fold's triggers;
- an input whose step's phase has no row is refused, naming the step and the
  phase, and the state is unchanged;
- a resume from the checkpoint of any of these states restores each step to
  the phase ``RESUMES`` says.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import (
    Asked,
    Began,
    Cancelled,
    Denied,
    Ended,
    Failed,
    GraphSpec,
    Interrupted,
    Phase,
    Question,
    RetryPolicy,
    Skipped,
    State,
    Succeeded,
    TransitionError,
    apply,
    checkpoint_of,
    initial_state,
    phase_of,
    plan,
)
from ekit_core.phases import RESUMES, Trigger
from ekit_core.transitions import TRANSITIONS, _asks
from tests.support.strategies import dags, shaped_dags

_ENDS: tuple[type, ...] = (Began, Succeeded, Ended, Failed, Denied, Interrupted, Asked, Skipped)


class Boom(Exception):
    pass


def _phases(state: State) -> dict[str, Phase]:
    return {name: phase_of(state, name) for name in state.spec.graph.names}


def _expanders(graph: GraphSpec) -> set[str]:
    return {s.map_over for s in graph.shapes.values() if s.map_over is not None}


def _input(kind: type, name: str, graph: GraphSpec, data: st.DataObject) -> Any:
    if kind is Succeeded:
        if name in _expanders(graph) and data.draw(st.integers(0, 9)):  # (else a MapError)
            return Succeeded(name, data.draw(st.lists(st.integers(0, 9), max_size=3)))
        return Succeeded(name, data.draw(st.integers(0, 9)))
    if kind is Ended:
        return Ended(name, data.draw(st.integers(0, 9)))
    if kind is Failed:
        return Failed(name, Boom("x"))
    if kind is Asked:
        return Asked(name, Question("value", "which?"))
    if kind is Skipped:
        return Skipped(name, "condition was false")
    if kind is Denied:
        return Denied(name, "no")
    return kind(name)


def _iteration(state: State, name: str) -> bool:
    """Whether ``name`` is an iteration of a loop (the one step a shell reports ``Ended`` for)."""
    ref = state.spec.shaped.items.get(name) if state.spec.shaped is not None else None
    return ref is not None and ref.iteration > 0


def _checked(state: State, item: Any) -> State:
    """``apply(state, [item])``, checking each step's move against the table."""
    names = state.spec.graph.names
    before = _phases(state)
    after_state = apply(state, [item])
    after = {name: phase_of(after_state, name) for name in names}
    own = None if isinstance(item, Cancelled) else item.name
    if own is not None:
        row = TRANSITIONS[(before[own], type(item))]
        assert after[own] in row.to, (own, before[own], type(item).__name__, after[own])
    for name in names:
        if name == own or before[name] == after[name]:
            continue
        moves = [t for t in Trigger if (before[name], t) in TRANSITIONS
                 and after[name] in TRANSITIONS[(before[name], t)].to]
        assert moves, (f"{name} moved {before[name]} -> {after[name]} on {item!r}, "
                       "which no row of the table allows")
    return after_state


def _refused(state: State, kind: type, name: str, data: st.DataObject) -> None:
    """An input with no row for its step's phase: refused, naming both; nothing changes."""
    phase = phase_of(state, name)
    if (phase, kind) in TRANSITIONS:
        return
    before = (_phases(state), dict(state.outputs), state.setbacks)
    with pytest.raises(TransitionError) as info:
        apply(state, [_input(kind, name, state.spec.graph, data)])
    message = str(info.value)
    assert repr(name) in message and f"which is {phase.value}" in message, message
    assert kind.__name__ in message
    assert (_phases(state), dict(state.outputs), state.setbacks) == before


def _resumed_as_the_table_says(state: State, options: dict[str, Any]) -> None:
    resumed = initial_state(state.spec.declared_graph, checkpoint_of(state), **options)
    for name in resumed.spec.graph.names:
        if name not in state.spec.graph.index:  # (an item only the resume has made: none)
            continue
        was = phase_of(state, name)
        now = phase_of(resumed, name)
        assert now in RESUMES[was][0], (name, was, now)


def _drive(graph: GraphSpec, options: dict[str, Any], data: st.DataObject) -> None:
    state = initial_state(graph, **options)
    for _ in range(80):
        if state.settled:
            break
        action = data.draw(st.sampled_from([*["start"] * 8, *["end"] * 12, "bogus", "resume",
                                            "cancel"]))
        if action == "start":
            batch = plan(state)
            for name in batch.withdraw:  # what a shell does with a withdrawn attempt
                state = _checked(state, Interrupted(name))
            if batch.starts:
                state = _checked(state, data.draw(st.sampled_from(batch.starts)))
        elif action == "end":
            in_flight = state.running_steps()
            if not in_flight:
                continue
            name = data.draw(st.sampled_from(in_flight))
            phase = phase_of(state, name)
            # As the shell: a denial only where the run asks approval, a skip only of a
            # step with a condition (the core refuses one of a step that has none).
            kinds = [k for k in _ENDS if (phase, k) in TRANSITIONS
                     and (k is not Denied or state.limits.approval)
                     and (k is not Skipped or _asks(state.spec, name))
                     and (k is not Ended or _iteration(state, name))]
            kind = data.draw(st.sampled_from(kinds))
            state = _checked(state, _input(kind, name, state.spec.graph, data))
        elif action == "bogus":
            name = data.draw(st.sampled_from(state.spec.graph.names))
            _refused(state, data.draw(st.sampled_from(_ENDS)), name, data)
        elif action == "resume":
            _resumed_as_the_table_says(state, options)
        else:
            state = _checked(state, Cancelled())
    _resumed_as_the_table_says(state, options)


@st.composite
def _options(draw: st.DrawFn, graph: GraphSpec) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if draw(st.booleans()):
        options["approval"] = True
    if draw(st.booleans()):
        options["isolate_failures"] = True
    if draw(st.booleans()):
        tries = draw(st.integers(2, 3))
        delay = draw(st.sampled_from([0.0, 1.0]))
        options["policies"] = {n: RetryPolicy(max_attempts=tries, backoff_base=delay)
                               for n in graph.names}
    if draw(st.booleans()):
        options["max_concurrency"] = draw(st.integers(1, 3))
    if draw(st.integers(0, 3)) == 0:
        options["only"] = [draw(st.sampled_from(graph.names))]
    return options


@settings(max_examples=300)
@given(graph=shaped_dags(loops=True), data=st.data())
def test_every_move_of_a_shaped_run_is_a_row_of_the_table(graph: GraphSpec,
                                                           data: st.DataObject) -> None:
    _drive(graph, data.draw(_options(graph)), data)


@settings(max_examples=150)
@given(graph=dags(max_steps=8), data=st.data())
def test_every_move_of_a_static_run_is_a_row_of_the_table(graph: GraphSpec,
                                                          data: st.DataObject) -> None:
    _drive(graph, data.draw(_options(graph)), data)


def test_every_input_the_shell_sends_has_a_row_and_every_row_a_known_effect() -> None:
    kinds = {kind for _, kind in TRANSITIONS if isinstance(kind, type)}
    assert kinds == {*_ENDS, Cancelled, type(plan(initial_state(GraphSpec.of({"a": []}))).starts[0])}
    assert set(RESUMES) == set(Phase)
    for (phase, kind), row in TRANSITIONS.items():
        assert callable(row.effect) and row.does, (phase, kind)
        assert phase is not None or kind is Cancelled
