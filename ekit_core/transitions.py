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


def _choose(
    graph: GraphSpec, limits: Limits, offset: int, ready: int, in_flight: int, inc: Incidents
) -> Batch:
    if inc.halt is not None or not ready:
        return _EMPTY
    room = None
    if limits.max_concurrency is not None:
        room = limits.max_concurrency - in_flight
        if room <= 0:
            return _EMPTY
    names, tries, delays = graph.names, inc.tries, inc.delays
    if not ready & (ready - 1):  # one ready step: the whole batch of a chain
        name = names[offset + ready.bit_length() - 1]
        return Batch((Start(name, tries.get(name, 0) + 1, delays.get(name, 0.0)),))
    starts = []
    for i in bit_indices(ready, room):
        name = names[offset + i]
        starts.append(Start(name, tries.get(name, 0) + 1, delays.get(name, 0.0)))
    return Batch(tuple(starts))


def plan(state: State) -> Batch:
    """The steps to start now.

    Every dependency done, not done or in flight already, the run not
    halted, within ``max_concurrency``; lowest declaration index first.
    Hand the batch (or any prefix of it) back to :func:`apply` once started.
    """
    return _choose(
        state.spec.graph,
        state.spec.limits,
        state.offset,
        state.ready,
        state.in_flight,
        state.incidents,
    )


def apply(state: State, results: Iterable[Result]) -> State:
    """Fold ``results`` into ``state``, in order, and return the new state.

    Raises ``ValueError`` for a result that does not fit the state (a start
    of a step that is not ready, an outcome of a step that is not in flight,
    an unknown step or result type); ``state`` is unchanged then too.
    """
    return _fold(state, results, start_next=False, record_events=True)[0]


def advance(
    state: State, results: Iterable[Result] = (), *, record_events: bool = True
) -> tuple[State, Batch]:
    """Fold ``results`` in, then start what :func:`plan` chooses, in one transition.

    Equivalent to ``s = apply(state, results); b = plan(s); return apply(s, b.starts), b``
    but builds one state instead of two: the shell's loop calls this once
    per group of completions. With ``record_events=False`` the new state's
    ``events`` is empty, which saves building event objects nobody will read.
    """
    return _fold(state, results, start_next=True, record_events=record_events)


def _index(graph: GraphSpec, name: str) -> int:
    i = graph.index.get(name)
    if i is None:
        raise ValueError(f"unknown step {name!r}")
    return i


def _not_in_flight(name: str, what: str) -> ValueError:
    return ValueError(f"{what} for step {name!r}, which is not in flight")


def _fit(offset: int, ready: int, running: int, i: int) -> tuple[int, int, int]:
    """Move the bit window so that step index ``i`` falls inside it.

    ``ready`` and ``running`` are relative to ``offset``, which a transition
    keeps at the lowest ready or running step so that these integers stay
    as narrow as the unfinished frontier. An empty window simply moves to
    ``i``; an index below it widens the window downwards.
    """
    if not (ready or running):
        return i, 0, 0
    if i < offset:
        shift = offset - i
        return i, ready << shift, running << shift
    return offset, ready, running


