"""Property tests of the pure core: random DAGs, completion orders, failures, crashes.

A small simulator drives ``advance`` (or ``plan``/``apply``) the way the shell
does, with hypothesis choosing which in-flight steps finish next, which fail,
when the run is cancelled or crashes, and what the budget is. Every run checks
the architecture's invariants:

1. a step is skipped on resume iff its output is recorded;
2. no recorded step runs again and no finished output is lost;
3. a step never starts before its dependencies finished;
4. resuming from any checkpoint gives the fresh run's outputs;
5. checkpoints of a run only grow.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import (
    Failed,
    GraphSpec,
    RetryPolicy,
    Start,
    Succeeded,
    TokenUsage,
    WorkflowCheckpoint,
    advance,
    apply,
    checkpoint_of,
    initial_state,
    plan,
)
from tests.support.core_simulator import Boom, Trace, fresh_outputs, output_of, simulate
from tests.support.strategies import dags


def assert_grows(checkpoints: list[WorkflowCheckpoint]) -> None:
    for older, newer in pairwise(checkpoints):
        for name, output in older.outputs.items():
            assert newer.outputs[name] == output
        assert newer.step_index >= older.step_index
        assert newer.cost.llm_calls >= older.cost.llm_calls


@settings(max_examples=150)
@given(dags(), st.data(), st.booleans())
def test_every_step_starts_once_after_its_dependencies(
    graph: GraphSpec, data: st.DataObject, use_plan_apply: bool
) -> None:
    trace = Trace()
    state = simulate(graph, data, trace, use_plan_apply=use_plan_apply)
    assert state.outcome == "finished"
    assert sorted(trace.starts) == sorted(graph.names)
    assert dict(state.outputs) == fresh_outputs(graph)
    assert state.cost == TokenUsage(len(graph), 2 * len(graph), len(graph))
    assert [c.step_index for c in trace.checkpoints] == sorted(c.step_index for c in trace.checkpoints)
    assert_grows(trace.checkpoints)


@settings(max_examples=150)
@given(dags(max_steps=10), st.data(), st.integers(1, 3))
def test_crash_anywhere_then_resume_matches_a_fresh_run(
    graph: GraphSpec, data: st.DataObject, limit: int
) -> None:
    trace = Trace()
    checkpoint: WorkflowCheckpoint | None = None
    for attempt in range(8):
        run = Trace()
        state = simulate(
            graph, data, run, resume_from=checkpoint, max_concurrency=limit, may_crash=attempt < 6
        )
        if checkpoint is not None:
            # Invariant 1: exactly the unrecorded steps may start.
            assert not set(run.starts) & set(checkpoint.outputs)
        assert run.max_in_flight <= limit
        trace.checkpoints.extend(run.checkpoints)
        trace.starts.extend(run.starts)
        if run.checkpoints:
            checkpoint = run.checkpoints[-1]
        if state.outcome == "finished":
            break
    else:
        pytest.fail("run never finished")
    assert dict(state.outputs) == fresh_outputs(graph)
    assert_grows(trace.checkpoints)
    # Invariant 2: a step runs again only if it was never recorded before its restart.
    recorded_at: dict[str, int] = {}
    for i, cp in enumerate(trace.checkpoints):
        for name in cp.outputs:
            recorded_at.setdefault(name, i)
    assert set(recorded_at) == set(graph.names)


@settings(max_examples=100)
@given(dags(max_steps=10), st.data())
def test_resume_from_every_checkpoint_gives_the_same_outputs(
    graph: GraphSpec, data: st.DataObject
) -> None:
    trace = Trace()
    simulate(graph, data, trace)
    expected = fresh_outputs(graph)
    for cp in trace.checkpoints:
        resumed = Trace()
        state = simulate(graph, data, resumed, resume_from=cp)
        assert state.outcome == "finished"
        assert dict(state.outputs) == expected
        assert set(resumed.starts) == set(graph.names) - set(cp.outputs)
        assert state.cost.llm_calls == len(graph)  # usage restored exactly, never paid twice


@settings(max_examples=150)
@given(dags(min_steps=2), st.data())
def test_a_failure_stops_new_starts_and_keeps_sibling_outputs(
    graph: GraphSpec, data: st.DataObject
) -> None:
    failing = data.draw(st.sets(st.sampled_from(graph.names), min_size=1), label="failing")
    trace = Trace()
    state = simulate(graph, data, trace, fail=frozenset(failing))
    assert state.outcome == "failed"
    failed_names = {name for name, _ in state.errors}
    assert failed_names and failed_names <= failing
    for name in failed_names:
        assert name not in state.outputs
        assert state.failures[name].error_type == "Boom"
        assert state.failures[name].attempts == 1
    # After the first fatal failure nothing new started.
    first_failure = next(i for i, cp in enumerate(trace.checkpoints) if cp.failures)
    assert all(point < first_failure for point in trace.start_points)
    assert len(trace.starts) == len(set(trace.starts))
    # The failure is not an output: resuming without the fault runs it and finishes.
    resumed = Trace()
    final = simulate(graph, data, resumed, resume_from=trace.checkpoints[-1])
    assert final.outcome == "finished"
    assert failed_names <= set(resumed.starts)
    assert not set(resumed.starts) & set(trace.checkpoints[-1].outputs)
    assert dict(final.outputs) == fresh_outputs(graph)
    assert final.failures[min(failed_names)].attempts == 1  # the record stays as history


@settings(max_examples=100)
@given(dags(), st.data(), st.integers(1, 4), st.integers(0, 5))
def test_retries_follow_the_policy(
    graph: GraphSpec, data: st.DataObject, max_attempts: int, failures: int
) -> None:
    target = data.draw(st.sampled_from(graph.names), label="flaky step")
    policy = RetryPolicy(max_attempts=max_attempts, backoff_base=1.0, backoff_cap=3.0)
    trace = Trace()
    state = simulate(
        graph, data, trace, policies={target: policy}, fail_times={target: failures}
    )
    if failures < max_attempts:
        assert state.outcome == "finished"
        assert trace.starts.count(target) == failures + 1
    else:
        assert state.outcome == "failed"
        assert trace.starts.count(target) == max_attempts
        assert state.errors[0][0] == target
    if failures:
        assert state.failures[target].attempts == min(failures, max_attempts)
    assert [policy.delay(k) for k in (1, 2, 3)] == [1.0, 2.0, 3.0]


@settings(max_examples=150)
@given(dags(min_steps=2), st.data(), st.integers(1, 6))
def test_budget_stops_new_starts_and_a_larger_budget_finishes(
    graph: GraphSpec, data: st.DataObject, calls: int
) -> None:
    trace = Trace()
    state = simulate(graph, data, trace, budget=TokenUsage(llm_calls=calls))
    if calls >= len(graph):
        assert state.outcome == "finished"
        return
    assert state.outcome in ("budget_exceeded", "finished")
    if state.outcome == "finished":
        return  # steps in flight when the budget was reached were the last ones
    halted_at = next(i for i, cp in enumerate(trace.checkpoints) if cp.cost.llm_calls >= calls)
    assert all(point < halted_at for point in trace.start_points)  # nothing started after
    assert state.halt is not None and state.halt.kind == "budget_exceeded"
    resumed = Trace()
    final = simulate(
        graph, data, resumed, resume_from=trace.checkpoints[-1], budget=TokenUsage(llm_calls=10**6)
    )
    assert final.outcome == "finished"
    assert not set(resumed.starts) & set(trace.checkpoints[-1].outputs)
    assert dict(final.outputs) == fresh_outputs(graph)


@settings(max_examples=150)
@given(dags(min_steps=2), st.data())
def test_cancellation_keeps_what_finished_and_resumes(graph: GraphSpec, data: st.DataObject) -> None:
    trace = Trace()
    checkpoint = None
    for attempt in range(8):
        run = Trace()
        state = simulate(graph, data, run, resume_from=checkpoint, may_cancel=attempt < 6)
        assert state.settled
        if checkpoint is not None:
            assert not set(run.starts) & set(checkpoint.outputs)
        trace.checkpoints.extend(run.checkpoints)
        if run.checkpoints:
            checkpoint = run.checkpoints[-1]
        if state.outcome == "finished":
            break
        assert state.outcome == "cancelled"
        assert not state.running_steps()
    assert dict(state.outputs) == fresh_outputs(graph)
    assert_grows(trace.checkpoints)


@given(dags(), st.data())
def test_advance_equals_apply_then_plan_then_apply(graph: GraphSpec, data: st.DataObject) -> None:
    state = initial_state(graph, max_concurrency=data.draw(st.integers(1, 4) | st.none()))
    while not state.settled:
        fused, batch = advance(state)
        slow = apply(state, plan(state).starts)
        assert batch == plan(state)
        assert fused.ready_steps() == slow.ready_steps() and fused.running_steps() == slow.running_steps()
        # The private bit window too: the fused path must build the very same value.
        assert (fused._offset, fused._ready, fused._running, fused.completed) == (
            slow._offset, slow._ready, slow._running, slow.completed
        )
        assert fused == slow
        assert fused.events == slow.events
        name = data.draw(st.sampled_from(fused.running_steps()))
        state = apply(fused, [Succeeded(name, output_of(graph, name, fused.outputs))])


def test_transitions_never_mutate_their_input() -> None:
    graph = GraphSpec.of({"a": [], "b": ["a"], "c": ["a"]})
    s0 = initial_state(graph)
    s1, batch = advance(s0)
    snapshot = (s1.ready_steps(), s1.running_steps(), dict(s1.outputs), s1.completed, s1.events)
    s2, _ = advance(s1, [Succeeded("a", 1)])
    s2b, _ = advance(s1, [Failed("a", Boom("x"))])  # a branch from the same state
    assert (s1.ready_steps(), s1.running_steps(), dict(s1.outputs), s1.completed, s1.events) == snapshot
    assert dict(s2.outputs) == {"a": 1} and dict(s2b.outputs) == {}
    assert s2.running_steps() == ("b", "c") and s2b.outcome == "failed"
    assert batch.names == ("a",) and s0.running_steps() == () and s0.running_count == 0


@pytest.mark.parametrize(
    ("results", "message"),
    [
        ([Succeeded("b", 1)], "which is waiting: no row of the phase table takes Succeeded"),
        ([Start("b")], "which is waiting: no row of the phase table takes Start"),
        ([Succeeded("ghost", 1)], "unknown step 'ghost'"),
        (["junk"], "cannot fold str"),
    ],
)
def test_results_that_do_not_fit_are_value_errors(results: list[Any], message: str) -> None:
    graph = GraphSpec.of({"a": [], "b": ["a"]})
    state, _ = advance(initial_state(graph))
    with pytest.raises(ValueError, match=message):
        apply(state, results)


def test_bad_run_arguments_are_value_errors() -> None:
    graph = GraphSpec.of({"a": []})
    for kwargs, message in [
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"max_concurrency": True}, "max_concurrency"),
        ({"budget": 5}, "budget"),
        ({"budget": TokenUsage(-1)}, "budget"),
        ({"policies": {"zz": RetryPolicy()}}, "unknown step 'zz'"),
        ({"context": {"a": 1}}, r"collide with step name\(s\): \['a'\]"),
        ({"resume_from": 7}, "resume_from"),
    ]:
        with pytest.raises(ValueError, match=message):
            initial_state(graph, **kwargs)  # type: ignore[arg-type]


def test_a_10000_step_chain_costs_linear_work() -> None:
    # Structure sharing: each transition touches O(1) entries, so the ledger
    # backing is shared by every state of the run (no copy of all outputs).
    n = 10_000
    graph = GraphSpec.of([(f"s{i}", [f"s{i - 1}"] if i else []) for i in range(n)])
    state, batch = advance(initial_state(graph))
    first_backing = None
    checkpoints = []
    while not state.settled:
        (start,) = batch.starts
        state, batch = advance(state, [Succeeded(start.name, 1)])
        checkpoints.append(checkpoint_of(state))
        first_backing = first_backing or state.outputs._b
        assert state.outputs._b is first_backing
    assert state.completed == n and checkpoints[0].step_index == 1 and len(checkpoints[0].outputs) == 1
    assert checkpoints[-1].step_index == n


@settings(max_examples=150)
@given(dags(max_steps=10), st.data())
def test_resume_from_any_recorded_subset_runs_each_missing_step_once(
    graph: GraphSpec, data: st.DataObject
) -> None:
    """A hand-made checkpoint (ExecutionKit's three keys) may record a step
    without its dependencies: only the missing steps run, each once and after
    its dependencies, and the fold reads the dependents among them alone."""
    recorded = data.draw(st.sets(st.sampled_from(graph.names)), label="recorded")
    expected = fresh_outputs(graph)
    cp = WorkflowCheckpoint.from_dict(
        {"step_index": len(recorded), "outputs": {n: expected[n] for n in recorded},
         "cost": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0}}
    )
    trace = Trace()
    state = simulate(graph, data, trace, resume_from=cp)
    assert state.outcome == "finished"
    assert sorted(trace.starts) == sorted(set(graph.names) - recorded)
    assert set(state.outputs) == set(graph.names)
    assert {n: state.outputs[n] for n in recorded} == {n: expected[n] for n in recorded}
