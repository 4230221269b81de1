"""``Worker``: takes runs from a queue and drives each with the runtime, under a lease.

For each run it claims, a worker starts the workflow (resuming from the
run's last checkpoint), saves every checkpoint through the queue (each save
fenced by the lease's epoch and renewing the lease), and renews the lease
every ``heartbeat`` seconds. The first refused write (a save or a renewal)
means the lease is lost: the worker cancels that run, writes nothing more
for it, and logs it. A cancel asked through the queue is seen at the next
renewal or save and stops the run the same way, after its final checkpoint.

The worker keeps its own conservative view of each lease: the start of the
last call that granted or renewed it, plus the lease length (after a save,
the share of it the queue's saves leave ahead, ``RunQueue.save_renews``), on
the monotonic clock. Before any attempt of a step starts (a first attempt, a
retry after its delay, an approved one), it waits for a save of that run
still pending, then checks that view: with less than a safety margin left
it renews first, and once the lease may have run out (a stalled loop, a
SIGSTOP, a database it could not reach) it starts nothing more and gives the
run up as lost, so that paid work is never started by two workers.

A renewal or a save that fails for another reason than a refusal (the
database is locked, the server is unreachable, the session was ended, the
disk is full: see :mod:`ekit_runtime.queue.transient`) is logged and tried
again for as long as the lease may still be valid (a renewal at the next
heartbeat, a save after a short backoff, before any new step starts); once
the worker's own clock says the lease has run out, the run is lost like a
refused one, and the next taker resumes from what was stored. A save that
fails for a permanent reason (an output that cannot be encoded) is the run's
failure. A claim that fails for a transient reason is logged and retried
after a backoff that doubles from ``poll`` up to 5 s; any other error from a
claim ends :meth:`Worker.run`.

Database calls run on one thread of the worker's own, so a slow database
never blocks the event loop the steps run on. The saves its runs ask, and
the endings of its runs, while that thread is writing are committed
together next, in one call of :meth:`RunQueue.write_many`
(:mod:`ekit_runtime.queue.group_commit`): one statement and one wait for the
disk for all of them, each still fenced and answered on its own. On
PostgreSQL those batches and the worker's quick claims are awaited on the
loop instead, through an asynchronous session of the worker's own
(:mod:`ekit_runtime.queue.postgres_loop`): the thread's hand-overs cost more
than the statements (decision 013).

Each run is driven with its own run options (stored with it at submit,
:mod:`ekit_runtime.queue.options`) merged over the worker's ``defaults``,
and with the worker's ``executor`` and a ``trace`` its factory makes for
that run. While the fleet's usage limits hold a step back, the run's
``reason`` says which (written when it changes, cleared when the step goes
on); and at most once a second the worker announces the workflows it
serves, so that a queued run no live worker serves says so, and the
attempts it runs at that moment (``RunQueue.in_flight``, the dashboard's
running steps).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ekit_runtime.cache.base import Cache
from ekit_runtime.child_runs import run_queued_child
from ekit_runtime.executors import Executor
from ekit_runtime.queue.base import claim_limit
from ekit_runtime.queue.contract import RunQueue
from ekit_runtime.queue.group_commit import GroupCommit
from ekit_runtime.queue.options import check_run_options
from ekit_runtime.queue.publisher import FLUSH_EVERY, StreamPublisher
from ekit_runtime.queue.records import (
    check_lease_seconds,
    check_seconds,
    check_step_name,
    check_workflow_name,
)
from ekit_runtime.queue.streams import DEFAULT_CAP, check_cap
from ekit_runtime.workflow import Workflow

if TYPE_CHECKING:
    from ekit_runtime.queue.postgres_loop import LoopSession

from ekit_runtime.queue.worker_claiming import _ANNOUNCE_EVERY, Claiming
from ekit_runtime.queue.worker_drive import StepsFailed
from ekit_runtime.queue.worker_parts import TraceFactory, _Drive, log

__all__ = ["StepsFailed", "TraceFactory", "Worker"]


def _check_objects(executor: object, trace: object, cache: object) -> None:
    """Refuse, naming it, a worker's ``executor``, ``trace`` or ``cache`` of the wrong kind."""
    if executor is not None and not isinstance(executor, Executor):
        raise ValueError(f"executor must be an ekit Executor or None, got {type(executor).__name__}")
    if trace is not None and not callable(trace):
        raise ValueError(f"trace must be a factory of trace callbacks or None, got {trace!r:.80}")
    if cache is not None and not isinstance(cache, Cache):
        raise ValueError(f"cache must be an ekit Cache (SqliteCache, DirectoryCache, ...) or None, "
                         f"got {type(cache).__name__}")


