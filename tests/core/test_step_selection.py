"""A run with ``only`` runs exactly the selection's closure, and a later run runs the rest.

Property tests of the core rule (:mod:`ekit_core.selection`) over random
graphs with mapped (item-wise chains too), conditional and joining steps,
completed in random orders: a selective run starts nothing outside the
closure its test computes on its own (every step the selected ones
transitively need), records or skips every selected step, and ends
``"finished"``; a resume of its checkpoint (read back from JSON) without
``only`` starts nothing the first run started, and ends with the outputs
and skips of one uninterrupted run of the whole graph.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ekit_core import (
    Ended,
    GraphSpec,
    Interrupted,
    RunSettled,
    Skipped,
    State,
    Succeeded,
    TokenUsage,
    advance,
    apply,
    checkpoint_of,
    initial_state,
    plan,
)
from ekit_core.growth import add_steps
from ekit_core.selection import closure, left_out
from ekit_core.shapes import Shape
from tests.support.strategies import dags, shaped_dags


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:8]


def _result(state: State, name: str) -> Succeeded | Skipped:
    """What step (or item) ``name`` does, decided by its inputs alone (so every run agrees)."""
    shaped = state.spec.shaped
    step, item = name, None
    if shaped is not None and name in shaped.items:
        ref = shaped.items[name]
        source = state.outputs[ref.source] if not ref.iteration else None
        step, item = ref.step, source if ref.pick is None else source[ref.pick]
    inputs = {d: state.outputs[d] for d in state.spec.graph.deps[name] if d in state.outputs}
    seed = _digest([name, inputs, item])
    shape = state.spec.declared_graph.shapes.get(step)
    if shape is not None and shape.when is not None and int(seed, 16) % 3 == 0:
        return Skipped(name, "condition cond was false")
    if shape is not None and shape.map_over is not None:
        return Succeeded(name, f"{name}:{seed}")
    output = [f"{name}:{seed}:{j}" for j in range(int(seed[:2], 16) % 4)]
    if shape is not None and shape.repeat is not None and (
            int(seed, 16) % 3 == 1 or name.endswith(f"#{shape.repeat}")):
        return Ended(name, output)  # (an iteration that ends its loop, by its cap at the latest)
    return Succeeded(name, output)


def _needed(graph: GraphSpec, chosen: list[str]) -> set[str]:
    """The test's own closure: every step ``chosen`` transitively needs, by every kind of
    edge a shape declares (a dependency, the step mapped over, a join's inputs)."""
    found: set[str] = set()
    todo = list(chosen)
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            shape = graph.shapes.get(name, Shape())
            todo += [*graph.deps[name], *([shape.map_over] if shape.map_over else [])]
    return found


def _owner(state: State, name: str) -> str:
    shaped = state.spec.shaped
    return shaped.items[name].step if shaped is not None and name in shaped.items else name


def _drive(state: State, batch: Any, order: st.DataObject | None) -> tuple[State, list[str], list[str]]:
    """Run ``state`` to its end (in ``order``'s order, else in order): the settled state,
    every start, and the problems seen."""
    in_flight, started, problems = list(batch.names), list(batch.names), []
    while not state.settled:
        if not in_flight:
            problems.append(f"stuck: nothing in flight, outcome {state.outcome}")
            break
        pick = 0 if order is None else order.draw(st.integers(0, len(in_flight) - 1), label="which")
        many = 1 if order is None else order.draw(st.integers(1, len(in_flight) - pick), label="group")
        done, in_flight = in_flight[pick:pick + many], in_flight[:pick] + in_flight[pick + many:]
        results = [_result(state, n) for n in done]
        if order is not None and order.draw(st.booleans(), label="apply, then plan"):
            # As a shell may drive the core: each transition apart, settling in between.
            state = apply(state, results)
            batch = plan(state)
            state = apply(state, batch.starts)
        else:
            state, batch = advance(state, results)
        in_flight += batch.names
        started += batch.names
        problems += _invariants(state)
    return state, started, problems


def _invariants(state: State) -> list[str]:
    """What holds of every state of a selective run: nothing outside the selection is
    ready, and the count of unsettled steps left out (what its end is counted without)
    is what the graph and the records say."""
    only = state.spec.limits.only
    if only is None:
        return []
    problems = [f"{n} is ready outside the selection" for n in state.ready_steps()
                if _owner(state, n) not in only]
    held = sum(1 for n in state.spec.graph.names if _owner(state, n) not in only
               and n not in state.outputs and n not in state.skipped)
    if held != state.spec.held:
        problems.append(f"held {state.spec.held}, but {held} steps outside are unsettled")
    return problems


def _reference(graph: GraphSpec) -> State:
    state, _, problems = _drive(*advance(initial_state(graph)), None)
    assert problems == [] and state.outcome == "finished"
    return state


def _settled(skipped: dict[str, str]) -> dict[str, str]:
    """The skips that say something (as test_shapes_properties compares them): not the
    items of a mapped step skipped as a whole; a step that needs several skipped steps
    names the one whose skip reached it first, so only a condition's own reason counts."""
    return {
        k: v if v.startswith("condition") else "needs a skipped step"
        for k, v in skipped.items() if k.split("[", 1)[0] == k or k.split("[", 1)[0] not in skipped
    }


def _partial(graph: GraphSpec, data: st.DataObject) -> tuple[dict[str, Any] | None, list[str]]:
    """The checkpoint (as JSON data) of a run of the whole graph cut short after a random
    number of turns (``None``: none), and what it started."""
    turns = data.draw(st.integers(0, 4), label="turns of a full run first")
    if not turns:
        return None, []
    state, batch = advance(initial_state(graph))
    in_flight, started = list(batch.names), list(batch.names)
    for _ in range(turns):
        if state.settled or not in_flight:
            break
        state, batch = advance(state, [_result(state, in_flight.pop(0))])
        in_flight += batch.names
        started += batch.names
    done = [n for n in started if n in state.outputs or n in state.skipped]
    return json.loads(json.dumps(checkpoint_of(state).to_dict())), done


def _check_selection_then_rest(graph: GraphSpec, chosen: list[str], data: st.DataObject) -> None:
    full = _reference(graph)
    needed = _needed(graph, chosen)
    assert closure(graph, chosen) == needed

    before, paid = _partial(graph, data)  # recorded outputs are still skipped
    first = initial_state(graph, before, only=chosen)
    assert _invariants(first) == []
    state, started, problems = _drive(*advance(first), data)
    assert problems == []
    assert not set(started) & set(paid), f"ran again: {sorted(set(started) & set(paid))}"
    assert state.outcome == "finished"
    outside = [n for n in started if _owner(state, n) not in needed]
    assert outside == [], f"started outside the closure {sorted(needed)}: {outside}"
    assert len(started) == len(set(started)), "a step started twice"
    assert all(n in state.outputs or n in state.skipped for n in needed)
    assert {k: v for k, v in state.outputs.items() if k in needed} == {
        k: v for k, v in full.outputs.items() if k in needed}
    assert set(left_out(state)) == {
        n for n in graph.names if n not in needed and n not in state.outputs and n not in state.skipped}

    started += paid
    saved = json.loads(json.dumps(checkpoint_of(state).to_dict()))
    rest, again, problems = _drive(*advance(initial_state(graph, saved)), data)
    assert problems == []
    assert rest.outcome == "finished"
    assert not set(again) & set(started), f"ran twice: {sorted(set(again) & set(started))}"
    assert all(_owner(rest, n) not in needed for n in again)
    assert dict(rest.outputs) == dict(full.outputs)
    assert _settled(dict(rest.skipped)) == _settled(dict(full.skipped))
    assert left_out(rest) == ()


@pytest.mark.timeout(300)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=shaped_dags(), data=st.data())
def test_a_selection_runs_exactly_its_closure_and_a_resume_runs_the_rest(
    graph: GraphSpec, data: st.DataObject
) -> None:
    chosen = data.draw(st.lists(st.sampled_from(graph.names), min_size=1, max_size=3), label="only")
    _check_selection_then_rest(graph, chosen, data)


