"""A loop whose body is a child workflow (``repeat=`` with ``child=``) resumed from any
checkpoint ends as the uninterrupted run does.

The body is the agent's shape: ``plan`` (the model call, reading the state the
loop carries), ``tool`` (what it asked for: one step, or mapped over ``plan``'s
list, zero to two items an iteration), ``fold`` (the body's output, which ends
the loop). Random caps, exit iterations (or none: the cap fails the loop),
``keep_last``, interrupted attempts, and crashes at random points, each resume
starting from the last checkpoint round tripped through JSON. Whatever the crashes:

- the run ends as the uninterrupted run does, and replay accepts the whole record;
- no body step of iteration ``k`` starts before iteration ``k-1``'s output step is
  recorded, nor before its own body dependencies of iteration ``k``;
- no iteration of a body step whose output a checkpoint recorded (or compacted) runs again;
- checkpoints only grow, but for compaction, which lets go of whole iterations only.
"""

from __future__ import annotations

import json
from itertools import pairwise
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import (
    Ended,
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
    rewind,
)
from ekit_core.expansion import iteration_of

BODY = ("agent/plan", "agent/tool", "agent/fold")
TABLE = dict.fromkeys(BODY)


def _graph(cap: int, keep: int | None, mapped: bool = False) -> GraphSpec:
    shapes = {"agent": Shape(child="agent/fold", repeat=cap, keep_last=keep)}
    if mapped:
        shapes["agent/tool"] = Shape(map_over="agent/plan")
    return GraphSpec.of(
        {"a": [], "agent/plan": ["a"], "agent/tool": ["agent/plan", "a"],
         "agent/fold": ["agent/tool", "agent/plan", "a"], "agent": ["agent/fold"], "z": ["agent"]},
        shapes)


def _iteration(name: str) -> tuple[str, int] | None:
    """``(body step, k)`` of a body step's iteration, or of an item of one (``agent/tool#k[i]``)."""
    return iteration_of(name.partition("[")[0], TABLE)


def _plan(carried: int, k: int, mapped: bool) -> Any:
    p = carried * 10 + k
    return [p + i for i in range(k % 3)] if mapped else p


def _fold(tool: Any, mapped: bool, k: int) -> int:
    return sum(tool) * 2 + k if mapped else int(tool) * 2


def _result(state: State, name: str, ends_at: int) -> Any:
    """plan: from the carried state; tool: plan + 1 (per item, mapped); fold: from tool,
    ending at ``ends_at``."""
    outputs = state.outputs
    if name == "a":
        return Succeeded("a", 1)
    if name == "z":
        return Succeeded("z", ["saw", outputs["agent"]])
    mapped = "agent/tool" in state.spec.declared_graph.shapes
    ref = state.spec.shaped.items[name]  # type: ignore[union-attr]
    if not ref.iteration:  # an item of iteration k's tool step: plan#k's item
        assert ref.step.startswith("agent/tool#") and ref.source == ref.step.replace("tool", "plan")
        return Succeeded(name, outputs[ref.source][ref.pick] + 1)
    step, k = ref.step, ref.iteration
    if step == "agent/plan":
        assert ref.source == ("" if k == 1 else f"agent/fold#{k - 1}")
        return Succeeded(name, _plan(outputs["a"] if k == 1 else outputs[ref.source], k, mapped))
    if step == "agent/tool":
        return Succeeded(name, outputs[f"agent/plan#{k}"] + 1)
    value = _fold(outputs[f"agent/tool#{k}"], mapped, k)
    return Ended(name, value) if k == ends_at else Succeeded(name, value)


def _expected(ends_at: int, mapped: bool = False) -> int:
    value = 1
    for k in range(1, ends_at + 1):
        plan = _plan(value, k, mapped)
        value = _fold([p + 1 for p in plan] if mapped else plan + 1, mapped, k)
    return value


