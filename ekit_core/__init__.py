"""ekit_core: the pure scheduling core of ekit.

No I/O, no clock, no randomness, no asyncio: every function here is
deterministic and never mutates its inputs. Build a :class:`GraphSpec`, make
the first :class:`State` with :func:`initial_state`, then alternate
:func:`plan` (what to start) and :func:`apply` (fold in what happened).
:func:`checkpoint_of` projects a state onto the durable
:class:`WorkflowCheckpoint`.
"""

from ekit_core.checkpoint import (
    FORMAT_VERSION,
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
from ekit_core.results import Cancelled, Denied, Failed, Interrupted, Result, Start, Succeeded
from ekit_core.state import Halt, Limits, State, checkpoint_of, initial_state
from ekit_core.transitions import Batch, apply, plan
from ekit_core.usage import TokenUsage

__all__ = [
    "FORMAT_VERSION",
    "Batch",
    "Cancelled",
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
    "Interrupted",
    "Ledger",
    "Limits",
    "Result",
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
    "apply",
    "checkpoint_of",
    "graph_changes",
    "initial_state",
    "plan",
]
