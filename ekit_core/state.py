"""The run state: an immutable value, and how a run's first state is built.

A ``State`` says what is done (outputs and per-step usage, in a shared
append-only :class:`~ekit_core.ledger.Ledger`), what is ready and what is in
flight (bit sets over declaration indices), what failed, and whether the run
has been halted. Transitions live in :mod:`ekit_core.transitions`; this
module owns the rules for starting a run: which arguments are valid, what a
resumed checkpoint restores, and what the durable projection of a state is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ekit_core.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    FailureRecord,
    WorkflowCheckpoint,
)
from ekit_core.compat import GraphMismatchError, graph_changes
from ekit_core.events import Event, RunFinished, RunStarted, StepSkipped
from ekit_core.graph import GraphSpec
from ekit_core.ledger import Ledger
from ekit_core.policy import RetryPolicy
from ekit_core.usage import TokenUsage

__all__ = ["Halt", "Incidents", "Limits", "RunSpec", "State", "checkpoint_of", "initial_state"]

OUTCOMES = ("finished", "failed", "budget_exceeded", "denied", "cancelled")


@dataclass(frozen=True, slots=True)
class Halt:
    """Why a run stopped starting steps: ``kind`` is ``"failed"``, ``"budget_exceeded"``,
    ``"denied"`` or ``"cancelled"``; ``step`` and ``reason`` say more where known."""

    kind: str
    step: str | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Limits:
    """What a run may do: steps in flight at once, usage budget, per-step retry policies."""

    max_concurrency: int | None = None
    budget: TokenUsage | None = None
    policies: Mapping[str, RetryPolicy] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True)
class RunSpec:
    """What does not change during a run: the graph, the limits, the context."""

    graph: GraphSpec
    limits: Limits
    context: MappingProxyType[str, Any]


@dataclass(frozen=True, slots=True)
class Incidents:
    """What went wrong so far, and whether the run is halting.

    ``failures`` is the durable record (attempts counted across runs);
    ``tries`` counts failed attempts per step in this run (what retry
    policies look at); ``delays`` holds the backoff before a retry;
    ``errors`` the exceptions of failures that ended the run. Kept apart from
    the hot fields of :class:`State` because it changes rarely.
    """

    failures: MappingProxyType[str, FailureRecord] = field(
        default_factory=lambda: MappingProxyType({})
    )
    tries: MappingProxyType[str, int] = field(default_factory=lambda: MappingProxyType({}))
    delays: MappingProxyType[str, float] = field(default_factory=lambda: MappingProxyType({}))
    halt: Halt | None = None
    errors: tuple[tuple[str, BaseException], ...] = ()


@dataclass(frozen=True, slots=True)
class State:
    """One moment of a run. Never mutated; transitions return new states.

    ``ready`` and ``running`` are bit sets over a window of declaration
    indices: bit ``i`` stands for ``graph.names[offset + i]``. The window
    starts at the lowest step that is ready or in flight, so each transition
    touches integers as wide as the unfinished frontier, not the graph (a
    long chain stays O(1) per step). ``in_flight`` counts the running bits.
    ``events`` is what the transition that made this state did. The
    properties below read through to :class:`RunSpec` and :class:`Incidents`.
    """

    spec: RunSpec
    outputs: Ledger[str, Any]
    step_usage: Ledger[str, TokenUsage]
    completed: int
    cost: TokenUsage
    offset: int
    ready: int
    running: int
    in_flight: int
    incidents: Incidents
    events: tuple[Event, ...]

    @property
    def graph(self) -> GraphSpec:
        """The validated graph of the run."""
        return self.spec.graph

    @property
    def limits(self) -> Limits:
        """Concurrency, budget and retry policies of the run."""
        return self.spec.limits

    @property
    def context(self) -> MappingProxyType[str, Any]:
        """The run's initial context (recorded context merged with the one passed)."""
        return self.spec.context

    @property
    def failures(self) -> MappingProxyType[str, FailureRecord]:
        """Latest failure of each step that failed, with attempts across runs."""
        return self.incidents.failures

    @property
    def tries(self) -> MappingProxyType[str, int]:
        """Failed attempts per step in this run."""
        return self.incidents.tries

    @property
    def delays(self) -> MappingProxyType[str, float]:
        """Backoff (seconds) before the next attempt of steps awaiting a retry."""
        return self.incidents.delays

    @property
    def halt(self) -> Halt | None:
        """Why the run stopped starting steps, or ``None``."""
        return self.incidents.halt

    @property
    def errors(self) -> tuple[tuple[str, BaseException], ...]:
        """``(step, exception)`` for each failure that ended the run."""
        return self.incidents.errors

    @property
    def running_count(self) -> int:
        """Number of steps in flight."""
        return self.in_flight

    @property
    def total(self) -> int:
        """Number of steps in the graph."""
        return len(self.spec.graph.names)

    @property
    def finished(self) -> bool:
        """Every step's output is recorded."""
        return self.completed == len(self.spec.graph.names)

    @property
    def settled(self) -> bool:
        """Nothing is in flight and nothing more will start: the run is over."""
        return not self.running and (self.finished or self.incidents.halt is not None)

    @property
    def outcome(self) -> str | None:
        """``None`` while running; else one of ``finished``, ``failed``,
        ``budget_exceeded``, ``denied``, ``cancelled``."""
        return outcome_of(self.completed, self.total, self.in_flight, self.incidents)

    def is_done(self, name: str) -> bool:
        """Is the output of step ``name`` recorded?"""
        return name in self.spec.graph.index and name in self.outputs

    def running_steps(self) -> tuple[str, ...]:
        """Steps in flight, in declaration order."""
        names, offset = self.spec.graph.names, self.offset
        return tuple(names[offset + i] for i in bit_indices(self.running))

    def ready_steps(self) -> tuple[str, ...]:
        """Steps whose dependencies are done and that wait to start, in declaration order."""
        names, offset = self.spec.graph.names, self.offset
        return tuple(names[offset + i] for i in bit_indices(self.ready))

    def attempt_of(self, name: str) -> int:
        """The attempt number the next (or current) attempt of ``name`` has in this run."""
        return self.incidents.tries.get(name, 0) + 1


