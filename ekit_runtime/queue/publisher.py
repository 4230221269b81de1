"""A worker's side of the runs' live streams: buffer what its runs do, publish it in batches.

Each run a worker drives gets a :class:`RunStream`, one more trace callback
of the run: it turns the run's events and its steps' ``partial()`` output
into stream events (:data:`ekit_runtime.queue.streams.KINDS`) in a buffer
of its own. The worker's :class:`StreamPublisher` flushes every run's
buffer together, ``every`` seconds after the first event that waits (50 ms
by default; at once when a buffer holds :data:`HIGH_WATER` events), in one
call of :meth:`RunQueue.publish_many` on the worker's database thread: one
transaction for all its runs, each fenced by its lease.
Before the worker writes a run's end, every buffer is flushed: with the
group commit that ends the run (finished, failed, cancelled), just before
its write on the same database thread, or on its own (parked, given back);
a reader that sees the run ended has read everything it published.

What is published is what happened, never what is about to:

- ``finished``, ``retried``, ``failed`` and ``waiting`` are held, with
  every event after them, until the checkpoint that records them is saved
  (the run's ``CheckpointSaved``): the stream keeps the run's order, and a
  save that fails publishes none of them;
- a buffer holds at most ``buffer_max`` events: past it (the database is
  slower than the run's tokens), new events are dropped and counted, and a
  ``dropped`` event saying how many follows what the buffer held;
- a flush refused for a run (its lease is lost) drops that run's buffer and
  publishes nothing more for it; a flush that fails otherwise (the database
  is unreachable) loses its events, and a ``dropped`` event says how many;
  a worker that dies loses its unflushed buffers (at most ``every``
  seconds of events, plus a flush in flight), and the next worker's
  ``claimed`` event starts a new epoch in the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ekit_core.events import (
    CheckpointSaved,
    StepFailed,
    StepFinished,
    StepPartial,
    StepRetried,
    StepStarted,
    StepWaiting,
)
from ekit_runtime import logs
from ekit_runtime.queue.base import RunQueue
from ekit_runtime.queue.records import Lease, LeaseLostError
from ekit_runtime.queue.streams import Published, check_cap
from ekit_runtime.stores.codec import default_dumps

__all__ = ["BUFFER_MAX", "FLUSH_EVERY", "HIGH_WATER", "RunStream", "StreamPublisher"]

log = logs.WORKER

FLUSH_EVERY = 0.05
"""Seconds a worker gathers its runs' events before it publishes them together."""

BUFFER_MAX = 10_000
"""Events one run's buffer holds before new ones are dropped (and counted: a ``dropped`` event)."""

HIGH_WATER = 1000
"""Events in one run's buffer that make the next flush go at once, without waiting out ``every``."""


def _json(value: object) -> str:
    """``value`` as the JSON text of a stream event; what JSON cannot hold, as its ``repr``."""
    try:
        text = default_dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = default_dumps(repr(value))
    if "\x00" in text:  # (in JSON text only from a str subclass's own encoding)
        text = text.replace("\x00", "\\u0000")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate, which neither backend stores: escaped, as an error is
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


