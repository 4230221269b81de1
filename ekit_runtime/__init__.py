"""ekit_runtime: the asyncio shell of ekit, and ExecutionKit's ``Workflow`` API.

``Workflow(steps)`` and ``await workflow.run(...)`` run a DAG of async (or
sync) steps concurrently, hand a :class:`WorkflowCheckpoint` to
``checkpoint_fn`` after progress, and resume from one without re-running a
recorded step. Every scheduling decision comes from :mod:`ekit_core`.
"""

from typing import TYPE_CHECKING

from ekit_core import (
    Answer,
    Question,
    RetryPolicy,
    TokenUsage,
    WorkflowCheckpoint,
)
from ekit_core.code import CodeChangedError
from ekit_runtime.approval import Approval
from ekit_runtime.attempt import Attempt, AttemptKey, attempt_key
from ekit_runtime.cache import Cache, DirectoryCache, SqliteCache
from ekit_runtime.children import Child
from ekit_runtime.context import StepContext
from ekit_runtime.errors import (
    ApprovalDenied,
    BudgetExceeded,
    RunHalted,
    RunWaiting,
    StepCancelledError,
    StepTimeoutError,
    TraceCallbackWarning,
)
from ekit_runtime.executors import BlockingStepWarning, Executor, LocalExecutor
from ekit_runtime.human import InputRequired, approve, ask
from ekit_runtime.loops import Done, History, HistoryError, Iteration, Repeat, history
from ekit_runtime.otel import OtelTracer
from ekit_runtime.progress import ProgressPrinter
from ekit_runtime.step import PatternResult, Step
from ekit_runtime.stores import (
    CorruptStoreError,
    JournalStore,
    JsonFileStore,
    SqliteStore,
    StoreLockedError,
    UnencodableError,
)
from ekit_runtime.streaming import partial
from ekit_runtime.typed import Codec
from ekit_runtime.workflow import RunOptions, Workflow, WorkflowResult

if TYPE_CHECKING:
    from ekit_runtime.dask import DaskExecutor, WorkerLostError
    from ekit_runtime.retry_hints import retry_after
    from ekit_runtime.stores.postgres import PostgresStore

__all__ = [
    "Answer",
    "Approval",
    "ApprovalDenied",
    "Attempt",
    "AttemptKey",
    "BlockingStepWarning",
    "BudgetExceeded",
    "Cache",
    "Child",
    "CodeChangedError",
    "Codec",
    "CorruptStoreError",
    "DaskExecutor",
    "DirectoryCache",
    "Done",
    "Executor",
    "History",
    "HistoryError",
    "InputRequired",
    "Iteration",
    "JournalStore",
    "JsonFileStore",
    "LocalExecutor",
    "OtelTracer",
    "PatternResult",
    "PostgresStore",
    "ProgressPrinter",
    "Question",
    "Repeat",
    "RetryPolicy",
    "RunHalted",
    "RunOptions",
    "RunWaiting",
    "SqliteCache",
    "SqliteStore",
    "Step",
    "StepCancelledError",
    "StepContext",
    "StepTimeoutError",
    "StoreLockedError",
    "TokenUsage",
    "TraceCallbackWarning",
    "UnencodableError",
    "WorkerLostError",
    "Workflow",
    "WorkflowCheckpoint",
    "WorkflowResult",
    "approve",
    "ask",
    "attempt_key",
    "history",
    "partial",
    "retry_after",
]


# Tracebacks name the package users import, not the private module.
for _error in (ApprovalDenied, BudgetExceeded, RunHalted, RunWaiting, StepCancelledError,
               StepTimeoutError, TraceCallbackWarning, BlockingStepWarning, InputRequired):
    _error.__module__ = __name__
del _error


def __getattr__(name: str) -> object:
    # PostgresStore imports psycopg (the optional "postgres" extra): only when asked for.
    if name == "PostgresStore":
        from ekit_runtime.stores.postgres import PostgresStore

        return PostgresStore
    # The Dask names live in ekit_runtime.dask, which imports distributed (the
    # optional "dask" extra) only when a DaskExecutor is built.
    if name in ("DaskExecutor", "WorkerLostError"):
        from ekit_runtime.dask import DaskExecutor, WorkerLostError

        return DaskExecutor if name == "DaskExecutor" else WorkerLostError
    # Read only when an attempt fails: not imported by a run that never fails.
    if name == "retry_after":
        from ekit_runtime.retry_hints import retry_after

        return retry_after
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