def _check_registry(registry: object) -> None:
    """Refuse a registry that is not workflow name -> ``Workflow``, or that names what no queue stores."""
    if not isinstance(registry, Mapping) or not registry:
        raise ValueError("registry must be a non-empty mapping of workflow name to Workflow")
    for key, workflow in registry.items():
        if not isinstance(workflow, Workflow):
            raise ValueError(f"registry[{key!r}] must be a Workflow, got {type(workflow).__name__}")
        # What the queue cannot store is refused here, before any step of any run is paid for.
        check_workflow_name(key, "registry key")
        for step in workflow.graph.names:
            check_step_name(step)
    _check_queued_children(registry)


def _check_queued_children(registry: Mapping[str, Workflow]) -> None:
    """Refuse, naming the step, a queued child whose workflow the registry lacks: the child run
    is submitted under its registry name, which must be this worker's and its fleet's."""
    known = {id(w) for w in registry.values()}
    for key, workflow in registry.items():
        for step in workflow.steps:
            run = step.run
            if not (isinstance(run, functools.partial) and run.func is run_queued_child):
                continue
            if id(run.args[0].workflow) not in known:
                raise ValueError(
                    f"registry[{key!r}]: step {step.name!r} runs its child as a queued run, and no "
                    "registry entry is that child's Workflow: register it under a name"
                )


def _stream_settings(queue: RunQueue, stream: object, cap: object, every: object) -> tuple[bool, int, float]:
    """``Worker``'s stream arguments, checked: whether it publishes, the cap, how often it flushes."""
    if not isinstance(stream, bool):
        raise ValueError(f"stream must be True or False, got {stream!r:.80}")
    # A queue that keeps no streams (a wrapper of another kind) is driven without one.
    publish = getattr(type(queue), "publish_many", None)
    publishes = stream and publish is not None and publish is not RunQueue.publish_many
    return publishes, check_cap(cap), check_seconds(every, "stream_every")


