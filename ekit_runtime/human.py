"""Asking a person from inside a step: :func:`ask` for a value, :func:`approve` for an approval.

A step calls ``ask(prompt)``; the first time, no answer is recorded, so
``ask`` raises :class:`InputRequired` carrying the :class:`~ekit_core.Question`.
The runner reads that as the step *waiting* (not failing: no retry policy
ever sees it): nothing that depends on the step starts, other branches run
on, and once nothing else can run, ``workflow.run`` saves the final
checkpoint and raises :class:`~ekit_runtime.errors.RunWaiting`. Resume it
with the answer, ``workflow.run(resume_from=err.checkpoint, answers={"step":
value})``: the step runs again from its start, and its k-th ``ask`` returns
the k-th answer. One step definition works in one process and in a queue.

How a step knows its answers: the runner sets a ``ContextVar`` around each
attempt of a step that has answers recorded, and only then, so that a run
that never asks pays nothing (an ``ask`` with the variable unset raises, as
there is no answer to give). A sync step's thread gets a copy of the
attempt's context, so it works there too. An executor that runs the step in
another process (the :class:`~ekit_runtime.dask.DaskExecutor`) does not carry
the answers: a first question works (the ``InputRequired`` travels back), but
the step would ask it again for ever once answered, so the runner refuses:
the attempt fails with a ``RuntimeError`` saying to run the asking step with
a ``LocalExecutor``.

Pitfall: :class:`InputRequired` derives from ``Exception`` (as LangGraph's
interrupt does), so a step's own ``except Exception:`` around ``ask`` swallows
the question; let it pass (``except InputRequired: raise`` first).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

from ekit_core import WorkflowCheckpoint
from ekit_core.human import Answer, Question, answer, check_answer, pending

__all__ = ["InputRequired", "approve", "ask", "refuse_dropped_answers", "with_answers"]


class InputRequired(Exception):
    """Raised by :func:`ask` and :func:`approve` when no answer is recorded: the step waits.

    ``question`` is what was asked, ``number`` which of the attempt's
    questions it is (from 1). Let it propagate out of the step: the runner
    records the question; a retry policy never retries it. It derives from
    ``Exception``: a bare ``except Exception`` in the step swallows it.
    """

    def __init__(self, question: Question, number: int = 1) -> None:
        super().__init__(f"a person must answer: {question.prompt}")
        self.question = question
        self.number = number

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.question, self.number))


class _Asking:
    """The answers one attempt may read, in order, and how many it has read."""

    __slots__ = ("answers", "asked")

    def __init__(self, answers: tuple[Answer, ...]) -> None:
        self.answers = answers
        self.asked = 0

    def next(self, question: Question) -> Answer:
        k = self.asked
        self.asked = k + 1
        if k < len(self.answers):
            return self.answers[k]
        raise InputRequired(question, k + 1)


ANSWERS: ContextVar[_Asking] = ContextVar("ekit_answers")
"""The answers of the attempt running in this context: set by the runner, only for a step that has some."""


def enter(answers: tuple[Answer, ...]) -> None:
    """Give the attempt running in this context ``answers`` (the runner calls this)."""
    ANSWERS.set(_Asking(answers))


def _question(kind: str, prompt: object, details: object) -> Question:
    if not isinstance(prompt, str):
        raise TypeError(f"the prompt of a question must be a string, got {type(prompt).__name__}")
    if details is not None:
        try:
            json.dumps(details, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"the details of a question must be JSON data (the checkpoint records them): {exc}"
            ) from None
    return Question(kind, prompt, details)  # type: ignore[arg-type]


def _next(question: Question) -> Answer:
    asking = ANSWERS.get(None)
    if asking is None:
        raise InputRequired(question, 1)
    return asking.next(question)


def ask(prompt: str, *, details: Any = None) -> Any:
    """Ask a person for a value: the answer recorded for this step's question, in order.

    Call it inside a step (sync or async, or an item of a mapped step). The
    step's k-th call returns the k-th answer recorded for it; with none
    recorded it raises :class:`InputRequired`, and the step waits for one
    (``details``: JSON data shown with the ``prompt``).
    """
    question = _question("value", prompt, details)
    given = _next(question)
    if given.approved is not None:
        raise RuntimeError(
            f"ask({prompt!r}) got the answer to an approval: the step asked its questions in "
            "another order than when they were answered"
        )
    return given.value


def approve(prompt: str, *, details: Any = None) -> None:
    """Ask a person to approve what follows: returns once approved.

    With no answer recorded it raises :class:`InputRequired` and the step
    waits. A denial is never handed to the step: the run that resumes a
    denied approval ends at once with
    :class:`~ekit_runtime.errors.ApprovalDenied`, without running the step.
    """
    question = _question("approval", prompt, details)
    given = _next(question)
    if given.approved is None:
        raise RuntimeError(
            f"approve({prompt!r}) got the answer to a value question: the step asked its "
            "questions in another order than when they were answered"
        )
    if not given.approved:  # (the core never runs a step whose approval was denied)
        raise RuntimeError(f"approve({prompt!r}) was denied: {given.reason}")


def with_answers(checkpoint: WorkflowCheckpoint, answers: Mapping[str, Any]) -> WorkflowCheckpoint:
    """``checkpoint`` with ``answers`` recorded: step -> an :class:`~ekit_core.Answer`, or a
    plain value for a value question (``Answer(value)``, answered by nobody named).

    Raises ``ValueError`` naming a step that is not waiting, or an answer
    that does not fit its question (an approval needs ``Answer.approve`` or
    ``Answer.deny``), before anything runs.
    """
    if not isinstance(answers, Mapping):
        raise ValueError(f"answers must be a mapping of step -> answer, got {type(answers).__name__}")
    waiting = pending(checkpoint.asked)
    for step, given in answers.items():
        if not isinstance(step, str):
            raise ValueError(f"answers keys must be step names, got {type(step).__name__} {step!r}")
        if not isinstance(given, Answer):
            question = waiting.get(step)
            if question is not None and question.kind == "approval":
                check_answer(step, question, Answer(given))  # refuses: names the two ways
            given = Answer(given)
        checkpoint = answer(checkpoint, step, given)
    return checkpoint


def refuse_dropped_answers(answers: Mapping[str, Any], kept: Mapping[str, Any]) -> None:
    """``ValueError`` naming the first step of ``answers`` whose question the resume dropped
    (not in ``kept``, the questions its first state keeps): its work changed since it asked,
    so its current code asks its own question, which this answer never saw."""
    for step in answers:
        if step not in kept:
            raise ValueError(
                f"step {step!r} no longer waits on the question answered: its work changed "
                "since it asked (its version, dependencies or shape, or those of a step it "
                "needs), so the current code asks its own question; resume without answering "
                f"{step!r}, then answer what it asks"
            )
