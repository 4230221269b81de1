"""ekit_runtime: the asyncio shell of ekit, and ExecutionKit's ``Workflow`` API.

``Workflow(steps)`` and ``await workflow.run(...)`` run a DAG of async (or
sync) steps concurrently, hand a :class:`WorkflowCheckpoint` to
``checkpoint_fn`` after progress, and resume from one without re-running a
recorded step. Every scheduling decision comes from :mod:`ekit_core`.
"""

from ekit_core import (
    RetryPolicy,
    TokenUsage,
    WorkflowCheckpoint,
)
from ekit_runtime.approval import Approval
from ekit_runtime.errors import ApprovalDenied, BudgetExceeded, RunHalted, TraceCallbackWarning
from ekit_runtime.otel import OtelTracer
from ekit_runtime.progress import ProgressPrinter
from ekit_runtime.step import PatternResult, Step
from ekit_runtime.stores import (
    CorruptStoreError,
    JournalStore,
    JsonFileStore,
    SqliteStore,
    UnencodableError,
)
from ekit_runtime.workflow import Workflow, WorkflowResult

__all__ = [
    "Approval",
    "ApprovalDenied",
    "BudgetExceeded",
    "CorruptStoreError",
    "JournalStore",
    "JsonFileStore",
    "OtelTracer",
    "PatternResult",
    "ProgressPrinter",
    "RetryPolicy",
    "RunHalted",
    "SqliteStore",
    "Step",
    "TokenUsage",
    "TraceCallbackWarning",
    "UnencodableError",
    "Workflow",
    "WorkflowCheckpoint",
    "WorkflowResult",
]
