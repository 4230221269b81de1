"""Claiming runs for the free places, backing off while the database fails, announcing what is served."""

from __future__ import annotations

import asyncio
import contextlib
import time

from ekit_runtime.queue.lifecycle import usage_limited
from ekit_runtime.queue.transient import is_transient
from ekit_runtime.queue.worker_drive import Driving
from ekit_runtime.queue.worker_parts import _Drive, log

__all__ = ["Claiming"]

# The longest wait between claims while the database keeps failing: short
# enough that a worker is back at work seconds after the database is, long
# enough not to hammer one that is struggling.
_MAX_BACKOFF = 5.0

# A worker tells the queue it is alive and which workflows it serves at most
# this often (seconds), however short its poll.
_ANNOUNCE_EVERY = 1.0


class Claiming(Driving):
    """Claims runs for the free places, backs off while the database fails, announces what it serves."""

    async def _try_claim(self) -> bool | None:
        """Claim runs for the free places: whether any was claimed, or ``None`` after a transient error.

        A permanent error is raised: retrying would only hide it.
        """
        try:
            claimed = await self._claim_some()
        except Exception as exc:
            if not is_transient(exc):
                raise
            self._claim_failures += 1
            log.warning(
                "worker %s: claiming a run failed (%s: %s); retrying in %.2f s (failure %d in a row)",
                self.name,
                type(exc).__name__,
                exc,
                self._backoff(),
                self._claim_failures,
                extra=self._fields("claim_failed"),
            )
            return None
        self._claim_failures = 0
        return claimed

    def _backoff(self) -> float:
        """The wait before the next claim after ``_claim_failures`` failures in a row.

        It doubles from ``poll`` up to ``_MAX_BACKOFF`` (or ``poll``, if longer).
        """
        cap = max(self.poll, _MAX_BACKOFF)
        exponent = min(self._claim_failures - 1, 32)  # 2**32 * poll is past any cap; keeps the float finite
        return min(cap, self.poll * 2.0**exponent)

    async def _claim_some(self) -> bool:
        """Fill the free places: the runs are leased together (one commit), so they start together."""
        asked = time.monotonic()
        free = self.max_runs - len(self._drives)
        if self._session is not None and self._executor is not None:
            leases = await self._session.claim_many(
                self.name, self.fingerprints, self.lease_seconds, free, self._executor
            )
        else:
            leases = await self._db(
                self.queue.claim_many, self.name, self.fingerprints, self.lease_seconds, free
            )
        if not leases:
            return False
        # The limits the claim read in its own transaction (one query fewer per claim).
        limits = leases[0].limits if leases[0].limits is not None else await self._db(self.queue.limits)
        gated = usage_limited(limits)
        for lease in leases:
            drive = _Drive(lease, asked + self.lease_seconds, gated=gated)
            self._log_claimed(lease)
            task = asyncio.create_task(self._drive(drive), name=f"ekit-run-{lease.run_id}")
            self._drives[task] = drive
        return True

    async def _announce(self) -> None:
        """Tell the queue this worker is alive and what it serves, at most once a second."""
        now = time.monotonic()
        if now - self._announced < _ANNOUNCE_EVERY:
            return
        self._announced = now
        # It counts for a few rounds of the loop: a claim's backoff, a long poll.
        seconds = 3 * max(self.poll, _MAX_BACKOFF)
        try:
            await self._db(self.queue.announce, self.name, self.fingerprints, seconds, self._doing())
        except Exception as exc:
            # A permanent error (no privilege, not a queue) would fail the claim
            # next: raised, as a claim's is. A transient one only costs a queued
            # run its reason for a while (it is advisory), so the loop goes on.
            if not is_transient(exc):
                raise
            log.warning("worker %s: announcing it serves %s failed (%s: %s)", self.name,
                        ", ".join(sorted(self.fingerprints)), type(exc).__name__, exc)

    def _doing(self) -> dict[str, tuple[int, dict[str, tuple[float, int]]]]:
        """What this worker runs now, for the dashboard: ``run id -> (epoch, its attempts in flight)``."""
        return {d.lease.run_id: (d.lease.epoch, dict(d.doing)) for d in self._drives.values() if d.doing}

    async def _retire(self) -> None:
        with contextlib.suppress(Exception):
            await self._db(self.queue.retire, self.name)
