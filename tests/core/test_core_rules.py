"""Core rules checked against their definitions, on random graphs and runs.

- Readiness: while a run is not halted, the ready steps are exactly those
  not done, not in flight, whose dependencies are all done, however the
  state was reached (fresh, resumed from any subset of outputs, any order of
  completions). The core counts unfinished dependencies instead of
  re-reading them, and this is what keeps that shortcut honest.
- Readiness costs O(1) per finished dependency: a join over n parents reads
  the outputs O(n) times in all, not O(n^2).
- No retry once halting: a failure folded after the run halted is final, is
  reported as ``StepFailed`` (never ``StepRetried``) and its error is kept.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import (
    Began,
    Denied,
    Failed,
    GraphSpec,
    Interrupted,
    RetryPolicy,
    State,
    StepFailed,
    StepRetried,
    StepStarted,
    Succeeded,
    TokenUsage,
    TransitionError,
    WorkflowCheckpoint,
    advance,
    apply,
    initial_state,
    plan,
)
from ekit_core.ledger import Ledger
from tests.support.strategies import dags


class Boom(Exception):
    """A step's failure in these simulations."""


def ready_by_definition(state: State) -> set[str]:
    graph = state.graph
    running = set(state.running_steps())
    return {
        n for n in graph.names
        if n not in state.outputs and n not in running
        and all(d in state.outputs for d in graph.deps[n])
    }


def check_ready(state: State) -> None:
    if state.halt is None:
        assert set(state.ready_steps()) == ready_by_definition(state)


@settings(max_examples=200)
@given(dags(max_steps=14), st.data())
def test_ready_steps_match_the_definition_from_any_recorded_subset(
    graph: GraphSpec, data: st.DataObject
) -> None:
    # Any subset, not only closed ones: a checkpoint from before a dependency
    # was added records a step whose new dependency is not done.
    recorded = data.draw(st.sets(st.sampled_from(graph.names)), label="recorded")
    checkpoint = WorkflowCheckpoint(len(recorded), {n: n for n in recorded})  # type: ignore[arg-type]
    state = initial_state(graph, checkpoint, allow_graph_change=True,
                          max_concurrency=data.draw(st.none() | st.integers(1, 3)))
    check_ready(state)
    state, _ = advance(state)
    check_ready(state)
    while not state.settled:
        done = data.draw(st.lists(st.sampled_from(state.running_steps()), min_size=1, unique=True))
        state, _ = advance(state, [Succeeded(n, n) for n in done])
        check_ready(state)
    assert state.outcome == "finished" and set(state.outputs) == set(graph.names)


def test_a_join_over_many_parents_reads_outputs_linearly(monkeypatch: Any) -> None:
    n = 3_000
    graph = GraphSpec.of([*((f"p{i}", []) for i in range(n)), ("join", [f"p{i}" for i in range(n)])])
    reads = [0]
    contains = Ledger.__contains__

    def counting(self: Ledger[Any, Any], key: object) -> bool:
        reads[0] += 1
        return contains(self, key)

    monkeypatch.setattr(Ledger, "__contains__", counting)
    state, batch = advance(initial_state(graph))
    assert len(batch) == n
    for i in range(n):  # one parent per transition: the worst case for re-reading
        state, batch = advance(state, [Succeeded(f"p{i}", i)])
    assert batch.names == ("join",)
    state, _ = advance(state, [Succeeded("join", 0)])
    assert state.outcome == "finished"
    assert reads[0] < 10 * n, f"{reads[0]} reads of the outputs for a join over {n} parents"


@settings(max_examples=200)
@given(dags(min_steps=2, max_steps=10), st.data())
def test_a_failure_folded_after_a_halt_is_final_not_retried(
    graph: GraphSpec, data: st.DataObject
) -> None:
    policies = {n: RetryPolicy(max_attempts=5, backoff_base=1.0) for n in graph.names}
    calls = data.draw(st.integers(1, len(graph)), label="budget calls")
    state, _ = advance(initial_state(graph, budget=TokenUsage(llm_calls=calls), policies=policies))
    while not state.settled:
        running = state.running_steps()
        chosen = data.draw(st.lists(st.sampled_from(running), min_size=1, unique=True))
        results: list[Any] = []
        for name in chosen:
            if data.draw(st.booleans(), label=f"{name} fails"):
                results.append(Failed(name, Boom(name)))
            else:
                results.append(Succeeded(name, name, TokenUsage(llm_calls=1)))
        for i, result in enumerate(results):
            if isinstance(result, Failed):
                before = apply(state, results[:i])
                after = apply(before, [result])
                if before.halt is not None:
                    kinds = [type(e) for e in after.events if getattr(e, "name", None) == result.name]
                    assert kinds == [StepFailed], kinds
                    assert (result.name, result.error) in after.errors
                    assert result.name not in after.delays
                    assert result.name not in after.ready_steps()
        state, batch = advance(state, results)
        if state.halt is not None:
            # A retry scheduled earlier in the same group is withdrawn, not started.
            assert not batch.starts
    if state.errors:
        assert state.outcome == "failed"