@pytest.mark.timeout(300)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=dags(min_steps=2, max_steps=10), data=st.data())
def test_a_selection_of_a_static_graph_runs_its_ancestors_only(graph: GraphSpec, data: st.DataObject) -> None:
    chosen = data.draw(st.lists(st.sampled_from(graph.names), min_size=1, max_size=3), label="only")
    _check_selection_then_rest(graph, chosen, data)


@pytest.mark.timeout(300)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=shaped_dags(), data=st.data())
def test_a_selection_resumed_midway_with_the_same_selection_pays_nothing_twice(
    graph: GraphSpec, data: st.DataObject
) -> None:
    # A selective run cut short (its checkpoint at a random point), then resumed
    # with the same ``only``: together they run the closure once, and end as one run.
    chosen = data.draw(st.lists(st.sampled_from(graph.names), min_size=1, max_size=2), label="only")
    needed = _needed(graph, chosen)
    state, batch = advance(initial_state(graph, only=chosen))
    in_flight, started = list(batch.names), list(batch.names)
    stop = data.draw(st.integers(0, 6), label="turns before the crash")
    for _ in range(stop):
        if state.settled or not in_flight:
            break
        state, batch = advance(state, [_result(state, in_flight.pop(0))])
        in_flight += batch.names
        started += batch.names
    finished = [n for n in started if n in state.outputs or n in state.skipped]
    saved = json.loads(json.dumps(checkpoint_of(state).to_dict()))
    resumed, again, problems = _drive(*advance(initial_state(graph, saved, only=chosen)), data)
    assert problems == [] and resumed.outcome == "finished"
    assert not set(again) & set(finished)
    assert all(_owner(resumed, n) in needed for n in again)
    assert all(n in resumed.outputs or n in resumed.skipped for n in needed)


