"""Admitting each attempt of a driven run: the fleet's usage limits, a resource slot, the lease's margin.

Runs as the run's ``before_attempt``: it waits (usage limits, a full
resource) holding nothing, writes why the run waits while it does, and
renews the lease first when little of it is left. How long each limit held
the attempt is told to the run (:func:`~ekit_runtime.attempt.note_hold`:
``limit:<name>`` for a usage limit, ``resource:<name>`` for a resource's
slots), which records it beside when the attempt began.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import cast

from ekit_runtime.attempt import Attempt, note_hold
from ekit_runtime.queue.records import LeaseLostError
from ekit_runtime.queue.transient import is_transient
from ekit_runtime.queue.worker_parts import _Drive, log
from ekit_runtime.queue.worker_saving import Saving

__all__ = ["Admission"]

# The first wait before a full resource is asked again for a slot; it doubles
# up to the heartbeat.
_SLOT_POLL = 0.01


class Admission(Saving):
    """Admits each attempt of a driven run: usage limits, resource slots, the lease's margin."""

    async def _admit(
        self, drive: _Drive, gate: Callable[[], Awaitable[None]] | None, attempt: Attempt
    ) -> Callable[[], Awaitable[None]] | None:
        """Let an attempt of ``drive``'s run start, or never return (the run is then cancelled).

        In order: the fleet's usage limits; a slot of the step's resource, if
        it names one (the release returned is the runner's to call once the
        attempt ends; given back here if the attempt never starts); every
        save handed over before (a step never starts ahead of a save that may
        yet fail and give the run up); the lease, last, so that nothing is
        awaited between the verdict and the start.

        The limits are read once the run's saves so far are stored: a save may
        wait for the worker's next group commit (see ``GroupCommit``), and the
        usage it adds must be in the window the limits count.
        """
        if gate is not None:
            while drive.saves:
                await drive.saved.wait()
            await gate()
        release = None if attempt.step.resource is None else await self._take_slot(drive, attempt)
        try:
            while not drive.lost:
                if drive.saves:
                    await drive.saved.wait()
                    continue  # (a renewal below awaits too: a save handed over meanwhile is waited for)
                left = drive.valid_until - time.monotonic()
                if left > self.start_margin:
                    return self._begun(drive, attempt, release)
                if left <= 0:
                    self._lapsed(drive)
                    break
                await self._confirm(drive, left)
            # Lost: the run is being cancelled; this attempt waits for it and never starts.
            await asyncio.Event().wait()
        except BaseException:
            if release is not None:
                await asyncio.shield(release())  # (a second cancel leaves it to finish alone)
            raise
        return None  # (unreachable: the wait above ends only by cancellation)

    @staticmethod
    def _begun(
        drive: _Drive, attempt: Attempt, release: Callable[[], Awaitable[None]] | None
    ) -> Callable[[], Awaitable[None]]:
        """Count the attempt as in flight until the runner calls the release returned (once, at its end)."""
        name = attempt.name
        drive.doing[name] = (time.time(), attempt.number)

        async def ended() -> None:
            drive.doing.pop(name, None)
            if release is not None:
                await release()

        return ended

    async def _take_slot(self, drive: _Drive, attempt: Attempt) -> Callable[[], Awaitable[None]]:
        """Wait for a slot of the attempt's resource and take it; return what gives it back.

        A full resource is asked again after a wait that doubles from
        ``_SLOT_POLL`` up to the heartbeat, holding nothing meanwhile (no
        connection, no transaction). A refusal (the lease is lost) never
        returns: the run is being cancelled. A transient failure is retried
        the same way, while the lease may hold.
        """
        resource, lease = cast(str, attempt.step.resource), drive.lease
        holder = str(attempt.key)
        wait, waited = _SLOT_POLL, False
        asked = time.monotonic()
        while True:
            try:
                if await self._db(self.queue.acquire_slot, lease, resource, holder):
                    if waited:
                        note_hold(f"resource:{resource}", time.monotonic() - asked)
                    return functools.partial(self._give_slot, drive, resource, holder)
            except LeaseLostError:
                self._lose(drive)
                await asyncio.Event().wait()  # cancelled with the run
            except Exception as exc:
                if not is_transient(exc):
                    raise  # the attempt's failure
                log.warning(
                    "worker %s: taking a slot of resource %r for %s failed (%s: %s); retrying",
                    self.name, resource, holder, type(exc).__name__, exc,
                )
            else:
                if not waited:
                    waited = True
                    log.info(
                        "worker %s: %s waits for a slot of resource %r (the fleet's cap is reached)",
                        self.name, holder, resource,
                    )
            await asyncio.sleep(wait)
            wait = min(wait * 2, self.heartbeat)

    async def _give_slot(self, drive: _Drive, resource: str, holder: str) -> None:
        """Give back a slot an attempt took, retrying a transient failure while the lease may hold.

        Once the lease may have run out there is nothing to do: the slot
        stopped counting with it.
        """
        wait = _SLOT_POLL
        while True:
            try:
                await self._db(self.queue.release_slot, drive.lease, resource, holder)
                return
            except Exception as exc:
                if not is_transient(exc) or drive.lost or time.monotonic() >= drive.valid_until:
                    log.warning(
                        "worker %s: giving back the slot of resource %r of %s failed (%s: %s); it "
                        "counts until the run's lease ends",
                        self.name, resource, holder, type(exc).__name__, exc,
                    )
                    return
            await asyncio.sleep(wait)
            wait = min(wait * 2, self.heartbeat)

    def _usage_gate(self, drive: _Drive) -> Callable[[], Awaitable[None]]:
        async def gate() -> None:
            held = False
            try:
                while True:
                    wait, reason = await self._db(self.queue.usage_hold)
                    if wait <= 0:
                        break
                    if not held:
                        held = True
                        drive.held += 1
                    await self._say(drive, reason)
                    slept = time.monotonic()
                    await asyncio.sleep(min(wait, self.heartbeat))
                    note_hold(_limit_named(reason), time.monotonic() - slept)
            finally:
                if held:
                    drive.held -= 1
            if held and not drive.held:
                await self._say(drive, None)  # the last attempt held goes on: clear the reason

        return gate

    async def _say(self, drive: _Drive, reason: str | None) -> None:
        """Record why the run waits, only when that changes; a refusal loses the lease."""
        if drive.reason == reason or drive.lost:
            return
        drive.reason = reason
        try:
            await self._db(self.queue.set_reason, drive.lease, reason)
        except LeaseLostError:
            self._lose(drive)
        except Exception as exc:  # a reason is for people: never the run's failure
            log.warning("worker %s: recording why run %r waits failed (%s: %s)", self.name,
                        drive.lease.run_id, type(exc).__name__, exc)


def _limit_named(reason: str | None) -> str:
    """The hold's name of a usage limit's reason: ``"rate limit tokens_per_minute"`` ->
    ``"limit:tokens_per_minute"`` (``"limit:usage"`` when none is said)."""
    if not reason:
        return "limit:usage"
    return "limit:" + reason.removeprefix("rate limit ").strip()