def _check_start(state: State, name: str) -> None:
    """What a start may rely on: its iteration's body dependencies, and the one before it."""
    at = _iteration(name)
    if at is None:
        return
    step, k = at
    compacted = state.spec.shaped.compacted.get("agent", 0)  # type: ignore[union-attr]
    needs = {"agent/plan": [], "agent/tool": ["agent/plan"],
             "agent/fold": ["agent/tool", "agent/plan"]}[step]
    if name.endswith("]"):  # an item of tool#k: plan#k is recorded
        needs = ["agent/plan"]
    for d in needs:
        assert f"{d}#{k}" in state.outputs, f"{name} started before {d}#{k} was recorded"
    if k > 1 and step == "agent/plan":
        assert f"agent/fold#{k - 1}" in state.outputs or k - 1 <= compacted, \
            f"{name} started before iteration {k - 1} ended"


def _drive(graph: GraphSpec, ends_at: int, crashes: list[int] | None
           ) -> tuple[State, list[WorkflowCheckpoint], list[str]]:
    state, batch = advance(initial_state(graph))
    checkpoints = [checkpoint_of(state)]
    started = [s.name for s in batch.starts]
    fold = 0
    while not state.settled:
        fold += 1
        if crashes and fold in crashes:  # what was in flight is lost; resume from the last save
            text = json.dumps(checkpoints[-1].to_dict())
            recorded = _recorded(WorkflowCheckpoint.from_dict(json.loads(text)))
            state, batch = advance(initial_state(graph, json.loads(text)))
            assert not recorded & {s.name for s in batch.starts}, "a recorded iteration runs again"
            for s in batch.starts:
                _check_start(state, s.name)
            started += [s.name for s in batch.starts]
            checkpoints.append(checkpoint_of(state))
            continue
        name = state.running_steps()[0]
        if crashes is not None and fold % 5 == 2:  # an attempt cut short: it runs again
            state, batch = advance(state, [Interrupted(name)])
        else:
            state, batch = advance(state, [_result(state, name, ends_at)])
        for s in batch.starts:
            _check_start(state, s.name)
        started += [s.name for s in batch.starts]
        checkpoints.append(checkpoint_of(state))
    return state, checkpoints, started


def _recorded(cp: WorkflowCheckpoint) -> set[str]:
    """The body iterations ``cp`` records: their outputs, and those compacted."""
    names = {n for n in cp.outputs if _iteration(n)}
    return names | {f"{s}#{k}" for s in BODY for k in range(1, cp.compacted.get("agent", 0) + 1)}


def _only_grow(graph: GraphSpec, checkpoints: list[WorkflowCheckpoint]) -> None:
    keep = graph.shapes["agent"].keep_last
    for before, after in pairwise(checkpoints):
        compacted = after.compacted.get("agent", 0)
        assert compacted >= before.compacted.get("agent", 0)
        for name, value in before.outputs.items():
            if name in after.outputs:
                assert after.outputs[name] == value, name
            else:
                at = _iteration(name)
                assert at is not None and at[1] <= compacted, f"{name} dropped, not compacted"
        kept = {at[1] for n in after.outputs if (at := _iteration(n)) is not None}
        assert keep is None or len(kept) <= keep + 1  # (the next iteration may have begun)
        assert all(k > compacted for k in kept)


@settings(max_examples=120, deadline=None)
@given(cap=st.integers(1, 6), ends_at=st.integers(1, 7), keep=st.sampled_from([None, 1, 2]),
       mapped=st.booleans(), crashes=st.lists(st.integers(1, 30), max_size=6))
