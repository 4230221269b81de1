"""The arguments a retry policy refuses, the delays it gives, and when a budget counts as reached.
"""

from __future__ import annotations

from typing import Any

import pytest

from ekit_core import (
    RetryPolicy,
    TokenUsage,
)

# -- retry policies ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"max_attempts": 0}, "max_attempts"),
        ({"max_attempts": True}, "max_attempts"),
        ({"max_attempts": 2.0}, "max_attempts"),
        ({"backoff_base": -0.1}, "backoff_base"),
        ({"backoff_base": True}, "backoff_base"),
        ({"backoff_base": "1"}, "backoff_base"),
        ({"backoff_cap": -1}, "backoff_cap"),
        ({"backoff_cap": False}, "backoff_cap"),
        ({"backoff_factor": 0.99}, "backoff_factor"),
        ({"backoff_factor": True}, "backoff_factor"),
        ({"backoff_factor": None}, "backoff_factor"),
        ({"retry_on": ValueError()}, "retry_on"),
        ({"retry_on": (ValueError, int)}, "retry_on"),
        ({"retry_on": [ValueError]}, "retry_on"),
    ],
)
def test_a_retry_policy_refuses_each_bad_argument_by_name(arguments: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^RetryPolicy\.{field} must"):
        RetryPolicy(**arguments)


def test_a_retry_policy_accepts_every_boundary_value() -> None:
    policy = RetryPolicy(max_attempts=1, backoff_base=0, backoff_cap=0, backoff_factor=1)
    assert (policy.max_attempts, policy.backoff_base, policy.backoff_cap, policy.backoff_factor) == (
        1, 0, 0, 1,
    )
    single = RetryPolicy(retry_on=KeyError)  # one type: made a tuple
    assert single.retry_on == (KeyError,)
    assert single.retries(KeyError("k"), 1) and not single.retries(ValueError("v"), 1)
    assert RetryPolicy(retry_on=(KeyboardInterrupt,)).retry_on == (KeyboardInterrupt,)


def test_retry_delays_follow_the_documented_formula() -> None:
    policy = RetryPolicy(max_attempts=9, backoff_base=0.5, backoff_cap=3.0, backoff_factor=3)
    assert [policy.delay(k) for k in (-1, 0, 1, 2, 3, 4)] == [0.0, 0.0, 0.5, 1.5, 3.0, 3.0]
    assert isinstance(policy.delay(1), float)
    assert RetryPolicy(backoff_base=2, backoff_factor=1).delay(5) == 2.0
    assert not policy.retries(ValueError(), 9) and policy.retries(ValueError(), 8)


# -- usage and budgets ----------------------------------------------------------------


@pytest.mark.parametrize("field", ["input_tokens", "output_tokens", "llm_calls"])
def test_a_budget_of_one_is_reached_by_one_in_its_own_field(field: str) -> None:
    budget = TokenUsage(**{field: 1})
    assert budget.reached(TokenUsage(**{field: 1}))
    assert not budget.reached(TokenUsage())
    others = {f: 5 for f in ("input_tokens", "output_tokens", "llm_calls") if f != field}
    assert not budget.reached(TokenUsage(**others))  # a zero field places no limit
    assert not TokenUsage(**{field: 1}).is_zero()
    assert TokenUsage().is_zero()
