"""The scheduling rules: every decision that makes or changes a run's state.

This module owns the state machine; each rule is one plain function here.

Theory of operation
-------------------
A :class:`~ekit_core.State` is a frozen value. A transition (:func:`apply`,
:func:`advance`) copies it once into a working copy (``_Run``), folds each
input into that copy with the rule the table below names for the input's
kind, then, for :func:`advance` only, starts what :func:`plan` would
(``_launch``), and freezes the copy once into the new state, deciding how the
run ended (``_freeze``, :func:`outcome_of`). Nothing else changes a state,
and the state before is never touched: the same inputs always give the same
state and the same ``state.events``.

The table (``RULES``), input -> rule -> what it changes:

=============== ================ ===================================================
``Succeeded``   ``_succeeded``   running -> recorded; dependents counted down, ready
                                 at zero (``_count_down``); a reached budget halts
``Start``       ``_start``       ready -> running, if ready, not halted, with room
``Began``       ``_began``       a gated attempt began: its ``StepStarted`` now
``Failed``      ``_failed``      retried by its policy (running -> ready) unless the
                                 run is halting; else it halts the run, or only its
                                 branch when the run isolates failures
``Denied``      ``_denied``      running -> ready; halts the run ("denied")
``Interrupted`` ``_interrupted`` running -> ready
``Cancelled``   ``_cancelled``   halts the run ("cancelled")
=============== ================ ===================================================

Around the table:

- the first state of a run, fresh or resumed (:func:`initial_state`): which
  arguments are valid, what a checkpoint restores, what is ready at once;
- a step is ready when all its dependencies are recorded
  (:func:`dependencies_recorded`; the fold keeps a count instead);
- what starts (:func:`plan`, ``_choose``): ready steps in declaration order,
  at most ``max_concurrency`` in flight, nothing once the run is halted; a
  retry waits out its delay and a first attempt asks approval when the run
  has it (a gated attempt); a halt withdraws gated attempts
  (``Batch.withdraw``);
- an attempt starts one way, ``_begin_attempts``, whether the shell hands a
  ``Start`` back or :func:`advance` starts it;
- halting (a final failure, a denial, a budget, a cancellation) starts
  nothing more; in-flight steps still finish and their outputs are kept;
- how a run ended (:func:`outcome_of`).

The ready and running steps are a bit window over declaration indices,
and :mod:`ekit_core.window` owns it: its representation, why it exists (a
transition touches integers as wide as the frontier, not the graph) and
every operation on it. The rules here call those operations by name; the
few written inline on the hot path of every step say which one they inline,
and the window module lists them and says why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace as _replace
from types import MappingProxyType
from typing import Any

from ekit_core import window
from ekit_core._frozen import batch, first_start, state_of_run
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
    Batch,
    Began,
    Cancelled,
    Denied,
    Failed,
    Input,
    Interrupted,
    Start,
    Succeeded,
)
from ekit_core.rewind import outdated_steps, without
from ekit_core.state import (
    Halt,
    Outcome,
    RunLimits,
    RunSpec,
    Setbacks,
    State,
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
    completed: int, total: int, in_flight: int, ready: int, setbacks: Setbacks
) -> Outcome | None:
    """How a run with these counts has ended, or ``None`` while it has not.

    A run that isolates failures ends ``"failed"`` once nothing is in flight
    or ready: what is left waits on a failed step.
    """
    if in_flight:
        return None
    if completed < total and setbacks.halt is None and (ready or not setbacks.errors):
        return None
    if setbacks.errors:
        return "failed"
    if completed == total or setbacks.halt is None:
        return "finished"
    return setbacks.halt.kind


# -- the first state -------------------------------------------------------------


def _check_limits(
    graph: GraphSpec,
    max_concurrency: int | None,
    budget: TokenUsage | None,
    policies: Mapping[str, RetryPolicy] | None,
    approval: bool,
    isolate_failures: bool,
) -> RunLimits:
    if not isinstance(graph, GraphSpec):
        raise ValueError(f"graph must be a GraphSpec, got {type(graph).__name__}")
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
    return RunLimits(
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
) -> tuple[list[int], dict[str, int], int, Mapping[str, tuple[str, ...]]]:
    """The steps ready at once (declaration indices), the countdowns of joins
    partly recorded, how many steps are recorded, and the dependents the fold reads."""
    ready: list[int] = []
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
                ready.append(i)
            continue
        missing = sum(1 for d in parents if d not in outputs)
        if not missing:
            ready.append(i)
        elif missing < len(parents):
            waiting[name] = missing
    done = len(graph) - len(pending)
    # A fresh run reads the graph's own dependents (built once per graph);
    # a resume only those among the steps it may run.
    return ready, waiting, done, graph.dependents_among(pending) if done else graph.dependents


def _recorded_halt(limits: RunLimits, checkpoint: WorkflowCheckpoint, left: int) -> Halt | None:
    """A budget the recorded usage reaches halts the run at once, if ``left`` steps remain."""
    if limits.budget is not None and limits.budget.reached(checkpoint.cost) and left:
        return Halt("budget_exceeded", reason="usage recorded in the checkpoint reaches the budget")
    return None


def _ledgers(checkpoint: WorkflowCheckpoint) -> tuple[Ledger[str, Any], Ledger[str, TokenUsage]]:
    """The ledgers a run starts from: the recorded outputs, and the usage of those steps."""
    # Membership is asked of the checkpoint's own mapping (a dict's lookup,
    # one per step), not of the ledger built from it.
    recorded = checkpoint.outputs
    usage = [(k, u) for k, u in checkpoint.step_usage.items() if k in recorded]
    return Ledger(recorded), Ledger(usage)


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
    limits = _check_limits(graph, max_concurrency, budget, policies, approval, isolate_failures)
    new_context = _check_context(graph, context if context is not None else {}, "initial_context")
    checkpoint = resume_checkpoint(graph, resume_from, allow_graph_change=allow_graph_change)
    tags = _check_versions(graph, versions)
    outdated = _outdated(graph, checkpoint, tags)
    checkpoint = without(checkpoint, graph, outdated)
    merged = _check_context(graph, checkpoint.context, "context") | new_context
    outputs, step_usage = _ledgers(checkpoint)
    first, waiting, done, dependents = _first_ready(graph, checkpoint.outputs)
    offset, ready = window.start(first)
    halt = _recorded_halt(limits, checkpoint, len(graph) - done)
    setbacks = Setbacks(failures=checkpoint.failures, halt=halt)
    outcome = outcome_of(done, len(graph), 0, ready, setbacks)
    events = (_first_events(graph, checkpoint.outputs, outdated, outcome, checkpoint.cost)
              if record_events else ())
    return State(
        RunSpec(graph, limits, MappingProxyType(merged), tags, dependents), outputs, step_usage,
        completed=done, cost=checkpoint.cost, setbacks=setbacks, events=events, outcome=outcome,
        _offset=offset, _ready=ready, _running=0, _in_flight=0, _waiting=MappingProxyType(waiting),
    )


# -- the working copy ------------------------------------------------------------


class _Run:
    """The working copy of one transition: a state's fields, edited in place by the rules.

    Made once per fold from the state before (:func:`_thaw`), frozen once at
    its end (:func:`_freeze`) by :func:`ekit_core._frozen.state_of_run`, which
    reads each field by its name here (the state's, less a leading
    underscore). ``offset``, ``ready`` and ``running`` are the state's bit
    window (:mod:`ekit_core.window`); on a window too wide to edit bit by
    bit, finished steps wait in ``done`` and newly ready ones in ``fresh``
    until :meth:`settle` applies them with one mask each. ``waiting`` is the
    state's mapping until first written, then a dict of the fold's own.
    """

    __slots__ = (
        "before",
        "completed",
        "cost",
        "done",
        "events",
        "fresh",
        "in_flight",
        "offset",
        "outputs",
        "ready",
        "record",
        "running",
        "setbacks",
        "spec",
        "step_usage",
        "waiting",
    )

    before: State
    spec: RunSpec
    record: bool
    outputs: Ledger[str, Any]
    step_usage: Ledger[str, TokenUsage]
    completed: int
    cost: TokenUsage
    setbacks: Setbacks
    offset: int
    ready: int
    running: int
    in_flight: int
    waiting: Mapping[str, int]
    events: list[Event]
    done: list[int]
    fresh: list[int]

    def bit(self, name: str) -> int:
        """The window index of step ``name`` (negative below the window), pending bits applied."""
        i = self.spec.graph.index.get(name)
        if i is None:
            raise TransitionError(f"unknown step {name!r}")
        if self.done or self.fresh:
            self.settle()
        return i - self.offset

    def settle(self) -> None:
        """Take ``done`` off the running set and add ``fresh`` to the ready set.

        One :func:`~ekit_core.window.mask` each, not one operation per step.
        A step reported done that was not in flight is a :class:`TransitionError`.
        """
        done, fresh, offset = self.done, self.fresh, self.offset
        if done:
            running = window.take(self.running, done, offset)
            if running < 0:
                names, running = self.spec.graph.names, self.running
                raise _not_in_flight(next(
                    names[i] for i in done if not window.has(running, i - offset)))
            self.running = running
            done.clear()
        if fresh:
            low = min(fresh)
            if low < offset or not (self.ready or self.running):
                self.offset, self.ready, self.running = window.fit(
                    offset, self.ready, self.running, low)
            self.ready = window.put(self.ready, fresh, self.offset)
            fresh.clear()

    def end_attempt(self, name: str, what: str) -> int:
        """Take ``name`` off the running set; its bit index, to put it back among the ready."""
        j = self.bit(name)
        if not window.has(self.running, j):
            raise TransitionError(f"{what} for step {name!r}, which is not in flight")
        self.running = window.remove(self.running, window.bit(j))
        self.in_flight -= 1
        if name in self.setbacks.gated:
            self.setbacks = _replace(self.setbacks, gated=_without(self.setbacks.gated, name))
        return j

    def halt(self, halt: Halt) -> None:
        """Stop starting steps, for the first reason given."""
        if self.setbacks.halt is None:
            self.setbacks = _replace(self.setbacks, halt=halt)

    def counts(self) -> dict[str, int]:
        """The unfinished-dependency counts, as the fold's own dict (copied on first write)."""
        waiting = self.waiting
        if type(waiting) is not dict:
            waiting = self.waiting = dict(waiting)
        return waiting


