"""ekit_core: the pure scheduling core of ekit.

No I/O, no clock, no randomness, no asyncio: every function here is
deterministic and never mutates its inputs. Build a :class:`GraphSpec`, make
the first :class:`State` with :func:`initial_state`, then alternate
:func:`plan` (what to start) and :func:`apply` (fold in what happened).
:func:`checkpoint_of` projects a state onto the durable
:class:`WorkflowCheckpoint`.
"""

from ekit_core.audit import Anomaly, AuditReport, StepAudit, audit
from ekit_core.checkpoint import (
    FORMAT_VERSION,
    CheckpointDelta,
    CheckpointError,
    FailureRecord,
    UnsupportedFormatError,
    WorkflowCheckpoint,
)
from ekit_core.compat import GraphChanges, GraphMismatchError, graph_changes
from ekit_core.events import (
    CheckpointSaved,
    Event,
    RunFinished,
    RunStarted,
    StepDenied,
    StepFailed,
    StepFinished,
    StepInterrupted,
    StepRetried,
    StepSkipped,
    StepStarted,
)
from ekit_core.graph import CycleError, GraphError, GraphSpec
from ekit_core.ledger import Ledger
from ekit_core.policy import RetryPolicy
from ekit_core.replay import ReplayReport, TimelineEntry, Violation, replay
from ekit_core.results import Cancelled, Denied, Failed, Interrupted, Result, Start, Succeeded
from ekit_core.state import Halt, Incidents, Limits, RunSpec, State, checkpoint_of, initial_state
from ekit_core.transitions import Batch, advance, apply, plan
from ekit_core.usage import TokenUsage

__all__ = [
    "replay",
    "Violation",
    "TimelineEntry",
    "ReplayReport",
    "audit",
    "StepAudit",
    "AuditReport",
    "Anomaly",
    "FORMAT_VERSION",
    "Batch",
    "Cancelled",
    "CheckpointDelta",
    "CheckpointError",
    "CheckpointSaved",
    "CycleError",
    "Denied",
    "Event",
    "Failed",
    "FailureRecord",
    "GraphChanges",
    "GraphError",
    "GraphMismatchError",
    "GraphSpec",
    "Halt",
    "Incidents",
    "Interrupted",
    "Ledger",
    "Limits",
    "Result",
    "RunSpec",
    "RetryPolicy",
    "RunFinished",
    "RunStarted",
    "Start",
    "State",
    "StepDenied",
    "StepFailed",
    "StepFinished",
    "StepInterrupted",
    "StepRetried",
    "StepSkipped",
    "StepStarted",
    "Succeeded",
    "TokenUsage",
    "UnsupportedFormatError",
    "WorkflowCheckpoint",
    "advance",
    "apply",
    "checkpoint_of",
    "graph_changes",
    "initial_state",
    "plan",
]
