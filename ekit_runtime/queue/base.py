"""What every run-queue backend shares: argument checks, encoding, and save bookkeeping.

A backend (SQLite, PostgreSQL) subclasses :class:`QueueBase` and supplies the
SQL. Everything here runs before a statement is sent, so a bad argument or an
output that cannot be encoded is refused with a ``ValueError`` before the
database is touched.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ekit_core import TokenUsage, WorkflowCheckpoint
from ekit_core.usage import NO_USAGE
from ekit_runtime.queue.records import (
    Lease,
    check_priority,
    check_run_id,
    check_seconds,
    check_workflow_name,
)
from ekit_runtime.stores._common import Dumps, Loads, default_dumps, encode_text
from ekit_runtime.stores._rows import EncodedCheckpoint, encode_checkpoint

__all__ = ["QueueBase", "Submission"]


class Submission:
    """A checked ``submit``: the run id (given or new), workflow, encoded context, priority."""

    __slots__ = ("context", "priority", "run_id", "workflow")

    def __init__(
        self,
        workflow: object,
        context: Mapping[str, Any] | None,
        run_id: object,
        priority: object,
        dumps: Dumps,
    ) -> None:
        self.workflow = check_workflow_name(workflow)
        self.run_id = uuid.uuid4().hex if run_id is None else check_run_id(run_id)
        self.priority = check_priority(priority)
        ctx = {} if context is None else context
        if not isinstance(ctx, Mapping) or not all(isinstance(k, str) for k in ctx):
            raise ValueError("context must be a mapping with string keys or None")
        self.context = encode_text(dict(ctx), dumps, (), ctx)


class QueueBase:
    """Bookkeeping shared by the backends: codec, lock, and the last save of each lease.

    ``_saved`` maps a run id to the epoch this object holds it at and the
    checkpoint it last stored, so that the next save writes only a delta.
    """

    def __init__(self, *, dumps: Dumps | None, loads: Loads | None) -> None:
        self.dumps: Dumps = dumps if dumps is not None else default_dumps
        self.loads: Loads = loads if loads is not None else json.loads
        self._lock = threading.RLock()
        self._saved: dict[str, tuple[int, WorkflowCheckpoint | None]] = {}

    def _submission(
        self, workflow: object, context: Mapping[str, Any] | None, run_id: object, priority: object
    ) -> Submission:
        return Submission(workflow, context, run_id, priority, self.dumps)

    def _encode(self, lease: Lease, checkpoint: WorkflowCheckpoint) -> EncodedCheckpoint:
        """The rows a save under ``lease`` writes: a delta on what this lease stored last."""
        if not isinstance(lease, Lease):
            raise ValueError(f"lease must be a Lease, got {type(lease).__name__}")
        epoch, previous = self._saved.get(lease.run_id, (lease.epoch, lease.checkpoint))
        if epoch != lease.epoch:
            previous = lease.checkpoint
        return encode_checkpoint(checkpoint, previous, self.dumps)

    def _prepare_save(
        self, lease: Lease, checkpoint: WorkflowCheckpoint
    ) -> tuple[EncodedCheckpoint, TokenUsage]:
        """The rows a save writes and the usage it adds to the fleet's rate window."""
        encoded = self._encode(lease, checkpoint)
        epoch, previous = self._saved.get(lease.run_id, (lease.epoch, lease.checkpoint))
        if epoch != lease.epoch:
            previous = lease.checkpoint
        added = checkpoint.cost - (previous.cost if previous is not None else NO_USAGE)
        # Unknown until the write commits: if it fails, the next save is in full.
        self._remember(lease, None)
        return encoded, added

    def _remember(self, lease: Lease, checkpoint: WorkflowCheckpoint | None) -> None:
        self._saved[lease.run_id] = (lease.epoch, checkpoint)

    def _forget(self, run_id: str) -> None:
        self._saved.pop(run_id, None)

    @staticmethod
    def _lease_seconds(value: object) -> float:
        return check_seconds(value, "lease_seconds")

    def _context(self, text: str) -> MappingProxyType[str, Any]:
        data = self.loads(text)
        if not isinstance(data, dict):
            raise ValueError("stored context is not an object")
        return MappingProxyType(data)

    @staticmethod
    def _workflows(workflows: Mapping[str, str | None]) -> list[tuple[str, str | None]]:
        if not isinstance(workflows, Mapping) or not workflows:
            raise ValueError("workflows must be a non-empty mapping of workflow name to graph fingerprint")
        return [(check_workflow_name(name), fp) for name, fp in workflows.items()]
