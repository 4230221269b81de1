"""What every room of a queue worker shares: the worker's settings and state, one drive's record, logging.

A :class:`~ekit_runtime.queue.worker.Worker` is built in floors, each a
module with one job, each class on the one below: these parts; keeping a
lease (:mod:`~ekit_runtime.queue.worker_lease`); saving and ending a run
(:mod:`~ekit_runtime.queue.worker_saving`); admitting an attempt against the
fleet's limits, caps and slots (:mod:`~ekit_runtime.queue.worker_admission`);
driving one run (:mod:`~ekit_runtime.queue.worker_drive`); claiming runs
(:mod:`~ekit_runtime.queue.worker_claiming`); and the worker's loop
(:mod:`~ekit_runtime.queue.worker`), which alone sets these attributes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from ekit_core.progress import run_progress
from ekit_runtime import logs
from ekit_runtime.cache.base import Cache
from ekit_runtime.executors import Executor
from ekit_runtime.queue.contract import RunQueue
from ekit_runtime.queue.group_commit import GroupCommit
from ekit_runtime.queue.publisher import StreamPublisher
from ekit_runtime.queue.records import (
    Lease,
    RunStatus,
)
from ekit_runtime.runner import TraceFn
from ekit_runtime.workflow import Workflow

__all__ = ["TraceFactory", "WorkerParts"]

if TYPE_CHECKING:
    from ekit_runtime.queue.postgres_loop import LoopSession

TraceFactory = Callable[[Lease], "TraceFn | list[TraceFn] | None"]
"""What ``Worker(trace=...)`` takes: called once per drive with the run's :class:`Lease`
(``run_id``, ``workflow``, ``epoch``, ``options``), returning that drive's trace callback(s)."""


T = TypeVar("T")
log = logs.WORKER  # logging.getLogger("ekit.worker"): see ekit_runtime.logs


@dataclass(slots=True)
class _Drive:
    """What the worker knows about one run it drives."""

    lease: Lease
    valid_until: float
    """``time.monotonic()`` before which the lease is surely still held: the start of
    the last call that granted or renewed it, plus the lease length (a save: plus
    the queue's ``save_renews`` share of it; the database set its expiry from a
    later moment, so this errs early, never late)."""
    gated: bool = False
    """Whether the fleet had usage limits when the run was claimed: each attempt then waits on them."""
    task: asyncio.Task[Any] | None = None
    lost: bool = False
    cancel_asked: bool = False
    stopping: bool = False
    outcome: str = field(default="")
    saves: int = 0
    """Saves handed over by the runner and not yet done: no attempt starts meanwhile."""
    saved: asyncio.Event = field(default_factory=asyncio.Event)
    """Set whenever ``saves`` is 0."""
    confirming: asyncio.Future[None] | None = None
    """A renewal asked by an attempt about to start near the lease's end, shared by all."""
    reason: str | None = None
    """The reason last written for the run (why it waits), ``None`` when none is."""
    held: int = 0
    """Attempts the fleet's usage limits hold back right now."""
    doing: dict[str, tuple[float, int]] = field(default_factory=dict)
    """``name -> (when it began, attempt number)`` of each attempt running now (its work
    begun, not yet ended), told to the queue with the worker's announcements."""

    def __post_init__(self) -> None:
        self.saved.set()


class WorkerParts:
    """The worker's settings and state (set by ``Worker``), its database calls and log lines."""

    queue: RunQueue
    registry: dict[str, Workflow]
    name: str
    max_runs: int
    lease_seconds: float
    heartbeat: float
    poll: float
    executor: Executor | None
    cache: Cache | None
    trace: TraceFactory | None
    defaults: dict[str, Any]
    stream: bool
    stream_cap: int
    stream_every: float
    fingerprints: dict[str, str]
    outcomes: dict[str, str]
    start_margin: float
    _publisher: StreamPublisher | None
    _announced: float
    _drives: dict[asyncio.Task[None], _Drive]
    _stop: asyncio.Event | None
    _executor: ThreadPoolExecutor | None
    _group: GroupCommit | None
    _session: LoopSession | None
    _claim_failures: int

    async def _db(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def _fields(self, event: str | None, lease: Lease | None = None, **more: Any) -> dict[str, Any]:
        """The ekit attributes of a worker record about ``lease``'s run (``extra=`` for logging).

        With ``event`` ``None``, the fields alone, for :func:`ekit_runtime.logs.log_event`.
        """
        fields: dict[str, Any] = dict.fromkeys(logs.FIELDS) if event is not None else {}
        fields["worker"] = self.name
        if lease is not None:
            fields.update(run_id=lease.run_id, workflow=lease.workflow, epoch=lease.epoch)
        if event is not None:
            fields["event"] = event
        fields.update(more)
        return fields

    def _log_claimed(self, lease: Lease) -> None:
        # (Counted as the queue and the run's own log lines count: ekit_core.progress.)
        counted = None if lease.checkpoint is None else run_progress(lease.checkpoint)
        logs.log_event(
            log, logging.INFO, "claimed", "worker %s: claimed run %r (workflow %r, epoch %d, %s)",
            self.name, lease.run_id, lease.workflow, lease.epoch,
            "new" if counted is None else f"resuming with {counted.text()}",
            recorded=None if counted is None else counted.done,
            total=None if counted is None else counted.total, **self._fields(None, lease),
        )

    def _log_ended(self, lease: Lease, status: RunStatus, message: str | None) -> None:
        """Log how a run this worker drove was recorded: finished, failed or cancelled."""
        if status == "failed":
            logs.log_event(
                log, logging.WARNING, "failed", "worker %s: run %r (epoch %d) failed: %s",
                self.name, lease.run_id, lease.epoch, message, status=status, error=message,
                **self._fields(None, lease),
            )
            return
        logs.log_event(
            log, logging.INFO, str(status), "worker %s: run %r (epoch %d) %s",
            self.name, lease.run_id, lease.epoch, status, status=status, **self._fields(None, lease),
        )