def test_the_closure_follows_every_kind_of_edge() -> None:
    # u -> m (maps over u) -> n (maps over m, item by item); c is conditional;
    # j joins c or m's sibling b; x is unrelated.
    graph = GraphSpec.of(
        {"u": (), "b": ("u",), "c": ("u",), "m": ("u", "b"), "n": ("m",), "j": ("b", "c"), "x": ()},
        {"m": Shape(map_over="u"), "n": Shape(map_over="m"), "c": Shape(when="cond"),
         "j": Shape(join="any")},
    )
    assert closure(graph, ["n"]) == {"n", "m", "u", "b"}
    assert closure(graph, ["j"]) == {"j", "b", "c", "u"}
    assert closure(graph, ["x", "x"]) == {"x"}


def test_a_mapped_step_outside_the_selection_never_starts_an_item() -> None:
    # 'u' is needed by the selected 'b'; 'm' maps over it but is not selected.
    graph = GraphSpec.of({"u": (), "m": ("u",), "b": ("u",)}, {"m": Shape(map_over="u")})
    state, batch = advance(initial_state(graph, only=["b"]))
    assert batch.names == ("u",)
    state, batch = advance(state, [Succeeded("u", [1, 2])])
    assert batch.names == ("b",)
    state, batch = advance(state, [Succeeded("b", "b")])
    assert state.outcome == "finished" and "m" not in state.outputs and left_out(state) == ("m",)
    # An input it cannot split fails nothing in a run that does not select it.
    state, batch = advance(initial_state(graph, only=["b"]))
    state, batch = advance(state, [Succeeded("u", 7)])
    state, batch = advance(state, [Succeeded("b", "b")])
    assert state.outcome == "finished" and not state.failures


