"""Steps and what they return: ``Step``, ``PatternResult`` and the usage rule.

A step's return value becomes its output, with one exception that carries
usage: a ``PatternResult`` (ours, or any object shaped like one: a ``value``
attribute and a ``cost`` attribute holding integer ``input_tokens``,
``output_tokens`` and ``llm_calls``, which ExecutionKit's own
``PatternResult`` is). Then ``value`` is the output and ``cost`` is added to
the run's usage. Everything else is stored as returned, with zero usage.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, Literal, TypeAlias, TypeVar

from ekit_core import RetryPolicy, TokenUsage
from ekit_core.usage import NO_USAGE

__all__ = ["PatternResult", "Step", "StepFn", "split_result"]

T = TypeVar("T")

StepFn: TypeAlias = Callable[[dict[str, Any]], Awaitable[Any] | Any]
"""A step body: takes the context dict, returns the output or an awaitable of it."""


@dataclass(frozen=True, slots=True)
class PatternResult(Generic[T]):
    """A step output that also reports the tokens spent making it."""

    value: T
    score: float | None = None
    cost: TokenUsage = NO_USAGE
    metadata: MappingProxyType[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __str__(self) -> str:
        return str(self.value)


def _usage_of(cost: object) -> TokenUsage | None:
    if isinstance(cost, TokenUsage):
        return cost
    counts = []
    for name in ("input_tokens", "output_tokens", "llm_calls"):
        value = getattr(cost, name, None)
        if isinstance(value, bool) or not isinstance(value, int):
            return None
        counts.append(value)
    return TokenUsage(*counts)


_PLAIN = frozenset({str, int, float, bool, bytes, dict, list, tuple, type(None)})


def split_result(returned: object) -> tuple[Any, TokenUsage]:
    """Split what a step returned into ``(output, usage)`` by the rule above."""
    if type(returned) in _PLAIN:
        return returned, NO_USAGE
    if isinstance(returned, PatternResult):
        return returned.value, returned.cost
    if hasattr(returned, "value") and hasattr(returned, "cost"):
        usage = _usage_of(returned.cost)
        if usage is not None:
            return returned.value, usage
    return returned, NO_USAGE


@dataclass(frozen=True, slots=True)
class Step:
    """A named unit of work and the steps it depends on.

    ``run`` receives a fresh ``dict`` context: the initial context plus the
    outputs finished so far (``context="all"``, ExecutionKit's behaviour), or
    the initial context plus only this step's dependencies
    (``context="dependencies"``, O(dependencies) per start instead of
    O(outputs), and the same on every run whatever finished first).
    ``run`` may be sync or async; a sync one marked ``blocking=True`` runs in
    a worker thread so it does not stall its siblings. ``retry`` and
    ``timeout`` (seconds per attempt) are optional.
    """

    name: str
    run: StepFn
    depends_on: tuple[str, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict)
    retry: RetryPolicy | None = None
    timeout: float | None = None
    blocking: bool = False
    context: Literal["all", "dependencies"] = "all"

    def __post_init__(self) -> None:
        # Checked once per step at construction; cheap on the valid path
        # because a 10,000-step workflow builds 10,000 of these.
        def bad(problem: str) -> ValueError:
            return ValueError(f"step {self.name!r}: {problem}")

        if not callable(self.run):
            raise bad(f"run must be callable, got {type(self.run).__name__}")
        depends_on = self.depends_on
        if type(depends_on) is not tuple:
            if isinstance(depends_on, str):
                raise bad(f"depends_on must be a tuple of names, not the string {depends_on!r}")
            try:
                object.__setattr__(self, "depends_on", tuple(depends_on))
            except TypeError:
                raise bad("depends_on must be a tuple of names") from None
        if type(self.metadata) is not dict and not isinstance(self.metadata, Mapping):
            raise bad("metadata must be a mapping")
        if self.retry is not None and not isinstance(self.retry, RetryPolicy):
            raise bad("retry must be a RetryPolicy or None")
        timeout = self.timeout
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
        ):
            raise bad("timeout must be a positive number of seconds or None")
        if self.context != "all" and self.context != "dependencies":
            raise bad("context must be 'all' or 'dependencies'")
