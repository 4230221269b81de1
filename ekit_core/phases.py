"""The phases of a step: what each step and item of a run is doing, by name.

This module names the phases; :data:`ekit_core.transitions.TRANSITIONS`, the
table of the fold, says which input moves a step from one phase to the next
and with what effect, and :data:`RESUMES` what a resume restores each phase to.

Every step and every item of a run is in exactly one :class:`Phase`. The
phase is not stored: a state keeps its steps in the representation chosen
for speed (the bit window of ready and running steps, :mod:`ekit_core.window`;
the countdowns of ``State._waiting``; the maps of :class:`~ekit_core.Setbacks`;
the recorded outputs), and :func:`phase_of` is its named reading. Storage and
names are kept apart on purpose: the hot path of every step (a success in a
chain) tests one bit it tests anyway, while a reader, a test or an error
message sees a phase.

Two kinds of input move a step. The shell's results (``Start``, ``Began``,
``Succeeded``, ``Failed``, ``Denied``, ``Interrupted``, ``Asked``,
``Skipped``, ``Cancelled``: :mod:`ekit_core.results`) move the step they name;
the fold's own :class:`Trigger`\\ s move *other* steps, as a consequence (a
dependency recorded counts a step down, a skip spreads, a halt withdraws
gated attempts). A (phase, input) pair with no row in the table is refused
with a :class:`~ekit_core.TransitionError` naming the step, its phase and the
input.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ekit_core import window
from ekit_core.exchanges import pending as waiting_on
from ekit_core.selection import selected

if TYPE_CHECKING:
    from ekit_core.state import RunSpec, Setbacks, State

__all__ = [
    "RESUMES",
    "Phase",
    "Row",
    "Trigger",
    "phase_of",
    "table_markdown",
]


class Phase(enum.StrEnum):
    """The phase a step (or item) is in: one at a time, read by :func:`phase_of`."""

    WAITING = "waiting"
    """Some dependency is neither recorded nor (for a join over alternatives) settled."""
    READY = "ready"
    """Every dependency is recorded: :func:`~ekit_core.plan` starts it when there is room."""
    DELAYED = "delayed"
    """Ready for a retry that first waits out its backoff (``Setbacks.delays``)."""
    GATED = "gated"
    """Started, but its work has not begun: it waits out a delay, asks its condition or
    its approval (``Setbacks.gated``), until the shell reports ``Began``."""
    RUNNING = "running"
    """Its attempt is in flight and doing its work."""
    RECORDED = "recorded"
    """Its output is recorded: it never runs again in this run or a resume."""
    FAILED = "failed"
    """Its last attempt failed and no retry is left: the run halts, or only its branch
    waits (``isolate_failures``)."""
    ASKED = "asked"
    """Waiting for a person: it asked a question that has no answer recorded."""
    SKIPPED = "skipped"
    """Its condition was false, or it needs a step that was skipped: it never runs."""
    HELD = "held"
    """Outside the steps a run with ``only=`` may start: it is never started."""
    COLLECTING = "collecting"
    """A mapped step whose input is recorded: expanded into its items, it records their
    outputs as its own once they are settled (and its other dependencies recorded)."""
    LOOPING = "looping"
    """A loop (``repeat=``) whose iterations run one at a time, ``step#k`` grown once
    ``step#(k-1)`` is recorded; it records the last one's output as its own once one
    says it is done."""


class Trigger(enum.StrEnum):
    """The fold's own inputs: what moves a step when *another* step changes."""

    DEPENDENCY_RECORDED = "dependency recorded"
    DEPENDENCY_SKIPPED = "dependency skipped"
    INPUT_RECORDED = "input recorded"
    ITEMS_SETTLED = "items settled"
    ITERATION_RECORDED = "iteration recorded"
    RUN_HALTED = "run halted"


@dataclass(frozen=True, slots=True)
class Row:
    """One row of the table: the phases a step may move to, the effect that moves it,
    and what that does, in a line the docs show."""

    to: tuple[Phase, ...]
    effect: Callable[..., Any]
    does: str


ANY_PHASE = None
"""The key of a row that applies whatever phase a step is in: an input about the run."""


