"""A child per item of a map (``child=`` with ``map_over=``), resumed from any checkpoint,
ends as the uninterrupted run does.

``P`` maps over ``xs`` (zero to four items, a list or a mapping) with a two-step
child (``fetch``, then ``sum``, which needs it and the run's ``a``). Crashes at
random points, each resume from the last checkpoint round tripped through JSON:
the run ends as the uninterrupted run does, no recorded item step runs again, no
item step starts before the same item's step it needs, checkpoints only grow,
and replay and audit accept the record.
"""

from __future__ import annotations

import json
from itertools import pairwise
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import (
    GraphSpec,
    Interrupted,
    Shape,
    State,
    Succeeded,
    WorkflowCheckpoint,
    advance,
    audit,
    checkpoint_of,
    initial_state,
    replay,
)

GRAPH = GraphSpec.of(
    {"a": [], "xs": [], "P/fetch": ["xs", "a"], "P/sum": ["P/fetch", "xs", "a"],
     "P": ["P/sum", "xs"], "z": ["P"]},
    {"P": Shape(map_over="xs", child="P/sum")})


def _result(state: State, name: str, xs: Any) -> Succeeded:
    outputs = state.outputs
    if name == "a":
        return Succeeded(name, 5)
    if name == "xs":
        return Succeeded(name, xs)
    if name == "z":
        return Succeeded(name, ["saw", outputs["P"]])
    ref = state.spec.shaped.items[name]  # type: ignore[union-attr]
    item = outputs["xs"][ref.pick]
    if ref.step == "P/fetch":
        return Succeeded(name, item * 10 + outputs["a"])
    fetched = f"P/fetch[{ref.key}]"
    assert fetched in outputs, f"{name} started before {fetched} was recorded"
    return Succeeded(name, outputs[fetched] + 1)


def _drive(xs: Any, crashes: list[int] | None, order: list[int]
           ) -> tuple[State, list[WorkflowCheckpoint]]:
    """Run to the end, finishing the running step ``order`` picks each fold (any of them:
    the core started each once what it needs was recorded)."""
    state, batch = advance(initial_state(GRAPH))
    checkpoints = [checkpoint_of(state)]
    fold = 0
    while not state.settled:
        fold += 1
        if crashes and fold in crashes:
            text = json.dumps(checkpoints[-1].to_dict())
            recorded = set(WorkflowCheckpoint.from_dict(json.loads(text)).outputs)
            state, batch = advance(initial_state(GRAPH, json.loads(text)))
            assert not recorded & {s.name for s in batch.starts}, "a recorded step runs again"
            checkpoints.append(checkpoint_of(state))
            continue
        running = state.running_steps()
        name = running[order[fold % len(order)] % len(running)]
        if crashes is not None and fold % 4 == 3:
            state, batch = advance(state, [Interrupted(name)])
        else:
            state, batch = advance(state, [_result(state, name, xs)])
        checkpoints.append(checkpoint_of(state))
    return state, checkpoints


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.integers(0, 9), max_size=4), as_mapping=st.booleans(),
       crashes=st.lists(st.integers(1, 25), max_size=5),
       order=st.lists(st.integers(0, 7), min_size=1, max_size=8))
def test_a_child_per_item_resumed_at_any_point_ends_as_the_uninterrupted_run(
        values: list[int], as_mapping: bool, crashes: list[int], order: list[int]) -> None:
    xs: Any = {f"k{i}": v for i, v in enumerate(values)} if as_mapping else values
    plain, plain_cps = _drive(xs, None, [0])
    state, checkpoints = _drive(xs, sorted(set(crashes)), order)
    expected = [v * 10 + 5 + 1 for v in values]
    if as_mapping:
        assert plain.outputs["P"] == {f"k{i}": e for i, e in enumerate(expected)}
    else:
        assert plain.outputs["P"] == expected
    assert state.outcome == plain.outcome == "finished"
    assert state.outputs["z"] == plain.outputs["z"] == ["saw", plain.outputs["P"]]
    for record in (plain_cps, checkpoints):
        for before, after in pairwise(record):
            assert all(after.outputs.get(n, after) == v for n, v in before.outputs.items())
        report = replay(GRAPH, record)
        assert report.ok, report.violations[:3]
        assert audit(GRAPH, record[-1]).clean
