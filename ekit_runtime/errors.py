"""Exceptions the runtime raises when a run stops short, and the trace warning."""

from __future__ import annotations

from collections.abc import Mapping

from ekit_core import TokenUsage, WorkflowCheckpoint
from ekit_core.human import Question

__all__ = [
    "ApprovalDenied",
    "BudgetExceeded",
    "RunHalted",
    "RunWaiting",
    "StepCancelledError",
    "StepTimeoutError",
    "TraceCallbackWarning",
]


class RunHalted(Exception):
    """A run stopped before finishing. ``checkpoint`` resumes it."""

    def __init__(self, message: str, checkpoint: WorkflowCheckpoint) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


class BudgetExceeded(RunHalted):
    """Accumulated usage reached the run's budget; steps in flight finished first.

    Resume ``checkpoint`` with a larger budget to finish the run without
    repeating any recorded step. ``step`` is the loop whose iteration reached
    the budget (one that did not end, say), or the step whose child workflow's
    step did (``within="child"``), else ``None``.
    """

    def __init__(self, checkpoint: WorkflowCheckpoint, budget: TokenUsage,
                 step: str | None = None, within: str = "loop") -> None:
        where = "loop" if within == "loop" else "the child workflow of step"
        super().__init__(
            f"token budget reached: used {checkpoint.cost}, budget {budget}; "
            f"{checkpoint.step_index} step(s) completed"
            + ("" if step is None else f"; reached in {where} {step!r}"
               + ("" if step in checkpoint.outputs else ", which has not ended")),
            checkpoint,
        )
        self.budget = budget
        self.cost = checkpoint.cost
        self.step = step


class ApprovalDenied(RunHalted):
    """The approval callback refused ``step`` for ``reason``; the step is not done."""

    def __init__(self, step: str, reason: str, checkpoint: WorkflowCheckpoint) -> None:
        super().__init__(
            f"step {step!r} was denied approval" + (f": {reason}" if reason else ""), checkpoint
        )
        self.step = step
        self.reason = reason


class RunWaiting(RunHalted):
    """Steps wait for a person's answer, and nothing else could run: the run is parked.

    ``questions`` maps each waiting step (or item) to its
    :class:`~ekit_core.Question`; ``checkpoint`` (saved already, when the
    run has a ``checkpoint_fn``) records them. Resume it with the answers:
    ``workflow.run(resume_from=err.checkpoint, answers={step: value})``
    (an ``Answer.approve(...)`` or ``Answer.deny(...)`` for an approval).
    """

    def __init__(self, checkpoint: WorkflowCheckpoint, questions: Mapping[str, Question]) -> None:
        asked = "; ".join(f"{name!r} asks {q.prompt!r}" for name, q in questions.items())
        super().__init__(
            f"run waits for {len(questions)} answer(s): {asked}; resume with "
            "answers={step: answer}", checkpoint,
        )
        self.questions = questions


class StepCancelledError(Exception):
    """A step raised ``asyncio.CancelledError`` although nothing cancelled it.

    Only the run's own cancellation (or a halt withdrawing an attempt that
    has not begun) interrupts a step; a ``CancelledError`` the step raised
    itself, say from a client library that cancels its own work, is the
    step's failure like any other error: its retry policy decides what
    follows (``__cause__`` holds the original ``CancelledError``). Without
    this rule such a step would be restarted at once, forever.
    """


class StepTimeoutError(TimeoutError):
    """An attempt of ``step`` ran past its ``timeout`` (seconds) and was stopped.

    ``step`` is the attempt's own name: an item of a mapped step is named as
    its failure is recorded (``summarize[1]``), so the message says which
    item timed out.

    A ``TimeoutError``, so ``RetryPolicy(retry_on=(TimeoutError,))`` retries
    it. A sync step running in a thread cannot be stopped: the attempt fails
    at the deadline, and the thread runs on until the function returns.
    """

    def __init__(self, step: str, timeout: float) -> None:
        super().__init__(f"step {step!r} timed out after {timeout:g}s")
        self.step = step
        self.timeout = timeout


class TraceCallbackWarning(UserWarning):
    """A trace callback raised; the run went on and the event was dropped."""

    @classmethod
    def dropped(cls, error: BaseException | None, event: str) -> TraceCallbackWarning:
        """The warning for a callback that raised ``error`` on an event of type ``event``."""
        return cls(
            f"trace callback raised {type(error).__name__}: {error} "
            f"(event {event} dropped for it; the run goes on)"
        )
