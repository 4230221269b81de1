"""The per-step frozen values, built fast: the one place the core plays this trick.

The trick. A frozen dataclass's generated ``__init__`` sets each field
through ``object.__setattr__`` (a lookup and a C call, about a thousand
machine instructions a field). A *twin* is a plain class with the very same
slots: it takes plain attribute stores, which the interpreter specialises to
a few instructions each. Assigning ``__class__`` then turns the twin
instance into an instance of the frozen class (same layout, so CPython
allows it): the same value, immutable from then on.

Why it is worth it. The core builds a state, a checkpoint, a start and a
batch, and the runtime a success, for every step of a run. Counted with
callgrind (CPython 3.11), those five cost about 59k instructions through
their ``__init__`` and about 19k through twins (a state alone 19k against
4k), where a whole chain step costs about 153k now
(``python -m benchmarks.instructions``; docs/performance.md). Code
generation would fold these constructors into one, but the core's purity
rule forbids ``exec``.

Every value built this way, and its constructor here:

- :class:`~ekit_core.State`, by :func:`state_of_run`: the state a
  transition's working copy freezes into, once per transition;
- :class:`~ekit_core.WorkflowCheckpoint`, by :func:`checkpoint`: what
  :meth:`WorkflowCheckpoint.of_ledgers <ekit_core.WorkflowCheckpoint.of_ledgers>`
  and :func:`~ekit_core.checkpoint_of` return, once per checkpoint;
- :class:`~ekit_core.Succeeded`, by :func:`succeeded`: a step's success as
  the shell reports it (importable as ``ekit_core.results.succeeded``);
- :class:`~ekit_core.Start`, by :func:`first_start`: a plain first attempt;
- :class:`~ekit_core.Batch`, by :func:`batch`: a batch of starts and
  nothing to withdraw;
- :class:`~ekit_core.CheckpointDelta`, by :func:`delta`: what a checkpoint
  of the core adds to the one before it, once per save of every store
  (measured: 0.23 us through the twin, 0.99 us through ``__init__``).

Everything else, these values included when built anywhere else, is built
the ordinary way. No other module of the core makes a twin or assigns
``__class__`` (``tests/test_construction_trick.py`` checks it). This module
imports the value classes, so the modules that define them reach it only
when called: ``ekit_core.results`` re-exports ``succeeded`` and
``first_start`` on first access, and ``checkpoint_of`` and ``of_ledgers``
call :func:`checkpoint` through the package.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, cast

from ekit_core.checkpoint import (
    _GRAPHS,
    _NO_FAILURES,
    _NO_SHAPES,
    _NOTHING,
    _NOTHING_REDONE,
    FORMAT_VERSION,
    CheckpointDelta,
    FailureRecord,
    Timings,
    WorkflowCheckpoint,
    _Unset,
)
from ekit_core.events import Event, Outcome
from ekit_core.ledger import Ledger
from ekit_core.results import Batch, Start, Succeeded
from ekit_core.shapes import Shape
from ekit_core.state import State
from ekit_core.usage import TokenUsage

if TYPE_CHECKING:
    from ekit_core.transitions import _Run

__all__ = ["batch", "checkpoint", "delta", "first_start", "state_of_run", "succeeded"]


def _twin(frozen: type) -> type[Any]:
    """A plain class with the slots of ``frozen`` and its bases: its instances may become ``frozen`` ones."""
    slots = tuple(name for cls in reversed(frozen.__mro__) for name in vars(cls).get("__slots__", ()))
    return type(f"_{frozen.__name__}Twin", (), {"__slots__": slots})


_StateTwin = _twin(State)
_CheckpointTwin = _twin(WorkflowCheckpoint)
_SucceededTwin = _twin(Succeeded)
_StartTwin = _twin(Start)
_BatchTwin = _twin(Batch)
_DeltaTwin = _twin(CheckpointDelta)


def state_of_run(w: _Run, events: tuple[Event, ...], outcome: Outcome | None) -> State:
    """The :class:`~ekit_core.State` a transition's working copy ``w`` freezes into.

    Each field is ``w``'s field of the same name (its bit window anchored,
    its countdowns read-only, by the caller); ``events`` and ``outcome`` are
    what the caller decided. Equal to ``State(...)`` of those fields.
    """
    state = _StateTwin()
    state.spec = w.spec
    state.outputs = w.outputs
    state.step_usage = w.step_usage
    state._times = w.times
    state.completed = w.completed
    state.cost = w.cost
    state.setbacks = w.setbacks
    state.events = events
    state.outcome = outcome
    state._offset = w.offset
    state._ready = w.ready
    state._running = w.running
    state._in_flight = w.in_flight
    state._waiting = w.waiting
    state.__class__ = State
    return cast(State, state)


def checkpoint(
    outputs: Ledger[str, Any], step_usage: Ledger[str, TokenUsage], times: Timings,
    # Before the "*": a positional default is filled from a tuple, a
    # keyword-only one looked up in a dict (on every call, once per step).
    asked: MappingProxyType[str, Any] = _NOTHING, *,
    step_index: int, cost: TokenUsage, context: MappingProxyType[str, Any],
    failures: MappingProxyType[str, FailureRecord],
    graph: Mapping[str, tuple[str, ...]] | None, versions: MappingProxyType[str, str],
    fingerprint: str | _Unset | None = _GRAPHS, format_version: int = FORMAT_VERSION,
    kind: type[WorkflowCheckpoint] = WorkflowCheckpoint,
    skipped: MappingProxyType[str, str] = _NOTHING,
    shapes: MappingProxyType[str, Shape] = _NO_SHAPES,
    superseded: MappingProxyType[str, Any] = _NOTHING,
    redone: MappingProxyType[str, int] = _NOTHING_REDONE,
) -> WorkflowCheckpoint:
    """:meth:`WorkflowCheckpoint.of_ledgers <ekit_core.WorkflowCheckpoint.of_ledgers>`, which see.

    Without a ``fingerprint`` the field holds ``_GRAPHS``, for the checkpoint's
    ``fingerprint`` property to read off ``graph`` when first asked; ``kind``
    is the class ``of_ledgers`` was called on.
    """
    cp = _CheckpointTwin()
    cp.step_index, cp.outputs, cp.cost = step_index, MappingProxyType(outputs), cost
    cp.context, cp.step_usage = context, MappingProxyType(step_usage)
    cp.failures, cp.graph = failures, graph
    cp.fingerprint = fingerprint
    cp.format_version, cp.versions = format_version, versions
    cp.skipped, cp.shapes, cp.superseded, cp.redone = skipped, shapes, superseded, redone
    # (durations left unset: built from the timings when first read)
    cp.asked, cp._times = asked, times
    cp._outputs_ledger, cp._usage_ledger = outputs, step_usage
    cp.__class__ = kind
    return cast(WorkflowCheckpoint, cp)


def succeeded(name: str, output: Any, usage: TokenUsage, duration: float | None) -> Succeeded:
    """``Succeeded(name, output, usage, duration)``: what the shell reports when a step returns."""
    value = _SucceededTwin()
    value.name = name
    value.output = output
    value.usage = usage
    value.duration = duration
    value.__class__ = Succeeded
    return cast(Succeeded, value)


def first_start(name: str) -> Start:
    """``Start(name)``: a plain first attempt (no delay, no condition, no approval)."""
    value = _StartTwin()
    value.name = name
    value.attempt = 1
    value.delay = 0.0
    value.approval = False
    value.condition = False
    value.__class__ = Start
    return cast(Start, value)


def batch(starts: tuple[Start, ...]) -> Batch:
    """``Batch(starts)``: starts, and no gated attempt to withdraw."""
    value = _BatchTwin()
    value.starts = starts
    value.withdraw = ()
    value.__class__ = Batch
    return cast(Batch, value)


def delta(
    outputs: tuple[tuple[str, Any], ...], step_usage: tuple[tuple[str, TokenUsage], ...],
    cost: TokenUsage, durations: tuple[tuple[str, float], ...],
) -> CheckpointDelta:
    """The delta of the usual save: ``CheckpointDelta(True, outputs, step_usage, no failures,
    cost, False, no skips, False, durations)`` (a prefix extended, nothing else changed)."""
    value = _DeltaTwin()
    value.extends = True
    value.outputs = outputs
    value.step_usage = step_usage
    value.failures = _NO_FAILURES
    value.cost = cost
    value.context_changed = False
    value.skipped = _NOTHING
    value.asked_changed = False
    value.durations = durations
    value.__class__ = CheckpointDelta
    return cast(CheckpointDelta, value)
