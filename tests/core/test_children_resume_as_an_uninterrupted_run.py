"""Child workflows (``ekit_core.children.nest``) resumed from any checkpoint end as the
uninterrupted run does.

Random child graphs (a random DAG, with a step mapped over another, a loop, or a
child of its own inside, each at random), nested under a step between a step it
needs and a step that needs it, and crashes at random points: each resume starts
from the last checkpoint, round tripped through JSON. Whatever the crashes:

- the run ends as the uninterrupted run does (every output, the parent's among
  them, which is its child's output step's);
- no step, item or iteration whose output a checkpoint recorded runs again (a
  crash in the child's k-th step resumes at the k-th);
- checkpoints only grow, and replay accepts the whole record;
- rewinding a child's step lets go of it and of everything after it alone.
"""

from __future__ import annotations

import json
from itertools import pairwise
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import (
    Ended,
    GraphError,
    GraphSpec,
    Interrupted,
    Shape,
    State,
    Succeeded,
    WorkflowCheckpoint,
    advance,
    checkpoint_of,
    initial_state,
    replay,
)
from ekit_core.children import children_of, nest, parent_of, rolled_up
from ekit_core.expansion import item_input
from ekit_core.usage import TokenUsage


@st.composite
def child_graphs(draw: st.DrawFn, depth: int = 0) -> GraphSpec:
    """A random child: a DAG of 1-5 steps, maybe a mapped step, a loop, or a child inside."""
    n = draw(st.integers(1, 5))
    names = [f"s{i}" for i in range(n)]
    deps: dict[str, list[str]] = {
        name: sorted(draw(st.sets(st.sampled_from(names[:i]), max_size=2))) if i else []
        for i, name in enumerate(names)}
    shapes: dict[str, Shape] = {}
    kind = draw(st.sampled_from(["plain", "map", "loop", "child"] if depth < 1 else ["plain", "map", "loop"]))
    last = names[-1]
    if kind == "map":
        deps["m"] = [last]
        shapes["m"] = Shape(map_over=last)
    elif kind == "loop":
        deps["l"] = [last]
        shapes["l"] = Shape(repeat=draw(st.integers(2, 4)))
    elif kind == "child":
        inner = draw(child_graphs(depth + 1))
        nested = nest("c", (last,), inner, inner.names[-1])
        deps.update({k: list(v) for k, v in nested.steps.items()})
        shapes.update(nested.shapes)
        deps["c"] = [nested.output]
        shapes["c"] = Shape(child=nested.output)
    return GraphSpec.of(deps, shapes)


def _parent_graph(child: GraphSpec) -> GraphSpec:
    nested = nest("P", ("a",), child, child.names[-1])
    deps: dict[str, list[str]] = {"a": [], "b": []}
    deps.update({k: list(v) for k, v in nested.steps.items()})
    deps["P"] = [nested.output]
    deps["z"] = ["P", "b"]
    return GraphSpec.of(deps, {**nested.shapes, "P": Shape(child=nested.output)})


def _result(state: State, name: str) -> Any:
    """What each step does, from what it needs alone (so any order gives the same outputs)."""
    graph, outputs = state.spec.graph, state.outputs
    shapes = state.spec.declared_graph.shapes
    shaped = state.spec.shaped
    ref = shaped.items.get(name) if shaped is not None else None
    if ref is not None and ref.iteration:  # a loop: ends at its second iteration
        before = outputs[ref.source] if ref.source else 0
        value = [name, before]
        return Ended(name, value) if ref.iteration == 2 else Succeeded(name, value)
    if ref is not None:
        return Succeeded(name, [name, item_input(ref, outputs)], TokenUsage(1, 0, 1))
    shape = shapes.get(name)
    if shape is not None and shape.child is not None:  # the step hands on its child's output
        return Succeeded(name, outputs[shape.child])
    return Succeeded(name, [name, *(outputs[d] for d in graph.deps[name])][:3], TokenUsage(2, 1, 1))


