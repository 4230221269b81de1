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

Both functions are pure: the input state is never changed, and the same
inputs always give the same state and the same ``state.events``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
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
from ekit_core.policy import NO_RETRY
from ekit_core.results import Cancelled, Denied, Failed, Interrupted, Result, Start, Succeeded
from ekit_core.state import Halt, State, bit_indices

__all__ = ["Batch", "apply", "plan"]


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


def plan(state: State) -> Batch:
    """The steps to start now.

    Every dependency done, not done or in flight already, the run not
    halted, within ``max_concurrency``; lowest declaration index first.
    Hand the batch (or any prefix of it) back to :func:`apply` once started.
    """
    if state.halt is not None or not state.ready:
        return _EMPTY
    limit = state.limits.max_concurrency
    room = None if limit is None else limit - state.running_count
    if room is not None and room <= 0:
        return _EMPTY
    names = state.graph.names
    tries, delays = state.tries, state.delays
    starts = []
    for i in bit_indices(state.ready, room):
        name = names[i]
        starts.append(Start(name, tries.get(name, 0) + 1, delays.get(name, 0.0)))
    return Batch(tuple(starts))


def _error_text(error: BaseException) -> tuple[str, str]:
    return type(error).__qualname__, str(error)


def apply(state: State, results: Iterable[Result]) -> State:
    """Fold ``results`` into ``state``, in order, and return the new state.

    Raises ``ValueError`` for a result that does not fit the state (a start
    of a step that is not ready, an outcome of a step that is not in flight,
    an unknown step or result type); ``state`` is unchanged then too.
    """
    graph = state.graph
    index, names, deps, dependents = graph.index, graph.names, graph.deps, graph.dependents
    limits = state.limits
    outputs, step_usage = state.outputs, state.step_usage
    completed, cost = state.completed, state.cost
    ready, running, running_count = state.ready, state.running, state.running_count
    failures, tries, delays = state.failures, state.tries, state.delays
    halt, errors = state.halt, state.errors
    total = len(names)
    events: list[Event] = []

    def bit_of(name: str) -> int:
        i = index.get(name)
        if i is None:
            raise ValueError(f"unknown step {name!r}")
        return 1 << i

    def in_flight(name: str, what: str) -> int:
        bit = bit_of(name)
        if not running & bit:
            raise ValueError(f"{what} for step {name!r}, which is not in flight")
        return bit

    for result in results:
        if isinstance(result, Start):
            name = result.name
            bit = bit_of(name)
            if halt is not None:
                raise ValueError(f"cannot start step {name!r}: the run is halted ({halt.kind})")
            if not ready & bit:
                raise ValueError(f"cannot start step {name!r}: it is not ready")
            if limits.max_concurrency is not None and running_count >= limits.max_concurrency:
                raise ValueError(
                    f"cannot start step {name!r}: {running_count} steps in flight "
                    f"is the max_concurrency"
                )
            ready ^= bit
            running |= bit
            running_count += 1
            delay = delays.get(name, 0.0)
            if name in delays:
                delays = MappingProxyType({k: v for k, v in delays.items() if k != name})
            events.append(StepStarted(name, tries.get(name, 0) + 1, delay))
        elif isinstance(result, Succeeded):
            name = result.name
            bit = in_flight(name, "success reported")
            running ^= bit
            running_count -= 1
            outputs = outputs.with_item(name, result.output)
            step_usage = step_usage.with_item(name, result.usage)
            completed += 1
            cost = cost + result.usage
            events.append(
                StepFinished(name, tries.get(name, 0) + 1, result.usage, result.duration)
            )
            for child in dependents[name]:
                if child not in outputs and all(d in outputs for d in deps[child]):
                    ready |= 1 << index[child]
            if (
                halt is None
                and limits.budget is not None
                and completed < total
                and limits.budget.reached(cost)
            ):
                halt = Halt("budget_exceeded", reason=f"usage {cost} reached budget {limits.budget}")
        elif isinstance(result, Failed):
            name = result.name
            bit = in_flight(name, "failure reported")
            running ^= bit
            running_count -= 1
            attempt = tries.get(name, 0) + 1
            tries = MappingProxyType({**tries, name: attempt})
            error_type, message = _error_text(result.error)
            previous = failures.get(name)
            failures = MappingProxyType(
                {
                    **failures,
                    name: FailureRecord(
                        error_type, message, (previous.attempts if previous else 0) + 1
                    ),
                }
            )
            policy = limits.policies.get(name, NO_RETRY)
            if halt is None and policy.retries(result.error, attempt):
                delay = policy.delay(attempt)
                ready |= bit
                delays = MappingProxyType({**delays, name: delay})
                events.append(
                    StepRetried(name, attempt, error_type, message, delay, result.duration)
                )
            else:
                errors = (*errors, (name, result.error))
                events.append(StepFailed(name, attempt, error_type, message, result.duration))
                if halt is None:
                    halt = Halt("failed", name, f"{error_type}: {message}")
        elif isinstance(result, Denied):
            name = result.name
            bit = in_flight(name, "denial reported")
            running ^= bit
            running_count -= 1
            ready |= bit
            events.append(StepDenied(name, result.reason))
            if halt is None:
                halt = Halt("denied", name, result.reason)
        elif isinstance(result, Interrupted):
            name = result.name
            bit = in_flight(name, "interruption reported")
            running ^= bit
            running_count -= 1
            ready |= bit
            events.append(StepInterrupted(name))
        elif isinstance(result, Cancelled):
            if halt is None:
                halt = Halt("cancelled", reason=result.reason)
        else:
            raise ValueError(f"apply() cannot fold {type(result).__name__} {result!r}")

    new = State(
        graph=graph,
        limits=limits,
        context=state.context,
        outputs=outputs,
        step_usage=step_usage,
        completed=completed,
        cost=cost,
        ready=ready,
        running=running,
        running_count=running_count,
        failures=failures,
        tries=tries,
        delays=delays,
        halt=halt,
        errors=errors,
        events=(),
    )
    outcome = new.outcome
    if outcome is not None and not state.settled:
        events.append(RunFinished(outcome, completed, total, cost))
    object.__setattr__(new, "events", tuple(events))
    return new
