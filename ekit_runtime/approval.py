"""Approval before a step starts: the verdict type and how callbacks are read."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

__all__ = ["Approval", "ApprovalFn", "ask"]


@dataclass(frozen=True, slots=True)
class Approval:
    """An approval callback's verdict: ``approved``, and a ``reason`` for a denial."""

    approved: bool
    reason: str = ""

    @classmethod
    def allow(cls) -> Approval:
        """Let the step run."""
        return cls(True)

    @classmethod
    def deny(cls, reason: str = "") -> Approval:
        """Refuse the step, saying why."""
        return cls(False, reason)


ApprovalFn: TypeAlias = Callable[
    [str, Mapping[str, Any]], "bool | Approval | Awaitable[bool | Approval]"
]
"""``approval(step_name, metadata)``, sync or async, returns a bool or an :class:`Approval`."""


async def ask(approval: ApprovalFn, name: str, metadata: Mapping[str, Any]) -> Approval:
    """Consult ``approval`` for step ``name``; a bad verdict is a ``ValueError``."""
    verdict: object = approval(name, metadata)
    if inspect.isawaitable(verdict):
        verdict = await verdict
    if isinstance(verdict, Approval):
        return verdict
    if isinstance(verdict, bool):
        return Approval(verdict)
    raise ValueError(
        f"approval callback returned {type(verdict).__name__} for step {name!r}; "
        "expected a bool or an Approval"
    )
