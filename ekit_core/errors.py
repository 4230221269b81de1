"""The core's own error types: an invalid graph, input it cannot fold, and a bug in ekit itself.

Each is raised before a state changes: a transition either returns a new
state or raises, and the state it was given is untouched either way. They
are on the ground floor, below every module that raises them
(:class:`GraphError` is raised by :mod:`ekit_core.graph` and by
:mod:`ekit_core.shapes`, which the graph imports).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["GraphError", "InternalError", "TransitionError"]


class GraphError(ValueError):
    """An invalid workflow graph. The message names the offending steps."""

    def __init__(self, message: str, steps: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.steps: tuple[str, ...] = tuple(steps)


class TransitionError(ValueError):
    """An input that does not fit the state it was folded into.

    An input whose step is in a phase the phase table has no row for (a start
    of a step that is not ready, the end of an attempt of a step that is not
    in flight: the message names the step, its phase and the input), an
    unknown step, something that is not an input at all. Like
    h11's ``LocalProtocolError``: the caller drove the state machine wrongly,
    and the state it passed is unchanged.
    """


class InternalError(RuntimeError):
    """ekit reached a state it believes impossible: a bug in ekit, please report it."""


TransitionError.__module__ = "ekit_core"
InternalError.__module__ = "ekit_core"
