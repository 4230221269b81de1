"""Run-time shapes hold under any completion order and any crash: property tests of the core.

Random DAGs whose steps may map over an upstream (item-wise chains too),
be conditional, or join alternatives; outputs of random length (zero items
included), derived from their inputs so that every order must agree; runs
completed in random orders and interrupted at random points, each resumed
from its last checkpoint read back from JSON. Every run must end as the
uninterrupted one does, never run a recorded step or item again, never
start an item before its input exists, and only ever grow its checkpoints.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ekit_core import (
    GraphSpec,
    Skipped,
    State,
    Succeeded,
    advance,
    checkpoint_of,
    initial_state,
)
from ekit_core.shapes import Shape
from tests.support.shaped_runs import all_skipped_chain, shaped_graphs, shaped_result

Drive = tuple[dict[str, Any], dict[str, str], list[str]]


def _drive(graph: GraphSpec, order: st.DataObject | None, crashes: bool) -> Drive:
    state, batch = advance(initial_state(graph))
    in_flight = list(batch.names)
    checkpoints: list[dict[str, Any]] = []
    problems: list[str] = []
    ran: set[str] = set()
    while not state.settled:
        if not in_flight:
            problems.append(f"stuck: nothing in flight, outcome {state.outcome}")
            break
        pick = 0 if order is None else order.draw(st.integers(0, len(in_flight) - 1), label="which")
        how_many = 1 if order is None else order.draw(st.integers(1, len(in_flight) - pick), label="group")
        done, in_flight = in_flight[pick:pick + how_many], in_flight[:pick] + in_flight[pick + how_many:]
        inputs = [shaped_result(state, n) for n in done]
        ran.update(done)
        state, batch = advance(state, inputs)
        _check_started(state, batch.names, problems)
        in_flight += batch.names
        cp = checkpoint_of(state).to_dict()
        if checkpoints and not _kept(checkpoints[-1]["outputs"], cp):
            problems.append("a checkpoint lost an output")
        checkpoints.append(json.loads(json.dumps(cp)))
        if crashes and order is not None and not state.settled and order.draw(st.booleans(), label="crash"):
            recorded = set(cp["outputs"]) | set(cp.get("skipped", {}))
            state, batch = advance(initial_state(graph, checkpoints[-1]))
            _check_started(state, batch.names, problems)
            again = [n for n in batch.names if n in recorded]
            if again:
                problems.append(f"resumed run started recorded {again}")
            in_flight = list(batch.names)
    return dict(state.outputs), dict(state.skipped), problems


def _kept(before: dict[str, Any], cp: dict[str, Any]) -> bool:
    """Whether ``cp`` keeps every output of ``before``, or counts it compacted (``keep_last``)."""
    compacted = cp.get("compacted", {})
    return all(n in cp["outputs"] or (n.rpartition("#")[0] in compacted
                                       and int(n.rpartition("#")[2]) <= compacted[n.rpartition("#")[0]])
               for n in before)


def _check_started(state: State, names: tuple[str, ...], problems: list[str]) -> None:
    shaped = state.spec.shaped
    declared = state.spec.declared_graph
    for mapped, shape in declared.shapes.items():
        if shape.map_over is not None and mapped in state.outputs:
            early = [d for d in declared.deps[mapped] if d not in state.outputs]
            if early:
                problems.append(f"{mapped} collected before its dependency {early[0]}")
    for name in names:
        for d in state.spec.graph.deps[name]:
            joins_any = state.spec.declared_graph.shapes.get(name, Shape()).join == "any"
            if d not in state.outputs and not (joins_any and d in state.skipped):
                problems.append(f"{name} started before its dependency {d} was recorded")
        ref = shaped.items.get(name) if shaped is not None else None
        if ref is not None and (ref.source or not ref.iteration) and ref.source not in state.outputs:
            problems.append(f"item {name} started before its input existed")


def _settled(skipped: dict[str, str]) -> dict[str, str]:
    """The skips that say something: not the items of a mapped step skipped as a whole
    (which a run records if it expanded the step before the skip reached it). A step
    that needs several skipped steps names the one whose skip reached it first, so
    only a condition's own reason is compared."""
    return {
        k: v if v.startswith("condition") else "needs a skipped step"
        for k, v in skipped.items() if k.split("[", 1)[0] == k or k.split("[", 1)[0] not in skipped
    }


@pytest.mark.timeout(300)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=shaped_graphs(), data=st.data())
def test_any_order_and_any_crash_end_as_the_plain_run(graph: GraphSpec, data: st.DataObject) -> None:
    reference, reference_skips, problems = _drive(graph, None, crashes=False)
    assert problems == []
    outputs, skipped, problems = _drive(graph, data, crashes=True)
    assert problems == []
    assert outputs == reference
    assert _settled(skipped) == _settled(reference_skips)
    for name, shape in graph.shapes.items():
        if shape.map_over is not None and name not in skipped:
            assert isinstance(outputs[name], list)


def test_a_chained_map_whose_items_are_all_skipped_waits_for_its_other_dependencies() -> None:
    # s4 runs item by item after s1, whose only item is skipped: s4's item is
    # skipped with it, but s4 itself also needs s2, which has not run yet (and
    # might yet be skipped): it is collected only once s2 is recorded.
    graph = GraphSpec.of(
        {"s0": (), "s1": ("s0",), "s2": ("s0", "s1"), "s4": ("s0", "s1", "s2")},
        {"s1": Shape(map_over="s0", when="cond"), "s4": Shape(map_over="s1")},
    )
    state, batch = advance(initial_state(graph))
    state, batch = advance(state, [Succeeded("s0", ["x"])])
    assert batch.names == ("s1[0]",)
    state, batch = advance(state, [Skipped("s1[0]", "condition cond was false")])
    assert state.outputs["s1"] == [] and "s4[0]" in state.skipped
    assert "s4" not in state.outputs and batch.names == ("s2",)
    state, batch = advance(state, [Succeeded("s2", "two")])
    assert state.outputs["s4"] == [] and state.outcome == "finished"


def test_a_chained_map_whose_items_were_skipped_before_a_resume_waits_for_its_other_dependencies() -> None:
    # The same rule when the run resumes between the skip and the dependency:
    # d runs item by item after b, whose only item was skipped (so d's was
    # too), and d also needs c, which had not run. The resume re-expands d
    # with every item settled; it must still wait for c, and c's skip skips d
    # (not record it as [], a checkpoint its own resume would refuse).
    graph, state = all_skipped_chain()
    assert state.outputs["b"] == [] and "d[0]" in state.skipped and "d" not in state.outputs
    saved = json.loads(json.dumps(checkpoint_of(state).to_dict()))

    state, batch = advance(initial_state(graph, saved))
    assert "d" not in state.outputs and batch.names == ("c",)
    skipped, _ = advance(state, [Skipped("c", "condition cond was false")])
    assert "d" not in skipped.outputs and skipped.skipped["d"] == "it needs 'c', which was skipped"
    assert skipped.outcome == "finished"
    initial_state(graph, checkpoint_of(skipped))  # its checkpoint resumes

    recorded, _ = advance(state, [Succeeded("c", "three")])
    assert recorded.outputs["d"] == [] and recorded.outcome == "finished"
