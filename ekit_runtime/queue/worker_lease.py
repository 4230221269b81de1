"""Keeping a run's lease: heartbeats, renewals, a renewal before an attempt near the lease's end, losing it.

A lease that cannot be renewed in time is lost: the run's task is
cancelled, and nothing of it is written again (the queue fences every
write by the lease's epoch). A renewal answers whether the run's
cancellation was asked, which cancels the run the same way.
"""

from __future__ import annotations

import asyncio
import time

from ekit_runtime.queue.records import LeaseLostError
from ekit_runtime.queue.worker_parts import WorkerParts, _Drive, log

__all__ = ["LeaseKeeping"]


class LeaseKeeping(WorkerParts):
    """Keeps each driven run's lease: renews it each heartbeat and before a late attempt; loses it."""

    def _renewed(self, drive: _Drive, asked: float, cancel: bool, share: float = 1.0) -> None:
        """A save or renewal asked at ``asked`` went through: the lease holds a while longer
        (``share`` of its length at least)."""
        drive.valid_until = max(drive.valid_until, asked + self.lease_seconds * share)
        self._on_cancel_flag(drive, cancel)

    async def _heartbeat(self, drive: _Drive) -> None:
        while not drive.lost:
            await asyncio.sleep(self.heartbeat)
            await self._renew(drive)

    async def _renew(self, drive: _Drive) -> None:
        """Renew the lease once: extended, still to be retried, or lost."""
        asked = time.monotonic()
        try:
            cancel = await self._db(self.queue.renew, drive.lease, self.lease_seconds)
        except LeaseLostError:
            self._lose(drive)
            return
        except Exception as exc:
            # Not a refusal: the database could not be asked. The lease may
            # still be ours, so keep it alive rather than let it lapse.
            self._renewal_failed(drive, exc)
            return
        self._renewed(drive, asked, cancel)

    def _renewal_failed(self, drive: _Drive, exc: Exception) -> None:
        """Log a renewal that raised; lose the lease once it has surely expired."""
        lease = drive.lease
        left = drive.valid_until - time.monotonic()
        if left > 0:
            log.warning(
                "worker %s: renewing the lease on run %r (epoch %d) failed (%s: %s); "
                "retrying at the next heartbeat, %.2f s before the lease runs out",
                self.name,
                lease.run_id,
                lease.epoch,
                type(exc).__name__,
                exc,
                left,
                extra=self._fields("renew_failed", lease),
            )
            return
        log.warning(
            "worker %s: renewing the lease on run %r (epoch %d) failed (%s: %s) and the lease has "
            "run out; treating it as lost",
            self.name,
            lease.run_id,
            lease.epoch,
            type(exc).__name__,
            exc,
            extra=self._fields("lease_lost", lease),
        )
        self._lose(drive)

    @staticmethod
    def _lose(drive: _Drive) -> None:
        drive.lost = True
        if drive.task is not None:
            drive.task.cancel()

    @staticmethod
    def _on_cancel_flag(drive: _Drive, cancel: bool) -> None:
        if cancel and not drive.cancel_asked:
            drive.cancel_asked = True
            if drive.task is not None:
                drive.task.cancel()

    async def _confirm(self, drive: _Drive, left: float) -> None:
        """Renew the lease before an attempt starts near its end (one renewal for all who ask)."""
        if drive.confirming is None or drive.confirming.done():
            drive.confirming = asyncio.ensure_future(self._renew(drive))
        await asyncio.shield(drive.confirming)
        if not drive.lost and drive.valid_until - time.monotonic() <= self.start_margin:
            # It failed without a refusal: try again shortly, while the lease may hold.
            await asyncio.sleep(min(self.start_margin / 4, left))

    def _lapsed(self, drive: _Drive) -> None:
        lease = drive.lease
        log.warning(
            "worker %s: the lease on run %r (epoch %d) may have run out by this worker's clock "
            "(not renewed for %.2f s of a %.2f s lease); starting no step and giving the run up",
            self.name,
            lease.run_id,
            lease.epoch,
            time.monotonic() - (drive.valid_until - self.lease_seconds),
            self.lease_seconds,
            extra=self._fields("lease_lost", lease),
        )
        self._lose(drive)