def _thaw(state: State, record: bool) -> _Run:
    """The working copy of ``state`` (built without ``__init__``: one per transition)."""
    w = _new(_Run)
    w.before, w.spec, w.record = state, state.spec, record
    w.outputs, w.step_usage = state.outputs, state.step_usage
    w.completed, w.cost, w.setbacks = state.completed, state.cost, state.setbacks
    w.offset, w.ready, w.running = state._offset, state._ready, state._running
    w.in_flight, w.waiting = state._in_flight, state._waiting
    w.events, w.done, w.fresh = [], [], []
    return w


_new = object.__new__


# -- the rules, one per input ------------------------------------------------------


def _succeeded(w: _Run, item: Succeeded) -> None:
    """Record the output; count down the dependents, ready at zero; a reached budget halts."""
    name = item.name  # the hot path of every run: plain int and dict operations
    spec = w.spec
    index = spec.graph.index
    i = index.get(name)
    if i is None:
        raise TransitionError(f"unknown step {name!r}")
    running = w.running
    if running < window.NARROW:  # narrow: change it in place (inlined, see ekit_core.window)
        j = i - w.offset
        if j < 0 or not (running >> j) & 1:  # window.has
            raise _not_in_flight(name)
        w.running = running ^ (1 << j)  # window.remove(running, window.bit(j))
    else:
        w.done.append(i)
    try:
        outputs = w.outputs = w.outputs.with_item(name, item.output)
    except ValueError:  # recorded already: reported twice in one fold
        raise _not_in_flight(name) from None
    w.in_flight -= 1
    w.completed += 1
    usage = item.usage
    if usage.input_tokens or usage.output_tokens or usage.llm_calls:  # else no entry
        w.step_usage, w.cost = w.step_usage.with_item(name, usage), w.cost + usage
    if w.record:
        w.events.append(StepFinished(name, w.setbacks.tries.get(name, 0) + 1, usage, item.duration))
    children = spec.dependents[name]
    if children:
        _count_down(w, children, outputs, index)
    budget = spec.limits.budget
    if budget is not None and w.setbacks.halt is None and w.completed < len(spec.graph.names) \
            and budget.reached(w.cost):
        w.halt(Halt("budget_exceeded", reason=f"usage reached {budget}"))


