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

from ekit_core.numbers import check_number

__all__ = ["RetryPolicy", "jitter_fraction"]


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
            check_number(getattr(self, name), f"RetryPolicy.{name}")
        check_number(self.backoff_factor, "RetryPolicy.backoff_factor", low=1, high=None, unit="")
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
        check_number(self.jitter, "RetryPolicy.jitter", high=1, unit="")
        check_number(self.max_retry_after, "RetryPolicy.max_retry_after")

    def delay(self, failures: int) -> float:
        """The backoff (no jitter): seconds before the attempt that follows ``failures`` failures."""
        if failures < 1 or not self.backoff_base or not self.backoff_cap:
            return 0.0
        cap, base, factor = float(self.backoff_cap), self.backoff_base, self.backoff_factor
        # Whether the power passes the cap is decided in log space, where no
        # count overflows: 2.0 ** 1024 (a doubling policy's 1,025th failure)
        # has no float. The exponent is bounded first, so that an int count
        # past the float range is never converted; at that bound any factor
        # above 1 has long passed any cap (2**64 * log(1 + 2**-52) > 4000).
        # Near the cap (the margin) the power itself decides, exactly as documented.
        exponent = min(failures - 1, 2**64)
        log_wait = math.log(base) + exponent * math.log(factor)
        if log_wait >= math.log(cap) + 1e-9:
            return cap
        try:
            return min(cap, float(base * factor**exponent))
        except OverflowError:  # a base so small that the power alone leaves the floats
            return min(cap, math.exp(log_wait))

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
