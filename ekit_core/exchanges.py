"""Human input as plain values: the questions steps ask a person, and the answers recorded.

A step asks (``ekit_runtime.ask`` for a value, ``ekit_runtime.approve`` for
an approval); with no answer recorded, its attempt ends with the question
(the :class:`~ekit_core.Asked` input) and the step *waits*: it is neither
failed nor done, nothing that depends on it starts, and a run with nothing
else to do settles ``"waiting"``. Its questions are recorded in the
checkpoint (``WorkflowCheckpoint.asked``) as :class:`Exchange` values, in
the order the step asked them; only the last may be unanswered.

:func:`answer` records a person's :class:`Answer` to a waiting step's
question, purely: a new checkpoint. A resume then runs the step again from
its start, and its k-th question gets the k-th answer, so a question is
never asked twice. An approval that was denied is not run again: the resume
ends ``"denied"`` at once. :func:`questions` lists what is waiting.

Everything here is plain data: a question's ``details`` and an answer's
``value`` are what JSON can hold (the checkpoint records them), and
``by`` and ``at`` (who answered, and when) are what the caller gives: the
core has no clock.

This module is on the ground floor: the checkpoint, the events and the
inputs are built from its values. What works on a whole checkpoint
(:func:`~ekit_core.answer`, :func:`~ekit_core.questions`) is in
:mod:`ekit_core.human`, above the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, TypeAlias

__all__ = [
    "HUMAN_FORMAT_VERSION",
    "NO_EXCHANGES",
    "Answer",
    "Exchange",
    "Question",
    "QuestionKind",
    "answers_of",
    "check_answer",
    "denial_of",
    "pending",
]

HUMAN_FORMAT_VERSION = 3
"""The format of a checkpoint that records questions (``asked``): written only then."""

QuestionKind: TypeAlias = Literal["value", "approval"]
"""What a question asks for: a value, or an approval (approve or deny)."""

_KINDS = ("value", "approval")


@dataclass(frozen=True, slots=True)
class Question:
    """A question a step asks a person: ``kind`` (``"value"`` or ``"approval"``),
    the ``prompt`` shown, and ``details`` (JSON-able data, or ``None``)."""

    kind: QuestionKind
    prompt: str
    details: Any = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"question kind must be 'value' or 'approval', got {self.kind!r}")
        if not isinstance(self.prompt, str):
            raise ValueError(f"question prompt must be a string, got {type(self.prompt).__name__}")

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the checkpoint."""
        data: dict[str, Any] = {"kind": self.kind, "prompt": self.prompt}
        if self.details is not None:
            data["details"] = self.details
        return data


@dataclass(frozen=True, slots=True)
class Answer:
    """A person's answer: ``value`` for a value question; ``approved`` (and a
    ``reason``) for an approval question; ``by`` who answered and ``at`` when
    (text or a number, as the caller gives it: ``None`` when not given).

    Build one with ``Answer(value, by=...)``, :meth:`approve` or :meth:`deny`.
    """

    value: Any = None
    by: str = ""
    at: str | float | None = None
    approved: bool | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.by, str):
            raise ValueError(f"answer 'by' must be a string, got {type(self.by).__name__}")
        at = self.at
        if at is not None and (isinstance(at, bool) or not isinstance(at, str | int | float)):
            raise ValueError(f"answer 'at' must be text, a number or None, got {type(at).__name__}")
        if self.approved is not None and not isinstance(self.approved, bool):
            raise ValueError(f"answer 'approved' must be a bool or None, got {self.approved!r}")
        if not isinstance(self.reason, str):
            raise ValueError(f"answer 'reason' must be a string, got {type(self.reason).__name__}")
        if self.approved is not None and self.value is not None:
            raise ValueError("an approval answer carries no value: give approved (and a reason)")

    @classmethod
    def approve(cls, *, by: str = "", at: str | float | None = None, reason: str = "") -> Answer:
        """Approve an approval question."""
        return cls(None, by, at, True, reason)

    @classmethod
    def deny(cls, reason: str = "", *, by: str = "", at: str | float | None = None) -> Answer:
        """Deny an approval question, saying why: the run ends denied, the step never runs."""
        return cls(None, by, at, False, reason)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the checkpoint."""
        data: dict[str, Any] = {"by": self.by}
        if self.at is not None:
            data["at"] = self.at
        if self.approved is None:
            data["value"] = self.value
        else:
            data["approved"] = self.approved
        if self.reason:
            data["reason"] = self.reason
        return data

    @classmethod
    def from_dict(cls, data: object) -> Answer:
        """The answer ``to_dict`` wrote (``ValueError`` naming the field for anything else)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"an answer must be a dict, got {type(data).__name__}")
        unknown = sorted(str(k) for k in data if k not in ("by", "at", "value", "approved", "reason"))
        if unknown:
            raise ValueError(f"an answer has unknown field(s): {', '.join(unknown)}")
        if "approved" in data and "value" in data:
            raise ValueError("an answer gives 'value' or 'approved', not both")
        return cls(data.get("value"), data.get("by", ""), data.get("at"), data.get("approved"),
                   data.get("reason", ""))


@dataclass(frozen=True, slots=True)
class Exchange:
    """One question a step asked, and its answer (``None`` while it waits)."""

    question: Question
    answer: Answer | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the checkpoint: the question's fields, and ``answer`` once given."""
        data = self.question.to_dict()
        if self.answer is not None:
            data["answer"] = self.answer.to_dict()
        return data


NO_EXCHANGES: MappingProxyType[str, tuple[Exchange, ...]] = MappingProxyType({})
"""What a run that never asked records: one shared empty mapping."""


def check_answer(step: str, question: Question, given: Answer) -> None:
    """``ValueError`` if ``given`` does not answer ``question`` (an approval needs a verdict)."""
    if question.kind == "approval" and given.approved is None:
        raise ValueError(
            f"step {step!r} asks for an approval: answer with Answer.approve(...) or "
            "Answer.deny(reason, ...)"
        )
    if question.kind == "value" and given.approved is not None:
        raise ValueError(f"step {step!r} asks for a value: answer with Answer(value, by=...)")


def pending(asked: Mapping[str, tuple[Exchange, ...]]) -> dict[str, Question]:
    """The steps (and items) whose last question is unanswered, with that question."""
    return {name: ex[-1].question for name, ex in asked.items() if ex and ex[-1].answer is None}


def denial_of(asked: Mapping[str, tuple[Exchange, ...]]) -> tuple[str, str] | None:
    """The first step whose last answer denies an approval, and the reason; or ``None``."""
    for name, ex in asked.items():
        last = ex[-1].answer if ex else None
        if last is not None and last.approved is False:
            return name, last.reason
    return None


def answers_of(asked: Mapping[str, tuple[Exchange, ...]]) -> dict[str, tuple[Answer, ...]]:
    """The recorded answers of each step, in the order it asked (what ``ask`` hands back)."""
    return {name: tuple(e.answer for e in ex if e.answer is not None) for name, ex in asked.items()}