def outcome_of(completed: int, total: int, in_flight: int, incidents: Incidents) -> str | None:
    """How a run with these counts has ended, or ``None`` while it has not."""
    if in_flight or (completed < total and incidents.halt is None):
        return None
    if incidents.errors:
        return "failed"
    if completed == total or incidents.halt is None:
        return "finished"
    return incidents.halt.kind


def bit_indices(bits: int, limit: int | None = None) -> list[int]:
    """Indices of the set bits of ``bits``, lowest first, at most ``limit`` of them."""
    if not bits & (bits - 1):  # zero or one bit: the common case of a chain
        return [bits.bit_length() - 1] if bits and limit != 0 else []
    out: list[int] = []
    if limit is None:
        limit = bits.bit_count()
    if limit <= 8:
        while bits and len(out) < limit:
            low = bits & -bits
            out.append(low.bit_length() - 1)
            bits ^= low
        return out
    digits = bin(bits)[:1:-1]
    i = digits.find("1")
    while i != -1 and len(out) < limit:
        out.append(i)
        i = digits.find("1", i + 1)
    return out


def _check_limits(
    graph: GraphSpec,
    max_concurrency: int | None,
    budget: TokenUsage | None,
    policies: Mapping[str, RetryPolicy] | None,
) -> Limits:
    if max_concurrency is not None and (
        isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1
    ):
        raise ValueError(f"max_concurrency must be None or an int >= 1, got {max_concurrency!r}")
    if budget is not None:
        if not isinstance(budget, TokenUsage):
            raise ValueError(f"budget must be a TokenUsage, got {type(budget).__name__}")
        if min(budget.input_tokens, budget.output_tokens, budget.llm_calls) < 0:
            raise ValueError(f"budget counts must not be negative, got {budget!r}")
    checked: dict[str, RetryPolicy] = {}
    for name, policy in (policies or {}).items():
        if name not in graph.index:
            raise ValueError(f"retry policy given for unknown step {name!r}")
        if not isinstance(policy, RetryPolicy):
            raise ValueError(f"retry policy of step {name!r} must be a RetryPolicy")
        checked[name] = policy
    return Limits(max_concurrency, budget, MappingProxyType(checked))


def _check_context(graph: GraphSpec, context: object, field_name: str) -> dict[str, Any]:
    if not isinstance(context, Mapping):
        raise ValueError(f"{field_name} must be a mapping, got {type(context).__name__}")
    bad = [k for k in context if not isinstance(k, str)]
    if bad:
        raise ValueError(f"{field_name} keys must be strings, got {bad[0]!r}")
    colliding = sorted(k for k in context if k in graph.index)
    if colliding:
        message = (
            f"{field_name} key(s) collide with step name(s): {colliding}; a step's output "
            "would be shadowed, so rename the key(s) or the step(s)"
        )
        if field_name == "initial_context":
            raise ValueError(message)
        raise CheckpointError("context", message)
    return dict(context)