def _drive(graph: GraphSpec, crashes: list[int] | None, resume: Any = None
           ) -> tuple[State, list[WorkflowCheckpoint], list[str]]:
    state, batch = advance(initial_state(graph, resume))
    checkpoints = [checkpoint_of(state)]
    started = [s.name for s in batch.starts]
    fold = 0
    while not state.settled:
        fold += 1
        if crashes and fold in crashes:  # what was in flight is lost; resume from the last save
            text = json.dumps(checkpoints[-1].to_dict())
            recorded = set(WorkflowCheckpoint.from_dict(json.loads(text)).outputs)
            state, batch = advance(initial_state(graph, json.loads(text)))
            assert not recorded & {s.name for s in batch.starts}, "a recorded step runs again"
            started += [s.name for s in batch.starts]
            checkpoints.append(checkpoint_of(state))
            continue
        name = state.running_steps()[-1 if fold % 2 else 0]
        if crashes is not None and fold % 5 == 2:  # an attempt cut short: it runs again
            state, batch = advance(state, [Interrupted(name)])
        else:
            state, batch = advance(state, [_result(state, name)])
        started += [s.name for s in batch.starts]
        checkpoints.append(checkpoint_of(state))
    return state, checkpoints, started


def _only_grow(checkpoints: list[WorkflowCheckpoint]) -> None:
    for before, after in pairwise(checkpoints):
        for name, value in before.outputs.items():
            assert name in after.outputs and after.outputs[name] == value, name


@settings(max_examples=150, deadline=None)
@given(child=child_graphs(), crashes=st.lists(st.integers(1, 40), max_size=6))
def test_a_child_resumed_at_any_point_ends_as_the_uninterrupted_run(
        child: GraphSpec, crashes: list[int]) -> None:
    graph = _parent_graph(child)
    plain, plain_cps, plain_started = _drive(graph, None)
    state, checkpoints, _ = _drive(graph, sorted(set(crashes)))
    assert plain.outcome == state.outcome == "finished"
    encoded = json.loads(json.dumps(dict(plain.outputs)))
    assert json.loads(json.dumps(dict(state.outputs))) == encoded
    out = graph.shapes["P"].child
    assert out is not None and plain.outputs["P"] == plain.outputs[out]
    assert len(plain_started) == len(set(plain_started)), "a step ran twice in a plain run"
    assert all(parent_of(n, graph.shapes) in {"P", "P/c"} for n in plain.outputs if n.startswith("P/"))
    _only_grow(plain_cps)
    _only_grow(checkpoints)
    for record in (plain_cps, checkpoints):
        report = replay(graph, record)
        assert report.ok, report.violations[:3]
    usage = rolled_up(plain.step_usage, "P")
    assert usage == sum((u for n, u in plain.step_usage.items() if n.startswith("P/")), TokenUsage())


@settings(max_examples=60, deadline=None)
@given(child=child_graphs(), data=st.data())
def test_rewinding_a_childs_step_runs_it_and_what_follows_it_again(
        child: GraphSpec, data: st.DataObject) -> None:
    from ekit_core import rewind

    graph = _parent_graph(child)
    state, _, _ = _drive(graph, None)
    inner = [n for n in graph.names if n.startswith("P/") and not graph.shapes.get(n, Shape()).child
             and graph.shapes.get(n, Shape()).map_over is None]
    target = data.draw(st.sampled_from(inner))
    rewound = rewind(graph, checkpoint_of(state), target)
    after = {target}
    for name in graph.names:  # declaration order: what needs a step comes after it
        if any(d in after for d in graph.deps[name]):
            after.add(name)
    declared = [n for n in graph.names if n in state.outputs]
    assert [n for n in declared if n in rewound.outputs] == [n for n in declared if n not in after]
    resumed, _, started = _drive(graph, None, json.loads(json.dumps(rewound.to_dict())))
    assert not set(started) & set(rewound.outputs), "a step the rewind kept runs again"
    assert target in started or graph.shapes.get(target, Shape()).repeat is not None
    assert json.loads(json.dumps(dict(resumed.outputs))) == json.loads(json.dumps(dict(state.outputs)))


def test_a_step_named_like_a_childs_step_is_refused() -> None:
    from ekit_core.children import check_names

    nested = nest("P", (), GraphSpec.of({"x": []}))
    try:
        check_names(["P"], ["P/x", "P/y", "P"], {"P": set(nested.steps)})
    except GraphError as exc:
        assert "'P/y'" in str(exc) and "'P'" in str(exc)
    else:
        raise AssertionError("P/y beside P's child was not refused")


def test_a_child_with_two_last_steps_and_no_output_is_refused() -> None:
    child = GraphSpec.of({"x": [], "y": []})
    try:
        nest("P", (), child)
    except GraphError as exc:
        assert "'P'" in str(exc) and "'x'" in str(exc) and "'y'" in str(exc)
    else:
        raise AssertionError("an ambiguous output was not refused")
    assert nest("P", (), child, "y").output == "P/y"
    assert children_of({"P": Shape(child="P/y")}) == {"P": "P/y"}
