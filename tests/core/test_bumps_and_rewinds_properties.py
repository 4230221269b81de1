"""Version bumps and rewinds, combined with maps, chains, conditions and joins, end as a fresh run.

The promise: whatever was bumped or rewound, in whatever order, and even
when a resume stopped at once leaving outputs set aside for an early
cutoff, the final resume gives what an uninterrupted run of the current
code gives (same outputs, same skips), starts only steps (or items of
steps) that a bump or rewind reached, starts none twice, and a further
resume of its checkpoint starts nothing. Every checkpoint is read back
from JSON. Random graphs from ``tests.support.strategies.shaped_dags``; each step's
output derives from its inputs and its version tag, so that work done by
other code shows up as a different output (a plain step's new code may
give the old output, so that early cutoffs happen).
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
    Skipped,
    State,
    Succeeded,
    WorkflowCheckpoint,
    advance,
    checkpoint_of,
    initial_state,
    rewind,
)
from ekit_core.rewind import downstream, grown
from ekit_core.state import attempt_number
from tests.support.strategies import shaped_dags


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:8]


def _step_of(name: str) -> str:
    """The declared step ``name`` is an item (``M[k]``) or an iteration (``L#k``) of, or itself."""
    return name.split("[", 1)[0].split("#", 1)[0]


def _result(state: State, name: str) -> Succeeded | Skipped:
    """What ``name`` does under the run's versions: decided by its inputs and its step's tag."""
    shaped = state.spec.shaped
    step, item = name, None
    if shaped is not None and name in shaped.items:
        ref = shaped.items[name]
        source = state.outputs[ref.source] if not ref.iteration else None
        step, item = ref.step, source if ref.pick is None else source[ref.pick]
    inputs = {d: state.outputs[d] for d in state.spec.graph.deps[name] if d in state.outputs}
    code = state.spec.versions.get(step)
    shape = state.spec.declared_graph.shapes.get(step)
    if shape is not None and shape.when is not None and int(_digest([name, inputs, item]), 16) % 3 == 0:
        return Skipped(name, "condition cond was false")
    if shape is not None and shape.map_over is not None:
        return Succeeded(name, f"{name}:{_digest([name, inputs, item, code])}")
    # Some new code gives a plain step the output the old did: what an early cutoff is for.
    seed = _digest([name, inputs, code if int(_digest([name, code]), 16) % 2 else None])
    output = [f"{name}:{seed}:{j}" for j in range(int(seed[:2], 16) % 4)]
    if shape is not None and shape.repeat is not None and (
            int(seed, 16) % 3 == 1 or name.endswith(f"#{shape.repeat}")):
        return Ended(name, output)  # (an iteration that ends its loop, by its cap at the latest)
    return Succeeded(name, output)


def _drive(graph: GraphSpec, cp: dict[str, Any] | None, versions: dict[str, str],
           numbers: dict[str, int] | None = None) -> tuple[State, list[str]]:
    """Run to the end from ``cp``; every step finishes as soon as it starts. ``numbers``
    gets each started step's (or item's) attempt number, counted across runs."""
    state, batch = advance(initial_state(graph, cp, versions=versions))
    started = list(batch.names)
    while not state.settled:
        assert batch.names, f"stuck: nothing in flight, outcome {state.outcome}"
        if numbers is not None:
            numbers.update((n, attempt_number(state, n)) for n in batch.names)
        state, batch = advance(state, [_result(state, n) for n in batch.names])
        started += batch.names
    return state, started


def _saved(state: State) -> dict[str, Any]:
    return json.loads(json.dumps(checkpoint_of(state).to_dict()))


def _bump(data: st.DataObject, graph: GraphSpec, versions: dict[str, str], tag: str,
          label: str) -> tuple[dict[str, str], set[str]]:
    bumped = set(data.draw(st.lists(st.sampled_from(graph.names), max_size=3, unique=True), label=label))
    return {**versions, **{n: tag for n in bumped}}, bumped


def _settled_skips(skipped: Any) -> set[str]:
    """The skips that say something: not the items of a mapped step skipped as a whole."""
    return {k for k in skipped if _step_of(k) == k or _step_of(k) not in skipped}


@pytest.mark.timeout(300)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=shaped_dags(), data=st.data())
def test_bumps_and_rewinds_in_any_order_end_as_a_fresh_run_of_the_current_code(
        graph: GraphSpec, data: st.DataObject) -> None:
    tagged = data.draw(st.lists(st.sampled_from(graph.names), unique=True), label="tagged")
    versions = {n: "1" for n in tagged}
    numbers: dict[str, int] = {}
    state, _ = _drive(graph, None, versions, numbers)
    made = {n: numbers[n] for n in state.outputs if n in numbers}  # what attempts made
    cp = _saved(state)
    reached: set[str] = set()
    if data.draw(st.booleans(), label="a resume that stops at once"):
        versions, bumped = _bump(data, graph, versions, "mid", "bumped first")
        reached |= bumped
        cp = _saved(initial_state(graph, cp, versions=versions))  # set aside, nothing run
    if data.draw(st.booleans(), label="rewind"):
        loaded = WorkflowCheckpoint.from_dict(cp)
        known = [*graph.names, *sorted(grown(graph, loaded.outputs).items)]
        names = data.draw(st.lists(st.sampled_from(known), min_size=1, max_size=2, unique=True),
                          label="rewound")
        reached |= {_step_of(n) for n in names}
        cp = json.loads(json.dumps(rewind(graph, loaded, names).to_dict()))
    versions, bumped = _bump(data, graph, versions, "2", "bumped last")
    reached |= bumped

    fresh, _ = _drive(graph, None, versions)
    numbers.clear()
    resumed, started = _drive(graph, cp, versions, numbers)
    assert dict(resumed.outputs) == dict(fresh.outputs)
    # Other work, other keys: what runs again never has the number of the attempt that made
    # the output let go of.
    assert not [n for n in started if n in made and numbers[n] <= made[n]]
    assert _settled_skips(resumed.skipped) == _settled_skips(fresh.skipped)
    assert len(started) == len(set(started)), "a step or item started twice"
    allowed = set(downstream(graph, reached))
    assert {_step_of(n) for n in started} <= allowed
    again, started_again = _drive(graph, _saved(resumed), versions)
    assert started_again == [] and dict(again.outputs) == dict(fresh.outputs)


