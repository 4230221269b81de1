"""Retry policy: whether a failed attempt is tried again, and after how long.

This module owns the retry rule. The core applies it when a failure is
folded into the state; the shell only sleeps for the delay the core chose.

Delays stay exact on replay: the optional jitter is not drawn from a random
generator but derived from a stable hash (SHA-256) of the failed attempt's
identity, the run's id (when it has one), the step and the number of the
failure, so the same failure of the same run always waits the same time
while different steps and runs spread out. A failure may also ask for a
wait of its own (an HTTP ``Retry-After``, read by the shell and folded in
with the failure): the retry then waits at least that long.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

__all__ = ["RetryPolicy", "jitter_fraction"]


def _number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def jitter_fraction(run_id: str | None, name: str, failure: int) -> float:
    """A number in ``[0, 1)`` fixed by ``(run_id, name, failure)``: the jitter's "random" draw.

    The first 8 bytes of the SHA-256 of the three, as a fraction of 2**64:
    the same identity always gives the same number, on every machine and in
    every Python process (unlike ``hash``), and nearby identities give
    unrelated numbers.
    """
    text = f"{'' if run_id is None else run_id}\x00{name}\x00{failure}"
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retry a failing step up to ``max_attempts`` times in all.

    Before attempt ``k + 1`` (after ``k`` failures) the step waits the
    *backoff* ``min(backoff_cap, backoff_base * backoff_factor ** (k - 1))``
    seconds (:meth:`delay`), scaled by ``jitter``: by a factor in
    ``[1 - jitter, 1]`` fixed by the attempt's identity (:meth:`jittered`).
    ``jitter=0`` (the default) waits the backoff exactly; ``jitter=1`` is
    "full jitter" (anywhere from 0 to the backoff).

    A failure that asks for a wait (its ``retry_after``: an HTTP
    ``Retry-After`` or an exception's own ``retry_after`` attribute, see
    :func:`ekit_runtime.retry_after`) waits at least that long; one that asks
    for more than ``max_retry_after`` seconds is not retried: the step
    fails (its attempts left unused), since waiting less than the server
    asked would be refused again. See :meth:`wait`.

    Only exceptions that are instances of ``retry_on`` are retried; a step
    timeout raises ``TimeoutError`` and counts like any other failure.
    Cancellation is never retried.
    """

    max_attempts: int = 3
    backoff_base: float = 0.5
    backoff_cap: float = 30.0
    backoff_factor: float = 2.0
    retry_on: tuple[type[BaseException], ...] = (Exception,)
    jitter: float = 0.0
    max_retry_after: float = 120.0

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
        if not _number(self.jitter) or not 0 <= self.jitter <= 1:
            raise ValueError(f"RetryPolicy.jitter must be a number from 0 to 1, got {self.jitter!r}")
        if not _number(self.max_retry_after) or self.max_retry_after < 0:
            raise ValueError(
                f"RetryPolicy.max_retry_after must be a finite number >= 0, got {self.max_retry_after!r}"
            )

    def delay(self, failures: int) -> float:
        """The backoff (no jitter): seconds before the attempt that follows ``failures`` failures."""
        if failures < 1:
            return 0.0
        return float(min(self.backoff_cap, self.backoff_base * self.backoff_factor ** (failures - 1)))

    def jittered(self, failures: int, run_id: str | None, name: str, failure: int) -> float:
        """:meth:`delay` scaled by the jitter drawn for failure number ``failure`` of ``name``.

        ``failures`` counts this run's failures of the step (the backoff's
        exponent); ``failure`` numbers the failure among all of the step's
        (across resumes, as its attempt key does), so that a resumed run
        does not repeat the delays of the run before it.
        """
        delay = self.delay(failures)
        if not self.jitter or not delay:
            return delay
        return delay * (1.0 - self.jitter * jitter_fraction(run_id, name, failure))

    def wait(
        self,
        failures: int,
        run_id: str | None,
        name: str,
        failure: int,
        retry_after: float | None = None,
    ) -> float | None:
        """Seconds to wait before retrying, or ``None``: the failure asked for too long a wait.

        The jittered backoff (:meth:`jittered`), or ``retry_after`` when the
        failure asked for longer; ``None`` when it asked for more than
        ``max_retry_after``.
        """
        delay = self.jittered(failures, run_id, name, failure)
        if retry_after is None:
            return delay
        if retry_after > self.max_retry_after:
            return None
        return max(delay, float(retry_after))

    def retries(self, error: BaseException, failures: int) -> bool:
        """Should a step that has failed ``failures`` times, last with ``error``, run again?"""
        return failures < self.max_attempts and isinstance(error, self.retry_on)


NO_RETRY = RetryPolicy(max_attempts=1)
"""The policy of a step that declares none: one attempt."""