class RunStream:
    """One drive's buffer: a trace callback of the run (see the module docstring).

    Events are buffered in the order the run reports them. An event that a
    checkpoint records (``finished``, ...) holds back itself and everything
    after it until that checkpoint is saved, so the stream keeps the run's
    order and never tells of an output that was not stored.
    """

    __slots__ = ("_publisher", "dropped", "hold_from", "lease", "open", "ready")

    def __init__(self, lease: Lease, publisher: StreamPublisher) -> None:
        self.lease = lease
        self.ready: list[Published] = []
        """The buffered events, in order."""
        self.hold_from: int | None = None
        """Where in ``ready`` the first event waiting for a save is (``None``: none waits)."""
        self.dropped = 0
        self.open = True
        self._publisher = publisher

    def add(self, kind: str, step: str | None, data: object, *, held: bool = False) -> None:
        """Buffer one event (dropped and counted past the buffer's bound); ``held``: until the next save."""
        if not self.open:
            return
        if len(self.ready) >= self._publisher.buffer_max:
            self.dropped += 1
            return
        if held and self.hold_from is None:
            self.hold_from = len(self.ready)
        self.ready.append(Published(kind, step, _json(data), time.time()))
        if self.hold_from is None:
            self._publisher.wake(len(self.ready) >= HIGH_WATER)

    def __call__(self, event: Any) -> None:
        kind = type(event)
        if kind is StepPartial:
            delta = event.delta
            if delta is None:
                self.add("partial", event.name, event.value)
            else:  # an async generator's text: only what it adds (docs/streams.md)
                self.add("rewritten" if event.replaces else "partial", event.name, delta)
        elif kind is StepStarted:
            self.add("started", event.name, {"attempt": event.attempt})
        elif kind is CheckpointSaved:
            if self.hold_from is not None:
                self.hold_from = None
                self._publisher.wake()
        elif kind is StepFinished:
            self.add("finished", event.name, {"attempt": event.attempt, "usage": event.usage.to_dict()},
                     held=True)
        elif kind is StepRetried:
            self.add("retried", event.name, {
                "attempt": event.attempt, "error": f"{event.error_type}: {event.message}",
                "delay": event.delay,
            }, held=True)
        elif kind is StepFailed:
            self.add("failed", event.name,
                     {"attempt": event.attempt, "error": f"{event.error_type}: {event.message}"}, held=True)
        elif kind is StepWaiting:
            self.add("waiting", event.name, {"question": event.question.to_dict()}, held=True)

    @property
    def pending(self) -> bool:
        """Whether the next flush has something of this run to publish."""
        return self.open and ((bool(self.ready) and self.hold_from != 0) or bool(self.dropped))

    def take(self) -> list[Published]:
        """What the next flush publishes: the events before any held one (and ``dropped``, if any were)."""
        upto = len(self.ready) if self.hold_from is None else self.hold_from
        taken, self.ready = self.ready[:upto], self.ready[upto:]
        if self.hold_from is not None:
            self.hold_from = 0
        if self.dropped and self.hold_from is None:
            taken.append(Published("dropped", None, _json({"events": self.dropped}), time.time()))
            self.dropped = 0
        return taken

    def close(self) -> None:
        """Publish nothing more for this drive (its lease is lost, or its run ended)."""
        self.open = False
        self.ready, self.hold_from = [], None