def _count_down(
    w: _Run, children: tuple[str, ...], outputs: Ledger[str, Any], index: Mapping[str, int]
) -> None:
    """:func:`dependencies_recorded`, as a countdown: a join over n parents stays O(n)."""
    deps = w.spec.graph.deps
    for child in children:
        if child in outputs:  # recorded before a dependency was added
            continue
        parents = len(deps[child])
        if parents > 1:
            waiting = w.counts()
            left = waiting.pop(child, parents) - 1
            if left:
                waiting[child] = left
                continue
        k = index[child]
        ready, offset = w.ready, w.offset
        if not (ready or w.running):  # an empty window moves to the child
            w.offset, w.ready = k, 1
        elif ready < window.NARROW and offset <= k < offset + window.WIDTH:
            w.ready = ready | 1 << (k - offset)  # window.add(ready, window.bit(...)), inlined
        else:
            w.fresh.append(k)


def _start(w: _Run, start: Start) -> None:
    """A start the shell made itself: the step must be ready, the run not halted, room left."""
    name = start.name
    j = w.bit(name)
    if w.setbacks.halt is not None:
        raise TransitionError(f"cannot start step {name!r}: the run is halted ({w.setbacks.halt.kind})")
    if not window.has(w.ready, j):
        raise TransitionError(f"cannot start step {name!r}: it is not ready")
    limit = w.spec.limits.max_concurrency
    if limit is not None and w.in_flight >= limit:
        raise TransitionError(f"cannot start step {name!r}: max_concurrency={limit} in flight")
    _begin_attempts(w, (start,), window.bit(j))


