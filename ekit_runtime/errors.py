"""Exceptions the runtime raises when a run stops short, and the trace warning."""

from __future__ import annotations

from ekit_core import TokenUsage, WorkflowCheckpoint

__all__ = ["ApprovalDenied", "BudgetExceeded", "RunHalted", "TraceCallbackWarning"]


class RunHalted(Exception):
    """A run stopped before finishing. ``checkpoint`` resumes it."""

    def __init__(self, message: str, checkpoint: WorkflowCheckpoint) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


class BudgetExceeded(RunHalted):
    """Accumulated usage reached the run's budget; steps in flight finished first.

    Resume ``checkpoint`` with a larger budget to finish the run without
    repeating any recorded step.
    """

    def __init__(self, checkpoint: WorkflowCheckpoint, budget: TokenUsage) -> None:
        super().__init__(
            f"token budget reached: used {checkpoint.cost}, budget {budget}; "
            f"{checkpoint.step_index} step(s) completed",
            checkpoint,
        )
        self.budget = budget
        self.cost = checkpoint.cost


class ApprovalDenied(RunHalted):
    """The approval callback refused ``step`` for ``reason``; the step is not done."""

    def __init__(self, step: str, reason: str, checkpoint: WorkflowCheckpoint) -> None:
        super().__init__(
            f"step {step!r} was denied approval" + (f": {reason}" if reason else ""), checkpoint
        )
        self.step = step
        self.reason = reason


class TraceCallbackWarning(UserWarning):
    """A trace callback raised; the run went on and the event was dropped."""