def _fold(
    state: State, results: Iterable[Result], *, start_next: bool, record_events: bool
) -> tuple[State, Batch]:
    spec = state.spec
    graph, limits = spec.graph, spec.limits
    index, deps, dependents = graph.index, graph.deps, graph.dependents
    total = len(graph.names)
    outputs, step_usage = state.outputs, state.step_usage
    completed, cost = state.completed, state.cost
    # The bit window, edited in place by this transition and frozen at the end.
    offset, ready, running, in_flight = state.offset, state.ready, state.running, state.in_flight
    inc = state.incidents
    events: list[Event] = []

    for result in results:
        if isinstance(result, Succeeded):
            # The hot path of every run: kept to plain int and dict operations.
            name = result.name
            i = index.get(name)
            if i is None:
                raise ValueError(f"unknown step {name!r}")
            j = i - offset
            if j < 0 or not (running >> j) & 1:
                raise _not_in_flight(name, "success reported")
            running ^= 1 << j
            in_flight -= 1
            usage = result.usage
            outputs = outputs.with_item(name, result.output)
            step_usage = step_usage.with_item(name, usage)
            completed += 1
            if usage.input_tokens or usage.output_tokens or usage.llm_calls:
                cost = cost + usage
            if record_events:
                events.append(StepFinished(name, inc.tries.get(name, 0) + 1, usage, result.duration))
            for child in dependents[name]:
                parents = deps[child]
                # A single parent is the step that just finished.
                if child not in outputs and (
                    len(parents) == 1 or all(d in outputs for d in parents)
                ):
                    k = index[child]
                    if k < offset or not (ready or running):
                        offset, ready, running = _fit(offset, ready, running, k)
                    ready |= 1 << (k - offset)
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
            i = _index(graph, name)
            if inc.halt is not None:
                raise ValueError(f"cannot start step {name!r}: the run is halted ({inc.halt.kind})")
            j = i - offset
            if j < 0 or not (ready >> j) & 1:
                raise ValueError(f"cannot start step {name!r}: it is not ready")
            if limits.max_concurrency is not None and in_flight >= limits.max_concurrency:
                raise ValueError(
                    f"cannot start step {name!r}: max_concurrency={limits.max_concurrency} in flight"
                )
            ready ^= 1 << j
            running |= 1 << j
            in_flight += 1
            events.append(_started(name, inc))
            if name in inc.delays:
                inc = _without_delay(inc, name)
        elif isinstance(result, (Failed, Denied, Interrupted)):
            name = result.name
            i = _index(graph, name)
            j = i - offset
            if j < 0 or not (running >> j) & 1:
                raise _not_in_flight(name, f"{type(result).__name__.lower()} result")
            running ^= 1 << j
            in_flight -= 1
            again = True  # not done: the step goes back among the ready
            if isinstance(result, Failed):
                attempt = inc.tries.get(name, 0) + 1
                error_type, message = type(result.error).__qualname__, str(result.error)
                previous = inc.failures.get(name)
                attempts = (previous.attempts if previous else 0) + 1
                inc = _replace(
                    inc,
                    failures=MappingProxyType(
                        {**inc.failures, name: FailureRecord(error_type, message, attempts)}
                    ),
                    tries=MappingProxyType({**inc.tries, name: attempt}),
                )
                policy = limits.policies.get(name, NO_RETRY)
                again = inc.halt is None and policy.retries(result.error, attempt)
                if again:
                    delay = policy.delay(attempt)
                    inc = _replace(inc, delays=MappingProxyType({**inc.delays, name: delay}))
                    events.append(
                        StepRetried(name, attempt, error_type, message, delay, result.duration)
                    )
                else:
                    events.append(StepFailed(name, attempt, error_type, message, result.duration))
                    inc = _replace(
                        inc,
                        errors=(*inc.errors, (name, result.error)),
                        halt=inc.halt or Halt("failed", name, f"{error_type}: {message}"),
                    )
            elif isinstance(result, Denied):
                events.append(StepDenied(name, result.reason))
                if inc.halt is None:
                    inc = _replace(inc, halt=Halt("denied", name, result.reason))
            else:
                events.append(StepInterrupted(name))
            if again:
                ready |= 1 << j
        elif isinstance(result, Cancelled):
            if inc.halt is None:
                inc = _replace(inc, halt=Halt("cancelled", reason=result.reason))
        else:
            raise ValueError(f"cannot fold {type(result).__name__} {result!r} into a state")

    batch = _EMPTY
    if start_next:
        batch = _choose(graph, limits, offset, ready, in_flight, inc)
        for start in batch.starts:
            name = start.name
            bit = 1 << (index[name] - offset)
            ready ^= bit
            running |= bit
            in_flight += 1
            if record_events:
                events.append(StepStarted(name, start.attempt, start.delay))
            if name in inc.delays:
                inc = _without_delay(inc, name)

    outcome = outcome_of(completed, total, in_flight, inc)
    if outcome is not None and not state.settled:
        events.append(RunFinished(outcome, completed, total, cost))
    both = ready | running
    if both and not both & 1:  # re-anchor the window at its lowest bit
        low = (both & -both).bit_length() - 1
        offset, ready, running = offset + low, ready >> low, running >> low
    new = State(
        spec, outputs, step_usage, completed, cost, offset, ready, running, in_flight, inc,
        tuple(events) if record_events else (),
    )
    return new, batch


def _started(name: str, inc: Incidents) -> StepStarted:
    return StepStarted(name, inc.tries.get(name, 0) + 1, inc.delays.get(name, 0.0))


def _without_delay(inc: Incidents, name: str) -> Incidents:
    return _replace(inc, delays=MappingProxyType({k: v for k, v in inc.delays.items() if k != name}))
