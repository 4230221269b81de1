"""Retry policy: whether a failed attempt is tried again, and after how long.

This module owns the retry rule. The core applies it when a failure is
folded into the state; the shell only sleeps for the delay the core chose.
Delays are deterministic (no jitter) so that a run can be replayed exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RetryPolicy"]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retry a failing step up to ``max_attempts`` times in all.

    Before attempt ``k + 1`` (after ``k`` failures) the step waits
    ``min(backoff_cap, backoff_base * backoff_factor ** (k - 1))`` seconds.
    Only exceptions that are instances of ``retry_on`` are retried; a step
    timeout raises ``TimeoutError`` and counts like any other failure.
    Cancellation is never retried.
    """

    max_attempts: int = 3
    backoff_base: float = 0.5
    backoff_cap: float = 30.0
    backoff_factor: float = 2.0
    retry_on: tuple[type[BaseException], ...] = (Exception,)

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise ValueError(f"RetryPolicy.max_attempts must be an int, got {self.max_attempts!r}")
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be at least 1, got {self.max_attempts}")
        for name in ("backoff_base", "backoff_cap"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"RetryPolicy.{name} must be a number >= 0, got {value!r}")
        factor = self.backoff_factor
        if isinstance(factor, bool) or not isinstance(factor, int | float) or factor < 1:
            raise ValueError(f"RetryPolicy.backoff_factor must be a number >= 1, got {factor!r}")
        retry_on = self.retry_on
        if isinstance(retry_on, type):
            retry_on = (retry_on,)
            object.__setattr__(self, "retry_on", retry_on)
        if not isinstance(retry_on, tuple) or not all(
            isinstance(t, type) and issubclass(t, BaseException) for t in retry_on
        ):
            raise ValueError(
                f"RetryPolicy.retry_on must be a tuple of exception types, got {retry_on!r}"
            )

    def delay(self, failures: int) -> float:
        """Seconds to wait before the attempt that follows ``failures`` failures."""
        if failures < 1:
            return 0.0
        return float(min(self.backoff_cap, self.backoff_base * self.backoff_factor ** (failures - 1)))

    def retries(self, error: BaseException, failures: int) -> bool:
        """Should a step that has failed ``failures`` times, last with ``error``, run again?"""
        return failures < self.max_attempts and isinstance(error, self.retry_on)


NO_RETRY = RetryPolicy(max_attempts=1)
"""The policy of a step that declares none: one attempt."""