def initial_state(
    graph: GraphSpec,
    resume_from: WorkflowCheckpoint | Mapping[str, Any] | None = None,
    *,
    context: Mapping[str, Any] | None = None,
    max_concurrency: int | None = None,
    budget: TokenUsage | None = None,
    policies: Mapping[str, RetryPolicy] | None = None,
    allow_graph_change: bool = False,
) -> State:
    """The first state of a run, fresh or resumed from a checkpoint.

    A resumed run restores the checkpoint's outputs, usage, failures and
    context verbatim; the steps counted as done are exactly those with a recorded output.
    ``context`` is merged over the recorded context (its keys win). Every
    argument is checked here, before any step could run: a bad one raises
    ``ValueError`` naming it, and a checkpoint from another graph raises
    :class:`~ekit_core.compat.GraphMismatchError` unless
    ``allow_graph_change`` is true.
    """
    if not isinstance(graph, GraphSpec):
        raise ValueError(f"graph must be a GraphSpec, got {type(graph).__name__}")
    limits = _check_limits(graph, max_concurrency, budget, policies)
    new_context = _check_context(graph, context if context is not None else {}, "initial_context")
    if resume_from is None:
        checkpoint = WorkflowCheckpoint(0, MappingProxyType({}))
    elif isinstance(resume_from, WorkflowCheckpoint):
        checkpoint = resume_from
    elif isinstance(resume_from, Mapping):
        checkpoint = WorkflowCheckpoint.from_dict(dict(resume_from))
    else:
        raise ValueError(
            f"resume_from must be a WorkflowCheckpoint or its dict, got {type(resume_from).__name__}"
        )
    if not allow_graph_change:
        changes = graph_changes(graph, checkpoint)
        if changes is not None:
            raise GraphMismatchError(changes)
    merged = _check_context(graph, checkpoint.context, "context") | new_context

    outputs: Ledger[str, Any] = Ledger(checkpoint.outputs.items())
    step_usage: Ledger[str, TokenUsage] = Ledger(
        (k, u) for k, u in checkpoint.step_usage.items() if k in outputs
    )
    names = graph.names
    recorded = [n for n in names if n in outputs]
    ready = 0
    for i, name in enumerate(names):
        if name not in outputs and all(d in outputs for d in graph.deps[name]):
            ready |= 1 << i
    offset = (ready & -ready).bit_length() - 1 if ready else 0
    halt = None
    if (
        limits.budget is not None
        and limits.budget.reached(checkpoint.cost)
        and len(recorded) < len(names)
    ):
        halt = Halt("budget_exceeded", reason="usage recorded in the checkpoint reaches the budget")
    incidents = Incidents(failures=checkpoint.failures, halt=halt)
    events: list[Event] = [RunStarted(len(names), len(recorded))]
    events.extend(StepSkipped(n) for n in recorded)
    outcome = outcome_of(len(recorded), len(names), 0, incidents)
    if outcome is not None:
        events.append(RunFinished(outcome, len(recorded), len(names), checkpoint.cost))
    return State(
        spec=RunSpec(graph, limits, MappingProxyType(merged)),
        outputs=outputs,
        step_usage=step_usage,
        completed=len(recorded),
        cost=checkpoint.cost,
        offset=offset,
        ready=ready >> offset,
        running=0,
        in_flight=0,
        incidents=incidents,
        events=tuple(events),
    )


def checkpoint_of(state: State) -> WorkflowCheckpoint:
    """The durable projection of ``state``: what a resume needs, and nothing in flight.

    Costs O(1): the checkpoint shares the state's output ledger.
    """
    return WorkflowCheckpoint(
        step_index=state.completed,
        outputs=MappingProxyType(state.outputs),
        cost=state.cost,
        context=state.spec.context,
        step_usage=MappingProxyType(state.step_usage),
        failures=state.incidents.failures,
        fingerprint=state.spec.graph.fingerprint,
        graph=state.spec.graph.deps,
        format_version=FORMAT_VERSION,
        _outputs_ledger=state.outputs,
        _usage_ledger=state.step_usage,
    )

