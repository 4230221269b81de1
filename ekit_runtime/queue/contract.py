"""``RunQueue``: the contract every run-queue backend keeps (SQLite, PostgreSQL).

The caller's side submits, inspects, cancels and prunes runs; the worker's
side claims a run under a lease, saves checkpoints and renews the lease, and
finishes or releases the run. Every worker-side write takes the
:class:`~ekit_runtime.queue.records.Lease` it was granted and is refused with
:class:`~ekit_runtime.queue.records.LeaseLostError`, writing nothing, unless
that lease is still the run's live one: the check and the write are one
statement or one transaction. The methods are synchronous; the
:class:`~ekit_runtime.queue.worker.Worker` calls them on a thread of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from ekit_core import WorkflowCheckpoint
from ekit_runtime.queue.records import Lease, Limits, RunInfo, RunStatus
from ekit_runtime.workflow import WorkflowResult

__all__ = ["RunQueue"]


class RunQueue(Protocol):
    """What a worker and a caller need from a queue backend; see the module docstring."""

    backend: str

    def submit(
        self,
        workflow: str,
        context: Mapping[str, Any] | None = None,
        *,
        run_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a run (idempotent for a given ``run_id``) and return its id."""
        ...

    def status(self, run_id: str) -> RunInfo:
        """The run's record."""
        ...

    def runs(self, status: RunStatus | None = None) -> list[RunInfo]:
        """Every run, or those with ``status``, in submission order."""
        ...

    def checkpoint(self, run_id: str) -> WorkflowCheckpoint | None:
        """The run's latest checkpoint."""
        ...

    def result(self, run_id: str) -> WorkflowResult | None:
        """The outputs of a finished run."""
        ...

    def cancel(self, run_id: str) -> bool:
        """Ask the run to stop."""
        ...

    def prune(self, older_than: float) -> int:
        """Delete ended runs older than ``older_than`` seconds; return how many."""
        ...

    def limits(self) -> Limits:
        """The fleet's limits."""
        ...

    def set_limits(self, limits: Limits) -> None:
        """Store the fleet's limits."""
        ...

    def claim(self, worker: str, workflows: Mapping[str, str | None], lease_seconds: float) -> Lease | None:
        """Lease the next claimable run."""
        ...

    def renew(self, lease: Lease, lease_seconds: float) -> bool:
        """Extend a lease; return whether a cancel was asked."""
        ...

    def save(self, lease: Lease, checkpoint: WorkflowCheckpoint, lease_seconds: float) -> bool:
        """Store a checkpoint under a lease; return whether a cancel was asked."""
        ...

    def finish(self, lease: Lease, status: RunStatus, error: str | None = None) -> None:
        """End the run under a lease."""
        ...

    def release(self, lease: Lease) -> bool:
        """Give a run back to the queue."""
        ...

    def usage_wait(self) -> float:
        """Seconds before the fleet's call and token limits let a step start."""
        ...

    def close(self) -> None:
        """Close the connection."""
        ...
