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
from ekit_runtime.step import PatternResult, Step
from ekit_runtime.workflow import Workflow, WorkflowResult

__all__ = [
    "Approval",
    "ApprovalDenied",
    "BudgetExceeded",
    "PatternResult",
    "RetryPolicy",
    "RunHalted",
    "Step",
    "TokenUsage",
    "TraceCallbackWarning",
    "Workflow",
    "WorkflowCheckpoint",
    "WorkflowResult",
]
