"""A small simulator of the shell over the pure core, shared by the core's property tests.

It drives ``advance`` (or ``plan``/``apply``) the way the shell does, with hypothesis
choosing which in-flight steps finish next, which fail, when the run is cancelled
or crashes, and what the budget is; ``Trace`` records what it saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from ekit_core import (
    Cancelled,
    Failed,
    GraphSpec,
    Interrupted,
    RetryPolicy,
    State,
    Succeeded,
    TokenUsage,
    WorkflowCheckpoint,
    advance,
    apply,
    checkpoint_of,
    initial_state,
    plan,
)


class Boom(Exception):
    """A step's failure in the simulation."""


def output_of(graph: GraphSpec, name: str, outputs: Any) -> str:
    # Built from the dependencies' outputs, so a wrong order or a lost input shows.
    return f"{name}({','.join(outputs[d] for d in sorted(graph.deps[name]))})"


def fresh_outputs(graph: GraphSpec) -> dict[str, str]:
    done: dict[str, str] = {}
    while len(done) < len(graph):
        for name in graph.names:
            if name not in done and all(d in done for d in graph.deps[name]):
                done[name] = output_of(graph, name, done)
    return done


@dataclass
class Trace:
    starts: list[str] = field(default_factory=list)
    # For each start, the index of the transition (checkpoint) it followed; -1 first.
    start_points: list[int] = field(default_factory=list)
    checkpoints: list[WorkflowCheckpoint] = field(default_factory=list)
    max_in_flight: int = 0


def simulate(
    graph: GraphSpec,
    data: st.DataObject,
    trace: Trace,
    *,
    resume_from: WorkflowCheckpoint | None = None,
    max_concurrency: int | None = None,
    budget: TokenUsage | None = None,
    fail: frozenset[str] = frozenset(),
    policies: dict[str, RetryPolicy] | None = None,
    fail_times: dict[str, int] | None = None,
    may_crash: bool = False,
    may_cancel: bool = False,
    use_plan_apply: bool = False,
) -> State:
    state = initial_state(
        graph, resume_from, max_concurrency=max_concurrency, budget=budget, policies=policies
    )
    failures_left = dict(fail_times or {})

    def start(state: State) -> State:
        if use_plan_apply:
            batch = plan(state)
            state = apply(state, batch.starts)
        else:
            state, batch = advance(state)
        for s in batch.starts:
            assert all(d in state.outputs for d in graph.deps[s.name]), "started before deps"
            assert s.name not in state.outputs, "recorded step started again"
            trace.starts.append(s.name)
            trace.start_points.append(len(trace.checkpoints) - 1)
        return state

    state = start(state)
    while not state.settled:
        in_flight = list(state.running_steps())
        trace.max_in_flight = max(trace.max_in_flight, len(in_flight))
        assert in_flight, "stalled: nothing in flight and the run is not settled"
        if may_crash and data.draw(st.integers(0, 9), label="crash?") == 0:
            return state  # the process died: only checkpoints survive
        results: list[Any] = []
        if may_cancel and data.draw(st.integers(0, 9), label="cancel?") == 0:
            results.append(Cancelled())
            for name in in_flight:
                if data.draw(st.booleans(), label=f"{name} finished before cancel"):
                    results.append(Succeeded(name, output_of(graph, name, state.outputs)))
                else:
                    results.append(Interrupted(name))
        else:
            chosen = data.draw(
                st.lists(st.sampled_from(in_flight), min_size=1, unique=True), label="complete"
            )
            for name in chosen:
                if name in fail:
                    results.append(Failed(name, Boom(name)))
                elif failures_left.get(name, 0) > 0:
                    failures_left[name] -= 1
                    results.append(Failed(name, Boom(name)))
                else:
                    out = output_of(graph, name, state.outputs)
                    results.append(Succeeded(name, out, TokenUsage(1, 2, 1)))
        before = state
        if use_plan_apply:
            state = apply(state, results)
        else:
            state, batch = advance(state, results)
            for s in batch.starts:
                assert all(d in state.outputs for d in graph.deps[s.name])
                trace.starts.append(s.name)
                trace.start_points.append(len(trace.checkpoints))
        # Finished outputs are never lost, whatever fails around them.
        for r in results:
            if isinstance(r, Succeeded):
                assert state.outputs[r.name] == r.output
        assert all(state.outputs[k] == v for k, v in before.outputs.items())
        trace.checkpoints.append(checkpoint_of(state))
        if use_plan_apply:
            state = start(state)
    return state
