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
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ekit_core import WorkflowCheckpoint
from ekit_core.progress import run_progress
from ekit_runtime import logs
from ekit_runtime.attempt import Attempt
from ekit_runtime.cache.base import Cache
from ekit_runtime.errors import RunWaiting
from ekit_runtime.executors import Executor
from ekit_runtime.queue.base import claim_limit
from ekit_runtime.queue.contract import RunQueue
from ekit_runtime.queue.group_commit import GroupCommit
from ekit_runtime.queue.lifecycle import drive_ending, usage_limited, waiting_reason
from ekit_runtime.queue.options import check_run_options, run_arguments
from ekit_runtime.queue.publisher import FLUSH_EVERY, StreamPublisher
from ekit_runtime.queue.records import (
    Lease,
    LeaseLostError,
    RunStatus,
    check_lease_seconds,
    check_seconds,
    check_step_name,
    check_workflow_name,
)
from ekit_runtime.queue.streams import DEFAULT_CAP, check_cap
from ekit_runtime.queue.transient import is_transient
from ekit_runtime.runner import TraceFn
from ekit_runtime.workflow import Workflow, WorkflowResult

if TYPE_CHECKING:
    from ekit_runtime.queue.postgres_loop import LoopSession

__all__ = ["StepsFailed", "TraceFactory", "Worker"]

TraceFactory = Callable[[Lease], "TraceFn | list[TraceFn] | None"]
"""What ``Worker(trace=...)`` takes: called once per drive with the run's :class:`Lease`
(``run_id``, ``workflow``, ``epoch``, ``options``), returning that drive's trace callback(s)."""

T = TypeVar("T")
log = logs.WORKER  # logging.getLogger("ekit.worker"): see ekit_runtime.logs

# The longest wait between claims while the database keeps failing: short
# enough that a worker is back at work seconds after the database is, long
# enough not to hammer one that is struggling.
_MAX_BACKOFF = 5.0
# The first wait before a save that failed transiently is tried again; it
# doubles up to a quarter of the heartbeat. Short: no step starts meanwhile.
_SAVE_RETRY = 0.02
# The first wait before a full resource is asked again for a slot; it doubles
# up to the heartbeat.
_SLOT_POLL = 0.01

# A worker tells the queue it is alive and which workflows it serves at most
# this often (seconds), however short its poll.
_ANNOUNCE_EVERY = 1.0


class StepsFailed(Exception):
    """A run driven with ``isolate_failures`` ended with failed steps: the queue marks it ``failed``.

    The checkpoint keeps every output the other steps recorded; the message
    names the failed steps (with their errors) and those that never started.
    """

    def __init__(self, result: WorkflowResult) -> None:
        failed = "; ".join(f"{n!r} ({type(e).__name__}: {e})" for n, e in result.failed.items())
        waiting = ", ".join(repr(n) for n in result.not_started) or "none"
        super().__init__(
            f"{len(result.failed)} step(s) failed with isolate_failures: {failed}; not started: {waiting}"
        )
        self.result = result


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


def _stream_settings(queue: RunQueue, stream: object, cap: object, every: object) -> tuple[bool, int, float]:
    """``Worker``'s stream arguments, checked: whether it publishes, the cap, how often it flushes."""
    if not isinstance(stream, bool):
        raise ValueError(f"stream must be True or False, got {stream!r:.80}")
    # A queue that keeps no streams (a wrapper of another kind) is driven without one.
    publish = getattr(type(queue), "publish_many", None)
    publishes = stream and publish is not None and publish is not RunQueue.publish_many
    return publishes, check_cap(cap), check_seconds(every, "stream_every")


class Worker:
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
      takes) for every run; a run's own options override them, name by name
      (``{"durations": True}`` records how long each step took, which the
      dashboard shows).
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
        self.defaults = check_run_options(defaults, "defaults")
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

    async def _db(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    # -- one run ------------------------------------------------------------

    async def _drive(self, drive: _Drive) -> None:
        lease = drive.lease
        # The log records of this task and of the run's name the worker, workflow and epoch.
        logs.bind_log_fields(worker=self.name, workflow=lease.workflow, epoch=lease.epoch)
        if drive.stopping:
            # Claimed while the worker was being stopped: give it back untouched.
            await self._give_back(drive)
            return
        if self._publisher is not None:
            self._publisher.open(lease, self.name)
        gate = self._usage_gate(drive) if drive.gated else None
        # The run's id keys its attempts (run/step/number, the number counted
        # across runs), and each attempt waits for the worker's admission.
        drive.task = asyncio.create_task(self._run(drive, gate))
        beat = asyncio.create_task(self._heartbeat(drive))
        try:
            await asyncio.wait({drive.task})
        finally:
            beat.cancel()
        await self._record_ending(drive, drive.task)

    async def _run(self, drive: _Drive, gate: Callable[[], Awaitable[None]] | None) -> WorkflowResult:
        """Drive the run with its options over the worker's; failed steps of an isolated run raise."""
        lease = drive.lease
        result = await self.registry[lease.workflow].run(
            None if lease.checkpoint is not None else dict(lease.context),
            checkpoint_fn=functools.partial(self._checkpoint, drive),
            resume_from=lease.checkpoint,
            run_id=lease.run_id,
            before_attempt=functools.partial(self._admit, drive, gate),
            **self._run_options(lease, drive),
        )
        if not result.ok:
            raise StepsFailed(result)
        return result

    def _run_options(self, lease: Lease, drive: _Drive | None = None) -> dict[str, Any]:
        """The ``Workflow.run`` arguments of one drive: run options over defaults, executor, trace
        (the run's stream among its callbacks, last)."""
        options = run_arguments({**self.defaults, **lease.options}) if self.defaults or lease.options else {}
        if self.executor is not None:
            options["executor"] = self.executor
        if self.cache is not None:
            options["cache"] = self.cache
        traces: list[Any] = []
        if self.trace is not None:
            trace = self.trace(lease)
            if trace is not None:
                traces = list(trace) if isinstance(trace, list | tuple) else [trace]
        stream = None if self._publisher is None else self._publisher.streams.get(lease.run_id)
        if stream is not None:
            traces.append(stream)
        if traces:
            options["trace"] = traces if len(traces) > 1 else traces[0]
        return options

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
        """Park a run that waits for a person: no lease, no worker, until someone answers."""
        await drive.saved.wait()  # the final checkpoint, with the questions, is stored first
        try:
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

    # -- log records (see ekit_runtime.logs) --------------------------------

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

    # -- before each attempt -------------------------------------------------

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
        while True:
            try:
                if await self._db(self.queue.acquire_slot, lease, resource, holder):
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
                    await asyncio.sleep(min(wait, self.heartbeat))
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