@st.composite
def _reshaped(draw: st.DrawFn, graph: GraphSpec) -> GraphSpec:
    """``graph`` with the shapes of some steps drawn again (mapped, plain, conditional, joined)."""
    from ekit_core.graph import GraphError
    from ekit_core.shapes import Shape

    shapes = dict(graph.shapes)
    for name in draw(st.lists(st.sampled_from(graph.names), min_size=1, max_size=3, unique=True)):
        parents = graph.deps[name]
        kind = draw(st.sampled_from(["plain", "map", "when", "join"]))
        shapes.pop(name, None)
        if kind == "map" and parents:
            shapes[name] = Shape(map_over=draw(st.sampled_from(parents)))
        elif kind == "when":
            shapes[name] = Shape(when="cond")
        elif kind == "join" and len(parents) >= 2:
            shapes[name] = Shape(join="any")
    try:
        return GraphSpec.of(dict(graph.deps), shapes)
    except GraphError:
        return graph


@pytest.mark.timeout(300)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=shaped_dags(), data=st.data())
def test_a_resume_into_reshaped_steps_ends_as_a_fresh_run_of_the_new_graph(
        graph: GraphSpec, data: st.DataObject) -> None:
    from ekit_core.compat import reshaped_steps

    state, _ = _drive(graph, None, {})
    cp = _saved(state)
    new = data.draw(_reshaped(graph), label="reshaped")
    fresh, _ = _drive(new, None, {})
    state, batch = advance(initial_state(new, cp, allow_graph_change=True))
    started = list(batch.names)
    while not state.settled:
        assert batch.names, f"stuck: nothing in flight, outcome {state.outcome}"
        state, batch = advance(state, [_result(state, n) for n in batch.names])
        started += batch.names
    assert dict(state.outputs) == dict(fresh.outputs)
    assert _settled_skips(state.skipped) == _settled_skips(fresh.skipped)
    reshaped = reshaped_steps(new, WorkflowCheckpoint.from_dict(cp))
    assert {_step_of(n) for n in started} <= set(downstream(new, reshaped))
    again, started_again = _drive(new, _saved(state), {})
    assert started_again == [] and dict(again.outputs) == dict(fresh.outputs)