def test_a_loop_body_resumed_at_any_point_ends_as_the_uninterrupted_run(
        cap: int, ends_at: int, keep: int | None, mapped: bool, crashes: list[int]) -> None:
    graph = _graph(cap, keep, mapped)
    plain, plain_cps, plain_started = _drive(graph, ends_at, None)
    state, checkpoints, started = _drive(graph, ends_at, sorted(set(crashes)))
    assert state.outcome == plain.outcome == ("finished" if ends_at <= cap else "failed")
    assert state.outputs.get("agent") == plain.outputs.get("agent")
    assert state.outputs.get("z") == plain.outputs.get("z")
    last = min(ends_at, cap)
    if ends_at <= cap:
        assert plain.outputs["z"] == ["saw", _expected(ends_at, mapped)]
        # the body's steps record their last iteration's outputs: the declared graph is whole
        assert plain.outputs["agent/fold"] == plain.outputs["agent"]
    else:
        assert state.setbacks.halt is not None and state.setbacks.halt.step == "agent"
        assert "LoopError" in state.setbacks.halt.reason and f"repeat={cap}" in state.setbacks.halt.reason
        assert f"agent/plan#{cap + 1}" not in started
    expected = [f"{s}#{k}" for s in BODY for k in range(1, last + 1)]
    if mapped:  # tool#k runs as its items, one per element of plan#k's list
        expected = [n for n in expected if not n.startswith("agent/tool#")] + [
            f"agent/tool#{k}[{i}]" for k in range(1, last + 1) for i in range(k % 3)]
    assert sorted(n for n in plain_started if "#" in n) == sorted(expected)
    _only_grow(graph, plain_cps)
    _only_grow(graph, checkpoints)
    for record in (plain_cps, checkpoints):
        report = replay(graph, record)
        assert report.ok, report.violations[:3]
    assert audit(graph, checkpoints[-1]).clean


@settings(max_examples=40, deadline=None)
@given(cap=st.integers(2, 6), ends_at=st.integers(1, 6), data=st.data())
def test_a_rewind_to_a_body_step_of_iteration_k_keeps_what_came_before(
        cap: int, ends_at: int, data: st.DataObject) -> None:
    graph = _graph(cap, None)
    state, _, _ = _drive(graph, ends_at, None)
    last = min(ends_at, cap)
    k = data.draw(st.integers(1, last))
    step = data.draw(st.sampled_from(BODY))
    rewound = rewind(graph, checkpoint_of(state), f"{step}#{k}")
    before = BODY[:BODY.index(step)]
    assert sorted(n for n in rewound.outputs if "#" in n) == sorted(
        [f"{s}#{j}" for s in BODY for j in range(1, k)] + [f"{s}#{k}" for s in before])
    assert not {"agent", "z", *BODY} & rewound.outputs.keys()
    report = audit(graph, rewound)
    assert report.clean and [s.name for s in report.steps if s.reason == "ready"] == [f"{step}#{k}"]
    assert [s.reason for s in report.steps if s.name in ("agent", *BODY)] == ["looping"] * 4
    _, batch = advance(initial_state(graph, json.loads(json.dumps(rewound.to_dict()))))
    assert [s.name for s in batch.starts] == [f"{step}#{k}"]


def test_a_loop_body_must_end_in_its_output_and_maps_only_over_an_unmapped_body_step() -> None:
    import pytest

    from ekit_core import GraphError

    with pytest.raises(GraphError, match=r"'agent'.*must end in its output 'agent/fold' alone.*"
                                         r"'agent/side'"):
        GraphSpec.of({"agent/fold": [], "agent/side": [], "agent": ["agent/fold"]},
                     {"agent": Shape(child="agent/fold", repeat=3)})
    with pytest.raises(GraphError, match=r"step 'agent/each' of the body of loop 'agent' cannot "
                                         r"take map_over on its output \(yet\)"):
        GraphSpec.of({"agent/plan": [], "agent/each": ["agent/plan"], "agent": ["agent/each"]},
                     {"agent": Shape(child="agent/each", repeat=3),
                      "agent/each": Shape(map_over="agent/plan")})
    chained = {"agent/plan": [], "agent/a": ["agent/plan"], "agent/b": ["agent/a"],
               "agent/fold": ["agent/b"], "agent": ["agent/fold"]}
    with pytest.raises(GraphError, match=r"'agent/b' of the body of loop 'agent' cannot take "
                                         r"map_over a mapped step"):
        GraphSpec.of(chained, {"agent": Shape(child="agent/fold", repeat=3),
                               "agent/a": Shape(map_over="agent/plan"),
                               "agent/b": Shape(map_over="agent/a")})
    with pytest.raises(GraphError, match=r"'agent/a' of the body of loop 'agent' cannot take when"):
        GraphSpec.of(chained, {"agent": Shape(child="agent/fold", repeat=3),
                               "agent/a": Shape(when="urgent")})
