"""Driving one claimed run: its workflow run with its options, its heartbeat, then its ending recorded."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ekit_core import WorkflowCheckpoint
from ekit_core.human import Answer, questions
from ekit_core.human import answer as answered
from ekit_runtime import logs
from ekit_runtime.child_runs import SPAWNER, ChildState, child_run_of
from ekit_runtime.queue.links import child_run_id
from ekit_runtime.queue.options import run_arguments
from ekit_runtime.queue.records import FINAL_STATUSES, Lease, LeaseLostError
from ekit_runtime.queue.worker_admission import Admission
from ekit_runtime.queue.worker_parts import _Drive
from ekit_runtime.workflow import WorkflowResult

__all__ = ["Driving", "StepsFailed"]

_CHILD_OPTIONS = ("only",)
"""Run options of a parent that its child runs do not take (the parent's own step selection)."""


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


class Driving(Admission):
    """Drives one claimed run from its start to its recorded ending."""

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
        # The run's steps submit and read their child runs through this drive (this task's context,
        # which the run's tasks copy).
        SPAWNER.set(_Spawner(self, drive))
        resume = lease.checkpoint
        if resume is not None and resume.asked:
            resume = await self._joined(resume)
        result = await self.registry[lease.workflow].run(
            None if lease.checkpoint is not None else dict(lease.context),
            checkpoint_fn=functools.partial(self._checkpoint, drive),
            resume_from=resume,
            run_id=lease.run_id,
            before_attempt=functools.partial(self._admit, drive, gate),
            worker=self.name,  # recorded in the checkpoint's drives: who ran each attempt
            **self._run_options(lease, drive),
        )
        if not result.ok:
            # A failed step ends the run at once, isolated or not: a parent parked for its other
            # items' children would be resumed by their wake, and the resume runs the failed step
            # again (decision 022). The close trigger stops the children still going.
            raise StepsFailed(result)
        return result

    async def _joined(self, checkpoint: WorkflowCheckpoint) -> WorkflowCheckpoint:
        """``checkpoint`` with the wait of each step whose child run ended answered: the durable
        join's last half. The step then runs again and reads its child (its output, or its failure);
        a child not yet ended leaves its step waiting."""
        waits = {step: child_run_of(q.details) for step, q in questions(checkpoint).items()}
        children = {step: run_id for step, run_id in waits.items() if run_id is not None}
        if not children:
            return checkpoint
        statuses = await self._db(self.queue.child_statuses, list(children.values()))
        for step, run_id in children.items():
            status = statuses.get(run_id)
            if status in FINAL_STATUSES:
                checkpoint = answered(checkpoint, step, Answer({"child_run": run_id, "status": status},
                                                               by="ekit"))
        return checkpoint

    def _registered(self, workflow: object) -> str:
        """The name this worker's registry gives ``workflow`` (a queued child's), by identity."""
        for name, registered in self.registry.items():
            if registered is workflow:
                return name
        raise ValueError("a queued child's workflow is not in the worker's registry: register it")

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


class _Spawner:
    """A drive's child runs, as its steps see them (:class:`ekit_runtime.children.Spawner`)."""

    __slots__ = ("_drive", "_worker")

    def __init__(self, worker: Driving, drive: _Drive) -> None:
        self._worker, self._drive = worker, drive

    def child_run_id(self, step: str, number: int) -> str:
        return child_run_id(self._drive.lease.run_id, step, number)

    async def state(self, run_id: str, output: str) -> ChildState | None:
        worker = self._worker
        return await worker._db(worker.queue.child_state, run_id, output)

    async def spawn(self, run_id: str, step: str, workflow: Any, context: Mapping[str, Any]) -> None:
        worker, lease = self._worker, self._drive.lease
        # The child takes the parent's run options (its budget, isolate_failures...), not its selection.
        options = {k: v for k, v in lease.options.items() if k not in _CHILD_OPTIONS}
        # The child's input is stored as JSON: values of the parent codec's own types (an item of a
        # map over them) go in the codec's stored form, as the parent's checkpoint holds them.
        codec = getattr(worker.registry[lease.workflow], "codec", None)
        stored = {k: codec.encode(v) for k, v in context.items()} if codec is not None else dict(context)
        try:
            await worker._db(functools.partial(
                worker.queue.spawn, lease, worker._registered(workflow), stored, run_id=run_id,
                step=step, options=options,
            ))
        except LeaseLostError:
            self._drive.lost = True  # (the drive ends "lost": nothing more is written for it)
            raise
