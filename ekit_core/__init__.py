"""ekit_core: the pure scheduling core of ekit.

No I/O, no clock, no randomness, no asyncio: every function here is
deterministic and never mutates its inputs. Build a :class:`GraphSpec`, make
the first :class:`State` with :func:`initial_state`, then alternate
:func:`plan` (what to start) and :func:`apply` (fold in what happened), or
call :func:`advance`, which does both in one transition.
:func:`checkpoint_of` projects a state onto the durable
:class:`WorkflowCheckpoint`; :func:`audit` and :func:`replay` explain
recorded checkpoints. Every rule lives in :mod:`ekit_core.transitions`.
"""

from ekit_core.audit import Anomaly, AuditReport, StepAudit, audit, changed_since_recorded
from ekit_core.checkpoint import (
    FORMAT_VERSION,
    SHAPED_FORMAT_VERSION,
    CheckpointDelta,
    CheckpointError,
    DriveRecord,
    FailureRecord,
    UnsupportedFormatError,
    WorkflowCheckpoint,
)
from ekit_core.compat import GraphChanges, GraphMismatchError
from ekit_core.errors import InternalError, TransitionError
from ekit_core.events import (
    CheckpointSaved,
    Event,
    RunSettled,
    RunStarted,
    StepCacheHit,
    StepDenied,
    StepExpanded,
    StepFailed,
    StepFinished,
    StepInterrupted,
    StepOutdated,
    StepPartial,
    StepRetried,
    StepSkipped,
    StepStarted,
    StepWaiting,
)
from ekit_core.expansion import LoopError, MapError
from ekit_core.graph import CycleError, GraphError, GraphSpec
from ekit_core.human import HUMAN_FORMAT_VERSION, Answer, Exchange, Question, answer, questions
from ekit_core.phases import Phase, phase_of
from ekit_core.policy import RetryPolicy
from ekit_core.replay import ReplayReport, TimelineEntry, Violation, replay
from ekit_core.results import (
    Asked,
    AttemptEnd,
    AttemptOutcome,
    Began,
    Cancelled,
    Denied,
    Ended,
    Failed,
    Gate,
    Input,
    Interrupted,
    Skipped,
    Start,
    Succeeded,
)
from ekit_core.rewind import rewind
from ekit_core.shapes import Shape
from ekit_core.state import Halt, HaltKind, Outcome, State, checkpoint_of
from ekit_core.transitions import Batch, advance, apply, initial_state, plan
from ekit_core.usage import TokenUsage

__all__ = [
    "Anomaly",
    "Answer",
    "Asked",
    "AttemptEnd",
    "AttemptOutcome",
    "AuditReport",
    "Batch",
    "Began",
    "Cancelled",
    "CheckpointDelta",
    "CheckpointError",
    "CheckpointSaved",
    "CycleError",
    "Denied",
    "DriveRecord",
    "Ended",
    "Event",
    "Exchange",
    "FORMAT_VERSION",
    "Failed",
    "FailureRecord",
    "Gate",
    "GraphChanges",
    "GraphError",
    "GraphMismatchError",
    "GraphSpec",
    "HUMAN_FORMAT_VERSION",
    "Halt",
    "HaltKind",
    "Input",
    "InternalError",
    "Interrupted",
    "LoopError",
    "MapError",
    "Outcome",
    "Phase",
    "Question",
    "ReplayReport",
    "RetryPolicy",
    "RunSettled",
    "RunStarted",
    "SHAPED_FORMAT_VERSION",
    "Shape",
    "Skipped",
    "Start",
    "State",
    "StepAudit",
    "StepCacheHit",
    "StepDenied",
    "StepExpanded",
    "StepFailed",
    "StepFinished",
    "StepInterrupted",
    "StepOutdated",
    "StepPartial",
    "StepRetried",
    "StepSkipped",
    "StepStarted",
    "StepWaiting",
    "Succeeded",
    "TimelineEntry",
    "TokenUsage",
    "TransitionError",
    "UnsupportedFormatError",
    "Violation",
    "WorkflowCheckpoint",
    "advance",
    "answer",
    "apply",
    "audit",
    "changed_since_recorded",
    "checkpoint_of",
    "initial_state",
    "phase_of",
    "plan",
    "questions",
    "replay",
    "rewind",
]

# Tracebacks and reprs name the package users import, not the private module.
for _name in ("CheckpointError", "UnsupportedFormatError", "GraphMismatchError", "CycleError",
              "GraphError"):
    globals()[_name].__module__ = "ekit_core"
del _name