# -- gated attempts: approval and retry delays are the core's decisions -----------------


def test_start_says_when_approval_is_asked_first_attempts_only() -> None:
    graph = GraphSpec.of({"a": [], "b": []})
    policy = RetryPolicy(max_attempts=2, backoff_base=0.0)
    state, batch = advance(initial_state(graph, approval=True, policies={"a": policy}))
    assert [(s.name, s.attempt, s.approval) for s in batch.starts] == [("a", 1, True), ("b", 1, True)]
    assert not any(isinstance(e, StepStarted) for e in state.events)  # not begun yet
    assert set(state.gated_steps()) == {"a", "b"}
    state, batch = advance(state, [Began("a")])
    assert [e for e in state.events if isinstance(e, StepStarted)] == [StepStarted("a", 1, 0.0)]
    state, batch = advance(state, [Failed("a", Boom("once"))])
    (retry,) = batch.starts
    assert (retry.name, retry.attempt, retry.approval, retry.gated) == ("a", 2, False, False)
    without = advance(initial_state(graph))[1]
    assert not any(s.approval for s in without.starts)


def test_a_retry_delay_gates_the_attempt_until_it_began() -> None:
    graph = GraphSpec.of({"a": []})
    policy = RetryPolicy(max_attempts=3, backoff_base=2.0)
    state, _ = advance(initial_state(graph, policies={"a": policy}))
    state, batch = advance(state, [Failed("a", Boom("x"))])
    (start,) = batch.starts
    assert start.delay == 2.0 and start.gated
    retried = [e for e in state.events if isinstance(e, StepRetried | StepStarted)]
    assert [type(e) for e in retried] == [StepRetried]  # the real start comes later
    state, _ = advance(state, [Began("a")])
    assert state.events == (StepStarted("a", 2, 2.0),)
    with pytest.raises(TransitionError, match="which is running: no row of the phase table takes Began"):
        apply(state, [Began("a")])  # it began already


def test_a_halt_withdraws_gated_attempts_and_nothing_else() -> None:
    graph = GraphSpec.of({"slow": [], "flaky": [], "bad": []})
    policy = RetryPolicy(max_attempts=3, backoff_base=5.0)
    state, _ = advance(initial_state(graph, policies={"flaky": policy}))
    state, batch = advance(state, [Failed("flaky", Boom("retry me"))])
    assert batch.names == ("flaky",) and not batch.withdraw
    state, batch = advance(state, [Failed("bad", Boom("fatal"))])
    assert batch.withdraw == ("flaky",) and not batch.starts
    assert plan(state).withdraw == ("flaky",)
    state, batch = advance(state, [Interrupted("flaky")])
    assert not batch.withdraw and state.running_steps() == ("slow",)
    state, _ = advance(state, [Succeeded("slow", 1)])
    assert state.outcome == "failed" and dict(state.outputs) == {"slow": 1}


@settings(max_examples=80, deadline=None)
@given(dags(max_steps=8), st.data())
def test_gated_runs_fused_equals_apply_then_plan(graph: GraphSpec, data: st.DataObject) -> None:
    policies = {n: RetryPolicy(max_attempts=3, backoff_base=1.0) for n in graph.names}
    state = initial_state(graph, approval=data.draw(st.booleans()), policies=policies,
                          max_concurrency=data.draw(st.none() | st.integers(1, 3)))
    inputs: list[Any] = []
    for _ in range(40):
        if state.settled:
            break
        fused, batch = advance(state, inputs)
        folded = apply(state, inputs)
        assert batch == plan(folded)
        slow = apply(folded, batch.starts)
        assert fused.events == folded.events + slow.events
        assert replace(fused, events=()) == replace(slow, events=())
        check_ready(fused) if not fused.gated_steps() else None
        state, inputs = fused, []
        for name in state.running_steps():
            choice = data.draw(st.sampled_from(["wait", "begin", "ok", "fail", "deny"]), label=name)
            gated = name in state.gated_steps()
            if choice == "begin" and gated:
                inputs.append(Began(name))
            elif choice == "ok" and not gated:
                inputs.append(Succeeded(name, name))
            elif choice == "fail":
                inputs.append(Failed(name, Boom(name)))
            elif choice == "deny" and gated:
                inputs.append(Denied(name, "no"))
        for name in batch.withdraw:
            if not any(getattr(i, "name", None) == name for i in inputs):
                inputs.append(Interrupted(name))
    assert all(n not in state.outputs or n not in state.running_steps() for n in graph.names)
