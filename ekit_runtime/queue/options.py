"""The run options a queued run carries: plain data, stored with the run, applied by its worker.

:data:`RUN_OPTIONS` is the one table of them: each name, what it takes, and
how its stored value becomes the :meth:`Workflow.run
<ekit_runtime.workflow.Workflow.run>` argument of the same name. A new option
is one more row. Everything here is data, never code: a callable, an object
of another kind or an unknown name is a ``ValueError`` naming it, raised
before anything is stored (what is code, an executor or a trace, is the
worker's: :class:`~ekit_runtime.queue.worker.Worker`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any

from ekit_core import TokenUsage
from ekit_runtime.step import unencodable

__all__ = ["RUN_OPTIONS", "RunOption", "check_run_options", "run_arguments"]


@dataclass(frozen=True, slots=True)
class RunOption:
    """One row of :data:`RUN_OPTIONS`.

    ``check(value, name)`` returns the value as stored (plain JSON data) or
    raises ``ValueError`` naming ``name``; ``apply(stored)`` turns the stored
    value into the ``Workflow.run`` argument; ``takes`` says what it takes,
    for help texts and errors.
    """

    check: Callable[[object, str], Any]
    apply: Callable[[Any], Any]
    takes: str


def _what(value: object) -> str:
    return "a callable" if callable(value) else type(value).__name__


def _count_or_none(value: object, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"run option {name!r} must be a positive int or None, got {_what(value)} {value!r:.80}"
        )
    return value


def _flag(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"run option {name!r} must be true or false, got {_what(value)} {value!r:.80}")
    return value


_USAGE_FIELDS = tuple(f.name for f in fields(TokenUsage))


def _budget(value: object, name: str) -> dict[str, int] | None:
    if value is None:
        return None
    if isinstance(value, TokenUsage):
        value = {k: getattr(value, k) for k in _USAGE_FIELDS}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"run option {name!r} must be a TokenUsage or a mapping of {', '.join(_USAGE_FIELDS)}, "
            f"got {_what(value)}"
        )
    unknown = sorted(str(k) for k in value if k not in _USAGE_FIELDS)
    if unknown:
        raise ValueError(
            f"run option {name!r} has unknown field(s) {', '.join(unknown)} "
            f"(fields: {', '.join(_USAGE_FIELDS)})"
        )
    budget: dict[str, int] = {}
    for key in _USAGE_FIELDS:
        count = value.get(key, 0)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(
                f"run option {name!r}: {key} must be an int >= 0, got {_what(count)} {count!r:.80}"
            )
        budget[key] = count
    return budget


def _step_names(value: object, name: str) -> list[str]:
    """A selection of steps (``only``): a non-empty list of names, checked against the
    workflow by the worker that runs it (an unknown name fails the run before any step)."""
    if isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, list):
        raise ValueError(
            f"run option {name!r} must be a list of step names, such as [\"summary\"], "
            f"got {_what(value)} {value!r:.80}"
        )
    if not value:
        raise ValueError(f"run option {name!r} must name at least one step, got an empty list")
    for i, step in enumerate(value):
        if not isinstance(step, str) or not step:
            raise ValueError(
                f"run option {name!r}: [{i}] must be a step name (a non-empty string), "
                f"got {_what(step)} {step!r:.80}"
            )
        why = unencodable(step)
        if why is not None:
            raise ValueError(f"run option {name!r}: [{i}] {why}")
    return value


def _usage(stored: dict[str, int] | None) -> TokenUsage | None:
    return None if stored is None else TokenUsage(**stored)


def _same(stored: Any) -> Any:
    return stored


RUN_OPTIONS: Mapping[str, RunOption] = MappingProxyType({
    "max_concurrency": RunOption(_count_or_none, _same, "a positive int: at most N steps in flight"),
    "budget": RunOption(
        _budget, _usage, "a TokenUsage or {input_tokens, output_tokens, llm_calls}: stop once reached"
    ),
    "isolate_failures": RunOption(_flag, _same, "true/false: a failed step stops only its dependants"),
    "allow_graph_change": RunOption(_flag, _same, "true/false: resume a checkpoint of another graph"),
    "durations": RunOption(_flag, _same, "true/false: record how long each step took"),
    "only": RunOption(
        _step_names, _same, 'a list of step names, such as ["summary"]: run those and what they need'
    ),
})
"""Every run option a queued run may carry, by name (the ``Workflow.run`` argument it sets)."""


def check_run_options(options: object, what: str = "options") -> dict[str, Any]:
    """``options`` as stored: each value checked by its :data:`RUN_OPTIONS` row (``ValueError`` naming it)."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ValueError(f"{what} must be a mapping of run option name to value, got {_what(options)}")
    unknown = sorted(repr(k) for k in options if k not in RUN_OPTIONS)
    if unknown:
        raise ValueError(
            f"unknown run option(s) in {what}: {', '.join(unknown)} (options: {', '.join(RUN_OPTIONS)})"
        )
    checked = {name: RUN_OPTIONS[name].check(value, name) for name, value in options.items()}
    for name, value in checked.items():
        _storable(value, name)
    return checked


def _storable(value: object, name: str) -> None:
    """Refuse a checked value no store could write (text UTF-8 cannot hold), naming its option.

    Each row checks its own values; this catches any text a row lets
    through, so a future option cannot fail at the store with a bare
    ``UnicodeEncodeError`` that names neither the option nor the run.
    """
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"run option {name!r} holds {exc.object[exc.start:exc.end]!r}, which UTF-8 cannot encode, "
            "so no store could save it"
        ) from None


def run_arguments(stored: Mapping[str, Any]) -> dict[str, Any]:
    """The ``Workflow.run`` keyword arguments that checked options ``stored`` stand for."""
    return {name: RUN_OPTIONS[name].apply(value) for name, value in stored.items()}