def _began(w: _Run, began: Began) -> None:
    """A gated attempt ended its wait: only now has it started."""
    name = began.name
    j = w.bit(name)
    gated = w.setbacks.gated
    if not window.has(w.running, j) or name not in gated:
        raise TransitionError(f"attempt of step {name!r} began, but it is not a gated attempt in flight")
    w.setbacks = _replace(w.setbacks, gated=_without(gated, name))
    w.events.append(StepStarted(name, w.setbacks.tries.get(name, 0) + 1, gated[name]))


def _failed(w: _Run, failed: Failed) -> None:
    """Retried by the step's policy unless the run is halting; else it halts the run (or its branch)."""
    name = failed.name
    j = w.end_attempt(name, "failed result")
    inc = w.setbacks
    attempt = inc.tries.get(name, 0) + 1
    error_type, message = describe_error(failed.error)
    previous = inc.failures.get(name)
    record = FailureRecord(error_type, message, (previous.attempts if previous else 0) + 1)
    inc = _replace(
        inc,
        failures=MappingProxyType({**inc.failures, name: record}),
        tries=MappingProxyType({**inc.tries, name: attempt}),
    )
    policy = w.spec.limits.policies.get(name, NO_RETRY)
    if inc.halt is None and policy.retries(failed.error, attempt):
        delay = policy.delay(attempt)
        w.setbacks = _replace(inc, delays=MappingProxyType({**inc.delays, name: delay}))
        w.events.append(StepRetried(name, attempt, error_type, message, delay, failed.duration))
        w.ready = window.add(w.ready, window.bit(j))
        return
    w.events.append(StepFailed(name, attempt, error_type, message, failed.duration))
    w.setbacks = _replace(inc, errors=(*inc.errors, (name, failed.error)))
    if not w.spec.limits.isolate_failures:  # else only what depends on it waits, forever
        w.halt(Halt("failed", name, f"{error_type}: {message}"))


