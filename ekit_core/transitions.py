"""The scheduling rules: every decision that makes or changes a run's state.

This module owns the state machine. Each rule lives in one function here:

- the first state of a run, fresh or resumed (:func:`initial_state`): which
  arguments are valid, what a checkpoint restores, what is ready at once;
- a step is ready when all its dependencies are recorded
  (:func:`dependencies_recorded`; the fold keeps a count instead);
- ready steps start in declaration order, at most ``max_concurrency`` in
  flight, nothing once the run is halted (:func:`plan`);
- an attempt is gated when it must wait out a retry delay or ask for
  approval (asked on a step's first attempt in a run); it has begun only
  once the shell reports :class:`~ekit_core.Began`, and a halt withdraws
  gated attempts (``Batch.withdraw``);
- a failure is retried when the step's policy says so, unless the run is
  halting (:func:`_failed`); a denial, a failure that will not be retried
  (unless the run isolates failures: then only its dependents wait), a
  reached budget and a cancellation halt the run; in-flight steps still
  finish and their outputs are kept;
- how a run ended (:func:`outcome_of`).

All functions are pure: the input state is never changed, and the same
inputs always give the same state and the same ``state.events``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from dataclasses import replace as _replace
from types import MappingProxyType
from typing import Any, cast

from ekit_core._fast import twin
from ekit_core.checkpoint import (
    CheckpointError,
    FailureRecord,
    WorkflowCheckpoint,
    describe_error,
    storable_text,
)
from ekit_core.compat import GraphMismatchError, graph_changes, recorded_from
from ekit_core.errors import TransitionError
from ekit_core.events import (
    Event,
    RunSettled,
    RunStarted,
    StepDenied,
    StepFailed,
    StepFinished,
    StepInterrupted,
    StepOutdated,
    StepRetried,
    StepSkipped,
    StepStarted,
)
from ekit_core.graph import GraphSpec
from ekit_core.ledger import Ledger
from ekit_core.policy import NO_RETRY, RetryPolicy
from ekit_core.results import (
    Began,
    Cancelled,
    Denied,
    Failed,
    Input,
    Interrupted,
    Start,
    Succeeded,
    first_start,
)
from ekit_core.rewind import outdated_steps, without
from ekit_core.state import (
    Halt,
    Incidents,
    Limits,
    Outcome,
    RunSpec,
    State,
    bit_indices,
    make_state,
)
from ekit_core.usage import TokenUsage

__all__ = [
    "Batch",
    "advance",
    "apply",
    "context_outputs",
    "dependencies_recorded",
    "initial_state",
    "outcome_of",
    "plan",
    "resume_checkpoint",
]


@dataclass(frozen=True, slots=True)
class Batch:
    """What the shell does next: ``starts`` in declaration order, and ``withdraw``.

    ``withdraw`` names gated attempts of a halted run (still waiting out a
    retry delay or an approval): the shell cancels them and reports each as
    :class:`~ekit_core.Interrupted`.
    """

    starts: tuple[Start, ...] = ()
    withdraw: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.starts)

    def __iter__(self) -> Iterator[Start]:
        return iter(self.starts)

    @property
    def names(self) -> tuple[str, ...]:
        """The names of the steps to start."""
        return tuple(s.name for s in self.starts)


_EMPTY = Batch()


# -- rules shared with audit and replay ----------------------------------------


def dependencies_recorded(graph: GraphSpec, outputs: Mapping[str, Any], name: str) -> bool:
    """The readiness rule: is every dependency of step ``name`` recorded in ``outputs``?

    The fold keeps a count of unfinished dependencies instead of calling this
    (a join over n parents stays O(n)); the property tests check the two agree.
    """
    return all(d in outputs for d in graph.deps[name])


def context_outputs(graph: GraphSpec, outputs: Mapping[str, Any]) -> dict[str, Any]:
    """ExecutionKit's rule: recorded outputs that are not steps were the run's context."""
    return {k: v for k, v in outputs.items() if k not in graph.index}


def outcome_of(
    completed: int, total: int, in_flight: int, ready: int, incidents: Incidents
) -> Outcome | None:
    """How a run with these counts has ended, or ``None`` while it has not.

    A run that isolates failures ends ``"failed"`` once nothing is in flight
    or ready: what is left waits on a failed step.
    """
    if in_flight:
        return None
    if completed < total and incidents.halt is None and (ready or not incidents.errors):
        return None
    if incidents.errors:
        return "failed"
    if completed == total or incidents.halt is None:
        return "finished"
    return incidents.halt.kind


# -- the first state -------------------------------------------------------------


def _check_limits(
    graph: GraphSpec,
    max_concurrency: int | None,
    budget: TokenUsage | None,
    policies: Mapping[str, RetryPolicy] | None,
    approval: bool,
    isolate_failures: bool,
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
    return Limits(
        max_concurrency, budget, MappingProxyType(checked), bool(approval), bool(isolate_failures)
    )


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


def resume_checkpoint(
    graph: GraphSpec, resume_from: object, *, allow_graph_change: bool = False
) -> WorkflowCheckpoint:
    """What ``resume_from`` says was recorded, checked against ``graph``: the one loading path.

    ``None`` is an empty checkpoint; a dict is parsed with
    :meth:`WorkflowCheckpoint.from_dict`. A checkpoint of another graph
    raises :class:`~ekit_core.GraphMismatchError` unless ``allow_graph_change``.
    """
    if resume_from is None:
        return WorkflowCheckpoint(0, MappingProxyType({}))
    if isinstance(resume_from, WorkflowCheckpoint):
        checkpoint = resume_from
    elif isinstance(resume_from, Mapping):
        checkpoint = WorkflowCheckpoint.from_dict(dict(resume_from))
    else:
        hint = " (pass store.load(), not the store)" if callable(getattr(resume_from, "load", None)) else ""
        raise ValueError(
            f"resume_from must be a WorkflowCheckpoint or its dict, got "
            f"{type(resume_from).__name__}{hint}"
        )
    if not allow_graph_change:
        changes = graph_changes(graph, checkpoint)
        if changes is not None:
            raise GraphMismatchError(changes)
    return checkpoint


def _first_events(
    graph: GraphSpec, outputs: Mapping[str, Any], outdated: Mapping[str, str],
    outcome: Outcome | None, cost: TokenUsage,
) -> tuple[Event, ...]:
    # One StepSkipped per recorded step: built only for someone to read them.
    recorded = [n for n in graph.names if n in outputs]
    total = len(graph)
    events: list[Event] = [RunStarted(total, len(recorded))]
    events.extend(StepOutdated(n, why) for n, why in outdated.items())
    events.extend(StepSkipped(n) for n in recorded)
    if outcome is not None:
        events.append(RunSettled(outcome, len(recorded), total, cost))
    return tuple(events)


def _check_versions(graph: GraphSpec, versions: Mapping[str, str] | None) -> MappingProxyType[str, str]:
    checked: dict[str, str] = {}
    for name, tag in (versions or {}).items():
        if name not in graph.index:
            raise ValueError(f"version given for unknown step {name!r}")
        if not isinstance(tag, str):
            raise ValueError(f"version of step {name!r} must be a string, got {type(tag).__name__}")
        checked[name] = tag
    return MappingProxyType(checked)


def _outdated(
    graph: GraphSpec, checkpoint: WorkflowCheckpoint, versions: Mapping[str, str]
) -> dict[str, str]:
    # The common resume (no tags, same graph) pays nothing for the rule.
    same_graph = recorded_from(graph, checkpoint) or checkpoint.graph is None
    if same_graph and not versions and not checkpoint.versions:
        return {}
    return outdated_steps(graph, checkpoint, versions)


def _first_ready(
    graph: GraphSpec, outputs: Mapping[str, Any]
) -> tuple[int, dict[str, int], int, Mapping[str, tuple[str, ...]]]:
    """The steps ready at once (as bits), the countdowns of joins partly
    recorded, how many steps are recorded, and the dependents the fold reads."""
    ready = 0
    waiting: dict[str, int] = {}
    pending: list[str] = []
    deps = graph.deps
    for i, name in enumerate(graph.names):
        if name in outputs:
            continue
        pending.append(name)
        parents = deps[name]
        if len(parents) < 2:  # most steps: no generator needed
            if not parents or parents[0] in outputs:
                ready |= 1 << i
            continue
        missing = sum(1 for d in parents if d not in outputs)
        if not missing:
            ready |= 1 << i
        elif missing < len(parents):
            waiting[name] = missing
    done = len(graph) - len(pending)
    # A fresh run reads the graph's own dependents (built once per graph);
    # a resume only those among the steps it may run.
    return ready, waiting, done, graph.dependents_among(pending) if done else graph.dependents


def initial_state(
    graph: GraphSpec,
    resume_from: WorkflowCheckpoint | Mapping[str, Any] | None = None,
    *,
    context: Mapping[str, Any] | None = None,
    max_concurrency: int | None = None,
    budget: TokenUsage | None = None,
    policies: Mapping[str, RetryPolicy] | None = None,
    allow_graph_change: bool = False,
    approval: bool = False,
    isolate_failures: bool = False,
    versions: Mapping[str, str] | None = None,
    record_events: bool = True,
) -> State:
    """The first state of a run, fresh or resumed from a checkpoint.

    A resumed run restores the checkpoint's outputs, usage, failures and
    context verbatim; the steps counted as done are exactly those with a
    recorded output. ``context`` is merged over the recorded context (its
    keys win). ``approval`` says that the run asks an approval callback
    before each step's first attempt. ``isolate_failures`` keeps a failure
    (after its retries) in its branch: only the steps that depend on it
    wait, the rest of the run goes on, and the run ends ``"failed"``.
    ``versions`` holds the steps' version tags: a recorded step whose tag
    (or, with ``allow_graph_change``, whose dependencies) changed runs again,
    with everything downstream of it (``StepOutdated`` events say why).
    With ``record_events=False`` the state's ``events`` is empty, as with
    :func:`advance`. Every argument is checked here, before any step could
    run: a bad one raises ``ValueError`` naming it.
    """
    if not isinstance(graph, GraphSpec):
        raise ValueError(f"graph must be a GraphSpec, got {type(graph).__name__}")
    limits = _check_limits(graph, max_concurrency, budget, policies, approval, isolate_failures)
    new_context = _check_context(graph, context if context is not None else {}, "initial_context")
    checkpoint = resume_checkpoint(graph, resume_from, allow_graph_change=allow_graph_change)
    tags = _check_versions(graph, versions)
    outdated = _outdated(graph, checkpoint, tags)
    checkpoint = without(checkpoint, graph, outdated)
    merged = _check_context(graph, checkpoint.context, "context") | new_context
    # Membership is asked of the checkpoint's own mapping (a dict's lookup,
    # one per step), not of the ledger built from it.
    recorded_outputs = checkpoint.outputs
    outputs: Ledger[str, Any] = Ledger(recorded_outputs)
    step_usage: Ledger[str, TokenUsage] = Ledger(
        [(k, u) for k, u in checkpoint.step_usage.items() if k in recorded_outputs]
    )
    ready, waiting, done, dependents = _first_ready(graph, recorded_outputs)
    offset = (ready & -ready).bit_length() - 1 if ready else 0
    halt = None
    if limits.budget is not None and limits.budget.reached(checkpoint.cost) and done < len(graph):
        halt = Halt("budget_exceeded", reason="usage recorded in the checkpoint reaches the budget")
    incidents = Incidents(failures=checkpoint.failures, halt=halt)
    outcome = outcome_of(done, len(graph), 0, ready, incidents)
    events = (_first_events(graph, recorded_outputs, outdated, outcome, checkpoint.cost)
              if record_events else ())
    return State(
        RunSpec(graph, limits, MappingProxyType(merged), tags, dependents), outputs, step_usage,
        done, checkpoint.cost, incidents, events, outcome, offset, ready >> offset, 0, 0,
        MappingProxyType(waiting),
    )


# -- plan: what starts -----------------------------------------------------------


def _choose(graph: GraphSpec, limits: Limits, offset: int, ready: int, in_flight: int,
            inc: Incidents) -> tuple[Start, ...]:
    if inc.halt is not None or not ready:
        return ()
    room = None
    if limits.max_concurrency is not None:
        room = limits.max_concurrency - in_flight
        if room <= 0:
            return ()
    names, tries, delays, gate = graph.names, inc.tries, inc.delays, limits.approval
    if not ready & (ready - 1) and not gate:  # one ready step: the whole batch of a chain
        name = names[offset + ready.bit_length() - 1]
        return (Start(name, tries.get(name, 0) + 1, delays.get(name, 0.0)),)
    if not (tries or delays or gate):  # plain first attempts: a fan-out's batch
        return tuple([first_start(names[offset + i]) for i in bit_indices(ready, room)])
    starts = []
    for i in bit_indices(ready, room):
        name = names[offset + i]
        attempt = tries.get(name, 0) + 1
        starts.append(Start(name, attempt, delays.get(name, 0.0), gate and attempt == 1))
    return tuple(starts)


def _first_batch(name: str) -> Batch:
    """``Batch((Start(name),))``, built through a twin class: a chain makes one per step."""
    batch = _BatchDraft()
    batch.starts = (first_start(name),)
    batch.withdraw = ()
    batch.__class__ = Batch
    return cast(Batch, batch)


_BatchDraft = twin(Batch)


def _withdrawn(inc: Incidents) -> tuple[str, ...]:
    return tuple(inc.gated) if inc.halt is not None and inc.gated else ()


def plan(state: State) -> Batch:
    """What to do now: the steps to start, and the gated attempts a halt withdraws.

    Every dependency done, not done or in flight already, the run not
    halted, within ``max_concurrency``; lowest declaration index first.
    Hand the starts (or any prefix of them) back to :func:`apply` once started.
    """
    inc = state.incidents
    starts = _choose(state.spec.graph, state.spec.limits, state._offset, state._ready,
                     state._in_flight, inc)
    withdraw = _withdrawn(inc)
    return Batch(starts, withdraw) if starts or withdraw else _EMPTY


# -- apply: folding inputs in ------------------------------------------------------


def apply(state: State, inputs: Iterable[Input]) -> State:
    """Fold ``inputs`` into ``state``, in order, and return the new state.

    Raises :class:`~ekit_core.TransitionError` (a ``ValueError``) for an
    input that does not fit the state (a start of a step that is not ready,
    an outcome of a step that is not in flight, an unknown step or input
    type); ``state`` is unchanged then too.
    """
    return _fold(state, inputs, False, True)[0]


def advance(
    state: State, inputs: Iterable[Input] = (), *, record_events: bool = True
) -> tuple[State, Batch]:
    """Fold ``inputs`` in, then start what :func:`plan` chooses, in one transition.

    Equivalent to ``s = apply(state, inputs); b = plan(s); return apply(s, b.starts), b``
    but builds one state instead of two: the shell's loop calls this once
    per group of completions. With ``record_events=False`` the new state's
    ``events`` is empty, which saves building event objects nobody will read.
    """
    return _fold(state, inputs, True, record_events)


class _Draft:
    """The parts of a state a rare input changes, edited in place during one fold."""

    __slots__ = ("events", "in_flight", "inc", "offset", "ready", "running", "spec")

    def __init__(self, spec: RunSpec, offset: int, ready: int, running: int, in_flight: int,
                 inc: Incidents, events: list[Event]) -> None:
        self.spec, self.offset, self.ready, self.running = spec, offset, ready, running
        self.in_flight, self.inc, self.events = in_flight, inc, events

    def bit(self, name: str) -> int:
        i = self.spec.graph.index.get(name)
        if i is None:
            raise TransitionError(f"unknown step {name!r}")
        return i - self.offset

    def end_attempt(self, name: str, what: str) -> int:
        """Take ``name`` off the running set; its bit index, to put it back among the ready."""
        j = self.bit(name)
        if j < 0 or not (self.running >> j) & 1:
            raise TransitionError(f"{what} for step {name!r}, which is not in flight")
        self.running ^= 1 << j
        self.in_flight -= 1
        if name in self.inc.gated:
            self.inc = _replace(self.inc, gated=_without(self.inc.gated, name))
        return j

    def halt(self, halt: Halt) -> None:
        if self.inc.halt is None:
            self.inc = _replace(self.inc, halt=halt)


def _start(d: _Draft, start: Start) -> None:
    name = start.name
    j = d.bit(name)
    if d.inc.halt is not None:
        raise TransitionError(f"cannot start step {name!r}: the run is halted ({d.inc.halt.kind})")
    if j < 0 or not (d.ready >> j) & 1:
        raise TransitionError(f"cannot start step {name!r}: it is not ready")
    limit = d.spec.limits.max_concurrency
    if limit is not None and d.in_flight >= limit:
        raise TransitionError(f"cannot start step {name!r}: max_concurrency={limit} in flight")
    d.ready ^= 1 << j
    d.running |= 1 << j
    d.in_flight += 1
    _launched(d, start, record=True)


def _launched(d: _Draft, start: Start, *, record: bool) -> None:
    """Book-keeping for an attempt that was just started (by :func:`_start` or the fused path)."""
    name, inc = start.name, d.inc
    if name in inc.delays:
        inc = _replace(inc, delays=_without(inc.delays, name))
    if start.gated:
        inc = _replace(inc, gated=MappingProxyType({**inc.gated, name: start.delay}))
    elif record:
        d.events.append(StepStarted(name, start.attempt, start.delay))
    d.inc = inc


def _began(d: _Draft, began: Began) -> None:
    name = began.name
    j = d.bit(name)
    if j < 0 or not (d.running >> j) & 1 or name not in d.inc.gated:
        raise TransitionError(f"attempt of step {name!r} began, but it is not a gated attempt in flight")
    delay = d.inc.gated[name]
    d.inc = _replace(d.inc, gated=_without(d.inc.gated, name))
    d.events.append(StepStarted(name, d.inc.tries.get(name, 0) + 1, delay))


def _failed(d: _Draft, failed: Failed) -> None:
    name = failed.name
    j = d.end_attempt(name, "failed result")
    inc = d.inc
    attempt = inc.tries.get(name, 0) + 1
    error_type, message = describe_error(failed.error)
    previous = inc.failures.get(name)
    record = FailureRecord(error_type, message, (previous.attempts if previous else 0) + 1)
    inc = _replace(
        inc,
        failures=MappingProxyType({**inc.failures, name: record}),
        tries=MappingProxyType({**inc.tries, name: attempt}),
    )
    policy = d.spec.limits.policies.get(name, NO_RETRY)
    if inc.halt is None and policy.retries(failed.error, attempt):
        delay = policy.delay(attempt)
        d.inc = _replace(inc, delays=MappingProxyType({**inc.delays, name: delay}))
        d.events.append(StepRetried(name, attempt, error_type, message, delay, failed.duration))
        d.ready |= 1 << j
        return
    d.events.append(StepFailed(name, attempt, error_type, message, failed.duration))
    d.inc = _replace(inc, errors=(*inc.errors, (name, failed.error)))
    if not d.spec.limits.isolate_failures:  # else only what depends on it waits, forever
        d.halt(Halt("failed", name, f"{error_type}: {message}"))


def _denied(d: _Draft, denied: Denied) -> None:
    j = d.end_attempt(denied.name, "denied result")
    reason = storable_text(str(denied.reason))
    d.events.append(StepDenied(denied.name, reason))
    d.halt(Halt("denied", denied.name, reason))
    d.ready |= 1 << j  # not done: a resume asks again


def _interrupted(d: _Draft, interrupted: Interrupted) -> None:
    j = d.end_attempt(interrupted.name, "interrupted result")
    d.events.append(StepInterrupted(interrupted.name))
    d.ready |= 1 << j


def _cancelled(d: _Draft, cancelled: Cancelled) -> None:
    d.halt(Halt("cancelled", reason=cancelled.reason))


_RARE: dict[type, Callable[[_Draft, Any], None]] = {
    Start: _start,
    Began: _began,
    Failed: _failed,
    Denied: _denied,
    Interrupted: _interrupted,
    Cancelled: _cancelled,
}
"""How each input other than a success changes the state (successes are the hot path)."""


def _rare(item: object) -> Callable[[_Draft, Any], None]:
    handler = _RARE.get(type(item))
    if handler is None:
        handler = next((h for t, h in _RARE.items() if isinstance(item, t)), None)
        if handler is None:
            raise TransitionError(f"cannot fold {type(item).__name__} {item!r} into a state")
    return handler


def _fold_rare(
    item: object, d: _Draft, done: list[int], fresh: list[int]
) -> tuple[int, int, int, int, Incidents]:
    """Fold one input other than a success (after the pending ones); the window and incidents it leaves."""
    d.offset, d.ready, d.running = _settle(d.spec.graph, d.offset, d.ready, d.running, done, fresh)
    _rare(item)(d, item)
    return d.offset, d.ready, d.running, d.in_flight, d.inc


def _fit(offset: int, ready: int, running: int, i: int) -> tuple[int, int, int]:
    """Move the bit window so that step index ``i`` falls inside it.

    An empty window simply moves to ``i``; an index below it widens the
    window downwards.
    """
    if not (ready or running):
        return i, 0, 0
    if i < offset:
        shift = offset - i
        return i, ready << shift, running << shift
    return offset, ready, running


def _fold(
    state: State, inputs: Iterable[Input], start_next: bool, record_events: bool
) -> tuple[State, Batch]:
    spec, graph, budget = state.spec, state.spec.graph, state.spec.limits.budget
    index, deps, dependents, total = graph.index, graph.deps, spec.dependents, len(graph.names)
    outputs, step_usage, completed, cost = state.outputs, state.step_usage, state.completed, state.cost
    offset, ready, running, in_flight = state._offset, state._ready, state._running, state._in_flight
    inc, events = state.incidents, cast(list[Event], [])
    waiting: dict[str, int] | None = None  # copied from the state on first write
    done: list[int] = []  # finished, and made ready: for _settle
    fresh: list[int] = []
    for item in inputs:
        if type(item) is not Succeeded and not isinstance(item, Succeeded):
            offset, ready, running, in_flight, inc = _fold_rare(
                item, _Draft(spec, offset, ready, running, in_flight, inc, events), done, fresh)
            continue
        name = item.name  # the hot path of every run: plain int and dict operations
        i = index.get(name)
        if i is None:
            raise TransitionError(f"unknown step {name!r}")
        if running < _NARROW:  # a window of a few hundred bits: change it in place
            j = i - offset
            if j < 0 or not (running >> j) & 1:
                raise _not_in_flight(name)
            running ^= 1 << j
        else:
            done.append(i)
        try:
            outputs = outputs.with_item(name, item.output)
        except ValueError:  # recorded already: reported twice in one fold
            raise _not_in_flight(name) from None
        in_flight, completed, usage = in_flight - 1, completed + 1, item.usage
        if usage.input_tokens or usage.output_tokens or usage.llm_calls:  # else no entry
            step_usage, cost = step_usage.with_item(name, usage), cost + usage
        if record_events:
            events.append(StepFinished(name, inc.tries.get(name, 0) + 1, usage, item.duration))
        for child in dependents[name]:
            if child in outputs:  # recorded before a dependency was added
                continue
            parents = len(deps[child])
            if parents > 1:  # dependencies_recorded(), as a countdown: a join stays O(n)
                waiting = dict(state._waiting) if waiting is None else waiting
                left = waiting.pop(child, parents) - 1
                if left:
                    waiting[child] = left
                    continue
            k = index[child]
            if not (ready or running):  # an empty window moves to the child
                offset, ready = k, 1
            elif ready < _NARROW and offset <= k < offset + 256:
                ready |= 1 << (k - offset)
            else:
                fresh.append(k)
        if budget is not None and inc.halt is None and completed < total and budget.reached(cost):
            inc = _replace(inc, halt=Halt("budget_exceeded", reason=f"usage reached {budget}"))
    if done or fresh:
        offset, ready, running = _settle(graph, offset, ready, running, done, fresh)
    counts = state._waiting if waiting is None else MappingProxyType(waiting)
    return _conclude(state, spec, offset, ready, running, in_flight, inc, events, outputs,
                     step_usage, completed, cost, counts, start_next, record_events)


def _conclude(
    before: State, spec: RunSpec, offset: int, ready: int, running: int, in_flight: int,
    inc: Incidents, events: list[Event], outputs: Ledger[str, Any],
    step_usage: Ledger[str, TokenUsage], completed: int, cost: TokenUsage,
    waiting: MappingProxyType[str, int], start_next: bool, record_events: bool,
) -> tuple[State, Batch]:
    """The end of a fold: start what :func:`plan` would (if asked), then close the state."""
    if start_next and ready and not ready & (ready - 1):
        chain = _start_only(spec, offset, ready, running, in_flight, inc, events, outputs,
                            step_usage, completed, cost, waiting, record_events)
        if chain is not None:
            return chain
    d = _Draft(spec, offset, ready, running, in_flight, inc, events)
    batch = _launch(d, record_events) if start_next else _EMPTY  # what plan() would start
    return _close(before, d, outputs, step_usage, completed, cost, waiting, record_events), batch


def _not_in_flight(name: str) -> TransitionError:
    return TransitionError(f"success reported for step {name!r}, which is not in flight")


_NARROW = 1 << 256  # below it, an int's operations cost about as much as a call


def _settle(
    graph: GraphSpec, offset: int, ready: int, running: int, done: list[int], fresh: list[int]
) -> tuple[int, int, int]:
    """Take the ``done`` steps off the running set and add the ``fresh`` ones to the ready set.

    One mask each, not one operation per step: an operation on an int costs
    its width, and a fan-out's window is as wide as the fan-out. Empties both
    lists. A step reported done that was not in flight is a :class:`TransitionError`.
    """
    if done:
        finished = _mask(done, offset) if min(done) >= offset else -1
        if finished < 0 or running & finished != finished:
            name = next(graph.names[i] for i in done if i < offset or not (running >> (i - offset)) & 1)
            raise _not_in_flight(name)
        running ^= finished
        done.clear()
    if fresh:
        low = min(fresh)
        if low < offset or not (ready or running):
            offset, ready, running = _fit(offset, ready, running, low)
        ready |= _mask(fresh, offset)
        fresh.clear()
    return offset, ready, running


def _mask(indices: list[int], offset: int) -> int:
    """The int with bit ``i - offset`` set for each ``i`` in ``indices`` (all >= ``offset``)."""
    if len(indices) <= 4:
        mask = 0
        for i in indices:
            mask |= 1 << (i - offset)
        return mask
    bits = bytearray(((max(indices) - offset) >> 3) + 1)
    for i in indices:
        j = i - offset
        bits[j >> 3] |= 1 << (j & 7)
    return int.from_bytes(bits, "little")


def _start_only(
    spec: RunSpec, offset: int, ready: int, running: int, in_flight: int, inc: Incidents,
    events: list[Event], outputs: Ledger[str, Any], step_usage: Ledger[str, TokenUsage],
    completed: int, cost: TokenUsage, waiting: MappingProxyType[str, int], record_events: bool,
) -> tuple[State, Batch] | None:
    """The fused path when exactly one step is ready (every step of a chain), or ``None``.

    What :func:`_launch` and :func:`_close` would do, on the fold's own
    values, with the batch of a plain first attempt built through twins (_first_batch).
    """
    limits = spec.limits
    if inc.halt is not None or limits.approval or limits.max_concurrency is not None:
        return None
    name = spec.graph.names[offset + ready.bit_length() - 1]
    if name in inc.tries:  # a retry: its delay and attempt number are _launch's
        return None
    if record_events:
        events.append(StepStarted(name, 1, 0.0))
    offset, ready, running = _anchor(offset, 0, running | ready)
    new = make_state(
        spec, outputs, step_usage, completed, cost, inc,
        tuple(events) if record_events else (), None, offset, ready, running, in_flight + 1,
        waiting,
    )
    return new, _first_batch(name)


def _close(
    before: State, d: _Draft, outputs: Ledger[str, Any], step_usage: Ledger[str, TokenUsage],
    completed: int, cost: TokenUsage, waiting: MappingProxyType[str, int], record_events: bool,
) -> State:
    """The state a fold ends in: its outcome decided, its window re-anchored, frozen."""
    total = len(d.spec.graph.names)
    outcome = outcome_of(completed, total, d.in_flight, d.ready, d.inc)
    if outcome is not None and not before.settled:
        d.events.append(RunSettled(outcome, completed, total, cost))
    offset, ready, running = _anchor(d.offset, d.ready, d.running)
    return make_state(
        d.spec, outputs, step_usage, completed, cost, d.inc,
        tuple(d.events) if record_events else (), outcome, offset, ready, running, d.in_flight,
        waiting,
    )


def _launch(d: _Draft, record_events: bool) -> Batch:
    """The fused half of :func:`advance`: choose the starts and mark them running."""
    starts = _choose(d.spec.graph, d.spec.limits, d.offset, d.ready, d.in_flight, d.inc)
    if starts:
        # _choose takes the lowest ready bits: mark them running with one
        # mask, not one operation per start on integers as wide as the batch.
        last = d.spec.graph.index[starts[-1].name] - d.offset
        chosen = d.ready & ((2 << last) - 1)
        d.ready ^= chosen
        d.running |= chosen
        d.in_flight += len(starts)
        if record_events or d.inc.delays or d.spec.limits.approval:
            for start in starts:
                _launched(d, start, record=record_events)
    withdraw = _withdrawn(d.inc)
    return Batch(starts, withdraw) if starts or withdraw else _EMPTY


def _anchor(offset: int, ready: int, running: int) -> tuple[int, int, int]:
    """Re-anchor the bit window at its lowest set bit, keeping the integers narrow."""
    both = ready | running
    if both and not both & 1:
        low = (both & -both).bit_length() - 1
        return offset + low, ready >> low, running >> low
    return offset, ready, running


def _without(table: Mapping[str, Any], name: str) -> MappingProxyType[str, Any]:
    return MappingProxyType({k: v for k, v in table.items() if k != name})
