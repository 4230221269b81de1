"""The run state: immutable values, and the durable projection of a state.

A ``State`` says what is done (outputs and per-step usage, in a shared
append-only :class:`~ekit_core.ledger.Ledger`), what is ready and what is in
flight, what failed, and whether the run has been halted. This module holds
data only: every rule that makes or changes a state (the first state of a
run included) lives in :mod:`ekit_core.transitions`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal, TypeAlias

from ekit_core._frozen import twin
from ekit_core.checkpoint import (
    FORMAT_VERSION,
    NO_DRIVES,
    SHAPED_FORMAT_VERSION,
    DriveRecord,
    FailureRecord,
    RecordedGraph,
    Timings,
    WorkflowCheckpoint,
    fast_checkpoint,
    with_retries,
    with_tables,
)
from ekit_core.events import Event, Outcome
from ekit_core.exchanges import HUMAN_FORMAT_VERSION, NO_EXCHANGES, Exchange
from ekit_core.expansion import Expansion
from ekit_core.graph import GraphSpec
from ekit_core.ledger import Ledger
from ekit_core.policy import RetryPolicy
from ekit_core.usage import TokenUsage
from ekit_core.window import indices as bit_indices  # its former home: kept for old imports
from ekit_core.window import names_of, size

__all__ = [
    "OUTCOMES",
    "Halt",
    "HaltKind",
    "Incidents",
    "Setbacks",
    "RunLimits",
    "Outcome",
    "RunSpec",
    "State",
    "attempt_number",
    "bit_indices",
    "checkpoint_of",
    "grown_spec",
]

_NO_COUNTS: MappingProxyType[str, int] = MappingProxyType({})
_NO_DELAYS: MappingProxyType[str, float] = MappingProxyType({})
NO_SKIPS: MappingProxyType[str, str] = MappingProxyType({})
"""The skips of every run without run-time shapes: one shared empty mapping."""
NO_REDONE: MappingProxyType[str, int] = MappingProxyType({})
"""The ``redone`` of every run that let go of no recorded output: one shared empty mapping."""
NO_CODE: MappingProxyType[str, str] = MappingProxyType({})
"""The code fingerprints of every run that asked for none: one shared empty mapping."""


HaltKind: TypeAlias = Literal["failed", "budget_exceeded", "denied", "cancelled"]
"""Why a run stopped starting steps."""

OUTCOMES: tuple[Outcome, ...] = (
    "finished", "failed", "budget_exceeded", "denied", "cancelled", "waiting")


@dataclass(frozen=True, slots=True)
class Halt:
    """Why a run stopped starting steps: ``kind`` is ``"failed"``, ``"budget_exceeded"``,
    ``"denied"`` or ``"cancelled"``; ``step`` and ``reason`` say more where known."""

    kind: HaltKind
    step: str | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class RunLimits:
    """What a run may do: steps in flight at once, usage budget, per-step retry policies,
    whether an approval callback gates each step's first attempt (and its retries
    while it has not answered), and whether a
    failure stops the run or only the steps that depend on it. ``run_id`` is
    the run's id where the shell gives one: it seeds the jitter of retry
    delays (:attr:`RetryPolicy.jitter`), so that runs spread out. ``only``
    is the set of steps a selective run may start (:mod:`ekit_core.selection`),
    ``None`` for every step. ``durations`` says whether the run records how
    long each success took (the checkpoint's ``durations``): off unless asked,
    because every recorded step then carries one more field to save and read."""

    max_concurrency: int | None = None
    budget: TokenUsage | None = None
    policies: Mapping[str, RetryPolicy] = field(default_factory=lambda: MappingProxyType({}))
    approval: bool = False
    isolate_failures: bool = False
    run_id: str | None = None
    # The steps a run with ``only`` may start (the selection's closure, see
    # ekit_core.selection); ``None``: every step.
    only: frozenset[str] | None = None
    durations: bool = False


_FROM_GRAPH: Mapping[str, tuple[str, ...]] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class RunSpec:
    """What does not change during a run: the graph, the limits, the context, the steps' versions.

    Except by growing: a run with run-time shapes (:mod:`ekit_core.shapes`)
    schedules a ``graph`` that grows by the items of its mapped steps, while
    ``declared`` keeps the graph as declared (what checkpoints record and
    fingerprint) and ``shaped`` what the expansions made so far.
    """

    graph: GraphSpec
    limits: RunLimits
    context: MappingProxyType[str, Any]
    versions: MappingProxyType[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # What the fold reads when a step finishes: ``graph.dependents`` unless
    # given, and in a resumed run the dependents among the steps left to run
    # (a recorded step never finishes again, and a recorded dependent is
    # skipped anyway), so that a resume pays nothing here per recorded step.
    # A one-step loop's iterations grown one at a time have no entry (see _grow_next).
    # Derived: left out of comparisons.
    dependents: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: _FROM_GRAPH, repr=False, compare=False
    )
    # The declared graph of a shaped run (None: ``graph`` is declared) and its expansions.
    declared: GraphSpec | None = field(default=None, repr=False)
    shaped: Expansion | None = field(default=None, repr=False)
    # A run with ``only`` (see ekit_core.selection): how many steps of ``graph``
    # outside the selection are neither recorded nor skipped, which the run
    # never settles (its end is counted without them). Changed by growing,
    # and by a skip that reaches such a step. Always 0 without ``only``.
    held: int = field(default=0, repr=False)
    # What the run's checkpoints record as ``redone`` (see WorkflowCheckpoint):
    # fixed when the run starts, read by attempt_number.
    redone: MappingProxyType[str, int] = field(default_factory=lambda: NO_REDONE, repr=False)
    # Step -> the fingerprint of its code, as the run's checkpoints record it
    # (see ekit_core.code): empty unless the workflow asked for fingerprints.
    code_fingerprints: MappingProxyType[str, str] = field(default_factory=lambda: NO_CODE, repr=False)
    # The run's drives as its checkpoints record them (the recorded ones, and this
    # run's, when the shell said who drives it): see WorkflowCheckpoint.drives.
    drives: tuple[DriveRecord, ...] = field(default=NO_DRIVES, repr=False)
    # The graph as the run's checkpoints record it: one value for all of them.
    recorded_graph: RecordedGraph = field(init=False, repr=False, compare=False)
    # Whether a declared step of this shaped run has a condition (``when``), so
    # that some attempt may be a Start(condition=True): derived once per spec,
    # not per start. A speed trick, and its one place: without it every start
    # of a shaped run (each item of a map) took the core's slow path of
    # ``_choose`` and ``_begin_attempts`` to ask whether its step has a
    # condition, 13k instructions per item (a map's 96.6k per item became 109.7k).
    conditional: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.dependents is _FROM_GRAPH:
            object.__setattr__(self, "dependents", self.graph.dependents)
        declared = self.declared if self.declared is not None else self.graph
        object.__setattr__(self, "recorded_graph", RecordedGraph.of(declared))
        object.__setattr__(self, "conditional", self.shaped is not None and any(
            shape.when is not None for shape in declared.shapes.values()))

    @property
    def declared_graph(self) -> GraphSpec:
        """The graph as declared: what the run's checkpoints record."""
        return self.declared if self.declared is not None else self.graph


_RunSpecTwin = twin(RunSpec)  # (see ekit_core._frozen)


def grown_spec(spec: RunSpec, graph: GraphSpec, dependents: Mapping[str, tuple[str, ...]],
               shaped: Expansion, held: int) -> RunSpec:
    """``spec`` with its running ``graph``, ``dependents``, ``shaped`` and ``held`` grown:
    equal to ``dataclasses.replace(spec, ...)`` of them, built through a twin (see
    :mod:`ekit_core._frozen`), once per growth of a shaped run (each loop iteration).

    The derived fields are the same: ``recorded_graph`` and ``conditional`` read the
    declared graph, which growing does not change (``replace`` cost a loop about 12k
    instructions an iteration, two a growth).
    """
    if spec.declared is None:  # (its derived fields read the graph itself: built anew)
        return replace(spec, graph=graph, dependents=dependents, shaped=shaped, held=held)
    made = _RunSpecTwin()
    made.graph = graph
    made.limits = spec.limits
    made.context = spec.context
    made.versions = spec.versions
    made.dependents = dependents
    made.declared = spec.declared
    made.shaped = shaped
    made.held = held
    made.redone = spec.redone
    made.code_fingerprints = spec.code_fingerprints
    made.drives = spec.drives
    made.recorded_graph = spec.recorded_graph
    made.conditional = spec.conditional
    made.__class__ = RunSpec
    grown: RunSpec = made  # (not typing.cast: a Python call per value built; see _frozen)
    return grown


NO_RETRIES: MappingProxyType[str, int] = MappingProxyType({})
"""The ``compacted_retries`` of a run none of whose compacted iterations had failed."""


@dataclass(frozen=True, slots=True)
class Setbacks:
    """What held the run back so far, and whether it is halting.

    ``failures`` is the durable record (attempts counted across runs);
    ``tries`` counts failed attempts per step in this run (what retry
    policies look at); ``delays`` holds the backoff before a retry;
    ``errors`` the exceptions of failures that ended the run; ``halt`` why
    the run stopped starting steps; ``gated`` the attempts in flight held
    back before their work begins (waiting out a retry delay or an
    approval), with their delay: what a halt withdraws. Kept apart from the
    hot fields of :class:`State` because it changes rarely.
    """

    failures: MappingProxyType[str, FailureRecord] = field(
        default_factory=lambda: MappingProxyType({})
    )
    tries: MappingProxyType[str, int] = field(default_factory=lambda: MappingProxyType({}))
    delays: MappingProxyType[str, float] = field(default_factory=lambda: MappingProxyType({}))
    halt: Halt | None = None
    errors: tuple[tuple[str, BaseException], ...] = ()
    gated: MappingProxyType[str, float] = field(default_factory=lambda: _NO_DELAYS)
    # Steps (and items) whose condition was false, or that needed one that
    # was: why each was skipped. Durable, as failures are.
    skipped: MappingProxyType[str, str] = field(default_factory=lambda: NO_SKIPS)
    # The questions steps asked a person, with the answers given: durable.
    # A step whose last question is unanswered waits (see ekit_core.human).
    asked: MappingProxyType[str, tuple[Exchange, ...]] = field(default_factory=lambda: NO_EXCHANGES)
    # Steps (and items) whose last attempt of this run failed before its
    # condition or its approval answered (either raised): their next attempt
    # asks again, as a resume would. Rare, so a frozenset copied per change.
    unanswered: frozenset[str] = frozenset()
    # Those of ``unanswered`` whose condition held, their approval then
    # raised (``Failed.gate``): their next attempt asks the approval only.
    held: frozenset[str] = frozenset()
    # Loop -> the most failed attempts of its compacted iterations, whose failure
    # records went with them (WorkflowCheckpoint.compacted_retries): durable.
    # (Here, not in the Expansion copied at every iteration: it changes rarely.)
    compacted_retries: MappingProxyType[str, int] = field(default_factory=lambda: NO_RETRIES)
    # The iterations (recorded or compacted) of the loops a run with ``only`` holds:
    # done, so counted in the checkpoints' step_index, but never grown into its graph.
    held_done: int = 0


Incidents = Setbacks
"""The former name of :class:`Setbacks` (it never held incidents), kept for old imports."""


@dataclass(frozen=True, slots=True)
class State:
    """One moment of a run. Never mutated; transitions return new states.

    Read it through ``outputs``, ``step_usage``, ``completed``, ``cost``,
    ``outcome``, ``events`` and the methods and properties below. The fields
    with a leading underscore are the representation chosen for speed, for
    :mod:`ekit_core.transitions` alone: ``_offset``, ``_ready`` and
    ``_running`` are a bit window (see :mod:`ekit_core.window`, the one
    module that reads or changes them bit by bit); ``_waiting`` counts the
    unfinished dependencies of steps that have several and some done, so
    readiness costs O(1) per finished dependency.
    ``step_usage`` is sparse: a step that spent nothing has no entry.
    ``_times`` are the durations of the recorded steps the shell timed
    (see :data:`~ekit_core.checkpoint.Timings`): what the checkpoint's
    ``durations`` are read from.
    """

    spec: RunSpec
    outputs: Ledger[str, Any]
    step_usage: Ledger[str, TokenUsage]
    completed: int
    cost: TokenUsage
    setbacks: Setbacks
    events: tuple[Event, ...]
    outcome: Outcome | None
    _offset: int
    _ready: int
    _running: int
    _in_flight: int
    _waiting: MappingProxyType[str, int] = field(default_factory=lambda: _NO_COUNTS)
    # Not compared or shown: a chain one tuple deep per timed step, which
    # == and repr would walk by recursion. The checkpoint's durations compare.
    _times: Timings = field(default=None, repr=False, compare=False)

    @property
    def graph(self) -> GraphSpec:
        """The validated graph of the run."""
        return self.spec.graph

    @property
    def limits(self) -> RunLimits:
        """Concurrency, budget and retry policies of the run."""
        return self.spec.limits

    @property
    def context(self) -> MappingProxyType[str, Any]:
        """The run's initial context (recorded context merged with the one passed)."""
        return self.spec.context

    @property
    def incidents(self) -> Setbacks:
        """The former name of ``setbacks``, kept for old code."""
        return self.setbacks

    @property
    def failures(self) -> MappingProxyType[str, FailureRecord]:
        """Latest failure of each step that failed, with attempts across runs."""
        return self.setbacks.failures

    @property
    def tries(self) -> MappingProxyType[str, int]:
        """Failed attempts per step in this run."""
        return self.setbacks.tries

    @property
    def delays(self) -> MappingProxyType[str, float]:
        """Backoff (seconds) before the next attempt of steps awaiting a retry."""
        return self.setbacks.delays

    @property
    def halt(self) -> Halt | None:
        """Why the run stopped starting steps, or ``None``."""
        return self.setbacks.halt

    @property
    def errors(self) -> tuple[tuple[str, BaseException], ...]:
        """``(step, exception)`` for each failure that ended the run."""
        return self.setbacks.errors

    @property
    def running_count(self) -> int:
        """Number of steps in flight."""
        return self._in_flight

    @property
    def ready_count(self) -> int:
        """Number of steps ready to start (including ones awaiting a retry)."""
        return size(self._ready)

    @property
    def total(self) -> int:
        """Number of steps in the graph."""
        return len(self.spec.graph.names)

    @property
    def complete(self) -> bool:
        """Every step's output is recorded, or the step skipped: nothing is left to run."""
        return self.completed + len(self.setbacks.skipped) == len(self.spec.graph.names)

    @property
    def skipped(self) -> MappingProxyType[str, str]:
        """Steps (and items) skipped by a condition, and why."""
        return self.setbacks.skipped

    @property
    def settled(self) -> bool:
        """Nothing is in flight and nothing more will start: the run is over."""
        return self.outcome is not None

    def is_done(self, name: str) -> bool:
        """Is the output of step ``name`` recorded?"""
        return name in self.spec.graph.index and name in self.outputs

    def running_steps(self) -> tuple[str, ...]:
        """Steps in flight, in declaration order."""
        return names_of(self.spec.graph.names, self._offset, self._running)

    def ready_steps(self) -> tuple[str, ...]:
        """Steps whose dependencies are done and that wait to start, in declaration order."""
        return names_of(self.spec.graph.names, self._offset, self._ready)

    def gated_steps(self) -> tuple[str, ...]:
        """Steps in flight whose attempt has not begun its work (a retry delay, an approval)."""
        return tuple(self.setbacks.gated)

    def attempt_of(self, name: str) -> int:
        """The attempt number the next (or current) attempt of ``name`` has in this run."""
        return self.setbacks.tries.get(name, 0) + 1


def attempt_number(state: State, name: str) -> int:
    """The number of the next (or current) attempt of step (or item) ``name``, counted
    across runs: one more than its attempts so far, failed ones (as the checkpoint's
    failures count them) and those whose output was let go of (``redone``).

    What an attempt's key is built on: an attempt redone after a crash, its
    output never saved, has the number it had (the same work); one after a
    rewind or a changed version has a new one (other work).
    """
    spec, recorded = state.spec, state.setbacks.failures.get(name)
    redone = spec.redone
    spent = redone.get(name, 0) if redone else 0
    if redone and name.endswith("]"):
        # An item of a loop body's map whose iteration keep_last compacted is counted under
        # its iteration's ``P/m#k[]`` (expansion.items_compacted), its own name being gone.
        spent += redone.get(f"{name[:name.rfind('[')]}[]", 0)
    return (0 if recorded is None else recorded.attempts) + spent + 1


def checkpoint_of(state: State) -> WorkflowCheckpoint:
    """The durable projection of ``state``: what a resume needs, and nothing in flight.

    Costs O(1): the checkpoint shares the state's ledgers and its run's
    recorded graph (see :meth:`WorkflowCheckpoint.of_ledgers`, whose builder,
    :func:`~ekit_core.checkpoint.fast_checkpoint`, this calls).
    """
    spec = state.spec
    shaped = spec.shaped
    setbacks = state.setbacks
    if (shaped is None and setbacks.asked is NO_EXCHANGES and spec.code_fingerprints is NO_CODE
            and spec.drives is NO_DRIVES):
        # A static graph that asked no one: no skips, no shapes, nothing set
        # aside, no questions, no code fingerprints (once per step).
        return fast_checkpoint(
            state.outputs, state.step_usage, state._times, step_index=state.completed, cost=state.cost,
            context=spec.context, failures=setbacks.failures,
            graph=spec.recorded_graph, versions=spec.versions, redone=spec.redone,
        )
    if shaped is None:  # (asked, or an empty mapping a hand-made state holds)
        cp = fast_checkpoint(
            state.outputs, state.step_usage, state._times, step_index=state.completed, cost=state.cost,
            context=spec.context, failures=setbacks.failures,
            graph=spec.recorded_graph, versions=spec.versions, redone=spec.redone,
            asked=setbacks.asked,
            format_version=HUMAN_FORMAT_VERSION if setbacks.asked else FORMAT_VERSION,
        )
    else:
        cp = fast_checkpoint(  # (asked to superseded and the version by place: see there)
            state.outputs, state.step_usage, state._times, setbacks.asked, shaped.compacted,
            setbacks.skipped, (spec.graph if spec.declared is None else spec.declared).shapes,
            shaped.superseded, HUMAN_FORMAT_VERSION if setbacks.asked else SHAPED_FORMAT_VERSION,
            step_index=state.completed + setbacks.held_done, cost=state.cost,
            context=spec.context, failures=setbacks.failures,
            graph=spec.recorded_graph, versions=spec.versions, redone=spec.redone,
        )
        if setbacks.compacted_retries:  # (a call less per save of a loop that never failed)
            with_retries(cp, setbacks.compacted_retries)
    code, drives = spec.code_fingerprints, spec.drives
    return cp if code is NO_CODE and drives is NO_DRIVES else with_tables(cp, code, drives=drives)