def _denied(w: _Run, denied: Denied) -> None:
    """A refused approval halts the run; the step is not done: a resume asks again."""
    j = w.end_attempt(denied.name, "denied result")
    reason = storable_text(str(denied.reason))
    w.events.append(StepDenied(denied.name, reason))
    w.halt(Halt("denied", denied.name, reason))
    w.ready = window.add(w.ready, window.bit(j))


def _interrupted(w: _Run, interrupted: Interrupted) -> None:
    """A cancelled attempt: the step is ready again."""
    j = w.end_attempt(interrupted.name, "interrupted result")
    w.events.append(StepInterrupted(interrupted.name))
    w.ready = window.add(w.ready, window.bit(j))


def _cancelled(w: _Run, cancelled: Cancelled) -> None:
    """The run is cancelled: start nothing more."""
    w.halt(Halt("cancelled", reason=cancelled.reason))


RULES: Mapping[type, Callable[[_Run, Any], None]] = MappingProxyType({
    Succeeded: _succeeded,
    Start: _start,
    Began: _began,
    Failed: _failed,
    Denied: _denied,
    Interrupted: _interrupted,
    Cancelled: _cancelled,
})
"""The table of the fold: each kind of input, and the rule that folds it in (see the top)."""


def _rule_of(item: object) -> Callable[[_Run, Any], None]:
    """The rule of an input of a subclass of an input type (the table is keyed by exact type)."""
    for kind, rule in RULES.items():
        if isinstance(item, kind):
            return rule
    raise TransitionError(f"cannot fold {type(item).__name__} {item!r} into a state")


# -- starting attempts: plan, and the one way an attempt starts ----------------------


def _choose(graph: GraphSpec, limits: RunLimits, offset: int, ready: int, in_flight: int,
            inc: Setbacks) -> tuple[Start, ...]:
    """The starts :func:`plan` chooses: lowest ready bits first, within ``max_concurrency``."""
    if inc.halt is not None or not ready:
        return ()
    room = None
    if limits.max_concurrency is not None:
        room = limits.max_concurrency - in_flight
        if room <= 0:
            return ()
    names, tries, delays, gate = graph.names, inc.tries, inc.delays, limits.approval
    # One ready step, the whole batch of a chain: window.only_one and
    # window.single, inlined (see ekit_core.window).
    if not ready & (ready - 1) and not gate:
        name = names[offset + ready.bit_length() - 1]
        if name not in tries and name not in delays:
            return (first_start(name),)
        return (Start(name, tries.get(name, 0) + 1, delays.get(name, 0.0)),)
    if not (tries or delays or gate):  # plain first attempts: a fan-out's batch
        return tuple([first_start(names[offset + i]) for i in window.indices(ready, room)])
    starts = []
    for i in window.indices(ready, room):
        name = names[offset + i]
        attempt = tries.get(name, 0) + 1
        starts.append(Start(name, attempt, delays.get(name, 0.0), gate and attempt == 1))
    return tuple(starts)


def _begin_attempts(w: _Run, starts: tuple[Start, ...], chosen: int) -> None:
    """Start ``starts``, whose bits are ``chosen``: the one way an attempt starts.

    Ready becomes running with one mask, not one operation per start on
    integers as wide as the batch (``window.remove`` and ``window.add``,
    inlined: see :mod:`ekit_core.window`); each attempt's retry delay is used up, and
    a gated attempt is held as such (its ``StepStarted`` waits for ``Began``).
    """
    w.ready ^= chosen  # window.remove
    w.running |= chosen  # window.add
    w.in_flight += len(starts)
    inc, record = w.setbacks, w.record
    if not (record or inc.delays or w.spec.limits.approval):
        return
    for start in starts:
        name = start.name
        if name in inc.delays:
            inc = _replace(inc, delays=_without(inc.delays, name))
        if start.gated:
            inc = _replace(inc, gated=MappingProxyType({**inc.gated, name: start.delay}))
        elif record:
            w.events.append(StepStarted(name, start.attempt, start.delay))
    w.setbacks = inc


