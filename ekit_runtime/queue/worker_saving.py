"""Saving a driven run's checkpoints and ending it: finished, failed, cancelled, parked, given back or lost.

Each save goes through the worker's group commit (one statement for the
saves and endings asked together), is retried while it fails transiently
and the lease surely holds, and renews the lease by the queue's
``save_renews`` share. No attempt starts while a save is outstanding.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any

from ekit_core import WorkflowCheckpoint
from ekit_runtime import logs
from ekit_runtime.child_runs import child_run_of
from ekit_runtime.errors import RunWaiting
from ekit_runtime.queue.lifecycle import drive_ending, waiting_reason
from ekit_runtime.queue.records import (
    LeaseLostError,
    RunStatus,
)
from ekit_runtime.queue.transient import is_transient
from ekit_runtime.queue.worker_lease import LeaseKeeping
from ekit_runtime.queue.worker_parts import _Drive, log

__all__ = ["Saving"]

# The first wait before a save that failed transiently is tried again; it
# doubles up to a quarter of the heartbeat. Short: no step starts meanwhile.
_SAVE_RETRY = 0.02


class Saving(LeaseKeeping):
    """Saves each driven run's checkpoints and records how its drive ended."""

    def _checkpoint(self, drive: _Drive, checkpoint: WorkflowCheckpoint) -> Awaitable[None]:
        """The run's ``checkpoint_fn``: counts the save as pending at once, before any step can start."""
        drive.saves += 1
        drive.saved.clear()
        return self._save(drive, checkpoint)

    async def _save(self, drive: _Drive, checkpoint: WorkflowCheckpoint) -> None:
        try:
            await self._store(drive, checkpoint)
        finally:
            drive.saves -= 1
            if not drive.saves:
                drive.saved.set()

    async def _store(self, drive: _Drive, checkpoint: WorkflowCheckpoint) -> None:
        """Save ``checkpoint``, retrying a transient failure while the lease may still be held."""
        lease = drive.lease
        failures = 0
        while True:
            if drive.lost:
                # Known lost: refuse without touching the database.
                raise LeaseLostError(lease.run_id, lease.epoch)
            asked = time.monotonic()
            try:
                # Committed with the saves of the worker's other runs that meet it.
                assert self._group is not None  # (made by _loop, which drives every run)
                cancel = await self._group.save(lease, checkpoint)
            except LeaseLostError:
                drive.lost = True
                raise
            except Exception as exc:
                if not is_transient(exc):
                    raise  # an output that cannot be stored: the run's failure
                failures += 1
                left = drive.valid_until - time.monotonic()
                self._save_failed(drive, exc, left, failures)
                if left <= 0:
                    raise
                await asyncio.sleep(min(self._retry_delay(failures), left))
                continue
            # A made save leaves at least this share of the lease ahead (SQLite's
            # usual save renews only past half of it: decision 015).
            self._renewed(drive, asked, cancel, self.queue.save_renews)
            return

    def _retry_delay(self, failures: int) -> float:
        """The wait before a save or an ending is made again after ``failures`` transient failures in
        a row: doubling from ``_SAVE_RETRY`` up to a quarter of the heartbeat."""
        return min(_SAVE_RETRY * 2.0 ** min(failures - 1, 16), max(self.heartbeat / 4, _SAVE_RETRY))

    def _save_failed(self, drive: _Drive, exc: Exception, left: float, failures: int) -> None:
        """Log a save that failed transiently; lose the lease once it may have run out."""
        lease = drive.lease
        what = f"saving run {lease.run_id!r} (epoch {lease.epoch}) failed ({type(exc).__name__}: {exc})"
        if left > 0:
            if failures & (failures - 1) == 0:  # the 1st, 2nd, 4th, 8th ... failure in a row
                log.warning(
                    "worker %s: %s; retrying, %.2f s before the lease may run out, and starting no "
                    "step of it meanwhile (failure %d in a row)",
                    self.name,
                    what,
                    left,
                    failures,
                    extra=self._fields("save_failed", lease),
                )
            return
        log.warning(
            "worker %s: %s and the lease may have run out; giving the run up (the next taker "
            "resumes from its last stored checkpoint)",
            self.name,
            what,
            extra=self._fields("lease_lost", lease),
        )
        # Not cancelled from here: this runs inside the run's own task, and
        # the error raised next ends the run (nothing more is written for it).
        drive.lost = True

    async def _record_ending(self, drive: _Drive, task: asyncio.Task[Any]) -> None:
        """Record how the run ended, unless the lease was lost (then write nothing)."""
        lease = drive.lease
        error = None if task.cancelled() else task.exception()
        ending = drive_ending(
            lost=drive.lost,
            stopping=drive.stopping,
            cancel_asked=drive.cancel_asked,
            cancelled=task.cancelled(),
            error=error,
        )
        if self._publisher is not None:
            if ending == "lost":
                self._publisher.lose(lease.run_id)
            elif ending in ("released", "parked"):
                # What the run published reaches its stream before its end is written (an
                # ending written by the group commit publishes it first: see GroupCommit).
                await self._publisher.end(lease.run_id)
        if ending == "lost":
            drive.outcome = "lost"
            log.warning(
                "worker %s: lease on run %r (epoch %d) was lost; stopped driving it and wrote nothing more",
                self.name,
                lease.run_id,
                lease.epoch,
                extra=self._fields("lease_lost", lease),
            )
            return
        if ending == "released":
            await self._give_back(drive)
            return
        if ending == "parked":
            assert isinstance(error, RunWaiting)
            await self._park(drive, error)
            return
        status: RunStatus = ending
        message = None if status != "failed" else f"{type(error).__name__}: {error}"
        failures = 0
        while True:
            try:
                # Ended in the commit of the saves (and other endings) that meet it.
                assert self._group is not None  # (made by _loop, which drives every run)
                await self._group.finish(lease, status, message)
                drive.outcome = status
                break
            except LeaseLostError:
                self._lost_before(drive, f"marked {status}", status=status)
                return
            except Exception as exc:
                # A dropped session, a server restarting: retried while the
                # lease may hold, as a save is. Left to fail, the run would
                # stay running until its lease ran out and another worker
                # took it only to end it.
                left = drive.valid_until - time.monotonic()
                if not is_transient(exc) or left <= 0:
                    raise
                failures += 1
                self._end_failed(drive, status, exc, left, failures)
                await asyncio.sleep(min(self._retry_delay(failures), left))
        self._log_ended(lease, status, message)

    def _end_failed(
        self, drive: _Drive, status: RunStatus, exc: Exception, left: float, failures: int
    ) -> None:
        """Log an ending that failed transiently (the 1st, 2nd, 4th, 8th ... in a row): retried."""
        if failures & (failures - 1):
            return
        lease = drive.lease
        log.warning(
            "worker %s: marking run %r (epoch %d) %s failed (%s: %s); retrying, %.2f s before the "
            "lease may run out (failure %d in a row)",
            self.name, lease.run_id, lease.epoch, status, type(exc).__name__, exc, left, failures,
            extra=self._fields("end_failed", lease),
        )

    async def _park(self, drive: _Drive, waiting: RunWaiting) -> None:
        """Park a run that waits for a person: no lease, no worker, until someone answers.

        A run that waits only for its child runs joins them instead: parked until one ends,
        or queued at once if one ended meanwhile (the queue decides, in one transaction).
        """
        await drive.saved.wait()  # the final checkpoint, with the questions, is stored first
        children = [child_run_of(q.details) for q in waiting.questions.values()]
        try:
            if children and None not in children:
                joined = await self._db(self.queue.join, drive.lease, [c for c in children if c])
                # (queued: a child ended meanwhile, and any worker resumes it)
                drive.outcome = {"waiting": "parked", "queued": "released"}.get(joined, joined)
                return
            await self._db(self.queue.park, drive.lease, waiting_reason(waiting.questions))
        except LeaseLostError:
            self._lost_before(drive, "parked")
            return
        drive.outcome = "parked"

    async def _give_back(self, drive: _Drive) -> None:
        """Release the run to the queue (a stop): any worker may claim it at once."""
        # ``release`` answers a lost lease with False (it raises only for a
        # refused write): either way another holder owns the run now.
        try:
            released = await self._db(self.queue.release, drive.lease)
        except LeaseLostError:
            released = False
        if not released:
            self._lost_before(drive, "given back")
            return
        drive.outcome = "released"
        logs.log_event(
            log, logging.INFO, "released", "worker %s: gave run %r (epoch %d) back to the queue (stopping)",
            self.name, drive.lease.run_id, drive.lease.epoch, **self._fields(None, drive.lease),
        )

    def _lost_before(self, drive: _Drive, what: str, **more: Any) -> None:
        """The run's last write was refused: another holder has it now, so nothing more is written."""
        drive.outcome = "lost"
        log.warning(
            "worker %s: lease on run %r (epoch %d) lost before it could be %s",
            self.name,
            drive.lease.run_id,
            drive.lease.epoch,
            what,
            extra=self._fields("lease_lost", drive.lease, **more),
        )