RESUMES: Mapping[Phase, tuple[tuple[Phase, ...], str]] = MappingProxyType({
    Phase.WAITING: ((Phase.WAITING,), "its dependencies are as recorded"),
    Phase.READY: ((Phase.READY,), "its dependencies are recorded"),
    Phase.DELAYED: ((Phase.READY,), "a retry's delay is not recorded: the retry runs at once"),
    Phase.GATED: ((Phase.READY,), "an attempt in flight is lost: it runs again, same number"),
    Phase.RUNNING: ((Phase.READY,), "an attempt in flight is lost: it runs again, same number"),
    Phase.RECORDED: ((Phase.RECORDED,), "never runs again"),
    Phase.FAILED: ((Phase.READY, Phase.FAILED),
                   "a recorded failure is no output: it runs again (a mapped step whose "
                   "input has no items fails again)"),
    Phase.ASKED: ((Phase.ASKED,), "until an answer is recorded (`human.answer`): then ready"),
    Phase.SKIPPED: ((Phase.SKIPPED,), "the skip is recorded"),
    Phase.HELD: ((Phase.HELD,), "with the same `only`"),
    Phase.COLLECTING: ((Phase.COLLECTING,), "expanded again from its recorded input"),
    Phase.LOOPING: ((Phase.LOOPING,),
                    "its next iteration is grown again after the last one recorded"),
})
"""What a resume from a checkpoint of a state restores each phase to (same options).

A step in flight is not in a checkpoint, nor a retry's delay: it is ready
again. :func:`~ekit_core.initial_state` restores these from the storage a
checkpoint holds (outputs, skips, questions, failures); a property test
checks every phase of random states against this table.
"""


def phase_of(state: State, name: str) -> Phase:
    """The phase step (or item) ``name`` of ``state`` is in.

    ``ValueError`` if ``name`` is no step of the run, nor an item it has made.
    """
    spec = state.spec
    return _reading(spec, state.outputs, state.setbacks,
                    (state._offset, state._ready, state._running), name)


def _reading(spec: RunSpec, outputs: Mapping[str, Any], setbacks: Setbacks,
             bits: tuple[int, int, int], name: str) -> Phase:
    """:func:`phase_of` over the fields of a state or of the fold's working copy
    (``bits``: its window, offset, ready and running)."""
    offset, ready, running = bits
    i = spec.graph.index.get(name)
    if i is None:
        raise ValueError(f"unknown step {name!r}")
    if name in outputs:
        return Phase.RECORDED
    if name in setbacks.skipped:
        return Phase.SKIPPED
    j = i - offset
    if j >= 0 and window.has(running, j):
        return Phase.GATED if name in setbacks.gated else Phase.RUNNING
    if j >= 0 and window.has(ready, j):
        return Phase.DELAYED if setbacks.delays.get(name, 0.0) > 0 else Phase.READY
    if setbacks.asked and name in waiting_on(setbacks.asked):
        return Phase.ASKED
    if any(step == name for step, _ in setbacks.errors):
        return Phase.FAILED
    only = spec.limits.only
    if only is not None and not selected(only, spec.shaped, name):
        return Phase.HELD
    shaped = spec.shaped
    if shaped is not None:
        if name in shaped.members:
            return Phase.COLLECTING
        if name in shaped.loops:
            return Phase.LOOPING
        ref = shaped.items.get(name)
        if ref is not None and not ref.iteration and shaped.body_maps:
            ref = shaped.items.get(ref.step, ref)  # (an item of a body's map: its iteration's)
        if ref is not None and ref.iteration and ref.iteration <= shaped.compacted.get(
                shaped.in_body.get(ref.step, ref.step), 0):
            return Phase.RECORDED  # (its output compacted: ``keep_last``)
    return Phase.WAITING


def _label(kind: object) -> str:
    if kind is ANY_PHASE:
        return "any"
    if isinstance(kind, enum.Enum):
        return str(kind.value)
    return f"`{getattr(kind, '__name__', kind)}`"


def table_markdown(table: Mapping[tuple[Phase | None, Any], Row],
                   resumes: Mapping[Phase, tuple[tuple[Phase, ...], str]] = RESUMES) -> str:
    """The table as the markdown docs/concepts.md shows: one line a row, then the resumes."""
    lines = [
        "| phase | input | next phase | effect | what it does |",
        "|---|---|---|---|---|",
    ]
    for (phase, kind), row in table.items():
        to = " or ".join(p.value for p in row.to) if row.to else "(unchanged)"
        lines.append(f"| {_label(phase)} | {_label(kind)} | {to} | `{row.effect.__name__}` "
                     f"| {row.does} |")
    lines += ["", "| phase recorded | after a resume | why |", "|---|---|---|"]
    for phase, (after, why) in resumes.items():
        lines.append(f"| {phase.value} | {' or '.join(p.value for p in after)} | {why} |")
    return "\n".join(lines) + "\n"
