"""Loops (``repeat=``) resumed from any checkpoint end as the uninterrupted run does.

Random caps, random exit iterations (or none: the cap fails the loop), random
``keep_last``, a loop between a step it needs and a step that needs it, and
crashes at random points: each resume starts from the last checkpoint, round
tripped through JSON. Whatever the crashes:

- the run ends as the uninterrupted run does (outcome, the loop's output, what
  its dependent saw), and replay accepts the whole record;
- no iteration whose output a checkpoint recorded (or compacted) runs again;
- checkpoints only grow, but for compaction: an iteration's output leaves a
  checkpoint only when ``compacted`` counts it, and at most ``keep_last`` of a
  loop's iterations are kept.
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
    checkpoint_of,
    initial_state,
    replay,
)
from ekit_core.expansion import iteration_of


def _graph(cap: int, keep: int | None) -> GraphSpec:
    return GraphSpec.of({"a": [], "agent": ["a"], "z": ["agent"]},
                        {"agent": Shape(repeat=cap, keep_last=keep)})


def _result(state: State, name: str, ends_at: int) -> Any:
    """What the step does: an iteration adds its number to the state it carries."""
    outputs = state.outputs
    if name == "a":
        return Succeeded("a", 1)
    if name == "z":
        return Succeeded("z", ["saw", outputs["agent"]])
    at = iteration_of(name, {"agent": None})
    assert at is not None, name
    k = at[1]
    before = outputs["a"] if k == 1 else outputs[f"agent#{k - 1}"]
    value = before * 10 + k
    return Ended(name, value) if k == ends_at else Succeeded(name, value)


def _drive(graph: GraphSpec, ends_at: int, crashes: list[int] | None
           ) -> tuple[State, list[WorkflowCheckpoint], list[str]]:
    """Run to the end, crashing after the folds ``crashes`` names; every checkpoint, every start."""
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
            started += [s.name for s in batch.starts]
            checkpoints.append(checkpoint_of(state))
            continue
        name = state.running_steps()[0]
        if crashes is not None and fold % 7 == 3:  # an attempt cut short: it runs again
            state, batch = advance(state, [Interrupted(name)])
        else:
            state, batch = advance(state, [_result(state, name, ends_at)])
        started += [s.name for s in batch.starts]
        checkpoints.append(checkpoint_of(state))
    return state, checkpoints, started


def _recorded(cp: WorkflowCheckpoint) -> set[str]:
    """The iterations ``cp`` records: their outputs, and those compacted."""
    names = {n for n in cp.outputs if iteration_of(n, {"agent": None})}
    return names | {f"agent#{k}" for k in range(1, cp.compacted.get("agent", 0) + 1)}


def _only_grow(graph: GraphSpec, checkpoints: list[WorkflowCheckpoint]) -> None:
    keep = graph.shapes["agent"].keep_last
    for before, after in pairwise(checkpoints):
        compacted = after.compacted.get("agent", 0)
        assert compacted >= before.compacted.get("agent", 0)
        for name, value in before.outputs.items():
            if name in after.outputs:
                assert after.outputs[name] == value, name
            else:
                at = iteration_of(name, {"agent": None})
                assert at is not None and at[1] <= compacted, f"{name} dropped, not compacted"
        kept = [n for n in after.outputs if iteration_of(n, {"agent": None})]
        assert keep is None or len(kept) <= keep


@settings(max_examples=150, deadline=None)
@given(cap=st.integers(1, 8), ends_at=st.integers(1, 10), keep=st.sampled_from([None, 1, 2, 3]),
       crashes=st.lists(st.integers(1, 25), max_size=6))
def test_a_loop_resumed_at_any_point_ends_as_the_uninterrupted_run(
        cap: int, ends_at: int, keep: int | None, crashes: list[int]) -> None:
    graph = _graph(cap, keep)
    plain, plain_cps, plain_started = _drive(graph, ends_at, None)
    state, checkpoints, started = _drive(graph, ends_at, sorted(set(crashes)))
    assert state.outcome == plain.outcome == ("finished" if ends_at <= cap else "failed")
    assert state.outputs.get("agent") == plain.outputs.get("agent")
    assert state.outputs.get("z") == plain.outputs.get("z")
    if ends_at <= cap:
        assert plain.outputs["z"] == ["saw", int("1" + "".join(str(k) for k in range(1, ends_at + 1)))]
        assert plain_started.count(f"agent#{ends_at}") == 1
    else:
        assert state.setbacks.halt is not None and state.setbacks.halt.step == "agent"
        assert "LoopError" in state.setbacks.halt.reason and f"repeat={cap}" in state.setbacks.halt.reason
        assert f"agent#{cap + 1}" not in started
    # every iteration ran once in the plain run; never more than its number of interruptions
    assert sorted(n for n in plain_started if "#" in n) == sorted(
        f"agent#{k}" for k in range(1, min(ends_at, cap) + 1))
    _only_grow(graph, plain_cps)
    _only_grow(graph, checkpoints)
    report = replay(graph, plain_cps)
    assert report.ok, report.violations[:3]
    report = replay(graph, checkpoints)
    assert report.ok, report.violations[:3]


@settings(max_examples=60, deadline=None)
@given(cap=st.integers(2, 8), ends_at=st.integers(1, 8), data=st.data())
def test_a_rewind_to_iteration_k_keeps_the_iterations_before_it(
        cap: int, ends_at: int, data: st.DataObject) -> None:
    from ekit_core import audit, rewind

    graph = _graph(cap, None)
    state, _, _ = _drive(graph, ends_at, None)
    last = min(ends_at, cap)
    k = data.draw(st.integers(1, last))
    rewound = rewind(graph, checkpoint_of(state), f"agent#{k}")
    assert sorted(n for n in rewound.outputs if "#" in n) == [f"agent#{j}" for j in range(1, k)]
    assert "agent" not in rewound.outputs and "z" not in rewound.outputs
    report = audit(graph, rewound)
    assert report.clean and [s.name for s in report.steps if s.reason == "ready"] == [f"agent#{k}"]
    _, batch = advance(initial_state(graph, json.loads(json.dumps(rewound.to_dict()))))
    assert [s.name for s in batch.starts] == [f"agent#{k}"]
