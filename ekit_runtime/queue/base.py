"""What every run-queue backend shares: argument checks, encoding, and save bookkeeping.

A backend (SQLite, PostgreSQL) subclasses :class:`QueueBase` and supplies the
SQL. The checks here run before a statement is sent, so a bad argument or an
output that cannot be encoded is refused with a ``ValueError`` before the
database is touched; the rest turns the rows a statement read into records
(a checkpoint, the fleet's limits, a lease, the wait before the next step).
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NoReturn, Self

from ekit_core import TokenUsage, WorkflowCheckpoint
from ekit_core.usage import NO_USAGE
from ekit_runtime.queue.records import (
    FINAL_STATUSES,
    Lease,
    LeaseLostError,
    Limits,
    RunInfo,
    RunStatus,
    UnknownRunError,
    check_priority,
    check_run_id,
    check_seconds,
    check_workflow_name,
)
from ekit_runtime.stores._common import Dumps, Loads, default_dumps, encode_text
from ekit_runtime.stores._rows import EncodedCheckpoint, decode_checkpoint, encode_checkpoint
from ekit_runtime.workflow import WorkflowResult

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

    def _previous(self, lease: Lease) -> WorkflowCheckpoint | None:
        """The checkpoint this object last stored under ``lease`` (else the one it was granted with)."""
        epoch, previous = self._saved.get(lease.run_id, (lease.epoch, lease.checkpoint))
        return previous if epoch == lease.epoch else lease.checkpoint

    def _encode(self, lease: Lease, checkpoint: WorkflowCheckpoint) -> EncodedCheckpoint:
        """The rows a save under ``lease`` writes: a delta on what this lease stored last."""
        if not isinstance(lease, Lease):
            raise ValueError(f"lease must be a Lease, got {type(lease).__name__}")
        return encode_checkpoint(checkpoint, self._previous(lease), self.dumps)

    def _prepare_save(
        self, lease: Lease, checkpoint: WorkflowCheckpoint
    ) -> tuple[EncodedCheckpoint, TokenUsage]:
        """The rows a save writes and the usage it adds to the fleet's rate window."""
        encoded = self._encode(lease, checkpoint)
        previous = self._previous(lease)
        added = checkpoint.cost - (previous.cost if previous is not None else NO_USAGE)
        # Unknown until the write commits: if it fails, the next save is in full.
        self._remember(lease, None)
        return encoded, added

    def _remember(self, lease: Lease, checkpoint: WorkflowCheckpoint | None) -> None:
        self._saved[lease.run_id] = (lease.epoch, checkpoint)

    def _forget(self, run_id: str) -> None:
        self._saved.pop(run_id, None)

    def _lost(self, lease: Lease) -> NoReturn:
        """A fenced write matched no row: forget the lease's last save and refuse."""
        self._forget(lease.run_id)
        raise LeaseLostError(lease.run_id, lease.epoch)

    def _granted(
        self,
        run_id: str,
        epoch: int,
        workflow: str,
        context: str,
        checkpoint: WorkflowCheckpoint | None,
        until: float,
    ) -> Lease:
        """The lease a claim read, remembered as holding ``checkpoint``."""
        lease = Lease(run_id, epoch, workflow, self._context(context), checkpoint, until)
        self._remember(lease, checkpoint)
        return lease

    def _decode_run(
        self,
        row: Sequence[Any] | None,
        run_id: str,
        entries: Callable[[], list[tuple[str, str, str]]],
        where: str,
        *,
        missing_ok: bool,
    ) -> WorkflowCheckpoint | None:
        """The checkpoint of a run row (header, four counts, failures) and its ``entries()``."""
        if row is None:
            if missing_ok:
                return None
            raise UnknownRunError(run_id)
        if row[0] is None:
            return None
        return decode_checkpoint(row[0], tuple(row[1:5]), row[5], entries(), self.loads, where)

    def result(self, run_id: str) -> WorkflowResult | None:
        """The outputs and cost of a finished run; ``None`` until it has finished.

        A failed or cancelled run has no result: its :meth:`status` says why.
        """
        info = self.status(run_id)
        checkpoint = self.checkpoint(run_id) if info.status == "finished" else None
        if checkpoint is None:
            return None
        return WorkflowResult(checkpoint.outputs, checkpoint.cost, checkpoint)

    @staticmethod
    def _limits_text(limits: Limits) -> str:
        """``limits`` as stored in the config row (refused unless a :class:`Limits`)."""
        if not isinstance(limits, Limits):
            raise ValueError(f"limits must be a Limits, got {type(limits).__name__}")
        return default_dumps(limits.to_dict())

    def _limits_from(self, row: Sequence[Any] | None) -> Limits:
        return Limits() if row is None else Limits.from_dict(self.loads(row[0]))

    @staticmethod
    def _final(status: RunStatus) -> None:
        if status not in FINAL_STATUSES:
            raise ValueError(f"status must be one of finished, failed, cancelled; got {status!r}")

    @staticmethod
    def _uses(added: TokenUsage) -> bool:
        """Whether a save adds calls or tokens to the fleet's usage window."""
        return added.llm_calls > 0 or added.total_tokens > 0

    @staticmethod
    def _usage_limited(limits: Limits) -> bool:
        return limits.llm_calls_per_minute is not None or limits.tokens_per_minute is not None

    @staticmethod
    def _usage_wait(limits: Limits, calls: int, tokens: int, oldest: Any, now: float) -> float:
        """Seconds before the window's ``calls`` and ``tokens`` (oldest at ``oldest``) let a step start."""
        over = (limits.llm_calls_per_minute is not None and calls >= limits.llm_calls_per_minute) or (
            limits.tokens_per_minute is not None and tokens >= limits.tokens_per_minute
        )
        return max(float(oldest) + limits.window - float(now), 0.01) if over else 0.0

    # What each backend supplies, and the methods above and below build on.

    def status(self, run_id: str) -> RunInfo:
        """The run's record; :class:`UnknownRunError` (a ``LookupError``) if there is none."""
        raise NotImplementedError

    def checkpoint(self, run_id: str) -> WorkflowCheckpoint | None:
        """The run's latest saved checkpoint, ``None`` before its first save."""
        raise NotImplementedError

    def close(self) -> None:
        """Close the connection."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
