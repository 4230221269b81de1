"""The scheduling rules: ``plan`` chooses what starts, ``apply`` folds in what happened.

This module owns every scheduling decision the library makes:

- a step is ready when all its dependencies are done, and starts in
  declaration order, at most ``max_concurrency`` in flight;
- nothing starts once the run is halted (a failure that will not be
  retried, a reached budget, a denial, a cancellation); in-flight steps
  still finish and their outputs are kept;
- a failed attempt is retried when its step's policy says so, after the
  policy's delay, unless the run is halting;
- a budget is reached when accumulated usage reaches any limited field.

All functions are pure: the input state is never changed, and the same
inputs always give the same state and the same ``state.events``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from dataclasses import replace as _replace
from types import MappingProxyType

from ekit_core.checkpoint import FailureRecord
from ekit_core.events import (
    Event,
    RunFinished,
    StepDenied,
    StepFailed,
    StepFinished,
    StepInterrupted,
    StepRetried,
    StepStarted,
)
from ekit_core.graph import GraphSpec
from ekit_core.policy import NO_RETRY
from ekit_core.results import Cancelled, Denied, Failed, Interrupted, Result, Start, Succeeded
from ekit_core.state import Halt, Incidents, Limits, State, bit_indices, outcome_of

__all__ = ["Batch", "advance", "apply", "plan"]


@dataclass(frozen=True, slots=True)
class Batch:
    """The steps ``plan`` says to start now, in declaration order."""

    starts: tuple[Start, ...] = ()

    def __len__(self) -> int:
        return len(self.starts)

    def __iter__(self) -> Iterator[Start]:
        return iter(self.starts)

    @property
    def names(self) -> tuple[str, ...]:
        """The names of the steps to start."""
        return tuple(s.name for s in self.starts)


_EMPTY = Batch()


def _choose(graph: GraphSpec, limits: Limits, ready: int, running: int, inc: Incidents) -> Batch:
    if inc.halt is not None or not ready:
        return _EMPTY
    room = None
    if limits.max_concurrency is not None:
        room = limits.max_concurrency - running.bit_count()
        if room <= 0:
            return _EMPTY
    names, tries, delays = graph.names, inc.tries, inc.delays
    starts = []
    for i in bit_indices(ready, room):
        name = names[i]
        starts.append(Start(name, tries.get(name, 0) + 1, delays.get(name, 0.0)))
    return Batch(tuple(starts))


def plan(state: State) -> Batch:
    """The steps to start now.

    Every dependency done, not done or in flight already, the run not
    halted, within ``max_concurrency``; lowest declaration index first.
    Hand the batch (or any prefix of it) back to :func:`apply` once started.
    """
    return _choose(state.spec.graph, state.spec.limits, state.ready, state.running, state.incidents)


def apply(state: State, results: Iterable[Result]) -> State:
    """Fold ``results`` into ``state``, in order, and return the new state.

    Raises ``ValueError`` for a result that does not fit the state (a start
    of a step that is not ready, an outcome of a step that is not in flight,
    an unknown step or result type); ``state`` is unchanged then too.
    """
    return _fold(state, results, start_next=False)[0]


def advance(state: State, results: Iterable[Result] = ()) -> tuple[State, Batch]:
    """Fold ``results`` in, then start what :func:`plan` chooses, in one transition.

    Equivalent to ``s = apply(state, results); b = plan(s); return apply(s, b.starts), b``
    but builds one state instead of two: the shell's loop calls this once
    per group of completions.
    """
    return _fold(state, results, start_next=True)


def _bit(graph: GraphSpec, name: str) -> int:
    i = graph.index.get(name)
    if i is None:
        raise ValueError(f"unknown step {name!r}")
    return 1 << i


def _not_in_flight(name: str, what: str) -> ValueError:
    return ValueError(f"{what} for step {name!r}, which is not in flight")


def _fold(state: State, results: Iterable[Result], *, start_next: bool) -> tuple[State, Batch]:
    spec = state.spec
    graph, limits = spec.graph, spec.limits
    index, deps, dependents = graph.index, graph.deps, graph.dependents
    total = len(graph.names)
    outputs, step_usage = state.outputs, state.step_usage
    completed, cost = state.completed, state.cost
    ready, running = state.ready, state.running
    inc = state.incidents
    events: list[Event] = []

    for result in results:
        if isinstance(result, Succeeded):
            name = result.name
            bit = _bit(graph, name)
            if not running & bit:
                raise _not_in_flight(name, "success reported")
            running ^= bit
            usage = result.usage
            outputs = outputs.with_item(name, result.output)
            step_usage = step_usage.with_item(name, usage)
            completed += 1
            if not usage.is_zero():
                cost = cost + usage
            events.append(StepFinished(name, inc.tries.get(name, 0) + 1, usage, result.duration))
            for child in dependents[name]:
                if child not in outputs and all(d in outputs for d in deps[child]):
                    ready |= 1 << index[child]
            budget = limits.budget
            if (
                budget is not None
                and inc.halt is None
                and completed < total
                and budget.reached(cost)
            ):
                inc = _replace(inc, halt=Halt("budget_exceeded", reason=f"usage reached {budget}"))
        elif isinstance(result, Start):
            name = result.name
            bit = _bit(graph, name)
            if inc.halt is not None:
                raise ValueError(f"cannot start step {name!r}: the run is halted ({inc.halt.kind})")
            if not ready & bit:
                raise ValueError(f"cannot start step {name!r}: it is not ready")
            if limits.max_concurrency is not None and running.bit_count() >= limits.max_concurrency:
                raise ValueError(
                    f"cannot start step {name!r}: max_concurrency={limits.max_concurrency} in flight"
                )
            ready ^= bit
            running |= bit
            events.append(_started(name, inc))
            if name in inc.delays:
                inc = _without_delay(inc, name)
        elif isinstance(result, Failed):
            name = result.name
            bit = _bit(graph, name)
            if not running & bit:
                raise _not_in_flight(name, "failure reported")
            running ^= bit
            attempt = inc.tries.get(name, 0) + 1
            error_type, message = type(result.error).__qualname__, str(result.error)
            previous = inc.failures.get(name)
            record = FailureRecord(error_type, message, (previous.attempts if previous else 0) + 1)
            inc = _replace(
                inc,
                failures=MappingProxyType({**inc.failures, name: record}),
                tries=MappingProxyType({**inc.tries, name: attempt}),
            )
            policy = limits.policies.get(name, NO_RETRY)
            if inc.halt is None and policy.retries(result.error, attempt):
                delay = policy.delay(attempt)
                ready |= bit
                inc = _replace(inc, delays=MappingProxyType({**inc.delays, name: delay}))
                events.append(StepRetried(name, attempt, error_type, message, delay, result.duration))
            else:
                events.append(StepFailed(name, attempt, error_type, message, result.duration))
                inc = _replace(
                    inc,
                    errors=(*inc.errors, (name, result.error)),
                    halt=inc.halt or Halt("failed", name, f"{error_type}: {message}"),
                )
        elif isinstance(result, Denied):
            name = result.name
            bit = _bit(graph, name)
            if not running & bit:
                raise _not_in_flight(name, "denial reported")
            running ^= bit
            ready |= bit
            events.append(StepDenied(name, result.reason))
            if inc.halt is None:
                inc = _replace(inc, halt=Halt("denied", name, result.reason))
        elif isinstance(result, Interrupted):
            name = result.name
            bit = _bit(graph, name)
            if not running & bit:
                raise _not_in_flight(name, "interruption reported")
            running ^= bit
            ready |= bit
            events.append(StepInterrupted(name))
        elif isinstance(result, Cancelled):
            if inc.halt is None:
                inc = _replace(inc, halt=Halt("cancelled", reason=result.reason))
        else:
            raise ValueError(f"cannot fold {type(result).__name__} {result!r} into a state")

    batch = _EMPTY
    if start_next:
        batch = _choose(graph, limits, ready, running, inc)
        for start in batch.starts:
            bit = 1 << index[start.name]
            ready ^= bit
            running |= bit
            events.append(_started(start.name, inc))
            if start.name in inc.delays:
                inc = _without_delay(inc, start.name)

    outcome = outcome_of(completed, total, running, inc)
    if outcome is not None and not state.settled:
        events.append(RunFinished(outcome, completed, total, cost))
    new = State(spec, outputs, step_usage, completed, cost, ready, running, inc, tuple(events))
    return new, batch


def _started(name: str, inc: Incidents) -> StepStarted:
    return StepStarted(name, inc.tries.get(name, 0) + 1, inc.delays.get(name, 0.0))


def _without_delay(inc: Incidents, name: str) -> Incidents:
    return _replace(inc, delays=MappingProxyType({k: v for k, v in inc.delays.items() if k != name}))
