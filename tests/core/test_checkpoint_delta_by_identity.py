"""The usual save's delta, read off by identity, is the one the general comparison gives.

``WorkflowCheckpoint.delta_since`` has a fast path (``ekit_core.checkpoint._grown``)
for the next checkpoint of one run of the core: it trusts that the mappings
the two share are the same objects and takes the ledgers' new entries. These
properties run random graphs (plain, mapped, conditional, joins), in random
completion orders, with failures and retries, crashes and resumes, and
compare the delta of every pair of checkpoints, either way round, with the
delta the general path gives for it.
"""

from __future__ import annotations

from itertools import pairwise, permutations
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ekit_core.checkpoint as checkpoint_module
from ekit_core import GraphSpec, RetryPolicy, State, WorkflowCheckpoint, advance, checkpoint_of, initial_state
from tests.support.core_simulator import Trace, simulate
from tests.support.shaped_runs import shaped_result
from tests.support.strategies import dags, shaped_dags


def _general(newer: WorkflowCheckpoint, older: WorkflowCheckpoint) -> Any:
    real = checkpoint_module._grown
    checkpoint_module._grown = lambda cp, previous: None  # type: ignore[assignment]
    try:
        return newer.delta_since(older)
    finally:
        checkpoint_module._grown = real


def _same_deltas(checkpoints: list[WorkflowCheckpoint]) -> int:
    """Compare every pair's delta with the general path's; how many the fast path answered."""
    fast = 0
    real = checkpoint_module._grown
    for older, newer in permutations(checkpoints[-25:], 2):
        fast += real(newer, older) is not None
        assert newer.delta_since(older) == _general(newer, older)
    return fast


@settings(max_examples=60, deadline=None)
@given(dags(max_steps=8), st.data())
def test_the_delta_of_a_run_with_failures_crashes_and_resumes_is_the_general_one(
    graph: GraphSpec, data: st.DataObject
) -> None:
    names = list(graph.names)
    flaky = data.draw(st.lists(st.sampled_from(names), unique=True, max_size=2), label="flaky")
    trace = Trace()
    checkpoint: WorkflowCheckpoint | None = None
    for attempt in range(6):
        run = Trace()
        state = simulate(
            graph,
            data,
            run,
            resume_from=checkpoint,
            policies={name: RetryPolicy(max_attempts=3) for name in flaky},
            fail_times={name: 1 for name in flaky},
            may_crash=attempt < 4,
        )
        trace.checkpoints.extend(run.checkpoints)
        if run.checkpoints:
            checkpoint = run.checkpoints[-1]
        if state.settled:
            break
    _same_deltas(trace.checkpoints)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shaped_dags(), st.data())
def test_the_delta_of_a_run_with_maps_skips_and_joins_is_the_general_one(
    graph: GraphSpec, data: st.DataObject
) -> None:
    state: State
    state, _batch = advance(initial_state(graph))
    checkpoints = [checkpoint_of(state)]
    while not state.settled:
        running = sorted(state.running_steps())
        assert running, "stalled"
        chosen = data.draw(st.lists(st.sampled_from(running), min_size=1, unique=True), label="complete")
        state, _batch = advance(state, [shaped_result(state, name) for name in chosen])
        checkpoints.append(checkpoint_of(state))
    _same_deltas(checkpoints)


def test_the_fast_path_answers_the_usual_save() -> None:
    # (Else the properties above would compare the general path with itself.)
    from ekit_runtime import Step, Workflow

    seen: list[WorkflowCheckpoint] = []
    Workflow([Step(f"s{i}", lambda ctx: "ok", (f"s{i - 1}",) if i else ()) for i in range(4)]).run_sync(
        checkpoint_fn=seen.append
    )
    for older, newer in pairwise(seen):
        assert checkpoint_module._grown(newer, older) is not None
        assert checkpoint_module._grown(older, newer) is None  # an earlier state: not a prefix
    assert _same_deltas(seen) > 0


