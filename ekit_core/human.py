"""Human input on a checkpoint: what is waiting for a person, and recording an answer.

A step asks (``ekit_runtime.ask`` for a value, ``ekit_runtime.approve`` for
an approval); the questions and their answers are plain values
(:class:`Question`, :class:`Answer`, :class:`Exchange`, in
:mod:`ekit_core.exchanges`, re-exported here) that the checkpoint records.
This module works on a whole checkpoint, so it sits above it:
:func:`questions` lists what is waiting, and :func:`answer` records a
person's answer, purely: a new checkpoint. A resume then runs the step again
from its start, and its k-th question gets the k-th answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType

from ekit_core.checkpoint import WorkflowCheckpoint
from ekit_core.exchanges import (
    HUMAN_FORMAT_VERSION,
    NO_EXCHANGES,
    Answer,
    Exchange,
    Question,
    QuestionKind,
    answers_of,
    check_answer,
    denial_of,
    pending,
)

__all__ = [
    "HUMAN_FORMAT_VERSION",
    "NO_EXCHANGES",
    "Answer",
    "Exchange",
    "Question",
    "QuestionKind",
    "answer",
    "answers_of",
    "check_answer",
    "denial_of",
    "pending",
    "questions",
]


def questions(checkpoint: WorkflowCheckpoint) -> Mapping[str, Question]:
    """The questions waiting for an answer in ``checkpoint``: step (or item) -> question."""
    return MappingProxyType(pending(checkpoint.asked))


def answer(checkpoint: WorkflowCheckpoint, step: str, given: Answer) -> WorkflowCheckpoint:
    """``checkpoint`` with ``given`` recorded as the answer to the question ``step`` waits on.

    Raises ``ValueError`` if ``step`` has no pending question (naming the
    steps that do), if ``given`` is not an :class:`Answer`, or if it does not
    fit the question (an approval needs :meth:`Answer.approve` or
    :meth:`Answer.deny`; a value question a value). Resuming the result runs
    ``step`` again with the answer; a denial ends the resume ``"denied"``.
    """
    if not isinstance(given, Answer):
        raise ValueError(f"the answer to step {step!r} must be an Answer, got {type(given).__name__}")
    exchanges = checkpoint.asked.get(step, ())
    if not exchanges or exchanges[-1].answer is not None:
        waiting = sorted(pending(checkpoint.asked))
        raise ValueError(
            f"step {step!r} has no pending question; "
            + (f"steps waiting: {', '.join(map(repr, waiting))}" if waiting else "no step is waiting")
        )
    check_answer(step, exchanges[-1].question, given)
    answered = (*exchanges[:-1], Exchange(exchanges[-1].question, given))
    return replace(
        checkpoint,
        asked=MappingProxyType({**checkpoint.asked, step: answered}),
        format_version=max(checkpoint.format_version, HUMAN_FORMAT_VERSION),
    )
