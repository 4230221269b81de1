"""``GroupCommit``: a worker's saves that meet are committed together.

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

Each save is still fenced on its own and answered on its own (its cancel
flag, or its own exception), and its caller still waits until it is durable.
A run has at most one save in a batch (a run's saves are made in order);
a save whose caller was cancelled before its batch was taken is not made,
as a write not yet begun on the worker's thread would not be.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from concurrent.futures import Executor

from ekit_core import WorkflowCheckpoint
from ekit_runtime.queue.base import RunQueue
from ekit_runtime.queue.records import Lease

__all__ = ["GroupCommit"]

# At most this many saves in one call of save_many (a worker seldom has more runs in flight).
_MANY = 256

_Waiting = tuple[Lease, WorkflowCheckpoint, "asyncio.Future[bool]"]


class GroupCommit:
    """Saves of one worker's runs, batched while a write is in flight (see the module docstring)."""

    def __init__(self, queue: RunQueue, executor: Executor, lease_seconds: float) -> None:
        self.queue, self.executor, self.lease_seconds = queue, executor, lease_seconds
        # Appended to by the event loop; taken from by the loop when a write
        # begins and by the worker's database thread while that write waits
        # for its turn (``more``), hence the lock.
        self._waiting: list[_Waiting] = []
        self._lock = threading.Lock()
        self._writing: asyncio.Future[list[bool | Exception]] | None = None
        self._soon = False
        self.batches = 0
        """How many calls of ``save_many`` were made (the tests and benchmarks read it)."""
        self.saves = 0
        """How many saves they held."""

    async def save(self, lease: Lease, checkpoint: WorkflowCheckpoint) -> bool:
        """Store ``checkpoint`` under ``lease`` (as ``RunQueue.save``); whether a cancel was asked."""
        loop = asyncio.get_running_loop()
        told: asyncio.Future[bool] = loop.create_future()
        with self._lock:
            self._waiting.append((lease, checkpoint, told))
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

    def _take(self, batch: list[_Waiting], runs: set[str], limit: int) -> list[_Waiting]:
        """Move up to ``limit`` waiting saves into ``batch``, at most one per run; return them."""
        taken: list[_Waiting] = []
        later: list[_Waiting] = []
        with self._lock:
            for item in self._waiting:
                if item[2].done():
                    continue  # its caller was cancelled before the write began: not made
                if item[0].run_id in runs or len(taken) >= limit:
                    later.append(item)  # a run's next save: after this one, in the next batch
                else:
                    runs.add(item[0].run_id)
                    taken.append(item)
            self._waiting = later
            self.saves += len(taken)
        batch.extend(taken)
        return taken

    def _write(self, loop: asyncio.AbstractEventLoop) -> None:
        self._soon = False
        batch: list[_Waiting] = []
        runs: set[str] = set()
        first = self._take(batch, runs, _MANY)
        if not first:
            return
        self.batches += 1

        def more(limit: int) -> list[tuple[Lease, WorkflowCheckpoint]]:
            # (On the database thread, while the write waits for its turn.)
            return [(lease, cp) for lease, cp, _ in self._take(batch, runs, limit)]

        call = functools.partial(
            self.queue.save_many, [(lease, cp) for lease, cp, _ in first], self.lease_seconds, more
        )
        writing = self._writing = loop.run_in_executor(self.executor, call)
        writing.add_done_callback(functools.partial(self._written, batch))

    def _written(self, batch: list[_Waiting], writing: asyncio.Future[list[bool | Exception]]) -> None:
        self._writing = None
        outcomes: list[bool | Exception]
        if writing.cancelled():
            outcomes = [ConnectionAbortedError("the write was cancelled") for _ in batch]
        elif (error := writing.exception()) is not None:
            # save_many answers each save's own error; one raised for the whole
            # call is a bug of the backend, told to every caller of the batch.
            outcomes = [error if isinstance(error, Exception) else RuntimeError(repr(error))] * len(batch)
        else:
            outcomes = writing.result()
            if not isinstance(outcomes, list) or len(outcomes) != len(batch):
                # A backend's bug; told to each caller rather than left unanswered (a hang).
                wrong = f"save_many returned {type(outcomes).__name__} for {len(batch)} saves"
                outcomes = [RuntimeError(wrong) for _ in batch]
        for (_lease, _cp, told), outcome in zip(batch, outcomes, strict=True):
            if told.done():
                continue  # its caller was cancelled meanwhile; the save was made all the same
            if isinstance(outcome, Exception):
                told.set_exception(outcome)
            else:
                told.set_result(outcome)
        if self._waiting:
            self._write(asyncio.get_running_loop())