class StreamPublisher:
    """One worker's runs' streams, flushed together (see the module docstring).

    ``call`` runs a queue method on the worker's database thread.
    """

    def __init__(
        self,
        queue: RunQueue,
        call: Callable[..., Awaitable[Any]],
        *,
        cap: int,
        every: float = FLUSH_EVERY,
        buffer_max: int = BUFFER_MAX,
    ) -> None:
        self.queue, self.call = queue, call
        self.cap = check_cap(cap)
        self.every = every
        self.buffer_max = buffer_max
        self.streams: dict[str, RunStream] = {}
        self._wake = asyncio.Event()
        self._urgent = asyncio.Event()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._failures = 0
        self.flushes = 0
        """How many calls of ``publish_many`` were made (benchmarks read it)."""

    def start(self) -> None:
        """Start the flusher on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._flusher(), name="ekit-stream-flusher")

    async def stop(self) -> None:
        """Flush what is left and stop the flusher."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.flush()

    def open(self, lease: Lease, worker: str) -> RunStream:
        """The stream of a drive that begins: its first event says who took the run, at which epoch."""
        stream = RunStream(lease, self)
        self.streams[lease.run_id] = stream
        stream.add("claimed", None, {"worker": worker, "resumed": lease.checkpoint is not None})
        return stream

    def wake(self, now: bool = False) -> None:
        """Something waits to be published: at the next flush, or (``now``) at once."""
        self._wake.set()
        if now:
            self._urgent.set()

    async def end(self, run_id: str) -> None:
        """Flush the run's buffer now (its end is about to be written), then close its stream."""
        stream = self.streams.get(run_id)
        if stream is None:
            return
        # Always, even with nothing pending: a flush in flight may hold this run's events, taken
        # out of its buffer, and the lock waits it out. Ending first let the run's end commit
        # overtake that flush (PostgreSQL: another session), whose fence then found the run over
        # and published none of them: a reader saw only ``end``.
        await self.flush()
        stream.close()
        self.streams.pop(run_id, None)

    def lose(self, run_id: str) -> None:
        """The drive lost its lease: nothing more is published for it."""
        stream = self.streams.pop(run_id, None)
        if stream is not None:
            stream.close()

    async def _flusher(self) -> None:
        while True:
            await self._wake.wait()
            # Gather: a step's tokens over ``every`` seconds go in one transaction
            # (longer after failed flushes, up to 5 s: a database that is down is not
            # hammered), unless a buffer passes HIGH_WATER first.
            delay = min(5.0, self.every * 2.0 ** min(self._failures, 16))
            if not self._urgent.is_set() and not self._failures:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._urgent.wait(), delay)
            elif self._failures:
                await asyncio.sleep(delay)
            self._wake.clear()
            self._urgent.clear()
            await self.flush()

    def take(self) -> list[tuple[RunStream, list[Published]]]:
        """Every open buffer's events ready to publish, taken out of the buffers (on the loop)."""
        batches = [(s, s.take()) for s in self.streams.values() if s.pending]
        return [(s, events) for s, events in batches if events]

    def publish(self, batches: list[tuple[RunStream, list[Published]]]) -> list[int | Exception] | Exception:
        """Publish ``batches`` (on the worker's database thread): each run's outcome, or the error that
        kept the call from being made. Never raises: a stream is advisory, never a run's failure."""
        try:
            return self.queue.publish_many([(s.lease, events) for s, events in batches], self.cap)
        except Exception as exc:
            return exc

    def settle(self, batches: list[tuple[RunStream, list[Published]]],
               result: list[int | Exception] | Exception) -> None:
        """Act on what :meth:`publish` returned (on the loop): a lost lease closes its run's stream;
        events that could not be stored are counted, and told by a ``dropped`` event."""
        self.flushes += 1
        if isinstance(result, Exception):
            for stream, events in batches:
                stream.dropped += len(events)
            self._failures += 1
            if self._failures & (self._failures - 1) == 0:  # the 1st, 2nd, 4th ... in a row
                log.warning("publishing the streams of %d run(s) failed (%s: %s); %d event(s) dropped "
                            "(failure %d in a row)", len(batches), type(result).__name__, result,
                            sum(len(events) for _s, events in batches), self._failures)
            self.wake()
            return
        self._failures = 0
        for (stream, events), outcome in zip(batches, result, strict=True):
            if isinstance(outcome, LeaseLostError):
                stream.close()  # a zombie publishes nothing
            elif isinstance(outcome, Exception):
                stream.dropped += len(events)
                log.warning("publishing the stream of run %r failed (%s: %s); %d event(s) dropped",
                            stream.lease.run_id, type(outcome).__name__, outcome, len(events))

    async def publish_after_flushes(self, batches: list[tuple[RunStream, list[Published]]]) -> None:
        """Publish ``batches`` (taken by :meth:`take`) once any flush in flight is done, and settle them.

        For an ending written on a session of its own (PostgreSQL's loop
        session): a flush in flight may hold events of the ending runs, and
        an end committed before it makes its fence find those runs over.
        """
        async with self._lock:
            if batches:
                self.settle(batches, await self.call(self.publish, batches))

    async def flush(self) -> None:
        """Publish every open buffer now (after any flush in flight), one transaction for all."""
        async with self._lock:
            batches = self.take()
            if batches:
                self.settle(batches, await self.call(self.publish, batches))