def _launch(w: _Run) -> Batch:
    """What :func:`advance` adds to :func:`apply`: start what :func:`plan` would."""
    if w.done or w.fresh:
        w.settle()
    starts = _choose(w.spec.graph, w.spec.limits, w.offset, w.ready, w.in_flight, w.setbacks)
    if starts:
        # _choose takes the lowest ready bits: those up to the last start's
        # (window.only_one, inlined for a chain's step, then window.through).
        ready = w.ready
        if ready & (ready - 1):
            ready = window.through(ready, w.spec.graph.index[starts[-1].name] - w.offset)
        _begin_attempts(w, starts, ready)
    if w.setbacks.gated and w.setbacks.halt is not None:
        return Batch(starts, _withdrawn(w.setbacks))
    return batch(starts) if starts else _EMPTY


def _withdrawn(inc: Setbacks) -> tuple[str, ...]:
    return tuple(inc.gated) if inc.halt is not None and inc.gated else ()


def plan(state: State) -> Batch:
    """What to do now: the steps to start, and the gated attempts a halt withdraws.

    Every dependency done, not done or in flight already, the run not
    halted, within ``max_concurrency``; lowest declaration index first.
    Hand the starts (or any prefix of them) back to :func:`apply` once started.
    """
    inc = state.setbacks
    starts = _choose(state.spec.graph, state.spec.limits, state._offset, state._ready,
                     state._in_flight, inc)
    withdraw = _withdrawn(inc)
    return Batch(starts, withdraw) if starts or withdraw else _EMPTY


# -- the transition: thaw, fold, freeze ------------------------------------------------


def apply(state: State, inputs: Iterable[Input]) -> State:
    """Fold ``inputs`` into ``state``, in order, and return the new state.

    Raises :class:`~ekit_core.TransitionError` (a ``ValueError``) for an
    input that does not fit the state (a start of a step that is not ready,
    the end of an attempt of a step that is not in flight, an unknown step or input
    type); ``state`` is unchanged then too.
    """
    return _freeze(_fold(state, inputs, True))


def advance(
    state: State, inputs: Iterable[Input] = (), *, record_events: bool = True
) -> tuple[State, Batch]:
    """Fold ``inputs`` in, then start what :func:`plan` chooses, in one transition.

    Equivalent to ``s = apply(state, inputs); b = plan(s); return apply(s, b.starts), b``
    but builds one state instead of two: the shell's loop calls this once
    per group of completions. With ``record_events=False`` the new state's
    ``events`` is empty, which saves building event objects nobody will read.
    """
    w = _fold(state, inputs, record_events)
    batch = _launch(w)
    return _freeze(w), batch


def _fold(state: State, inputs: Iterable[Input], record: bool) -> _Run:
    """The working copy of ``state`` with every input folded in by its rule in :data:`RULES`."""
    w = _thaw(state, record)
    rules = RULES
    for item in inputs:
        rule = rules.get(type(item))
        (rule or _rule_of(item))(w, item)
    return w


def _freeze(w: _Run) -> State:
    """The state a fold ends in: pending bits applied, its outcome decided, frozen.

    The copy is anchored (its window, its countdowns read-only) and handed
    over whole: :func:`~ekit_core._frozen.state_of_run` reads its fields by name.
    """
    if w.done or w.fresh:
        w.settle()
    outcome = None
    if not w.in_flight:  # else the run goes on: no need to ask
        total = len(w.spec.graph.names)
        outcome = outcome_of(w.completed, total, 0, w.ready, w.setbacks)
        if outcome is not None and not w.before.settled:
            w.events.append(RunSettled(outcome, w.completed, total, w.cost))
    w.offset, w.ready, w.running = window.anchor(w.offset, w.ready, w.running)
    if type(w.waiting) is dict:  # the fold's own countdowns: frozen read-only
        w.waiting = MappingProxyType(w.waiting)
    return state_of_run(w, tuple(w.events) if w.record else (), outcome)


# -- helpers -------------------------------------------------------------------------


def _not_in_flight(name: str) -> TransitionError:
    return TransitionError(f"success reported for step {name!r}, which is not in flight")


def _without(table: Mapping[str, Any], name: str) -> MappingProxyType[str, Any]:
    return MappingProxyType({k: v for k, v in table.items() if k != name})
