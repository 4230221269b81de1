"""``RunQueue``: the contract every run-queue backend keeps (SQLite, PostgreSQL).

The caller's side submits, inspects, cancels and prunes runs; the worker's
side claims a run under a lease, saves checkpoints and renews the lease, and
finishes or releases the run. Every worker-side write takes the
:class:`~ekit_runtime.queue.records.Lease` it was granted and is refused with
:class:`~ekit_runtime.queue.records.LeaseLostError`, writing nothing, unless
that lease is still the run's live one: the check and the write are one
statement or one transaction. The methods are synchronous; the
:class:`~ekit_runtime.queue.worker.Worker` calls them on a thread of its own.

The contract is one class, defined with what the backends share in
:mod:`ekit_runtime.queue.base`; this module keeps the name where it always was.
"""

from __future__ import annotations

from ekit_runtime.queue.base import Ending, RunQueue

__all__ = ["Ending", "RunQueue"]
