"""What ``apply`` folds into a state: starts and outcomes of step attempts.

Each is a small frozen value. ``Start`` is what ``plan`` returns; the shell
hands it back to ``apply`` once it has launched the attempt. The others
report how an attempt ended, or that the whole run is being cancelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ekit_core.usage import NO_USAGE, TokenUsage

__all__ = ["Cancelled", "Denied", "Failed", "Interrupted", "Result", "Start", "Succeeded"]


@dataclass(frozen=True, slots=True)
class Start:
    """Start attempt ``attempt`` of step ``name`` after waiting ``delay`` seconds."""

    name: str
    attempt: int = 1
    delay: float = 0.0


@dataclass(frozen=True, slots=True)
class Succeeded:
    """Step ``name`` returned ``output`` having spent ``usage``."""

    name: str
    output: Any
    usage: TokenUsage = NO_USAGE
    duration: float | None = None


@dataclass(frozen=True, slots=True)
class Failed:
    """Step ``name`` raised ``error`` (a timeout is a ``TimeoutError``)."""

    name: str
    error: BaseException
    duration: float | None = None


@dataclass(frozen=True, slots=True)
class Denied:
    """The approval callback refused step ``name`` for ``reason``."""

    name: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Interrupted:
    """The in-flight attempt of step ``name`` was cancelled before it finished."""

    name: str


@dataclass(frozen=True, slots=True)
class Cancelled:
    """The run is being cancelled: start nothing more."""

    reason: str = "cancelled"


Result = Start | Succeeded | Failed | Denied | Interrupted | Cancelled
