"""Driving one claimed run: its workflow run with its options, its heartbeat, then its ending recorded."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from ekit_runtime import logs
from ekit_runtime.queue.options import run_arguments
from ekit_runtime.queue.records import Lease
from ekit_runtime.queue.worker_admission import Admission
from ekit_runtime.queue.worker_parts import _Drive
from ekit_runtime.workflow import WorkflowResult

__all__ = ["Driving", "StepsFailed"]


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
        result = await self.registry[lease.workflow].run(
            None if lease.checkpoint is not None else dict(lease.context),
            checkpoint_fn=functools.partial(self._checkpoint, drive),
            resume_from=lease.checkpoint,
            run_id=lease.run_id,
            before_attempt=functools.partial(self._admit, drive, gate),
            worker=self.name,  # recorded in the checkpoint's drives: who ran each attempt
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