def test_a_skip_reaches_the_steps_outside_the_selection_but_starts_no_join() -> None:
    # c is conditional and selected; d needs it; j joins c or e (e outside): none starts.
    graph = GraphSpec.of({"c": (), "d": ("c",), "e": (), "j": ("c", "e")},
                         {"c": Shape(when="cond"), "j": Shape(join="any")})
    state, batch = advance(initial_state(graph, only=["c"]))
    state, batch = advance(state, [Skipped("c", "condition cond was false")])
    assert state.outcome == "finished" and batch.names == ()
    assert set(state.skipped) == {"c", "d"} and left_out(state) == ("e", "j")
    rest, batch = advance(initial_state(graph, checkpoint_of(state)))
    assert batch.names == ("e",)
    rest, batch = advance(rest, [Succeeded("e", "e")])
    assert batch.names == ("j",)


def test_steps_added_to_a_selective_run_wait_for_a_run_without_only() -> None:
    graph = GraphSpec.of({"a": (), "b": ("a",), "c": ()})
    state, batch = advance(initial_state(graph, only=["b"]))
    state = add_steps(state, {"late": ()})
    state, batch = advance(state, [Succeeded("a", "a")])
    assert batch.names == ("b",)
    state, batch = advance(state, [Succeeded("b", "b")])
    assert state.outcome == "finished" and left_out(state) == ("c", "late")


def test_a_join_outside_the_selection_never_starts_even_with_an_input_recorded() -> None:
    # j joins a (recorded before) or c (selected, conditional): c's skip settles
    # j's inputs, and j would be ready in a run of every step; here it waits.
    graph = GraphSpec.of({"a": (), "c": (), "j": ("a", "c")},
                         {"c": Shape(when="cond"), "j": Shape(join="any")})
    state, _ = advance(initial_state(graph))
    state = apply(state, [Succeeded("a", "a"), Interrupted("c")])
    state, batch = advance(initial_state(graph, checkpoint_of(state), only=["c"]))
    assert batch.names == ("c",)
    state, batch = advance(state, [Skipped("c", "condition cond was false")])
    assert (batch.names, state.outcome, left_out(state)) == ((), "finished", ("j",))
    _, batch = advance(initial_state(graph, checkpoint_of(state)))
    assert batch.names == ("j",)


def test_a_skipped_item_reaches_the_item_chained_to_it_outside_the_selection() -> None:
    # n maps over m item by item; only m runs: m[0]'s skip must reach n[0], as a
    # run of every step records it, or the resume would wait for m[0] for ever.
    graph = GraphSpec.of({"u": (), "m": ("u",), "n": ("m",)},
                         {"m": Shape(map_over="u", when="cond"), "n": Shape(map_over="m")})
    state, batch = advance(initial_state(graph, only=["m"]))
    state, batch = advance(state, [Succeeded("u", ["x", "y"])])
    assert batch.names == ("m[0]", "m[1]")
    state, batch = advance(state, [Skipped("m[0]", "condition cond was false"), Succeeded("m[1]", 1)])
    assert state.outcome == "finished" and state.outputs["m"] == [1]
    assert "n[0]" in state.skipped and "n[1]" not in state.skipped and left_out(state) == ("n",)
    rest, batch = advance(initial_state(graph, json.loads(json.dumps(checkpoint_of(state).to_dict()))))
    assert batch.names == ("n[1]",)
    rest, batch = advance(rest, [Succeeded("n[1]", 2)])
    assert rest.outcome == "finished" and rest.outputs["n"] == [2]


def test_run_settled_counts_what_a_selective_run_leaves_out() -> None:
    graph = GraphSpec.of({"a": (), "b": ("a",), "c": ("a",), "d": ("b", "c")})
    state, _ = advance(initial_state(graph, only=["b"]))
    state, _ = advance(state, [Succeeded("a", "a")])
    state, _ = advance(state, [Succeeded("b", "b")])
    assert state.events[-1] == RunSettled("finished", 2, 4, TokenUsage(), left_out=2)
    # A resume with the selection recorded already settles in its first state.
    again = initial_state(graph, checkpoint_of(state), only=["a", "b"])
    assert again.outcome == "finished" and again.events[-1] == RunSettled("finished", 2, 4, TokenUsage(), 2)
    assert initial_state(graph, checkpoint_of(state)).outcome is None
