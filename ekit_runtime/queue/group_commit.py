"""``GroupCommit``: a worker's saves and run endings that meet are committed together.

A durable commit waits for the disk, and SQLite lets one process commit at a
time, so a worker that commits every run's every save on its own spends its
database thread, and the fleet its write lock, waiting for fsyncs. Here a
save asked while the worker's previous write is still being made waits for
it, and then goes with every other save that waited meanwhile, in one call
of :meth:`RunQueue.save_many`: one statement, one fsync. A save asked when
nothing is being written goes at the loop's next turn, so an idle worker's
latency is what it was; under load the batches grow by themselves, as the
writes get slower. While a write waits for its turn (the database thread,
SQLite's write lock), the backend may take in the saves asked meanwhile
through ``save_many``'s ``more``.

A run that ends (finished, failed, cancelled) is ended the same way, in the
batch of the saves that meet it (:meth:`RunQueue.write_many`): the worker's
runs that end together, or while others save, cost no commit of their own.

Each write is still fenced on its own and answered on its own (a save's
cancel flag, or its own exception), and its caller still waits until it is
durable. A run has at most one write in a batch (a run's writes are made in
order: its ending after its last save); a write whose caller was cancelled
before its batch was taken is not made, as a write not yet begun on the
worker's thread would not be.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, cast

from ekit_core import WorkflowCheckpoint
from ekit_runtime.queue.base import Ending, RunQueue
from ekit_runtime.queue.records import Lease, RunStatus

if TYPE_CHECKING:
    from ekit_runtime.queue.postgres_loop import LoopSession
    from ekit_runtime.queue.publisher import StreamPublisher

__all__ = ["GroupCommit"]

# At most this many saves in one call of save_many (a worker seldom has more runs in flight).
_MANY = 256

# A save (its checkpoint) or an ending, and its caller's future.
_Waiting = tuple[Lease, "WorkflowCheckpoint | Ending", "asyncio.Future[Any]"]


class GroupCommit:
    """Saves of one worker's runs, batched while a write is in flight (see the module docstring)."""

    def __init__(
        self,
        queue: RunQueue,
        executor: Executor,
        lease_seconds: float,
        session: LoopSession | None = None,
        publisher: StreamPublisher | None = None,
    ) -> None:
        self.queue, self.executor, self.lease_seconds = queue, executor, lease_seconds
        # The runs' streams: a batch that ends runs first publishes what every
        # stream holds, on the same thread, so that a run's stream is whole
        # before its end is written (ekit_runtime.queue.publisher).
        self.publisher = publisher
        # When given, each batch is awaited on the loop through it instead of
        # made on the executor's thread (see ekit_runtime.queue.postgres_loop).
        self.session = session
        # Appended to by the event loop; taken from by the loop when a write
        # begins and by the worker's database thread while that write waits
        # for its turn (``more``), hence the lock.
        self._waiting: list[_Waiting] = []
        self._lock = threading.Lock()
        self._writing: asyncio.Future[tuple[list[bool | Exception], list[Exception | None]]] | None = None
        self._soon = False
        self._published: tuple[list[Any], Any] | None = None
        self.batches = 0
        """How many calls of ``write_many`` were made (the tests and benchmarks read it)."""
        self.saves = 0
        """How many saves they held."""
        self.endings = 0
        """How many run endings they held."""

    async def save(self, lease: Lease, checkpoint: WorkflowCheckpoint) -> bool:
        """Store ``checkpoint`` under ``lease`` (as ``RunQueue.save``); whether a cancel was asked."""
        told: bool = await self._ask(lease, checkpoint)
        return told

    async def finish(self, lease: Lease, status: RunStatus, error: str | None = None) -> None:
        """End the run under ``lease`` (as ``RunQueue.finish``), with the saves that meet it."""
        await self._ask(lease, Ending(lease, status, error))

    async def _ask(self, lease: Lease, write: WorkflowCheckpoint | Ending) -> Any:
        loop = asyncio.get_running_loop()
        told: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            self._waiting.append((lease, write, told))
        if self._writing is None and not self._soon:
            # Begun in the loop's next round, not now: the runs whose saves
            # were answered together go on together, and the others' saves
            # are asked later in this round. (Callbacks the loop already has
            # run before one it is handed now.)
            self._soon = True
            loop.call_soon(self._write, loop)
        return await told

    async def drain(self) -> None:
        """Wait until nothing is being written (before the worker's thread is shut down)."""
        while self._writing is not None:
            await asyncio.wait({self._writing})

    def _take(self, runs: set[str], limit: int, *, ends: bool) -> list[_Waiting]:
        """Take up to ``limit`` waiting writes, at most one per run (``runs``: the batch's so far).

        ``ends=False`` (a write already begun, taking in more) leaves the endings for the next batch.
        """
        taken: list[_Waiting] = []
        later: list[_Waiting] = []
        with self._lock:
            for item in self._waiting:
                if item[2].done():
                    continue  # its caller was cancelled before the write began: not made
                run_id = item[0].run_id
                if run_id in runs or len(taken) >= limit or (not ends and type(item[1]) is Ending):
                    later.append(item)
                else:
                    taken.append(item)
                runs.add(run_id)  # (a run's later write waits for the next batch: its order kept)
            self._waiting = later
            ending = sum(type(item[1]) is Ending for item in taken)
            self.saves += len(taken) - ending
            self.endings += ending
        return taken

    def _write(self, loop: asyncio.AbstractEventLoop) -> None:
        self._soon = False
        runs: set[str] = set()
        first = self._take(runs, _MANY, ends=True)
        if not first:
            return
        self.batches += 1
        # The batch in the order of write_many's outcomes: the saves (then those
        # taken in while the write waits), and the endings.
        order = [item for item in first if type(item[1]) is not Ending]
        ended = [item for item in first if type(item[1]) is Ending]
        saves = [(lease, cast(WorkflowCheckpoint, cp)) for lease, cp, _ in order]
        endings = [cast(Ending, end) for _lease, end, _ in ended]

        def more(limit: int) -> list[tuple[Lease, WorkflowCheckpoint]]:
            # (On the database thread, while the write waits for its turn.)
            joined = self._take(runs, limit, ends=False)
            order.extend(joined)
            return [(lease, cast(WorkflowCheckpoint, cp)) for lease, cp, _ in joined]

        writing: asyncio.Future[tuple[list[bool | Exception], list[Exception | None]]]
        publisher = self.publisher if endings else None
        streams = publisher.take() if publisher is not None else []
        if self.session is not None:
            # A task: a caller cancelled while it runs does not cancel it.
            writing = asyncio.ensure_future(self._published_then_written(streams, saves, endings))
        else:
            call = functools.partial(self.queue.write_many, saves, endings, self.lease_seconds, more)
            if streams:
                call = functools.partial(self._publish_then_write, streams, call)
            writing = loop.run_in_executor(self.executor, call)
        self._writing = writing
        writing.add_done_callback(functools.partial(self._written, order, ended))

    def _publish_then_write(self, streams: list[Any], write: Any) -> Any:
        """On the database thread: the streams' events, then the batch's writes."""
        assert self.publisher is not None
        published = self.publisher.publish(streams)
        result = write()
        self._published = (streams, published)  # (settled by _written, on the loop, once this returns)
        return result

    async def _published_then_written(
        self, streams: list[Any], saves: list[tuple[Lease, WorkflowCheckpoint]], endings: list[Ending]
    ) -> tuple[list[bool | Exception], list[Exception | None]]:
        assert self.session is not None
        if endings and self.publisher is not None:
            # Even with nothing taken here: a flush in flight may hold these runs' events, and
            # this session's commit of their ends would overtake it (a reader then saw no event
            # of the run but its end; the database thread keeps the order without a session).
            await self.publisher.publish_after_flushes(streams)
        return await self.session.write_many(saves, endings, self.lease_seconds, self.executor)

    def _written(
        self,
        order: list[_Waiting],
        ended: list[_Waiting],
        writing: asyncio.Future[tuple[list[bool | Exception], list[Exception | None]]],
    ) -> None:
        self._writing = None
        if self._published is not None and self.publisher is not None:
            streams, published = self._published
            self._published = None
            self.publisher.settle(streams, published)
        batch = order + ended
        outcomes: list[Any]
        if writing.cancelled():
            outcomes = [ConnectionAbortedError("the write was cancelled") for _ in batch]
        elif (error := writing.exception()) is not None:
            # write_many answers each write's own error; one raised for the whole
            # call is a bug of the backend, told to every caller of the batch.
            outcomes = [error if isinstance(error, Exception) else RuntimeError(repr(error))] * len(batch)
        else:
            result = writing.result()
            if not (
                isinstance(result, tuple) and len(result) == 2
                and isinstance(result[0], list) and len(result[0]) == len(order)
                and isinstance(result[1], list) and len(result[1]) == len(ended)
            ):
                # A backend's bug; told to each caller rather than left unanswered (a hang).
                wrong = (
                    f"write_many returned {type(result).__name__} for {len(order)} saves "
                    f"and {len(ended)} endings"
                )
                outcomes = [RuntimeError(wrong) for _ in batch]
            else:
                outcomes = [*result[0], *result[1]]
        for (_lease, _write, told), outcome in zip(batch, outcomes, strict=True):
            if told.done():
                continue  # its caller was cancelled meanwhile; the write was made all the same
            if isinstance(outcome, Exception):
                told.set_exception(outcome)
            else:
                told.set_result(outcome)
        if self._waiting:
            self._write(asyncio.get_running_loop())
