"""``Worker``: takes runs from a queue and drives each with the runtime, under a lease.

For each run it claims, a worker starts the workflow (resuming from the
run's last checkpoint), saves every checkpoint through the queue (each save
fenced by the lease's epoch and renewing the lease), and renews the lease
every ``heartbeat`` seconds. The first refused write (a save or a renewal)
means the lease is lost: the worker cancels that run, writes nothing more
for it, and logs it. A cancel asked through the queue is seen at the next
renewal or save and stops the run the same way, after its final checkpoint.

A renewal that fails for another reason (the database is locked, the
server is unreachable) is logged and tried again at the next heartbeat, for
as long as the lease may still be valid; once the worker's own conservative
clock says it has run out, the lease is lost like a refused one. A claim that
fails for a transient reason (see :mod:`ekit_runtime.queue.transient`) is
logged and retried after a backoff that doubles from ``poll`` up to 5 s; any
other error from a claim ends :meth:`Worker.run`.

Database calls run on one thread of the worker's own, so a slow database
never blocks the event loop the steps run on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ekit_core import WorkflowCheckpoint
from ekit_runtime.queue.contract import RunQueue
from ekit_runtime.queue.keys import Gate, keyed_workflow
from ekit_runtime.queue.records import Lease, LeaseLostError, check_seconds
from ekit_runtime.queue.transient import is_transient
from ekit_runtime.workflow import Workflow

__all__ = ["Worker"]

T = TypeVar("T")
log = logging.getLogger("ekit.worker")

# The longest wait between claims while the database keeps failing: short
# enough that a worker is back at work seconds after the database is, long
# enough not to hammer one that is struggling.
_MAX_BACKOFF = 5.0


@dataclass(slots=True)
class _Drive:
    """What the worker knows about one run it drives."""

    lease: Lease
    valid_until: float
    """``time.monotonic()`` before which the lease is surely still held: the start of
    the last call that granted or renewed it, plus the lease length (the database
    set its expiry from a later moment, so this errs early, never late)."""
    task: asyncio.Task[Any] | None = None
    lost: bool = False
    cancel_asked: bool = False
    stopping: bool = False
    outcome: str = field(default="")


class Worker:
    """Drive runs from ``queue`` with the workflows of ``registry`` (name -> ``Workflow``).

    - ``name``: how this worker signs its claims in the queue (for people;
      recovery never looks at it). Default ``host:pid``.
    - ``max_runs``: runs this worker drives at once.
    - ``lease_seconds``: how long a lease lasts without renewal;
      ``heartbeat`` (default a third of it) how often it is renewed.
    - ``poll``: seconds between claims while the queue has nothing to give.

    ``await worker.run()`` works until :meth:`stop` (or cancellation);
    ``await worker.run_until_idle()`` returns once nothing is claimable and
    nothing is in flight. Either can run inside an application's own loop.
    """

    def __init__(
        self,
        queue: RunQueue,
        registry: Mapping[str, Workflow],
        *,
        name: str | None = None,
        max_runs: int = 4,
        lease_seconds: float = 30.0,
        heartbeat: float | None = None,
        poll: float = 0.5,
    ) -> None:
        """Check the arguments; nothing is claimed until :meth:`run`."""
        if not isinstance(registry, Mapping) or not registry:
            raise ValueError("registry must be a non-empty mapping of workflow name to Workflow")
        for key, workflow in registry.items():
            if not isinstance(workflow, Workflow):
                raise ValueError(f"registry[{key!r}] must be a Workflow, got {type(workflow).__name__}")
        if isinstance(max_runs, bool) or not isinstance(max_runs, int) or max_runs < 1:
            raise ValueError(f"max_runs must be a positive int, got {max_runs!r}")
        self.queue = queue
        self.registry = dict(registry)
        self.name = name if name is not None else f"{socket.gethostname()}:{os.getpid()}"
        self.max_runs = max_runs
        self.lease_seconds = check_seconds(lease_seconds, "lease_seconds")
        self.heartbeat = check_seconds(
            heartbeat if heartbeat is not None else self.lease_seconds / 3, "heartbeat"
        )
        if self.heartbeat >= self.lease_seconds:
            raise ValueError("heartbeat must be shorter than lease_seconds")
        self.poll = check_seconds(poll, "poll")
        self.fingerprints = {k: w.graph.fingerprint for k, w in self.registry.items()}
        self.outcomes: dict[str, str] = {}
        """``run id -> how this worker's last drive of it ended``: finished, failed,
        cancelled, lost (lease lost), released (given back on stop)."""
        self._drives: dict[asyncio.Task[None], _Drive] = {}
        self._stop: asyncio.Event | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._gated = False
        self._claim_failures = 0

    # -- the loop -----------------------------------------------------------

    async def run(self) -> None:
        """Claim and drive runs until :meth:`stop` is called or this task is cancelled."""
        await self._loop(idle_exit=False)

    async def run_until_idle(self) -> int:
        """Claim and drive runs until none is claimable and none is in flight; return how many ended here."""
        before = len(self.outcomes)
        await self._loop(idle_exit=True)
        return len(self.outcomes) - before

    def stop(self) -> None:
        """Stop claiming; cancel the runs in flight (each saves a final checkpoint) and give them back."""
        if self._stop is not None:
            self._stop.set()

    async def _loop(self, *, idle_exit: bool) -> None:
        self._stop = stop = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ekit-worker-db")
        stopping = asyncio.ensure_future(stop.wait())
        self._claim_failures = 0
        try:
            while not stop.is_set():
                claimed: bool | None = False
                if len(self._drives) < self.max_runs:
                    claimed = await self._try_claim()
                    if claimed:
                        continue
                # A claim that failed says nothing about whether the queue is empty.
                if idle_exit and not self._drives and claimed is False:
                    return
                await asyncio.wait(
                    {*self._drives, stopping},
                    timeout=self.poll if claimed is False else self._backoff(),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                self._reap()
        finally:
            stopping.cancel()
            await self._stop_all()
            self._executor.shutdown(wait=True)

    async def _try_claim(self) -> bool | None:
        """Claim one run: whether one was claimed, or ``None`` after a transient error.

        A permanent error is raised: retrying would only hide it.
        """
        try:
            claimed = await self._claim_one()
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

    async def _claim_one(self) -> bool:
        limits = await self._db(self.queue.limits)
        self._gated = limits.llm_calls_per_minute is not None or limits.tokens_per_minute is not None
        asked = time.monotonic()
        lease = await self._db(self.queue.claim, self.name, self.fingerprints, self.lease_seconds)
        if lease is None:
            return False
        drive = _Drive(lease, asked + self.lease_seconds)
        task = asyncio.create_task(self._drive(drive), name=f"ekit-run-{lease.run_id}")
        self._drives[task] = drive
        return True

    def _reap(self) -> None:
        for task in [t for t in self._drives if t.done()]:
            drive = self._drives.pop(task)
            self.outcomes[drive.lease.run_id] = drive.outcome
            if not task.cancelled() and task.exception() is not None:
                log.error(
                    "worker %s: driving run %r failed: %r", self.name, drive.lease.run_id, task.exception()
                )

    async def _stop_all(self) -> None:
        for drive in self._drives.values():
            drive.stopping = True
            if drive.task is not None:
                drive.task.cancel()
        pending = set(self._drives)
        while pending:
            # Held against further cancellation: each run must save its final
            # checkpoint and be given back before the worker returns.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(asyncio.wait(pending))
            pending = {t for t in pending if not t.done()}
        self._reap()

    async def _db(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    # -- one run ------------------------------------------------------------

    async def _drive(self, drive: _Drive) -> None:
        lease = drive.lease
        workflow = keyed_workflow(
            self.registry[lease.workflow],
            lease.run_id,
            lease.checkpoint,
            self._gate() if self._gated else None,
        )
        drive.task = asyncio.create_task(
            workflow.run(
                None if lease.checkpoint is not None else dict(lease.context),
                checkpoint_fn=functools.partial(self._save, drive),
                resume_from=lease.checkpoint,
            )
        )
        beat = asyncio.create_task(self._heartbeat(drive))
        try:
            await asyncio.wait({drive.task})
        finally:
            beat.cancel()
        await self._conclude(drive, drive.task)

    async def _conclude(self, drive: _Drive, task: asyncio.Task[Any]) -> None:
        """Record how the run ended, unless the lease was lost (then write nothing)."""
        lease = drive.lease
        error = None if task.cancelled() else task.exception()
        if drive.lost or _lost(error):
            drive.outcome = "lost"
            log.warning(
                "worker %s: lease on run %r (epoch %d) was lost; stopped driving it and wrote nothing more",
                self.name,
                lease.run_id,
                lease.epoch,
            )
            return
        if drive.stopping and not drive.cancel_asked:
            drive.outcome = "released"
            await self._db(self.queue.release, lease)
            return
        if drive.cancel_asked and (task.cancelled() or isinstance(error, asyncio.CancelledError)):
            status, message = "cancelled", None
        elif error is None and not task.cancelled():
            status, message = "finished", None
        else:
            status, message = "failed", f"{type(error).__name__}: {error}"
        try:
            await self._db(self.queue.finish, lease, status, message)
            drive.outcome = status
        except LeaseLostError:
            drive.outcome = "lost"
            log.warning(
                "worker %s: lease on run %r lost before it could be marked %s",
                self.name,
                lease.run_id,
                status,
            )

    async def _save(self, drive: _Drive, checkpoint: WorkflowCheckpoint) -> None:
        if drive.lost:
            # Known lost: refuse without touching the database.
            raise LeaseLostError(drive.lease.run_id, drive.lease.epoch)
        asked = time.monotonic()
        try:
            cancel = await self._db(self.queue.save, drive.lease, checkpoint, self.lease_seconds)
        except LeaseLostError:
            drive.lost = True
            raise
        drive.valid_until = asked + self.lease_seconds  # every save renews the lease
        self._on_cancel_flag(drive, cancel)

    async def _heartbeat(self, drive: _Drive) -> None:
        while not drive.lost:
            await asyncio.sleep(self.heartbeat)
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
                continue
            drive.valid_until = asked + self.lease_seconds
            self._on_cancel_flag(drive, cancel)

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

    def _gate(self) -> Gate:
        async def gate() -> None:
            while True:
                wait = await self._db(self.queue.usage_wait)
                if wait <= 0:
                    return
                await asyncio.sleep(min(wait, self.heartbeat))

        return gate


def _lost(error: BaseException | None) -> bool:
    """Whether ``error`` is, or holds, a refused write."""
    if isinstance(error, LeaseLostError):
        return True
    if isinstance(error, BaseExceptionGroup):
        return any(_lost(e) for e in error.exceptions)
    return False
