"""A retry policy's backoff exists for any number of failures: a policy retrying for ever never dies of it.

``backoff_base * backoff_factor ** (failures - 1)`` overflows a float at the
1,025th failure of a doubling policy (``2.0 ** 1024``) long before the cap
would apply; the delay must be the cap from the moment the power passes it,
whatever the count (a run that retries for ever counts past any bound).
Sleeps are injected: no test waits for real.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from ekit_core import RetryPolicy
from ekit_runtime import Step, Workflow

policies = st.builds(
    RetryPolicy,
    max_attempts=st.integers(1, 2**64),
    backoff_base=st.floats(0, 1e9, allow_nan=False) | st.integers(0, 10**9),
    backoff_cap=st.floats(0, 1e9, allow_nan=False) | st.integers(0, 10**9),
    backoff_factor=st.floats(1, 1e300, allow_nan=False) | st.integers(1, 10**300),
    jitter=st.floats(0, 1, allow_nan=False),
)
huge_counts = st.integers(1, 10**400) | st.integers(1000, 5000) | st.sampled_from([1024, 1025, 1026, 2**63])


@given(policies, huge_counts, st.text(max_size=10), st.none() | st.floats(0, 1e9, allow_nan=False))
def test_the_backoff_is_a_finite_delay_within_the_cap_for_any_number_of_failures(
    policy: RetryPolicy, failures: int, name: str, asked: float | None
) -> None:
    delay = policy.delay(failures)
    assert isinstance(delay, float) and math.isfinite(delay)
    assert 0 <= delay <= policy.backoff_cap
    jittered = policy.jittered(failures, "run", name, failures)
    assert 0 <= jittered <= delay
    wait = policy.wait(failures, "run", name, failures, asked)
    assert wait is None or math.isfinite(wait)


@given(policies, st.integers(1, 200))
def test_the_backoff_never_shrinks_as_failures_grow(policy: RetryPolicy, failures: int) -> None:
    # Once at the cap it stays there, however many more failures follow.
    assert policy.delay(failures) <= policy.delay(failures + 1) <= policy.delay(failures * 10**30)


@given(st.integers(1, 60), st.floats(0.001, 100), st.integers(2, 10))
def test_below_the_cap_the_delay_is_the_documented_power(failures: int, base: float, factor: int) -> None:
    policy = RetryPolicy(backoff_base=base, backoff_cap=1e9, backoff_factor=factor)
    assert policy.delay(failures) == min(1e9, base * factor ** (failures - 1))


def test_a_doubling_policy_waits_its_cap_at_the_1025th_failure_and_after() -> None:
    policy = RetryPolicy(max_attempts=10**9, backoff_base=0.5, backoff_cap=30.0)
    assert [policy.delay(k) for k in (1024, 1025, 1026, 10**6, 10**400)] == [30.0] * 5
    nothing = RetryPolicy(max_attempts=10**9, backoff_base=0, backoff_cap=30.0)
    assert nothing.delay(10**400) == 0.0


def test_a_step_retried_past_its_1025th_failure_still_finishes() -> None:
    failures = 1100
    calls: list[int] = []

    async def flaky(context: dict[str, Any]) -> str:
        calls.append(1)
        if len(calls) <= failures:
            raise ConnectionError("busy")
        return "done"

    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    forever = RetryPolicy(max_attempts=10**9, backoff_base=0.001, backoff_cap=0.5)
    workflow = Workflow([Step("fetch", flaky, retry=forever)])
    state = asyncio.run(workflow.runner(sleep=sleep).run())
    assert state.outputs["fetch"] == "done"
    assert len(calls) == failures + 1
    assert len(slept) == failures and slept[-1] == 0.5
