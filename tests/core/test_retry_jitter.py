"""Retry jitter: delays within their bounds, the same for the same failure, spread across others.

The jitter is not drawn from a random generator: it is a hash of the failed
attempt's identity (the run's id, the step, the failure's number across
runs), so a run replays exactly while steps and runs retry at different
moments. Sleeps are injected: no test waits for real.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ekit_core import (
    Event,
    Failed,
    GraphSpec,
    RetryPolicy,
    StepRetried,
    advance,
    initial_state,
)
from ekit_core.policy import jitter_fraction
from ekit_runtime import Step, Workflow, WorkflowCheckpoint

policies = st.builds(
    RetryPolicy,
    max_attempts=st.integers(1, 10),
    backoff_base=st.floats(0, 100, allow_nan=False),
    backoff_cap=st.floats(0, 1000, allow_nan=False),
    backoff_factor=st.floats(1, 10, allow_nan=False),
    jitter=st.floats(0, 1, allow_nan=False),
)
identities = st.tuples(st.none() | st.text(max_size=20), st.text(min_size=1, max_size=20),
                       st.integers(1, 10_000))


@given(policies, st.integers(1, 30), identities)
def test_a_jittered_delay_lies_between_its_backoff_scaled_down_by_the_jitter_and_the_backoff(
    policy: RetryPolicy, failures: int, identity: tuple[str | None, str, int]
) -> None:
    backoff = policy.delay(failures)
    delay = policy.jittered(failures, *identity)
    assert backoff * (1 - policy.jitter) - 1e-9 <= delay <= backoff
    assert delay == policy.jittered(failures, *identity)  # the same identity, the same delay
    assert 0 <= jitter_fraction(*identity) < 1


@given(policies, st.integers(1, 30), identities,
       st.none() | st.floats(0, 1000, allow_nan=False))
def test_a_retry_waits_the_longer_of_its_backoff_and_what_the_failure_asked_within_the_cap(
    policy: RetryPolicy, failures: int, identity: tuple[str | None, str, int],
    asked: float | None,
) -> None:
    wait = policy.wait(failures, *identity, asked)
    backoff = policy.jittered(failures, *identity)
    if asked is None:
        assert wait == backoff
    elif asked > policy.max_retry_after:
        assert wait is None  # not retried: the server asked for more than the policy allows
    else:
        assert wait == max(backoff, asked)


def test_without_jitter_the_delays_are_the_backoff_exactly() -> None:
    policy = RetryPolicy(max_attempts=9, backoff_base=0.5, backoff_cap=3.0, backoff_factor=3)
    assert policy.jitter == 0
    assert [policy.jittered(k, "run", "s", k) for k in (1, 2, 3, 4)] == [0.5, 1.5, 3.0, 3.0]


def test_jitter_spreads_the_delays_of_many_steps_and_of_many_runs_over_the_whole_range() -> None:
    policy = RetryPolicy(backoff_base=10.0, jitter=1.0)
    by_step = [policy.jittered(1, "run-1", f"step{i}", 1) for i in range(200)]
    by_run = [policy.jittered(1, f"run-{i}", "step", 1) for i in range(200)]
    by_failure = [policy.jittered(1, "run-1", "step", k) for k in range(1, 201)]
    for delays in (by_step, by_run, by_failure):
        assert len(set(delays)) == 200
        assert min(delays) < 1.0 and max(delays) > 9.0  # reaches both ends of [0, 10]
        # Roughly uniform: each tenth of the range holds some.
        assert all(any(d // 1 == tenth for d in delays) for tenth in range(10))
    half = RetryPolicy(backoff_base=10.0, jitter=0.5)
    assert all(5.0 <= half.jittered(1, "run-1", f"step{i}", 1) <= 10.0 for i in range(200))


def test_the_jitter_is_the_same_in_another_process_whatever_its_hash_seed() -> None:
    identities = [("run-1", "fetch", 1), (None, "fetch", 2), ("r", "é[ü]", 7)]
    code = (
        "import json, sys\n"
        "from ekit_core.policy import jitter_fraction\n"
        "print(json.dumps([jitter_fraction(*i) for i in json.loads(sys.argv[1])]))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(identities)],
        env=env, capture_output=True, text=True, check=True, timeout=60,
    ).stdout
    assert json.loads(out) == [jitter_fraction(*i) for i in identities]


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"jitter": -0.1}, "jitter"),
        ({"jitter": 1.5}, "jitter"),
        ({"jitter": True}, "jitter"),
        ({"jitter": math.nan}, "jitter"),
        ({"jitter": "0.5"}, "jitter"),
        ({"max_retry_after": -1}, "max_retry_after"),
        ({"max_retry_after": math.inf}, "max_retry_after"),
        ({"max_retry_after": "60"}, "max_retry_after"),
        ({"max_retry_after": False}, "max_retry_after"),
    ],
)
def test_a_retry_policy_refuses_a_bad_jitter_or_cap_by_name(arguments: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^RetryPolicy\.{field} must"):
        RetryPolicy(**arguments)


# -- through the runner -------------------------------------------------------------


POLICY = RetryPolicy(max_attempts=3, backoff_base=2.0, jitter=1.0)


def _failing_twice() -> Workflow:
    calls: dict[str, int] = {}

    def flaky(name: str) -> Any:
        def run(context: dict[str, Any]) -> str:
            calls[name] = calls.get(name, 0) + 1
            if calls[name] <= 2:
                raise ConnectionError(f"{name} busy")
            return name

        return run

    return Workflow([Step(n, flaky(n), retry=POLICY) for n in ("a", "b", "c")])


def _run(run_id: str | None, resume_from: WorkflowCheckpoint | None = None,
         workflow: Workflow | None = None) -> tuple[list[float], list[tuple[str, int, float]]]:
    slept: list[float] = []
    retried: list[tuple[str, int, float]] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    def trace(event: Event) -> None:
        if isinstance(event, StepRetried):
            retried.append((event.name, event.attempt, event.delay))

    runner = (workflow or _failing_twice()).runner(
        sleep=sleep, trace=trace, run_id=run_id, resume_from=resume_from)
    asyncio.run(runner.run())
    return slept, retried


def test_a_run_sleeps_the_jittered_delays_its_trace_reports_and_the_same_ones_again() -> None:
    slept, retried = _run("run-1")
    expected = {(n, k, POLICY.jittered(k, "run-1", n, k)) for n in "abc" for k in (1, 2)}
    assert set(retried) == expected
    assert sorted(slept) == sorted(d for _, _, d in retried)
    assert len(set(slept)) == 6  # three steps, two failures each: six different delays
    again, retried_again = _run("run-1")
    # Exact replay of the same run (in whatever order its threads finished this time).
    assert sorted(retried_again) == sorted(retried) and sorted(again) == sorted(slept)
    other, _ = _run("run-2")
    assert set(other).isdisjoint(slept)  # another run retries at other moments


def test_replaying_a_runs_inputs_through_the_core_gives_the_delays_it_recorded() -> None:
    """The core's decisions from recorded inputs (what a replay re-folds) are the run's own."""
    _, retried = _run("run-1")
    graph = GraphSpec.of({"a": [], "b": [], "c": []})
    state = initial_state(graph, policies={n: POLICY for n in "abc"}, run_id="run-1")
    replayed: list[tuple[str, int, float]] = []
    state, batch = advance(state, ())
    for _ in range(2):  # each round: every step fails once more, and is started again
        state, batch = advance(state, [Failed(n, ConnectionError(f"{n} busy")) for n in "abc"])
        replayed += [(e.name, e.attempt, e.delay) for e in state.events if isinstance(e, StepRetried)]
        assert {(s.name, s.delay) for s in batch} == {(n, d) for n, _, d in replayed[-3:]}
    assert sorted(replayed) == sorted(retried)


def test_a_resumed_run_draws_its_jitter_for_the_failures_numbers_across_runs() -> None:
    """Failure 3 of a step after a resume is not failure 1 again: it waits its own delay."""
    policy = RetryPolicy(max_attempts=2, backoff_base=2.0, jitter=1.0)
    saved: list[WorkflowCheckpoint] = []
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    workflow = Workflow([Step("s", _ok_after(2), retry=policy)])
    state = asyncio.run(
        workflow.runner(sleep=sleep, run_id="run-1", checkpoint_fn=saved.append).run())
    assert state.outcome == "failed" and saved[-1].failures["s"].attempts == 2
    assert slept == [policy.jittered(1, "run-1", "s", 1)]
    # The resumed run's first retry follows the step's third failure in all.
    _, retried = _run("run-1", saved[-1], Workflow([Step("s", _ok_after(1), retry=policy)]))
    assert retried == [("s", 1, policy.jittered(1, "run-1", "s", 3))]
    assert retried[0][2] != slept[0]


def _ok_after(failures: int) -> Any:
    calls: list[int] = []

    def run(context: dict[str, Any]) -> str:
        calls.append(1)
        if len(calls) <= failures:
            raise ConnectionError("busy")
        return "ok"

    return run


def test_the_core_refuses_a_failure_asking_for_a_wait_that_is_no_number() -> None:
    from ekit_core import TransitionError

    graph = GraphSpec.of({"a": []})
    state, _ = advance(initial_state(graph, policies={"a": POLICY}), ())
    for bad in (math.nan, -1.0, math.inf, "7", True):
        with pytest.raises(TransitionError, match=r"'a'.*retry_after"):
            advance(state, [Failed("a", ConnectionError(), retry_after=bad)])  # type: ignore[arg-type]


def test_initial_state_refuses_a_run_id_that_is_no_string() -> None:
    with pytest.raises(ValueError, match=r"^run_id must"):
        initial_state(GraphSpec.of({"a": []}), run_id=7)  # type: ignore[arg-type]