class Worker(Claiming):
    """Drive runs from ``queue`` with the workflows of ``registry`` (name -> ``Workflow``).

    - ``name``: how this worker signs its claims in the queue (for people;
      recovery never looks at it). Default ``host:pid``.
    - ``max_runs``: runs this worker drives at once.
    - ``lease_seconds``: how long a lease lasts without renewal;
      ``heartbeat`` (default a third of it, and shorter than it) how often
      it is renewed.
    - ``poll``: seconds between claims while the queue has nothing to give.
    - ``executor``: the :class:`~ekit_runtime.executors.Executor` every run
      is driven with (steps that name their own keep it).
    - ``trace``: a factory called once per drive with the run's
      :class:`Lease` (``run_id``, ``workflow``, ...) returning that drive's
      trace callback, a list of them, or ``None`` (an ``OtelTracer()``, a
      ``ProgressPrinter``, ...).
    - ``defaults``: run options (plain data, as ``submit(options=...)``
      takes) for every run; a run's own options override them, name by name.
      ``durations`` is on unless they say ``False``: each run's checkpoints
      record how long each step took and when it began, which the
      dashboard's step table and timeline show.
    - ``stream``: publish each run's events and its steps' ``partial()``
      output to the run's stream in the queue (default ``True``), which
      ``queue.stream(run_id)``, ``ekit queue watch`` and the dashboard read
      (see ``docs/streams.md``); ``stream_cap`` events are kept per run
      (oldest dropped first), published every ``stream_every`` seconds.
    - ``cache``: a :class:`~ekit_runtime.cache.Cache` every run is driven
      with (``run(cache=...)``): steps with ``cache=True`` are looked up in
      it, and a call any run of the fleet made is not paid again.

    ``await worker.run()`` works until :meth:`stop` (or cancellation);
    ``await worker.run_until_idle()`` returns once nothing is claimable and
    nothing is in flight. Either can run inside an application's own loop.
    Steps run where a plain ``workflow.run`` runs them (sync steps in the
    default executor's threads, or the step's own executor).
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
        executor: Executor | None = None,
        trace: TraceFactory | None = None,
        defaults: Mapping[str, Any] | None = None,
        stream: bool = True,
        stream_cap: int = DEFAULT_CAP,
        stream_every: float = FLUSH_EVERY,
        cache: Cache | None = None,
    ) -> None:
        """Check the arguments; nothing is claimed until :meth:`run`."""
        _check_registry(registry)
        claim_limit(max_runs, "max_runs")  # what a claim of every free place takes
        self.queue = queue
        self.registry = dict(registry)
        self.name = name if name is not None else f"{socket.gethostname()}:{os.getpid()}"
        self.max_runs = max_runs
        self.lease_seconds = check_lease_seconds(lease_seconds)
        self.heartbeat = check_seconds(
            heartbeat if heartbeat is not None else self.lease_seconds / 3, "heartbeat"
        )
        if self.heartbeat >= self.lease_seconds:
            raise ValueError("heartbeat must be shorter than lease_seconds")
        self.poll = check_seconds(poll, "poll")
        _check_objects(executor, trace, cache)
        self.executor = executor
        self.cache = cache
        self.trace = trace
        # Queued runs record their times unless told not to: the dashboard's timeline and step
        # durations need them, and a timed save costs the queue no more pages (docs/queue.md).
        self.defaults = {"durations": True, **check_run_options(defaults, "defaults")}
        self.stream, self.stream_cap, self.stream_every = _stream_settings(
            queue, stream, stream_cap, stream_every
        )
        self._publisher: StreamPublisher | None = None
        self._announced = -_ANNOUNCE_EVERY
        self.fingerprints = {k: w.graph.fingerprint for k, w in self.registry.items()}
        self.outcomes: dict[str, str] = {}
        """``run id -> how this worker's last drive of it ended``: finished, failed,
        cancelled, lost (lease lost), released (given back on stop), parked
        (waiting for a person's answer, holding no lease)."""
        # Less than this left of a lease, an attempt about to start renews it
        # first. A healthy worker always has more left (it renews every
        # heartbeat), so only a stall or a failing database ever gets here.
        self.start_margin = min(self.lease_seconds / 10, (self.lease_seconds - self.heartbeat) / 2)
        self._drives: dict[asyncio.Task[None], _Drive] = {}
        self._stop: asyncio.Event | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._group: GroupCommit | None = None
        self._session: LoopSession | None = None
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
        """Stop claiming; cancel the runs in flight (each saves a final checkpoint) and give them back.

        A run claimed while the stop was asked is given back without starting.
        """
        if self._stop is not None:
            self._stop.set()

    async def _loop(self, *, idle_exit: bool) -> None:
        self._stop = stop = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ekit-worker-db")
        # The queue's session of this loop, if it has one: PostgreSQL's (see
        # ekit_runtime.queue.postgres_loop). Looked up on the class, so that
        # a wrapper delegating to a queue (a test's fault injection) is
        # called through its own methods.
        opener = getattr(type(self.queue), "_loop_session", None)
        self._session = opener(self.queue) if opener is not None else None
        if self.stream:
            self._publisher = StreamPublisher(
                self.queue, self._db, cap=self.stream_cap, every=self.stream_every
            )
            self._publisher.start()
        self._group = GroupCommit(
            self.queue, self._executor, self.lease_seconds, self._session, self._publisher
        )
        stopping = asyncio.ensure_future(stop.wait())
        self._claim_failures = 0
        try:
            while not stop.is_set():
                await self._announce()
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
            if self._publisher is not None:
                with contextlib.suppress(Exception):
                    await self._publisher.stop()
                self._publisher = None
            await self._retire()
            await self._group.drain()
            if self._session is not None:
                with contextlib.suppress(Exception):
                    await self._session.aclose()
            self._executor.shutdown(wait=True)


    def _reap(self) -> None:
        for task in [t for t in self._drives if t.done()]:
            drive = self._drives.pop(task)
            self.outcomes[drive.lease.run_id] = drive.outcome
            if self._publisher is not None:
                self._publisher.lose(drive.lease.run_id)  # (a drive that raised: its buffer goes)
            if not task.cancelled() and task.exception() is not None:
                log.error(
                    "worker %s: driving run %r failed: %r", self.name, drive.lease.run_id, task.exception(),
                    extra=self._fields("drive_failed", drive.lease),
                )

    async def _stop_all(self) -> None:
        for drive in self._drives.values():
            # A drive whose run has not started yet sees this flag and gives
            # the run back without starting it.
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


    # -- one run ------------------------------------------------------------


    # -- log records (see ekit_runtime.logs) --------------------------------


    # -- before each attempt -------------------------------------------------


