"""The scheduling rules: every decision that makes or changes a run's state.

This module owns the state machine; each rule is one plain function here.

Theory of operation
-------------------
A :class:`~ekit_core.State` is a frozen value. A transition (:func:`apply`,
:func:`advance`) copies it once into a working copy (``_Run``), folds each
input into that copy by its row of the table below (its step's phase and
its kind), then, for :func:`advance` only, starts what :func:`plan` would
(``_launch``), and freezes the copy once into the new state, deciding how the
run ended (``_freeze``, :func:`outcome_of`). Nothing else changes a state,
and the state before is never touched: the same inputs always give the same
state and the same ``state.events``.

The table (:data:`TRANSITIONS`) is keyed by a step's phase and an input:
every step and item is in one :class:`~ekit_core.phases.Phase`, read from
the storage below by :func:`~ekit_core.phases.phase_of`, and each row says
the phases the input may move it to and the effect (a function here) that
moves it. ``_fold`` reads the phase of each input's step, looks its row up
and runs the effect; a (phase, input) pair with no row is a
:class:`~ekit_core.TransitionError` naming the step, its phase and the
input. Besides the shell's inputs (``Start``, ``Began``, ``Succeeded``,
``Failed``, ``Denied``, ``Interrupted``, ``Asked``, ``Skipped``,
``Cancelled``), the table has the fold's own triggers
(:class:`~ekit_core.phases.Trigger`): what moves *other* steps when one
changes. A dependency recorded counts its dependents down, ready at zero
(``_count_down``); an output that steps map over, recorded, expands them
into items (``_expand``: the graph grows); items settled collect their
mapped step (``_item_settled``, ``_collect``); a skip passes to every step
that needs the skipped one, except a join over alternatives
(``join="any"``), which runs once every dependency is settled if any ran
(``_skip``, ``_join_any``); a halt withdraws gated attempts
(``_withdrawn``). :data:`~ekit_core.phases.RESUMES` says what a resume
restores each phase to. docs/concepts.md shows both tables, rendered from
these (``python -m tools.phase_table``). A new rule is a row, an effect
function, and a line of what a resume restores.

For speed, the table is compiled into one entry per input type (``RULES``):
a success's entry is the effect of its running row itself, whose first test
(the step's bit, which it clears anyway) reads the phase of the hot path;
any other phase takes the general lookup. A graph without shapes pays one
check per success for the shape rules.

Around the table:

- the first state of a run, fresh or resumed (:func:`initial_state`): which
  arguments are valid, what a checkpoint restores, what is ready at once;
- a step is ready when all its dependencies are recorded
  (:func:`dependencies_recorded`; the fold keeps a count instead);
- what starts (:func:`plan`, ``_choose``): ready steps in declaration order,
  at most ``max_concurrency`` in flight, nothing once the run is halted; a
  retry waits out its delay and a first attempt asks its step's condition
  when it has one and approval when the run has it, in the order
  ``Start.gates`` gives the shell (a gated attempt: its ``StepStarted``
  waits for ``Began``); a halt withdraws gated attempts (``Batch.withdraw``);
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
from typing import Any, cast

from ekit_core import appending, window
from ekit_core._frozen import twin
from ekit_core.appending import grown_table, with_one
from ekit_core.checkpoint import (
    CheckpointError,
    DriveRecord,
    FailureRecord,
    Timings,
    WorkflowCheckpoint,
    _begun,
    _held_table,
    _timed,
    check_began,
    check_durations,
    describe_error,
    storable_text,
)
from ekit_core.children import parent_of
from ekit_core.claims import check_claims, check_collections
from ekit_core.code import code_changed
from ekit_core.compat import GraphMismatchError, graph_changes, recorded_from, reshaped_steps
from ekit_core.errors import TransitionError
from ekit_core.events import (
    Event,
    RunSettled,
    RunStarted,
    StepDenied,
    StepExpanded,
    StepFailed,
    StepFinished,
    StepInterrupted,
    StepOutdated,
    StepRetried,
    StepSkipped,
    StepStarted,
    StepWaiting,
)
from ekit_core.exchanges import NO_EXCHANGES, Exchange, denial_of
from ekit_core.exchanges import pending as waiting_on
from ekit_core.expansion import (
    NO_NESTING,
    Expanded,
    Expansion,
    ItemRef,
    LoopError,
    MapError,
    Nesting,
    bodies_of,
    body_iteration,
    body_maps,
    child_items,
    children_per_item,
    collected,
    expand,
    expanders,
    grown_expansion,
    item_input,
    item_ref,
    items_compacted,
    iterating,
    iteration_of,
    loops_of,
    same_encoding,
)
from ekit_core.graph import GraphSpec, grown_graph
from ekit_core.ledger import Ledger
from ekit_core.numbers import check_number
from ekit_core.phases import Phase, Row, Trigger, _reading
from ekit_core.policy import NO_RETRY, RetryPolicy
from ekit_core.results import (
    APPROVAL,
    Asked,
    Batch,
    Began,
    Cancelled,
    Denied,
    Ended,
    Failed,
    HeldSucceeded,
    Input,
    Interrupted,
    Skipped,
    Start,
    Succeeded,
    batch,
    first_start,
)
from ekit_core.rewind import (
    changed_steps,
    compacted_done,
    downstream,
    grown,
    keep_forced_skips,
    kept_unrecorded,
    outdated_steps,
    reached,
    redone_after,
    without,
    without_questions,
)
from ekit_core.selection import check_only, closure, held_chained, narrowed, selected, split
from ekit_core.shapes import item_name, items_of, iteration_name
from ekit_core.state import (
    NO_CODE,
    NO_SKIPS,
    Halt,
    Outcome,
    RunLimits,
    RunSpec,
    Setbacks,
    State,
    grown_spec,
)
from ekit_core.usage import NO_USAGE, TokenUsage, check_usage

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
    """ExecutionKit's rule: recorded outputs that are not steps were the run's context.

    Nor items: ``M[key]`` for a step ``M`` of ``graph`` that maps over
    another is an item of ``M`` (no step may be named so), whether or not
    this graph has grown by it yet; nor iterations, ``L#k`` for a loop ``L``.
    """
    index = graph.index
    mapped = tuple(f"{n}[" for n, s in graph.shapes.items() if s.map_over is not None)
    if mapped:  # (and the steps of a child per item: P/s[key])
        mapped += tuple(f"{n}[" for steps in children_per_item(graph).values() for n in steps)
    loops = iterating(graph) if graph.shapes else {}
    if not mapped and not loops:
        return {k: v for k, v in outputs.items() if k not in index}
    return {k: v for k, v in outputs.items()
            if k not in index and not (mapped and k.startswith(mapped) and k.endswith("]"))
            and not (loops and iteration_of(k.partition("[")[0], loops) is not None)}


def outcome_of(
    completed: int, total: int, in_flight: int, ready: int, setbacks: Setbacks
) -> Outcome | None:
    """How a run with these counts has ended, or ``None`` while it has not.

    A run that isolates failures ends ``"failed"`` once nothing is in flight
    or ready: what is left waits on a failed step. A run with nothing in
    flight or ready, no halt and no failure, in which a step waits for an
    answer, ends ``"waiting"`` (a halt or a failure says more, and wins).
    """
    if in_flight:
        return None
    if completed < total and setbacks.halt is None and (ready or not setbacks.errors):
        if not ready and setbacks.asked and waiting_on(setbacks.asked):
            return "waiting"
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
        check_usage(budget, "budget")  # a NaN count would never be reached: a budget never kept
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
        _check_numbers(checkpoint)  # (from_dict checks a dict's: a value skipped the parser)
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


def _check_numbers(checkpoint: WorkflowCheckpoint) -> None:
    """A checkpoint value's numbers are those ``from_dict`` requires of its dict: usage and
    attempts are counts, durations seconds (else the run's own later checkpoints are refused)."""
    check_usage(checkpoint.cost, "cost")
    for name, usage in checkpoint.step_usage.items():
        check_usage(usage, f"step_usage.{name}")
    for name, failure in checkpoint.failures.items():
        attempts = failure.attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 0:
            raise ValueError(f"failures.{name}.attempts must be an int >= 0, got {attempts!r:.80}")
    check_durations(checkpoint.durations)
    check_began(checkpoint.began)


def _first_events(
    graph: GraphSpec, outputs: Mapping[str, Any], outdated: Mapping[str, str],
    outcome: Outcome | None, cost: TokenUsage,
    asked: Mapping[str, tuple[Exchange, ...]] | None = None,
) -> tuple[Event, ...]:
    # One StepSkipped per recorded step: built only for someone to read them.
    recorded = [n for n in graph.names if n in outputs]
    total = len(graph)
    events: list[Event] = [RunStarted(total, len(recorded))]
    events.extend(StepOutdated(n, why) for n, why in outdated.items())
    events.extend(StepSkipped(n) for n in recorded)
    if asked:
        events.extend(_held_events(asked))
    if outcome is not None:
        events.append(RunSettled(outcome, len(recorded), total, cost))
    return tuple(events)


def _held_events(asked: Mapping[str, tuple[Exchange, ...]]) -> list[Event]:
    """What a resume announces of recorded questions: those waiting, and a denial."""
    events: list[Event] = [StepWaiting(n, q, len(asked[n])) for n, q in waiting_on(asked).items()]
    denied = denial_of(asked)
    if denied is not None:
        events.append(StepDenied(*denied))
    return events


def _held(graph: GraphSpec, checkpoint: WorkflowCheckpoint, first: list[int],
          items: bool) -> tuple[list[int], Halt | None]:
    """The steps ready at once less those waiting for an answer, and the halt a
    recorded denial makes (``None`` if none): read only when questions are recorded.

    A waiting step (or item) with an output, or (a declared step) whose
    dependencies are not all recorded (a join over alternatives: settled),
    contradicts its record: refused.
    """
    waiting = waiting_on(checkpoint.asked)
    index, outputs, skipped = graph.index, checkpoint.outputs, checkpoint.skipped
    for name in waiting:
        if name in outputs:
            raise CheckpointError("asked", f"records a question {name!r} waits on, and its output too")
        if name in index:
            shape = graph.shapes.get(name)
            joins_any = shape is not None and shape.join == "any"
            missing = [d for d in graph.deps[name] if d not in outputs and not (joins_any and d in skipped)]
            if missing:
                raise CheckpointError("asked", f"records a question {name!r} waits on, yet not the "
                                               f"output of {missing[0]!r}, which it needs")
        elif not items or ("[" not in name and "#" not in name):
            raise CheckpointError("asked", f"names {name!r}, which is no step of this run")
    held = {index[n] for n in waiting if n in index}
    denied = denial_of(checkpoint.asked)
    halt = None
    if denied is not None and denied[0] not in outputs:
        halt = Halt("denied", denied[0], storable_text(denied[1]))
    return ([i for i in first if i not in held] if held else first), halt


def _check_versions(graph: GraphSpec, versions: Mapping[str, str] | None) -> MappingProxyType[str, str]:
    checked: dict[str, str] = {}
    for name, tag in (versions or {}).items():
        if name not in graph.index:
            raise ValueError(f"version given for unknown step {name!r}")
        if not isinstance(tag, str):
            raise ValueError(f"version of step {name!r} must be a string, got {type(tag).__name__}")
        checked[name] = tag
    return MappingProxyType(checked)


def _check_code(graph: GraphSpec, code: Mapping[str, str] | None) -> MappingProxyType[str, str]:
    """The steps' code fingerprints, checked (a ValueError naming the step), or the shared empty."""
    if not code:
        return NO_CODE
    for name, print_ in code.items():
        if name not in graph.index:
            raise ValueError(f"code fingerprint given for unknown step {name!r}")
        if not isinstance(print_, str) or not print_:
            raise ValueError(f"code fingerprint of step {name!r} must be a non-empty string, "
                             f"got {print_!r:.80}")
    return MappingProxyType(dict(code))


def _check_kept(graph: GraphSpec, kept: Iterable[str]) -> tuple[str, ...]:
    """The steps whose changed code is kept, checked (a ValueError naming the step)."""
    if not kept:
        return ()
    if isinstance(kept, str):
        raise ValueError(f"code_kept must be step names, not one string {kept!r:.80}")
    names = tuple(kept)
    for name in names:
        if name not in graph.index:
            raise ValueError(f"code_kept names unknown step {name!r:.80}")
    return names


def _outdated(
    graph: GraphSpec, checkpoint: WorkflowCheckpoint, versions: Mapping[str, str], resumed: bool,
    code: Mapping[str, str] = MappingProxyType({}), kept: tuple[str, ...] = (),
) -> tuple[dict[str, str], frozenset[str]]:
    """The outdated steps, and what runs on changed work (:func:`changed_work`) if ``resumed``."""
    # The common resume (no tags, same graph) pays nothing for the rule.
    same_graph = recorded_from(graph, checkpoint) or checkpoint.graph is None
    if same_graph and not versions and not checkpoint.versions and not kept and not (
            code and checkpoint.code_fingerprints and checkpoint.code_fingerprints != code):
        return {}, _NO_NAMES
    touched = changed_work(graph, checkpoint, versions, code, kept) if resumed else _NO_NAMES
    return outdated_steps(graph, checkpoint, versions, code), touched


_NO_NAMES: frozenset[str] = frozenset()


def changed_work(graph: GraphSpec, checkpoint: WorkflowCheckpoint, versions: Mapping[str, str],
                 code: Mapping[str, str] | None = None, kept: Iterable[str] = ()
                 ) -> frozenset[str]:
    """What a resume runs on work that changed since ``checkpoint`` (a changed tag,
    dependencies or shape, and what is downstream: :func:`~ekit_core.rewind.reached`),
    recorded or not: those attempts get new numbers, and their questions are dropped
    (audit reads the same rule). ``code``: the steps' code fingerprints, as decided
    (:mod:`ekit_core.code`); ``kept``: the steps whose changed code a ``keep`` policy
    kept, whose unrecorded items and iterations run the new code all the same
    (:func:`~ekit_core.rewind.kept_unrecorded`)."""
    anew = kept_unrecorded(graph, checkpoint, kept) if kept else _NO_NAMES
    same_graph = recorded_from(graph, checkpoint) or checkpoint.graph is None
    if same_graph and not versions and not checkpoint.versions and not (
            code and checkpoint.code_fingerprints and checkpoint.code_fingerprints != code):
        return frozenset(anew)  # the common resume pays nothing for the rule
    roots = changed_steps(graph, checkpoint, versions, code)
    return frozenset(reached(graph, checkpoint, roots)).union(anew) if roots else frozenset(anew)


def _first_ready(
    graph: GraphSpec, outputs: Mapping[str, Any]
) -> tuple[list[int], dict[str, int], int, Mapping[str, tuple[str, ...]]]:
    """The steps ready at once (declaration indices), the countdowns of joins
    partly recorded, how many steps are recorded, and the dependents the fold reads."""
    deps = graph.deps
    if not outputs:  # a fresh run: its roots are ready, and no join is partly recorded
        return [i for i, name in enumerate(graph.names) if not deps[name]], {}, 0, graph.dependents
    ready: list[int] = []
    waiting: dict[str, int] = {}
    pending: list[str] = []
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


def _kept(table: Mapping[str, Any], drop: set[str] | frozenset[str]) -> MappingProxyType[str, Any]:
    return MappingProxyType({k: v for k, v in table.items() if k not in drop})


def _ledgers(checkpoint: WorkflowCheckpoint, graph: GraphSpec
             ) -> tuple[Ledger[str, Any], Ledger[str, TokenUsage], Timings]:
    """The ledgers a run starts from: the recorded outputs, and the usage and durations
    of those steps.

    A duration (or usage) of a step with no recorded output is dropped: a
    step rewound by hand. A duration naming no step or item of ``graph`` is
    a :class:`CheckpointError` naming it.
    """
    # Membership is asked of the checkpoint's own mapping (a dict's lookup,
    # one per step), not of the ledger built from it.
    recorded = checkpoint.outputs
    usage = [(k, u) for k, u in checkpoint.step_usage.items() if k in recorded]
    durations: Mapping[str, float] | None = checkpoint.durations  # (see Timings)
    if not durations:
        durations = None  # (no container under the run's timings: see Timings)
    elif not durations.keys() <= recorded.keys():  # (what a run writes: one C loop)
        _check_timed_names(graph, [k for k in durations if k not in recorded])
        durations = MappingProxyType({k: d for k, d in durations.items() if k in recorded})
    times: Timings = durations
    if durations and checkpoint.began:
        # When the recorded attempts began, as the run records it: four-field
        # tuples over the durations (O(timed) once per resume; see Timings),
        # five-field where a limit held the attempt (``held``).
        held = checkpoint.held
        for name, began in checkpoint.began.items():
            if name in durations:
                holds = held.get(name) if held else None
                times = (name, durations[name], times, began) if holds is None \
                    else (name, durations[name], times, began, holds)
    return Ledger(recorded), Ledger(usage), times


def _drives(recorded: tuple[DriveRecord, ...], drive: DriveRecord | None) -> tuple[DriveRecord, ...]:
    """The drives a run's checkpoints record: the recorded ones, then this run's (if given)."""
    if drive is None:
        return recorded
    if not isinstance(drive, DriveRecord) or not isinstance(drive.worker, str) or not drive.worker:
        raise ValueError(f"drive must be a DriveRecord naming its worker, got {drive!r:.80}")
    return (*recorded, drive)


def _check_timed_names(graph: GraphSpec, names: list[str]) -> None:
    """Refuse a duration naming no step of ``graph`` nor an item of one of its mapped steps."""
    mapped = tuple(f"{name}[" for name, shape in graph.shapes.items() if shape.map_over is not None)
    loops = dict.fromkeys(loops_of(graph))
    for name in names:
        if name not in graph.index and not (name.endswith("]") and name.startswith(mapped)) \
                and iteration_of(name, loops) is None:
            raise CheckpointError(f"durations.{name}", "names no step or item of the graph")


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
    run_id: str | None = None,
    only: object = None,
    durations: bool = False,
    code_fingerprints: Mapping[str, str] | None = None,
    drive: DriveRecord | None = None,
    code_kept: Iterable[str] = (),
) -> State:
    """The first state of a run, fresh or resumed from a checkpoint.

    A resumed run restores the checkpoint's outputs, usage, failures and context verbatim; the steps counted
    as done are exactly those with a recorded output. ``context`` is merged over the recorded context (its
    keys win). ``approval``: the run asks an approval callback before each step's first attempt.
    ``isolate_failures`` keeps a failure (after its retries) in its branch: only its dependents wait, the
    rest goes on, and the run ends ``"failed"``. ``versions`` holds the steps' version tags: a recorded step
    whose tag (or, with ``allow_graph_change``, whose dependencies) or whose code fingerprint
    (``code_fingerprints``: :mod:`ekit_core.code`) changed runs again, with everything downstream
    (``StepOutdated`` says why); ``code_kept`` names the steps whose changed code is kept (their recorded
    fingerprint in ``code_fingerprints``): their recorded outputs stand, what is not recorded runs under new
    attempt numbers. ``record_events=False``: no events; ``run_id`` seeds retries' jitter. ``only`` (step
    names) starts only those steps and what they need, and ends once they are recorded
    (:mod:`ekit_core.selection`). ``durations`` records each attempt's duration; ``drive`` joins the recorded
    ``drives``. Each argument is checked before any step runs (a ``ValueError`` names it)."""
    limits = _of_this_run(graph, _check_limits(graph, max_concurrency, budget, policies, approval,
                                               isolate_failures), run_id, only, durations)
    new_context = _check_context(graph, context if context is not None else {}, "initial_context")
    checkpoint = resume_checkpoint(graph, resume_from, allow_graph_change=allow_graph_change)
    check_claims(graph, checkpoint)
    tags, code = _check_versions(graph, versions), _check_code(graph, code_fingerprints)
    outdated, touched = _outdated(graph, checkpoint, tags, resume_from is not None, code,
                                  _check_kept(graph, code_kept))
    # Its dependents come from each path below (a whole index: an entry per recorded step).
    base = RunSpec(graph, limits, MappingProxyType(
        _check_context(graph, checkpoint.context, "context") | new_context), tags, _NOT_YET,
        code_fingerprints=code, drives=_drives(checkpoint.drives, drive))
    if graph.shapes:  # (it sets aside what an early cutoff may keep before dropping it)
        return _initial_shaped(graph, checkpoint, base, outdated, record_events, touched)
    return _initial_static(graph, checkpoint, base, outdated, record_events, touched)


def _of_this_run(graph: GraphSpec, limits: RunLimits, run_id: object, only: object,
                 durations: object = False) -> RunLimits:
    """``limits`` with the run's id (the jitter's seed: see ``_retry_wait``), the steps
    it may start (``only``: see :mod:`ekit_core.selection`) and whether it records
    durations, each checked; a run with none of them pays nothing here."""
    if durations is not False:
        if not isinstance(durations, bool):
            raise ValueError(f"durations must be True or False, got {durations!r:.80}")
        limits = _replace(limits, durations=durations)
    if run_id is not None:
        if not isinstance(run_id, str):
            raise ValueError(f"run_id must be None or a string, got {type(run_id).__name__}")
        limits = _replace(limits, run_id=run_id)
    if only is not None:
        limits = _replace(limits, only=closure(graph, check_only(graph, only)))
    return limits


_NOT_YET: Mapping[str, tuple[str, ...]] = MappingProxyType({})


def _initial_static(graph: GraphSpec, checkpoint: WorkflowCheckpoint, base: RunSpec,
                    outdated: Mapping[str, str], record_events: bool, touched: frozenset[str]
                    ) -> State:
    """:func:`initial_state` of a graph without run-time shapes (most runs)."""
    resumed = without_questions(without(checkpoint, graph, outdated), touched)
    base, checkpoint = _replace(base, redone=redone_after(checkpoint, resumed, touched)), resumed
    limits = base.limits
    outputs, step_usage, durations = _ledgers(checkpoint, graph)
    first, waiting, done, dependents = _first_ready(graph, checkpoint.outputs)
    held = 0
    if limits.only is not None:  # only the selection is ready, or made ready
        recorded = checkpoint.outputs
        first, kept, held = narrowed(tuple(graph.names), limits.only, first,
                                     [n for n in graph.names if n not in recorded])
        dependents = graph.dependents_among(kept)
    asked = checkpoint.asked
    denied = None
    if asked:  # steps that wait for an answer are not ready; a denial halts
        first, denied = _held(graph, checkpoint, first, False)
    offset, ready = window.start(first)
    halt = denied or _recorded_halt(limits, checkpoint, len(graph) - done - held)
    setbacks = Setbacks(failures=checkpoint.failures, halt=halt,
                        asked=asked if asked else NO_EXCHANGES)  # (one shared empty mapping)
    outcome = outcome_of(done, len(graph) - held, 0, ready, setbacks)
    events = (_first_events(graph, checkpoint.outputs, outdated, outcome, checkpoint.cost, asked)
              if record_events else ())
    if held and outcome is not None and events:  # settled at once: say what it leaves out
        events = (*events[:-1], _replace(cast(RunSettled, events[-1]), left_out=held))
    return State(
        _replace(base, dependents=dependents, held=held), outputs, step_usage,
        completed=done, cost=checkpoint.cost, setbacks=setbacks, events=events, outcome=outcome,
        _offset=offset, _ready=ready, _running=0, _in_flight=0, _waiting=MappingProxyType(waiting),
        _times=durations,
    )


def _initial_shaped(graph: GraphSpec, checkpoint: WorkflowCheckpoint, base: RunSpec,
                    outdated: Mapping[str, str], record: bool, touched: frozenset[str]) -> State:
    """:func:`initial_state` of a graph with run-time shapes: what is recorded expands again."""
    resumed = without_questions(kept_on_resume(graph, checkpoint, outdated, base.versions,
                                                base.code_fingerprints), touched)
    base, checkpoint = _replace(base, redone=redone_after(checkpoint, resumed, touched)), resumed
    skipped = checkpoint.skipped
    bodies, in_body, per_item, grown_later = _grown_later(graph)
    first, waiting, done, left = _first_ready_shaped(graph, checkpoint.outputs, skipped, grown_later)
    held = 0
    if base.limits.only is not None:  # only the selection is ready, or made ready
        first, left, held = narrowed(tuple(graph.names), base.limits.only, first, left)
    asked = checkpoint.asked
    denied = None
    if asked:  # steps and items that wait for an answer are not ready; a denial halts
        first, denied = _held(graph, checkpoint, first, True)
    offset, ready = window.start(first)
    spec = _replace(base, dependents=_lowered(graph, left, grown_later), declared=graph,
                    shaped=_first_expansion(graph, checkpoint, bodies, in_body, per_item), held=held)
    halt = denied or _recorded_halt(spec.limits, checkpoint, len(graph) - done - held)
    outputs, step_usage, durations = _ledgers(checkpoint, graph)
    setbacks = Setbacks(failures=checkpoint.failures, halt=halt, skipped=skipped,
                        asked=asked if asked else NO_EXCHANGES)
    first_state = State(
        spec, outputs, step_usage, completed=done, cost=checkpoint.cost, setbacks=setbacks,
        events=(), outcome=None, _offset=offset, _ready=ready, _running=0, _in_flight=0,
        _waiting=MappingProxyType(waiting), _times=durations,
    )
    w = _thaw(first_state, record)
    if record:
        w.events = list(_first_events(graph, checkpoint.outputs, outdated, None, checkpoint.cost,
                                      asked))
    loops = dict.fromkeys(loops_of(graph))
    for name in graph.names:
        if name in spec.shaped.expanders and name in outputs:  # type: ignore[union-attr]
            _expand(w, name)
        if name in spec.shaped.per_item_over and name in outputs:  # type: ignore[union-attr]
            _grow_children(w, name)
        if name in loops:
            _start_loop(w, name, checkpoint)
    _check_expansion(w, checkpoint)
    if record:
        w.events = _counted_at_start(w)
    ghosts = [n for n in waiting_on(asked) if n not in w.spec.graph.index] if asked else []
    if ghosts:
        raise CheckpointError("asked", f"records a question of {ghosts[0]!r}, which is no step "
                                       "or item of this run")
    return _freeze(w)


def _grown_later(graph: GraphSpec) -> tuple[dict[str, tuple[str, ...]], dict[str, str],
                                            dict[str, tuple[str, ...]], dict[str, str]]:
    """The loops' bodies and each body step's loop; the children per item and each of their
    steps' parent: never started themselves (they grow per iteration or per item)."""
    bodies = bodies_of(graph)
    in_body = {t: loop for loop, body in bodies.items() for t in body}
    per_item = children_per_item(graph)
    return bodies, in_body, per_item, {**in_body, **{t: p for p, ss in per_item.items() for t in ss}}


def _first_expansion(graph: GraphSpec, checkpoint: WorkflowCheckpoint,
                     bodies: dict[str, tuple[str, ...]], in_body: dict[str, str],
                     per_item: dict[str, tuple[str, ...]]) -> Expansion:
    """A shaped run's expansion before anything is expanded: what steps map over, what was
    set aside for an early cutoff, the loops' bodies (see ``bodies_of``) and the children
    per item (see ``children_per_item``)."""
    over: dict[str, tuple[str, ...]] = {}
    for parent in per_item:
        source = cast(str, graph.shapes[parent].map_over)
        over[source] = (*over.get(source, ()), parent)
    nesting = Nesting(MappingProxyType(bodies), MappingProxyType(in_body),
                      MappingProxyType(body_maps(graph) if bodies else {}),
                      MappingProxyType(per_item), MappingProxyType(over)) \
        if bodies or per_item else NO_NESTING
    return Expansion(expanders(graph), superseded=checkpoint.superseded, nesting=nesting)


def _counted_at_start(w: _Run) -> list[Event]:
    """A resume's first events, ``RunStarted`` counting what its expansions made (every item of
    a mapped step whose input is recorded, as ekit_core.progress counts the checkpoint) and
    those expansions marked as counted, so that a reader adding them up counts each once."""
    events: list[Event] = []
    for e in w.events:
        if type(e) is RunStarted:
            e = RunStarted(len(w.spec.graph.names), w.completed, len(w.setbacks.skipped))
        elif type(e) is StepExpanded:
            e = _replace(e, at_start=True)
        events.append(e)
    return events


def kept_on_resume(graph: GraphSpec, checkpoint: WorkflowCheckpoint, outdated: Mapping[str, str],
                   versions: Mapping[str, str], code: Mapping[str, str] | None = None
                   ) -> WorkflowCheckpoint:
    """What a resume of a shaped graph keeps of ``checkpoint`` (audit reads the same rule).

    The outdated outputs go (``outdated``: :func:`~ekit_core.rewind.outdated_steps`),
    with the items and skips that depend on them, some set aside for an
    early cutoff (``_set_aside``); the items of a skipped mapped step are let
    go (a run that expanded it before the skip records them, one that did
    not has none; neither expands it again).
    """
    checkpoint = _iterations_kept(graph, without(
        _set_aside(graph, checkpoint, outdated, versions, code or {}), graph, outdated))
    checkpoint = _without_stale_iterations(graph, checkpoint, outdated, versions)
    gone = tuple(f"{n}[" for n in checkpoint.skipped if n in graph.shapes and graph.shapes[n].map_over)
    if not gone:
        return checkpoint
    return _replace(checkpoint, skipped=MappingProxyType(
        {k: v for k, v in checkpoint.skipped.items() if not k.startswith(gone)}))


def _without_stale_iterations(graph: GraphSpec, checkpoint: WorkflowCheckpoint,
                              outdated: Mapping[str, str], versions: Mapping[str, str]
                              ) -> WorkflowCheckpoint:
    """``checkpoint`` without the iterations of a loop it has not recorded whose work changed:
    its code or dependencies, or a step upstream of it runs again (``outdated``). Old code
    or an old input made them, and an uninterrupted run of the new code makes none of
    them: the loop starts again from its first iteration (its compacted count goes too).
    A recorded loop is in ``outdated`` itself, and :func:`without` lets go of them.
    Nor is the output of a step of another recorded graph an iteration, however named
    (a graph without shapes may declare ``agent#1`` beside ``agent``): it goes too."""
    loops = dict.fromkeys(loops_of(graph)) if graph.shapes and checkpoint.outputs else None
    if not loops:
        return checkpoint
    recorded = checkpoint.graph
    if recorded is not None and not recorded_from(graph, checkpoint):
        steps = [n for n in checkpoint.outputs if n in recorded and iteration_of(n, loops)]
        if steps:
            checkpoint = without(checkpoint, graph, steps)
    if not checkpoint.shapes:
        return checkpoint
    table = {n: n for n in loops if n not in checkpoint.outputs}
    for loop, body in bodies_of(graph).items():  # (a body's loop started with its steps')
        if loop in table:
            table.update(dict.fromkeys(body, loop))
    started = {table[at[0]] for n in checkpoint.outputs if (at := iteration_of(n, table)) is not None} \
        if table else set()
    if not started:
        return checkpoint
    # (A loop whose cap or keep_last only changed keeps them: raising the cap after a
    # LoopError must not pay for its iterations again.)
    roots = [*outdated, *(n for n in changed_steps(graph, checkpoint, versions)
                          if not _recapped(graph, checkpoint, versions, n))]
    stale = started.intersection(downstream(graph, roots)) if roots else ()
    return without(checkpoint, graph, stale) if stale else checkpoint


def _recapped(graph: GraphSpec, checkpoint: WorkflowCheckpoint, versions: Mapping[str, str],
              name: str) -> bool:
    """Whether ``name`` is a loop then and now whose work changed only in its cap or
    ``keep_last``: the same code on the same dependencies, so its iterations stand."""
    now, then = graph.shapes.get(name), checkpoint.shapes.get(name)
    recorded = (checkpoint.graph or {}).get(name)
    return (now is not None and then is not None and now.repeat is not None
            and then.repeat is not None
            and _replace(now, repeat=then.repeat, keep_last=then.keep_last) == then
            and checkpoint.versions.get(name) == versions.get(name)
            and (recorded is None or set(recorded) == set(graph.deps[name])))


def _iterations_kept(graph: GraphSpec, checkpoint: WorkflowCheckpoint) -> WorkflowCheckpoint:
    """``checkpoint`` without the iterations no loop of ``graph`` makes again: those of a step
    that was a loop when recorded and is not one now (or is otherwise shaped: a loop whose
    cap or keep_last alone changed keeps them, so that raising the cap after a LoopError
    pays for none again), and the skipped first iteration of a loop whose own skip is gone
    (it is decided again)."""
    was = {n for n, s in checkpoint.shapes.items() if s.repeat is not None}
    if not was:
        return checkpoint
    now = graph.shapes
    stale = {n for n in was if n not in now or (now[n] != checkpoint.shapes[n] and not (
        now[n].repeat is not None and _replace(now[n], repeat=checkpoint.shapes[n].repeat,
                                               keep_last=checkpoint.shapes[n].keep_last)
        == checkpoint.shapes[n]))}
    # (a body's first iterations L/s#1 are skipped with their loop as L#1 is)
    loop_of = {n: n for n in was}
    if any(checkpoint.shapes[n].child is not None for n in was):
        loop_of.update((s, n) for n, body in bodies_of(graph).items() if n in was for s in body)
    drop = {n for n in (*checkpoint.outputs, *checkpoint.skipped)
            if (at := iteration_of(n, loop_of)) is not None
            and (at[0] in stale or (n in checkpoint.skipped and loop_of[at[0]] not in checkpoint.skipped))}
    if not drop:
        return checkpoint
    kept = _dropped(checkpoint, drop, {}, dict(checkpoint.superseded))
    return _replace(kept, compacted=MappingProxyType(
        {n: c for n, c in checkpoint.compacted.items() if n not in stale}))


def _set_aside(graph: GraphSpec, checkpoint: WorkflowCheckpoint, outdated: Mapping[str, str],
               versions: Mapping[str, str], code: Mapping[str, str]) -> WorkflowCheckpoint:
    """``checkpoint`` with the items whose input runs again set aside, for an early cutoff.

    An output a mapped step maps over that runs again (its version or its
    dependencies changed, or it needs one that did) goes to ``superseded``
    with the items made from it: when it is recorded again, an item whose new
    input equals its old one keeps its output (see ``_cutoff``). The items
    of a mapped step whose own version or dependencies changed (or one it is
    chained to) are dropped: their code is not the code that made them.
    """
    mapped = {n: s.map_over for n, s in graph.shapes.items() if s.map_over is not None}
    for parent, steps in children_per_item(graph).items():  # (a child per item: its steps map too)
        mapped.update(dict.fromkeys(steps, cast(str, graph.shapes[parent].map_over)))
    reshaped = reshaped_steps(graph, checkpoint)  # (mapped then or now: their items go too)
    if not (outdated or checkpoint.versions or versions or checkpoint.superseded or reshaped):
        return checkpoint
    changed = {n for n in mapped if checkpoint.versions.get(n) != versions.get(n)
               or code_changed(checkpoint.code_fingerprints, code, n)
               or outdated.get(n, "").startswith("its ")} | set(reshaped)
    again = set(downstream(graph, [*outdated, *reshaped]))
    below = again - set(outdated)
    roots = _roots(graph, mapped, changed, again)
    prefixes = {f"{m}[": m for m in (*mapped, *reshaped)}
    aside = _still_aside(checkpoint.superseded, graph.index, prefixes, roots)
    aside.update((u, checkpoint.outputs[u]) for u in expanders(graph)
                 if u in outdated and u in checkpoint.outputs)
    # A skip below a step that runs again is decided again, and so are the
    # items below a changed mapped step that never collected (so is in no
    # ``outdated``): their conditions were decided on its old items.
    drop = {n for n in below if n in checkpoint.skipped}
    stale = again.union(downstream(graph, changed))
    for name in (*checkpoint.outputs, *checkpoint.skipped):
        owner = next((m for p, m in prefixes.items() if name.startswith(p)), None)
        if owner is None or owner not in stale:
            continue
        drop.add(name)
        root, clean = roots.get(owner, (owner, False))
        if clean and root in outdated and name in checkpoint.outputs:
            aside[name] = checkpoint.outputs[name]
    if drop & checkpoint.skipped.keys():  # ...unless a skip that stands forces it still
        keep_forced_skips(graph, grown(graph, checkpoint.outputs), checkpoint.skipped, drop)
    forced = _forced_skips(graph, checkpoint, drop, again)
    if not drop and not forced and aside.keys() == checkpoint.superseded.keys():
        return checkpoint
    return _dropped(checkpoint, drop, forced, aside)


def _dropped(checkpoint: WorkflowCheckpoint, drop: set[str], forced: dict[str, str],
             aside: dict[str, Any]) -> WorkflowCheckpoint:
    """``checkpoint`` without what ``drop`` names, ``forced`` skipped, ``aside`` set aside."""
    outputs = checkpoint.outputs
    return _replace(
        checkpoint,
        # One step fewer finished per output dropped: else the resume's first save, which
        # counts what it keeps, reads to replay as step_index going down.
        step_index=max(0, checkpoint.step_index - sum(1 for n in drop if n in outputs)),
        outputs=MappingProxyType({k: v for k, v in outputs.items() if k not in drop}),
        step_usage=MappingProxyType({k: v for k, v in checkpoint.step_usage.items() if k not in drop}),
        durations=_kept(checkpoint.durations, drop), began=_kept(checkpoint.began, drop),
        held=_kept(checkpoint.held, drop),
        skipped=MappingProxyType({k: v for k, v in checkpoint.skipped.items() if k not in drop} | forced),
        superseded=MappingProxyType(aside),
    )


def _forced_skips(graph: GraphSpec, checkpoint: WorkflowCheckpoint, drop: set[str], again: set[str]
                  ) -> dict[str, str]:
    """The steps that run again (``again``) which a skip that stands forces to be skipped:
    one now needs a skipped step it joined as an alternative before, say (a changed shape).
    A run would skip them as the skip reached them; a resume records it at once."""
    kept = {k for k in checkpoint.skipped if k not in drop}
    forced: dict[str, str] = {}
    grew = bool(kept)
    while grew:
        grew = False
        for name in graph.names:
            if name not in again or name in forced or name in kept:  # (recorded ones are outdated)
                continue
            shape, deps = graph.shapes.get(name), graph.deps[name]
            gone = [d for d in deps if d in kept or d in forced]
            if shape is not None and shape.join == "any":
                why = "every step it joins was skipped" if deps and len(gone) == len(deps) else ""
            else:
                why = f"it needs {gone[0]!r}, which was skipped" if gone else ""
            if why:
                forced[name], grew = why, True
    return forced


def _roots(graph: GraphSpec, mapped: Mapping[str, str], changed: set[str], again: set[str]
           ) -> dict[str, tuple[str, bool]]:
    """Mapped step -> (its first upstream, whether its items may be kept by an early cutoff:
    neither it nor a step it is chained to changed, and no other input of theirs runs again)."""
    roots: dict[str, tuple[str, bool]] = {}

    def root_of(name: str) -> tuple[str, bool]:
        # (by the chain, not by declaration order: a chained step may be declared before
        # the mapped step it is chained to, whose root it shares)
        if name not in roots:
            over = mapped[name]
            root, clean = root_of(over) if over in mapped else (over, True)
            others = [d for d in graph.deps[name] if d != over]
            roots[name] = (root, clean and name not in changed and not any(d in again for d in others))
        return roots[name]

    for name in mapped:
        root_of(name)
    return roots


def _still_aside(superseded: Mapping[str, Any], index: Mapping[str, int], prefixes: Mapping[str, str],
                 roots: Mapping[str, tuple[str, bool]]) -> dict[str, Any]:
    """What an earlier resume or rewind set aside that a cutoff may still keep: an item goes
    once its mapped step's code or other inputs changed (its output is not what the
    current code would make of it), or once its step is no mapped step at all."""
    aside = {}
    for name, value in superseded.items():
        if name not in index:  # an item (else the output of what steps map over)
            owner = next((m for p, m in prefixes.items() if name.startswith(p)), None)
            if owner is None or not roots.get(owner, (owner, False))[1]:
                continue
        aside[name] = value
    return aside


def _first_ready_shaped(
    graph: GraphSpec, outputs: Mapping[str, Any], skipped: Mapping[str, str],
    in_body: Mapping[str, str],
) -> tuple[list[int], dict[str, int], int, list[str]]:
    """:func:`_first_ready` with shapes: a mapped step is never ready by its dependencies, a
    skipped step never ready, a join over alternatives counts skipped dependencies as settled."""
    ready: list[int] = []
    waiting: dict[str, int] = {}
    pending: list[str] = []
    shapes, deps = graph.shapes, graph.deps
    for i, name in enumerate(graph.names):
        parents = deps[name]
        shape = shapes.get(name)
        joins_any = shape is not None and shape.join == "any"
        if name in outputs or name in skipped:
            _check_skips_agree(name, parents, outputs, skipped, joins_any)
            continue
        pending.append(name)
        gone = [d for d in parents if d in skipped]
        if gone and not joins_any:  # (a mapped step too: its items could never start)
            raise CheckpointError("skipped", f"records {gone[0]!r} as skipped, yet not {name!r}, "
                                             "which needs it")
        if (shape is not None and (shape.map_over is not None or shape.repeat is not None)) \
                or (in_body and name in in_body):
            continue  # (expanded into its items, or grown into its iterations: never started)
        missing = sum(1 for d in parents if d not in outputs and d not in skipped)
        if not missing:
            if parents and not any(d in outputs for d in parents):
                raise CheckpointError("skipped", f"every step {name!r} joins is skipped, "
                                                 "yet it is not")
            ready.append(i)
        elif missing < len(parents):
            waiting[name] = missing
    return ready, waiting, sum(1 for n in graph.names if n in outputs), pending


def _check_skips_agree(name: str, parents: tuple[str, ...], outputs: Mapping[str, Any],
                       skipped: Mapping[str, str], joins_any: bool) -> None:
    """A recorded (or skipped) step whose record the recorded skips contradict is refused."""
    if name in outputs and name in skipped:
        raise CheckpointError("skipped", f"records {name!r} as skipped and its output too")
    if name in outputs and parents:
        gone = [d for d in parents if d in skipped]
        if gone and (not joins_any or len(gone) == len(parents)):
            raise CheckpointError("skipped", f"records {gone[0]!r} as skipped, yet the output "
                                             f"of {name!r}, which needs it")


def _check_compacted(checkpoint: WorkflowCheckpoint, bodies: Mapping[str, tuple[str, ...]]
                     ) -> None:
    """Every ``compacted`` count is of a loop (by the shapes the checkpoint records: the run
    that wrote it; its keep_last may since be gone, by a graph change), and ``outputs`` keeps
    no iteration it counts as compacted: else a resume would let go of, or keep, what no
    run did."""
    shapes, compacted = checkpoint.shapes, checkpoint.compacted
    inside = {items_compacted(step) for body in bodies.values() for step in body}
    for loop in compacted:
        if loop in inside:  # (the items of a body's map, counted: see items_compacted)
            continue
        shape = shapes.get(loop)
        if shape is None or shape.repeat is None:
            raise CheckpointError(f"compacted.{loop}", "counts compacted iterations of a step "
                                                       "that is no loop")
    upto = {n: c for n, c in compacted.items() if n not in inside}
    for loop in list(upto):  # (a body's steps are compacted with their loop, iteration by iteration)
        upto.update(dict.fromkeys(bodies.get(loop, ()), compacted[loop]))
    for name in checkpoint.outputs:
        at = iteration_of(name, upto)
        if at is not None and at[1] <= upto[at[0]]:
            raise CheckpointError(f"compacted.{at[0]}", f"counts {name!r} as compacted, yet "
                                                        "outputs keeps it")


def _lowered(graph: GraphSpec, pending: list[str], in_body: Mapping[str, str]
             ) -> MappingProxyType[str, tuple[str, ...]]:
    """The dependents the fold reads in a shaped run: no edge into a mapped step
    (it expands and collects; it is never made ready by its dependencies), nor into
    a loop or a step of a loop's body (their iterations wait for its dependencies instead)."""
    mapped = {n for n, s in graph.shapes.items() if s.map_over is not None or s.repeat is not None}
    mapped.update(in_body)
    among = graph.dependents_among(pending)
    return MappingProxyType({
        k: tuple(c for c in v if c not in mapped) if v else v for k, v in among.items()
    })


def _check_expansion(w: _Run, checkpoint: WorkflowCheckpoint) -> None:
    """Every recorded item and skip names an item the recorded outputs make, or a step."""
    index = w.spec.graph.index
    mapped = tuple(f"{n}[" for n, s in w.spec.declared_graph.shapes.items() if s.map_over)
    shaped = cast(Expansion, w.spec.shaped)
    loops: Mapping[str, Any] = shaped.loops
    if shaped.in_body:
        loops = {**loops, **shaped.in_body}
    if checkpoint.compacted:
        _check_compacted(checkpoint, shaped.bodies)
    for name in checkpoint.outputs:
        if name not in index and name.startswith(mapped):
            raise CheckpointError("outputs", f"records item {name!r}, which the recorded output "
                                             "it maps over does not have")
        if loops and name not in index and iteration_of(name, loops) is not None:
            raise CheckpointError("outputs", f"records iteration {name!r}, yet not every "
                                             "iteration before it")
    outputs, skipped = checkpoint.outputs, checkpoint.skipped
    check_collections(w.spec.declared_graph, outputs, skipped, cast(Expansion, w.spec.shaped).members)
    for name in skipped:
        if name not in index:
            raise CheckpointError("skipped", f"names {name!r}, which is no step or item of this run")
        if name in outputs:
            raise CheckpointError("skipped", f"records {name!r} as skipped and its output too")
        needing = [c for c in w.spec.dependents.get(name, ()) if c in outputs]
        if needing:
            raise CheckpointError("skipped", f"records {name!r} as skipped, yet the output "
                                             f"of {needing[0]!r}, which needs it")


# -- the working copy ------------------------------------------------------------


class _Run:
    """The working copy of one transition: a state's fields, edited in place by the rules.

    Made once per fold from the state before (:func:`_thaw`), frozen once at
    its end (:func:`_freeze`) by :func:`state_of_run`, which
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
        "times",
        "waiting",
    )

    before: State
    spec: RunSpec
    record: bool
    outputs: Ledger[str, Any]
    step_usage: Ledger[str, TokenUsage]
    times: Timings
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
                name = next(names[i] for i in done if not window.has(running, i - offset))
                before = self.before  # (this fold recorded it: its phase is the one before)
                raise _no_row(Succeeded, name, _reading(
                    self.spec, before.outputs, self.setbacks, (offset, self.ready, running), name))
            self.running = running
            self.done = _NONE
        if fresh:
            low = min(fresh)
            if low < offset or not (self.ready or self.running):
                self.offset, self.ready, self.running = window.fit(
                    offset, self.ready, self.running, low)
            self.ready = window.put(self.ready, fresh, self.offset)
            self.fresh = _NONE

    def pending_done(self, i: int) -> None:
        """Take step ``i`` off the running set at the next :meth:`settle`."""
        if self.done is _NONE:
            self.done = []
        self.done.append(i)

    def ready_later(self, i: int) -> None:
        """Add step ``i`` to the ready set at the next :meth:`settle`."""
        if self.fresh is _NONE:
            self.fresh = []
        self.fresh.append(i)

    def end_attempt(self, name: str) -> int:
        """Take ``name`` (running or gated: the table's row says so) off the running set;
        its bit index, to put it back among the ready."""
        j = self.bit(name)
        self.running = window.remove(self.running, window.bit(j))
        self.in_flight -= 1
        if name in self.setbacks.gated:
            del self.gated()[name]
        return j

    def gated(self) -> dict[str, float]:
        """The gated attempts, as the fold's own dict (copied on first write, frozen by ``_freeze``).

        A batch of conditional items is gated whole: one copy per fold, not one per item.
        """
        gated: Mapping[str, float] = self.setbacks.gated
        if not isinstance(gated, dict):
            gated = dict(gated)
            self.setbacks = _replace(self.setbacks, gated=cast(Any, gated))
        return gated

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
    w.outputs, w.step_usage, w.times = state.outputs, state.step_usage, state._times
    w.completed, w.cost, w.setbacks = state.completed, state.cost, state.setbacks
    w.offset, w.ready, w.running = state._offset, state._ready, state._running
    w.in_flight, w.waiting = state._in_flight, state._waiting
    # (done and fresh are made lists when first added to: most folds add to neither)
    w.events, w.done, w.fresh = [], _NONE, _NONE
    return w


_new = object.__new__
_NONE: Any = ()
"""The ``done`` and ``fresh`` of a working copy that has added nothing to them."""


# -- the rules, one per input ------------------------------------------------------


def _succeeded(w: _Run, item: Succeeded) -> None:
    """Record the output; count down the dependents, ready at zero; a reached budget halts."""
    name = item.name  # the hot path of every run: plain int and dict operations
    spec = w.spec
    index = spec.graph.index
    i = index.get(name)
    if i is None:
        raise TransitionError(f"unknown step {name!r}")
    gated = w.setbacks.gated
    running = w.running
    # Its phase, read by the test of its bit (inlined, see ekit_core.window): running, the
    # row of the hot path; else the table's row of its phase (see _compiled).
    if gated and name in gated:
        return _succeeded_elsewhere(w, item)
    if running < window.NARROW:  # narrow: change it in place
        j = i - w.offset
        if j < 0 or not (running >> j) & 1:  # window.has
            return _succeeded_elsewhere(w, item)
        w.running = running ^ (1 << j)  # window.remove(running, window.bit(j))
    else:  # wide: its bit is tested by settle(), with those of the whole fold
        w.pending_done(i)
    try:
        outputs = w.outputs = w.outputs.with_item(name, item.output)
    except ValueError:  # recorded already: reported twice in one fold
        raise _no_row(Succeeded, name, Phase.RECORDED) from None
    w.in_flight -= 1
    w.completed += 1
    usage = item.usage
    if usage is not NO_USAGE and (usage.input_tokens or usage.output_tokens or usage.llm_calls):
        w.step_usage, w.cost = w.step_usage.with_item(name, usage), w.cost + usage
    duration = item.duration
    # Else (not asked for, not timed, a bad clock) none.
    if duration is not None and spec.limits.durations and 0 <= duration < _LONGEST:
        w.times = _timed_node(w.times, name, duration, item)
    if w.record:
        w.events.append(StepFinished(name, w.setbacks.tries.get(name, 0) + 1, usage, duration))
    if spec.shaped is None:
        children = spec.dependents[name]
        if children:
            _count_down(w, children, outputs, index)
    else:  # (its dependents counted down there: it knows which names have none)
        _after_recorded(w, name, spec.shaped, outputs, index)
    budget = spec.limits.budget
    # w.spec, not spec: a recorded output that steps map over grew the graph above (and an
    # early cutoff may have recorded items with it), so ``spec`` no longer counts its steps.
    if budget is not None and w.setbacks.halt is None and w.completed < len(w.spec.graph.names) \
            and budget.reached(w.cost):
        w.halt(Halt("budget_exceeded", _loop_of(w.spec, name), f"usage reached {budget}"))


def _timed_node(times: Timings, name: str, duration: float, item: Succeeded) -> Timings:
    """The run's timings with ``item``'s duration: one tuple (see Timings), four fields when the
    shell said when it began, five when a limit held it first (the shell reports it so)."""
    began = item.began
    if began is None or not 0 <= began < _LONGEST:
        return (name, duration, times)
    if type(item) is HeldSucceeded:
        return (name, duration, times, began, item.held)
    return (name, duration, times, began)


def _loop_of(spec: RunSpec, name: str) -> str | None:
    """The loop ``name`` is an iteration of, else the step whose child workflow it is a step
    (or item) of, innermost first (``None``: neither), which a budget names."""
    ref = spec.shaped.items.get(name) if spec.shaped is not None else None
    if ref is not None and ref.iteration:
        return spec.shaped.in_body.get(ref.step, ref.step)  # type: ignore[union-attr]
    shapes = spec.declared_graph.shapes
    return parent_of(name if ref is None else ref.step, shapes) if shapes else None


_LONGEST = 2.0**53 / 1e6
"""Seconds a recorded duration stays below (some 285 years): its microseconds a float
holds exactly. A clock's nonsense (negative, infinite, NaN) is not recorded."""


def _attempt_times(spec: Any, failed: Failed) -> tuple[float, float] | tuple[()]:
    """When the failed attempt began and ended (UTC epoch seconds), when the run records
    durations and the shell timed it sensibly; else nothing (the record has no times)."""
    began, duration = failed.began, failed.duration
    if began is None or duration is None or not spec.limits.durations:
        return ()
    if not (0 <= began < _LONGEST and 0 <= duration < _LONGEST):
        return ()
    return began, began + duration


def _count_down(
    w: _Run, children: tuple[str, ...], outputs: Ledger[str, Any], index: Mapping[str, int]
) -> None:
    """:func:`dependencies_recorded`, as a countdown: a join over n parents stays O(n)."""
    deps, skipped = w.spec.graph.deps, w.setbacks.skipped
    for child in children:
        # Recorded before a dependency was added, or skipped (never in a run
        # without shapes, whose skips are the one shared empty mapping).
        if child in outputs or (skipped is not NO_SKIPS and child in skipped):
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
            w.ready_later(k)


def _start(w: _Run, start: Start) -> None:
    """A start the shell made itself: the step must be ready, the run not halted, room left."""
    name = start.name
    j = w.bit(name)
    if w.setbacks.halt is not None:
        raise TransitionError(f"cannot start step {name!r}: the run is halted ({w.setbacks.halt.kind})")
    limit = w.spec.limits.max_concurrency
    if limit is not None and w.in_flight >= limit:
        raise TransitionError(f"cannot start step {name!r}: max_concurrency={limit} in flight")
    _begin_attempts(w, (start,), window.bit(j))


def _began(w: _Run, began: Began) -> None:
    """A gated attempt ended its wait: only now has it started."""
    name = began.name
    delay = w.gated().pop(name)
    w.events.append(StepStarted(name, w.setbacks.tries.get(name, 0) + 1, delay))


def _began_and_succeeded(w: _Run, item: Succeeded) -> None:
    """A gated attempt's success, its ``Began`` not reported: it began, then succeeded."""
    _began(w, Began(item.name))
    _succeeded(w, item)


def _ended(w: _Run, item: Ended) -> None:
    """An iteration's success that ends its loop: recorded as any success, and its loop
    records that output as its own in the same transition (``_iterated``)."""
    name = item.name
    shaped = w.spec.shaped
    ref = shaped.items.get(name) if shaped is not None else None
    if shaped is None or ref is None or not ref.iteration:
        raise TransitionError(f"Ended for step {name!r}, which is no iteration of a loop: "
                              "report a Succeeded")
    loop = shaped.in_body.get(ref.step) if shaped.in_body else None
    if loop is not None and w.spec.declared_graph.shapes[loop].child != ref.step:
        raise TransitionError(f"Ended for step {name!r}, an iteration of a step of the body of "
                              f"loop {loop!r} that is not its output: report a Succeeded")
    w.spec = _replace(w.spec, shaped=_replace(shaped, ending=shaped.ending | {name}))
    _succeeded(w, item)


def _began_and_ended(w: _Run, item: Ended) -> None:
    """A gated iteration's last success, its ``Began`` not reported: it began, then ended."""
    _began(w, Began(item.name))
    _ended(w, item)


def _began_and_asked(w: _Run, asked: Asked) -> None:
    """A gated attempt's question, its ``Began`` not reported: it began, then asked."""
    _began(w, Began(asked.name))
    _asked(w, asked)


def _failed(w: _Run, failed: Failed) -> None:
    """Retried by the step's policy unless the run is halting; else it halts the run (or its branch).

    The policy also decides the delay: its jittered backoff, or the wait the
    failure asked for (``Failed.retry_after``) when longer; a failure that
    asked for more than the policy's ``max_retry_after`` is not retried.
    """
    name = failed.name
    before_work = name in w.setbacks.gated
    unanswered = _unanswered(w.setbacks, name, before_work)
    j = w.end_attempt(name)
    inc = w.setbacks if unanswered is None else _replace(w.setbacks, unanswered=unanswered)
    held = _condition_held(inc, name, before_work and failed.gate == APPROVAL)
    if held is not None:
        inc = _replace(inc, held=held)
    attempt = inc.tries.get(name, 0) + 1
    error_type, message = describe_error(failed.error)
    previous = inc.failures.get(name)
    record = FailureRecord(error_type, message, (previous.attempts if previous else 0) + 1,
                           *_attempt_times(w.spec, failed))
    inc = _replace(
        inc,
        failures=MappingProxyType({**inc.failures, name: record}),
        tries=MappingProxyType({**inc.tries, name: attempt}),
    )
    policy = _policy_of(w.spec, name)
    asked = _wait_asked(failed)
    if inc.halt is None and policy.retries(failed.error, attempt):
        delay = _retry_wait(w.spec, policy, failed, attempt, record.attempts, asked)
        if delay is not None:
            w.setbacks = _replace(inc, delays=MappingProxyType({**inc.delays, name: delay}))
            w.events.append(
                StepRetried(name, attempt, error_type, message, delay, failed.duration, asked))
            w.ready = window.add(w.ready, window.bit(j))
            return
    w.events.append(StepFailed(name, attempt, error_type, message, failed.duration, asked))
    w.setbacks = _replace(inc, errors=(*inc.errors, (name, failed.error)))
    if not w.spec.limits.isolate_failures:  # else only what depends on it waits, forever
        w.halt(Halt("failed", name, f"{error_type}: {message}"))


def _unanswered(inc: Setbacks, name: str, before_work: bool) -> frozenset[str] | None:
    """The steps whose gate is unanswered once ``name``'s attempt failed, if that changes them.

    An attempt that failed before its work began (still gated), having asked
    its condition or its approval (a first attempt, or one after such a
    failure), got no answer from them: its next attempt asks again.
    """
    unanswered = inc.unanswered
    if before_work and (name not in inc.tries or name in unanswered):
        return None if name in unanswered else unanswered | {name}
    return unanswered - {name} if name in unanswered else None


def _condition_held(inc: Setbacks, name: str, approval_raised: bool) -> frozenset[str] | None:
    """The steps whose condition held though their gate is unanswered, once ``name``'s
    attempt failed, if that changes them: its approval raised after its condition held
    (or it had no condition), so the condition has answered and is not asked again."""
    held = inc.held
    if approval_raised and name in inc.unanswered:
        return None if name in held else held | {name}
    return held - {name} if name in held else None


def _wait_asked(failed: Failed) -> float | None:
    """The wait the failure asked for (``Failed.retry_after``): ``None``, or seconds >= 0."""
    asked = failed.retry_after
    if asked is None:
        return None
    try:  # any finite wait (10**400 is none): how long is too long is the policy's to say
        return check_number(asked, "retry_after", high=None)
    except ValueError as exc:
        raise TransitionError(
            f"failed result for step {failed.name!r}: {str(exc).replace('must be', 'must be None or', 1)}"
        ) from None


def _retry_wait(spec: RunSpec, policy: RetryPolicy, failed: Failed, tries: int, failure: int,
                asked: float | None) -> float | None:
    """The delay before retrying ``failed``'s step (``None``: it asked too long a wait).

    The jitter is drawn for the attempt's identity: the run's id, the step,
    and the failure's number across runs (``failure``), as its attempt key has.
    """
    return policy.wait(tries, spec.limits.run_id, failed.name, failure, asked)


def _policy_of(spec: RunSpec, name: str) -> RetryPolicy:
    """The retry policy of step ``name`` (an item's is its mapped step's; a body map's item
    ``L/m#k[key]`` is an item of ``L/m#k``, itself an iteration of ``L/m``)."""
    policy = spec.limits.policies.get(name)
    items = spec.shaped.items if spec.shaped is not None else {}
    while policy is None and name in items:
        name = items[name].step
        policy = spec.limits.policies.get(name)
    return NO_RETRY if policy is None else policy


def _denied(w: _Run, denied: Denied) -> None:
    """A refused approval halts the run; the step is not done: a resume asks again."""
    j = w.end_attempt(denied.name)
    reason = storable_text(str(denied.reason))
    w.events.append(StepDenied(denied.name, reason))
    w.halt(Halt("denied", denied.name, reason))
    w.ready = window.add(w.ready, window.bit(j))


def _interrupted(w: _Run, interrupted: Interrupted) -> None:
    """A cancelled attempt: the step is ready again."""
    j = w.end_attempt(interrupted.name)
    w.events.append(StepInterrupted(interrupted.name))
    w.ready = window.add(w.ready, window.bit(j))


def _asked(w: _Run, asked: Asked) -> None:
    """The attempt asked a question nobody has answered: the step waits, its question recorded.

    Not a failure (no retry, no attempt counted) and not done: it is neither
    ready nor running, so nothing that needs it starts, and a resume does
    not run it again until :func:`ekit_core.human.answer` records an answer.
    """
    name, question = asked.name, asked.question
    w.end_attempt(name)
    inc = w.setbacks
    before = inc.asked.get(name, ())
    if before and before[-1].answer is None:
        raise TransitionError(f"step {name!r} asked a question while one waits for an answer")
    exchanges = (*before, Exchange(question))
    w.setbacks = _replace(inc, asked=MappingProxyType({**inc.asked, name: exchanges}))
    w.events.append(StepWaiting(name, question, len(exchanges)))


def _skipped(w: _Run, skipped: Skipped) -> None:
    """The step's condition was false: it is skipped, and what needs it with it."""
    if not _asks(w.spec, skipped.name):  # (a checkpoint recording the skip would be refused)
        raise TransitionError(f"Skipped for step {skipped.name!r}, which has no condition")
    w.end_attempt(skipped.name)
    _skip(w, skipped.name, storable_text(str(skipped.reason)))


def _cancelled(w: _Run, cancelled: Cancelled) -> None:
    """The run is cancelled: start nothing more."""
    w.halt(Halt("cancelled", reason=cancelled.reason))


# -- run-time shapes: items, their collection, skips --------------------------------


def _after_recorded(w: _Run, name: str, shaped: Expansion, outputs: Ledger[str, Any],
                    index: Mapping[str, int]) -> None:
    """A recorded output counts its dependents down (``_count_down``); one that steps map
    over expands them; a recorded item counts its step down, and so does a dependency an
    empty mapped step waits for."""
    ref = shaped.items.get(name)
    dependents = w.spec.dependents
    # (A loop's iteration that _grow_next grew has no entry: nothing depends on it.)
    children = () if ref is not None and ref.iteration and name not in dependents \
        else dependents[name]
    if children:
        _count_down(w, children, outputs, index)
    if name in shaped.expanders:
        _expand(w, name)
        shaped = w.spec.shaped  # type: ignore[assignment]
    # (The nesting's tables read as fields, not through properties: once per item and iteration.)
    per_item_over = shaped.nesting.per_item_over
    if per_item_over and name in per_item_over:
        _grow_children(w, name)
        shaped = w.spec.shaped  # type: ignore[assignment]
    if ref is not None:
        if ref.iteration:
            body_maps = shaped.nesting.body_maps
            if body_maps and ref.step in body_maps:
                _expand_in_body(w, name, ref)
            _iterated(w, name, ref)
        else:
            _item_settled(w, ref.step)
    for mapped in shaped.waits.get(name, ()):
        _item_settled(w, mapped)


def _expand(w: _Run, over: str) -> None:
    """Grow the run by the items of every step mapped over ``over``, whose output is recorded."""
    more, refused = expand(w.spec.declared_graph, over, w.outputs[over])
    only = w.spec.limits.only
    if only is not None:  # a mapped step the run does not select fails nothing in it
        refused = {mapped: why for mapped, why in refused.items() if mapped in only}
    for mapped, why in refused.items():
        _map_failed(w, mapped, why)
    skipped = w.setbacks.skipped
    if skipped:  # a mapped step skipped already (it needs a skipped step) gets no items
        more = _without_skipped(more, skipped)
    if cast(Expansion, w.spec.shaped).superseded:
        _cutoff(w, over, more)
    if only is not None:
        more, outside = split(more, only)
        _grow_held(w, outside)
    _grow(w, more)
    _skip_needing_skipped(w, more)
    outputs, waiting, skipped = w.outputs, w.counts(), w.setbacks.skipped
    deps = w.spec.declared_graph.deps
    for mapped, members in more.members.items():
        if w.record:
            done = sum(1 for m in members if m in outputs or m in skipped)
            w.events.append(StepExpanded(mapped, len(members), done))
        if mapped in outputs:  # a resume: collected already
            continue
        left = sum(1 for m in members if m not in outputs and m not in skipped)
        if not left:
            # No item to wait for (none, or all settled already: a resume, a
            # cutoff): it waits for its dependencies themselves, so that one
            # skipped meanwhile skips it in every order of events.
            left = _wait_for_dependencies(w, mapped, deps[mapped])
        if left:
            waiting[mapped] = left
        else:
            _collect(w, mapped)


def _skip_needing_skipped(w: _Run, more: Expanded) -> None:
    """Skip the new items that need an item recorded as skipped: a resume into a step now
    mapped over a mapped step whose skipped items it records (they could never start)."""
    skipped = w.setbacks.skipped
    if not skipped:
        return
    for name, deps in more.steps.items():
        gone = next((d for d in deps if d in skipped), None)
        if gone is not None and name not in w.outputs and not _joins_any(w, more.items[name].step):
            _skip(w, name, f"it needs {gone!r}, which was skipped")


def _wait_for_dependencies(w: _Run, mapped: str, deps: tuple[str, ...]) -> int:
    """Count down ``mapped``, whose items are settled (or none), by its unrecorded dependencies."""
    missing = [d for d in deps if d not in w.outputs]
    if missing:
        shaped = w.spec.shaped
        assert shaped is not None
        waits = dict(shaped.waits)
        for d in missing:
            waits[d] = (*waits.get(d, ()), mapped)
        w.spec = _replace(w.spec, shaped=_replace(shaped, waits=MappingProxyType(waits)))
    return len(missing)


def _cutoff(w: _Run, over: str, more: Expanded) -> None:
    """Early cutoff: record, without running them, the items whose input is unchanged.

    ``over`` ran again (a rewind, a changed version) with its old output set
    aside; an item of the new output equal, by encoded value, to the old one
    under the same key keeps the output set aside for it, and so does, item
    by item, a chained item whose upstream item was kept. The rest run; what
    was set aside for these items is let go either way.
    """
    shaped = cast(Expansion, w.spec.shaped)
    aside = dict(shaped.superseded)
    old = aside.pop(over, _MISSING)
    kept: list[str] = []
    for name, ref in more.items.items():
        previous = aside.pop(name, _MISSING)
        if previous is _MISSING or name in w.outputs:
            continue
        if ref.pick is None:
            unchanged = ref.source in kept
        else:
            shape = w.spec.declared_graph.shapes[ref.step]
            before = _old_item(old, shape.item_key, ref.key)
            unchanged = before is not _MISSING and same_encoding(before, item_input(ref, w.outputs))
        if unchanged:
            w.outputs = w.outputs.with_item(name, previous)
            kept.append(name)
            if w.record:
                w.events.append(StepSkipped(name, "its input is unchanged: its output is kept"))
    w.spec = _replace(w.spec, shaped=_replace(shaped, superseded=MappingProxyType(aside)))


_MISSING: Any = object()


def _old_item(old: Any, item_key: str | None, key: str) -> Any:
    """The item under ``key`` in the set-aside output ``old``, or ``_MISSING``."""
    if old is _MISSING:
        return _MISSING
    items = items_of(old, item_key)
    if isinstance(items, str):
        return _MISSING
    return next((value for k, value, _ in items if k == key), _MISSING)


def _without_skipped(more: Expanded, skipped: Mapping[str, str]) -> Expanded:
    keep = {m for m in more.members if m not in skipped}
    return Expanded(
        {n: d for n, d in more.steps.items() if more.items[n].step in keep},
        {n: r for n, r in more.items.items() if r.step in keep},
        {m: v for m, v in more.members.items() if m in keep},
        {m: k for m, k in more.kinds.items() if m in keep},
    )


def _grow(w: _Run, more: Expanded, collected: frozenset[str] = frozenset(),
          loops: MappingProxyType[str, int] | None = None) -> None:
    """Add the items of ``more`` to the graph; those whose dependencies are recorded are ready.

    An item waits on its dependencies as any step does (a countdown when it
    has several), so readiness stays O(1) per finished dependency; edges
    from recorded dependencies are not kept (those never finish again).
    ``collected`` are grown steps that never start (a loop body's mapped step's
    iteration, which expands into items and collects them): no edge into them.
    ``loops``: the loops' newest iterations, when this growth grows one.
    O(what ``more`` adds): the tables grow by appending (see ``ekit_core.appending``),
    except the rare edge into a step grown before (a first iteration waiting for the
    loop's inputs), which copies the dependents.
    """
    spec, outputs, skipped = w.spec, w.outputs, w.setbacks.skipped
    graph = spec.graph.extended(more.steps)
    added: dict[str, tuple[str, ...]] = dict.fromkeys(more.steps, ())
    extra: dict[str, list[str]] = {}
    waiting = w.counts()
    index = graph.index
    held = waiting_on(w.setbacks.asked) if w.setbacks.asked else {}
    for name, deps in more.steps.items():
        if name in outputs:  # a resume: recorded already
            w.completed += 1
            continue
        if name in skipped or name in held or name in collected:  # (an item waiting for an
            continue  # answer never starts, nor what collects its items)
        missing = [d for d in deps if d not in outputs]
        for d in missing:
            extra.setdefault(d, []).append(name)
        if not missing:
            w.ready_later(index[name])
        elif len(deps) > 1:
            waiting[name] = len(missing)
    before: dict[str, tuple[str, ...]] = {}
    for d, names in extra.items():
        if d in added:
            added[d] = (*added[d], *names)
        else:
            before[d] = (*spec.dependents.get(d, ()), *names)
    dependents = grown_table(spec.dependents, added)
    if before:  # (an edge into an older step: its entry changes, so the table is copied)
        dependents = MappingProxyType({**dependents, **before})
    assert spec.shaped is not None
    w.spec = grown_spec(spec, graph, dependents, spec.shaped.grown(more, loops), spec.held)


def _grow_held(w: _Run, outside: Expanded) -> None:
    """Add the items of mapped steps a run with ``only`` does not select: known (their
    recorded outputs and skips stay theirs), never ready, never collected; those not
    settled are held (see :mod:`ekit_core.selection`)."""
    if not outside.steps:
        return
    spec, outputs, skipped = w.spec, w.outputs, w.setbacks.skipped
    held = 0
    for name in outside.steps:
        if name in outputs:
            w.completed += 1
        elif name not in skipped:
            held += 1
    assert spec.shaped is not None
    w.spec = _replace(spec, graph=spec.graph.extended(outside.steps),
                      shaped=spec.shaped.grown(outside), held=spec.held + held)


def _expand_in_body(w: _Run, over: str, ref: ItemRef) -> None:
    """Iteration ``over`` (``U#k``) of a loop body's step is recorded: grow the items of each
    body step ``M`` mapped over ``U`` as ``M#k[key]``, collected as ``M#k`` (or fail ``M#k``
    when ``over``'s output has no items), as a declared map over ``U`` would."""
    shaped = cast(Expansion, w.spec.shaped)
    shapes, deps = w.spec.declared_graph.shapes, w.spec.graph.deps
    output, k = w.outputs[over], ref.iteration
    more = Expanded()
    for step in shaped.body_maps[ref.step]:
        mapped = iteration_name(step, k)
        if mapped in shaped.members:  # (a resume's, expanded already)
            continue
        items = items_of(output, shapes[step].item_key)
        if isinstance(items, str):
            _map_failed(w, mapped, f"step {mapped!r} maps over {over!r}, but {items}")
            continue
        needs, names = deps[mapped], []
        for key, _value, pick in items:
            name = item_name(mapped, key)
            names.append(name)
            more.steps[name] = needs
            more.items[name] = ItemRef(mapped, key, over, pick)
        more.members[mapped] = tuple(names)
        more.kinds[mapped] = "dict" if isinstance(output, Mapping) else "list"
    if not more.members:
        return
    _grow(w, more)
    _await_members(w, more, told=True)


def _grow_children(w: _Run, over: str) -> None:
    """``over`` is recorded: each step that runs a child per item of it grows its child once
    per item (``P/s[key]``, see ``child_items``), each child step collecting its items as
    a mapped step does; the parent records its child's output step's collected output."""
    shaped = cast(Expansion, w.spec.shaped)
    graph = w.spec.declared_graph
    for parent in shaped.per_item_over[over]:
        steps = shaped.per_item[parent]
        if steps[0] in shaped.members or parent in w.setbacks.skipped:  # (grown, or skipped)
            continue
        more = Expanded()
        why = child_items(graph, parent, steps, w.outputs[over], more)
        only = w.spec.limits.only
        if why is not None:
            if only is None or parent in only:  # (outside the selection it fails nothing)
                _map_failed(w, parent, why)
            continue
        if only is not None:  # (as _expand: steps outside the selection are held, not run)
            more, outside = split(more, only)
            _grow_held(w, outside)
        _grow(w, more)
        _await_members(w, more, told=False)


def _await_members(w: _Run, more: Expanded, *, told: bool) -> None:
    """Each step ``more`` grew items of waits for those not recorded yet (and, with none
    left, for its own dependencies), or is collected now; ``told``: a ``StepExpanded``
    for each (a body map's; a child per item's steps are not told apart)."""
    outputs, waiting, deps = w.outputs, w.counts(), w.spec.graph.deps
    for mapped, members in more.members.items():
        if told and w.record:
            w.events.append(StepExpanded(mapped, len(members),
                                         sum(1 for m in members if m in outputs)))
        if mapped in outputs:  # a resume: collected already
            if not told:  # (a child per item's step: its parent may be left to record)
                _hand_on_to_parent(w, mapped)
            continue
        left = sum(1 for m in members if m not in outputs)
        if not left:
            left = _wait_for_dependencies(w, mapped, deps[mapped])
        if left:
            waiting[mapped] = left
        else:
            _collect(w, mapped)


def _item_settled(w: _Run, mapped: str) -> None:
    """An item of ``mapped`` was recorded or skipped: at the last one, collect.

    Collected only once its own dependencies are recorded too: one of them
    skipped (now, or by the skip still being passed on) skips ``mapped``
    instead, whatever its items did.
    """
    if mapped in w.setbacks.skipped:
        return
    waiting = w.counts()
    left = waiting.pop(mapped, 0) - 1  # (no count: collected already, on a resume)
    if left < 0:
        return
    if not left:
        # Its items are settled; it waits for its own dependencies too (a
        # chained step's items may be skipped before a dependency finishes),
        # so that a skip of one still skips it, in every order of events.
        left = _wait_for_dependencies(w, mapped, w.spec.graph.deps[mapped])
    if left:
        waiting[mapped] = left
    else:
        _collect(w, mapped)


def _collect(w: _Run, mapped: str) -> None:
    """Record a mapped step's output: its recorded items' outputs, in order."""
    shaped = w.spec.shaped
    assert shaped is not None
    output = collected(shaped.members[mapped], shaped.kinds[mapped], shaped.items, w.outputs)
    outputs = w.outputs = w.outputs.with_item(mapped, output)
    w.completed += 1
    if w.record:
        w.events.append(StepFinished(mapped, 1, NO_USAGE, None))
    children = w.spec.dependents[mapped]
    if children:
        _count_down(w, children, outputs, w.spec.graph.index)
    for waiting in shaped.waits.get(mapped, ()):
        _item_settled(w, waiting)
    if shaped.per_item:  # a child per item's output step: its parent hands it on
        _hand_on_to_parent(w, mapped)


def _hand_on_to_parent(w: _Run, mapped: str) -> None:
    """``mapped`` is recorded: if it is a child per item's output step, its parent (not
    recorded yet, and selected) records its output (a resume may find it recorded by a run
    whose ``only`` left the parent out)."""
    shapes = w.spec.declared_graph.shapes
    parent = next((p for p in cast(Expansion, w.spec.shaped).per_item
                   if shapes[p].child == mapped), None)
    only = w.spec.limits.only
    if parent is not None and parent not in w.outputs and (only is None or parent in only):
        _hand_on(w, parent, w.outputs[mapped])


def _hand_on(w: _Run, step: str, output: Any) -> None:
    """Record ``output`` as ``step``'s own (a step that runs a child per item, once its
    child's output step collected), and pass it on as any recorded output."""
    outputs = w.outputs = w.outputs.with_item(step, output)
    w.completed += 1
    if w.record:
        w.events.append(StepFinished(step, 1, NO_USAGE, None))
    children = w.spec.dependents.get(step, ())
    if children:
        _count_down(w, children, outputs, w.spec.graph.index)
    shaped = cast(Expansion, w.spec.shaped)
    if step in shaped.expanders:
        _expand(w, step)
    if shaped.per_item_over and step in shaped.per_item_over:
        _grow_children(w, step)
    for waiting in shaped.waits.get(step, ()):
        _item_settled(w, waiting)


def _map_failed(w: _Run, mapped: str, why: str) -> None:
    """A mapped step whose input has no items fails (its input stays recorded)."""
    error = MapError(why)
    inc = w.setbacks
    record = FailureRecord("MapError", storable_text(why), 1)
    w.setbacks = _replace(inc, failures=MappingProxyType({**inc.failures, mapped: record}),
                          errors=(*inc.errors, (mapped, error)))
    w.events.append(StepFailed(mapped, 1, "MapError", record.message, None))
    if not w.spec.limits.isolate_failures:
        w.halt(Halt("failed", mapped, f"MapError: {record.message}"))


# -- loops: one iteration at a time ---------------------------------------------------


def _start_loop(w: _Run, loop: str, checkpoint: WorkflowCheckpoint) -> None:
    """A run's first state grows ``loop`` by its recorded iterations, then by the next one
    (the first, in a fresh run): unless the loop is recorded, skipped, held, or its
    recorded iterations reach its cap (it fails again)."""
    only = w.spec.limits.only
    skipped = w.setbacks.skipped
    body = cast(Expansion, w.spec.shaped).bodies.get(loop)
    if loop in skipped:  # its first iteration, which waited for it, is skipped with it
        for step in body or (loop,):
            first = iteration_name(step, 1)
            skipped = w.setbacks.skipped
            if first not in skipped:  # (a run that held the loop never grew it: as a run would)
                deps = w.spec.declared_graph.deps[loop if body is None else step]
                gone = next((d for d in deps if d in skipped), loop)
                why = f"it needs {gone!r}, which was skipped"
                w.setbacks = _replace(w.setbacks, skipped=MappingProxyType({**skipped, first: why}))
                if w.record:
                    w.events.append(StepSkipped(first, why))
        _grow_iterations(w, loop, 1, 1)
        return
    if only is not None and loop not in only:
        held = checkpoint.compacted.get(loop, 0)
        done = _held_done(checkpoint, loop, body is not None)
        if done:  # (never grown, yet done: step_index counts them, as the run that did them)
            w.setbacks = _replace(w.setbacks, held_done=w.setbacks.held_done + done)
        if held:  # (never grown, its count is carried: else its own checkpoint is refused)
            shaped = cast(Expansion, w.spec.shaped)
            w.spec = _replace(w.spec, shaped=_replace(
                shaped, compacted=MappingProxyType({**shaped.compacted, loop: held})))
            _retried(w, checkpoint, loop)
        return
    outputs, cap = w.outputs, cast(int, w.spec.declared_graph.shapes[loop].repeat)
    compacted = checkpoint.compacted.get(loop, 0)
    last = compacted
    ends = _exit_of(w, loop)
    while iteration_name(ends, last + 1) in outputs:
        last += 1
    if compacted:
        if last == compacted and loop not in outputs:
            raise CheckpointError("compacted", f"compacts every recorded iteration of loop "
                                               f"{loop!r}: the last one is always kept")
        _grow_compacted(w, loop, compacted, checkpoint.compacted)
        _retried(w, checkpoint, loop)
    if loop in outputs or last >= cap:
        if last > compacted:
            _grow_iterations(w, loop, compacted + 1, last)
        if loop not in outputs:
            _loop_failed(w, loop, last, cap)
        return
    _grow_iterations(w, loop, compacted + 1, last + 1)


def _held_done(checkpoint: WorkflowCheckpoint, loop: str, body: bool) -> int:
    """How many done steps and items ``loop``'s iterations (kept, or compacted) stand for
    in ``checkpoint``: what its step_index counts of a loop a run with ``only`` holds."""
    inside = (f"{loop}#",) if not body else (f"{loop}/",)
    kept = sum(1 for n in checkpoint.outputs if n.startswith(inside) and (not body or "#" in n))
    counts = {k: c for k, c in checkpoint.compacted.items()
              if k == loop or (k.endswith("[]") and k.startswith(f"{loop}/"))}
    return kept + (compacted_done(checkpoint, counts) if counts else 0)


def _retried(w: _Run, checkpoint: WorkflowCheckpoint, loop: str) -> None:
    """A resume carries ``loop``'s ``compacted_retries`` from ``checkpoint`` (when it has any)."""
    spent = checkpoint.compacted_retries.get(loop)
    if spent:
        inc = w.setbacks
        w.setbacks = _replace(inc, compacted_retries=MappingProxyType({**inc.compacted_retries, loop: spent}))


def _exit_of(w: _Run, loop: str) -> str:
    """The step whose iterations decide ``loop``: itself, or its body's output step."""
    shaped = cast(Expansion, w.spec.shaped)
    if shaped.bodies and loop in shaped.bodies:
        return cast(str, w.spec.declared_graph.shapes[loop].child)
    return loop


def _iterations(w: _Run, loop: str, first: int, last: int) -> Expanded:
    """Iterations ``first`` to ``last`` of ``loop``: each of a one-step loop depends on the
    loop's dependencies and on the one before it; a body's, see ``body_iteration``."""
    graph = w.spec.declared_graph
    more = Expanded()
    body = cast(Expansion, w.spec.shaped).bodies.get(loop)
    if body is not None:
        for k in range(first, last + 1):
            body_iteration(graph, loop, body, k, more)
        return more
    deps = graph.deps[loop]
    for k in range(first, last + 1):
        name, before = iteration_name(loop, k), iteration_name(loop, k - 1) if k > 1 else ""
        more.steps[name] = (*deps, before) if before else deps
        more.items[name] = ItemRef(loop, str(k), before, None, k)
    return more


def _grow_compacted(w: _Run, loop: str, upto: int, recorded: Mapping[str, int]) -> None:
    """A resume knows ``loop``'s compacted iterations, 1 to ``upto``, as recorded: in the
    graph and counted, their outputs let go of (see ``_compact``); never started. The
    items of a body's maps in them are counted only (``recorded``: the checkpoint's counts),
    in step_index as ``held_done`` is: never in the graph, so never in the run's count of
    what it settled (else it ends before its last steps)."""
    more = _iterations(w, loop, 1, upto)
    shaped = cast(Expansion, w.spec.shaped).grown(more)
    counts = {**shaped.compacted, loop: upto}
    for step in shaped.bodies.get(loop, ()) if shaped.body_maps else ():
        key = items_compacted(step)
        if key in recorded:
            counts[key] = recorded[key]
            w.setbacks = _replace(w.setbacks, held_done=w.setbacks.held_done + recorded[key])
    w.spec = _replace(w.spec, graph=w.spec.graph.extended(more.steps), shaped=_replace(
        shaped, loops=MappingProxyType({**shaped.loops, loop: upto}),
        compacted=MappingProxyType(counts)))
    w.completed += len(more.steps)


def _grow_iterations(w: _Run, loop: str, first: int, last: int) -> None:
    """Grow the run by iterations ``first`` to ``last`` of ``loop`` (one growth, however
    many: a resume's)."""
    more = _iterations(w, loop, first, last)
    shaped = cast(Expansion, w.spec.shaped)
    loops = MappingProxyType({**shaped.loops, loop: last})
    if not shaped.body_maps or loop not in shaped.bodies:
        _grow(w, more, loops=loops)
        return
    maps = shaped.body_maps
    mapped = frozenset(iteration_name(m, k) for over in maps for m in maps[over]
                       for k in range(first, last + 1))
    _grow(w, more, mapped, loops)
    for name, ref in more.items.items():  # (a resume's: what recorded iterations mapped over)
        if ref.step in maps and name in w.outputs:
            _expand_in_body(w, name, ref)


def _iterated(w: _Run, name: str, ref: ItemRef) -> None:
    """Iteration ``name`` of a loop is recorded: the loop records its output if it ended
    (``Ended``); else a loop at its cap fails; else its next iteration is grown."""
    loop, k = ref.step, ref.iteration
    # (Annotated locals, not typing.cast, and the nesting's tables and the declared graph
    # read as fields, not through properties: this runs once per iteration.)
    spec = w.spec
    shaped: Expansion = spec.shaped  # type: ignore[assignment]
    declared = spec.declared if spec.declared is not None else spec.graph
    shapes = declared.shapes
    bodies = shaped.nesting.bodies
    if bodies:
        owner = shaped.nesting.in_body.get(loop)
        if owner is not None:  # a body step: its loop decides once its output step is recorded
            if shapes[owner].child != loop:
                return
            loop = owner
    shape = shapes[loop]
    if shape.keep_last is not None and k > shape.keep_last:
        _compact(w, loop, k - shape.keep_last)
        shaped = w.spec.shaped  # type: ignore[assignment]
    if name in shaped.ending:
        w.spec = _replace(w.spec, shaped=_replace(shaped, ending=shaped.ending - {name}))
        _end_loop(w, loop, name)
    elif k >= shape.repeat:  # type: ignore[operator]
        _loop_failed(w, loop, k, k)
    else:
        if (bodies and loop in bodies) or not _grow_next(w, declared, loop, name, k + 1):
            _grow_iterations(w, loop, k + 1, k + 1)
        if w.record:  # the run's total grows by one iteration: what a progress display counts
            w.events.append(StepExpanded(loop, len(bodies.get(loop, (loop,)))))


def _grow_next(w: _Run, declared: GraphSpec, loop: str, before: str, k: int) -> bool:
    """Grow iteration ``k`` of the one-step ``loop``, whose iteration ``before`` (``k-1``) was
    just recorded, as ``_grow_iterations`` does, in O(1): the usual growth of every
    iteration after the first, ready at once (its inputs are recorded: ``before`` and the
    loop's own), with one entry for each table but the dependents (nothing depends on an
    iteration but the next, grown once it is recorded: ``_after_recorded`` reads none as
    none, and the copy of that table cost an iteration 2.6k instructions). ``False`` (nothing
    done) for any other case, which ``_grow_iterations`` handles: an input not recorded, or
    the name recorded, skipped or asked about already."""
    spec, outputs = w.spec, w.outputs
    inputs = declared.deps[loop]
    name = f"{loop}#{k}"
    if name in outputs or (inputs and any(d not in outputs for d in inputs)) \
            or w.setbacks.asked or name in w.setbacks.skipped:
        return False
    shaped: Expansion = spec.shaped  # type: ignore[assignment]
    graph = grown_graph(spec.graph, name, (*inputs, before) if inputs else (before,))
    i = len(graph.names) - 1
    ready, offset = w.ready, w.offset  # ready at once: as _count_down makes a step ready
    if not (ready or w.running):
        w.offset, w.ready = i, 1
    elif ready < window.NARROW and offset <= i < offset + window.WIDTH:
        w.ready = ready | 1 << (i - offset)
    else:
        w.ready_later(i)
    items: Mapping[str, ItemRef] = shaped.items
    ref = item_ref(loop, str(k), before, None, k)
    if type(items) is MappingProxyType and len(items) <= appending.SMALL:  # (with_one's, inline)
        more = items.copy()
        more[name] = ref
        items = MappingProxyType(more)
    else:
        items = with_one(items, name, ref)
    w.spec = grown_spec(spec, graph, spec.dependents, grown_expansion(
        shaped, items, None, None, MappingProxyType({**shaped.loops, loop: k})), spec.held)
    return True


def _compact(w: _Run, loop: str, upto: int) -> None:
    """Let go of the outputs (and usage, durations, failure records, questions) of ``loop``'s
    iterations up to ``upto``: ``keep_last``. They stay recorded (counted in ``compacted``,
    never run again); the run's checkpoints no longer hold them, so a long loop's stay
    bounded. O(what is kept)."""
    shaped = cast(Expansion, w.spec.shaped)
    before = shaped.compacted.get(loop, 0)
    if upto <= before:
        return
    gone = {iteration_name(step, j) for step in shaped.bodies.get(loop, (loop,))
            for j in range(before + 1, upto + 1)}
    counts = {**shaped.compacted, loop: upto}
    if shaped.body_maps and loop in shaped.bodies:  # (and the items of a body's maps, counted)
        for name in list(gone):
            members = shaped.members.get(name, ())
            if members:
                key = items_compacted(shaped.items[name].step)
                counts[key] = counts.get(key, 0) + len(members)
                gone.update(members)
    w.outputs = Ledger({n: v for n, v in w.outputs.items() if n not in gone})
    if any(n in w.step_usage for n in gone):
        w.step_usage = Ledger({n: u for n, u in w.step_usage.items() if n not in gone})
    if w.times is not None:
        kept = _timings_without(w.times, gone)
        if kept is not None:
            w.times = kept
    inc = w.setbacks  # (their failure records and questions too: history kept per iteration)
    if shaped.body_maps and loop in shaped.bodies and (inc.failures or inc.asked):
        # (and those of items its maps no longer have: a bump re-decided the items, and the
        # old item's failure or question stayed recorded under the iteration compacted now)
        under = tuple(f"{iteration_name(step, j)}[" for step in shaped.bodies[loop]
                      for j in range(before + 1, upto + 1))
        gone.update(n for n in (*inc.failures, *inc.asked) if n.startswith(under))
    if not gone.isdisjoint(inc.failures) or not gone.isdisjoint(inc.asked):
        # (the most failed attempts of one is kept: a later run of them numbers past it)
        spent = max((inc.failures[n].attempts for n in gone if n in inc.failures), default=0)
        retries = inc.compacted_retries
        if spent > retries.get(loop, 0):
            retries = MappingProxyType({**retries, loop: spent})
        w.setbacks = _replace(
            inc, failures=MappingProxyType({n: r for n, r in inc.failures.items() if n not in gone}),
            asked=MappingProxyType({n: q for n, q in inc.asked.items() if n not in gone}),
            compacted_retries=retries)
    w.spec = _replace(w.spec, shaped=_replace(shaped, compacted=MappingProxyType(counts)))


def _timings_without(times: Timings, gone: set[str]) -> Timings | None:
    """``times`` without the entries of ``gone`` (``None``: it has none of them)."""
    durations = _timed(times)
    if not gone & durations.keys():
        return None
    began, held = _begun(times), _held_table(times)
    kept: Timings = MappingProxyType({n: d for n, d in durations.items() if n not in gone})
    for name, at in began.items():
        if name not in gone and name in durations:
            holds = held.get(name)
            kept = (name, durations[name], kept, at) if holds is None \
                else (name, durations[name], kept, at, holds)
    return kept


def _end_loop(w: _Run, loop: str, last: str) -> None:
    """Record the loop's output, its last iteration's, and pass it on as any recorded output.
    A body's steps record theirs too, their last iteration's (every one is recorded: each
    leads to the output step), so that the declared graph is recorded whole."""
    shaped = cast(Expansion, w.spec.shaped)
    body = shaped.bodies.get(loop) if shaped.bodies else None
    if body is not None:
        k = shaped.items[last].iteration
        for step in body:
            w.outputs = w.outputs.with_item(step, w.outputs[iteration_name(step, k)])
            w.completed += 1
            if w.record:
                w.events.append(StepFinished(step, 1, NO_USAGE, None))
    outputs = w.outputs = w.outputs.with_item(loop, w.outputs[last])
    w.completed += 1
    if w.record:
        w.events.append(StepFinished(loop, 1, NO_USAGE, None))
    children = w.spec.dependents.get(loop, ())
    if children:
        _count_down(w, children, outputs, w.spec.graph.index)
    shaped = cast(Expansion, w.spec.shaped)
    if loop in shaped.expanders:
        _expand(w, loop)
    if shaped.per_item_over and loop in shaped.per_item_over:  # (a child per item of it)
        _grow_children(w, loop)
    for waiting in shaped.waits.get(loop, ()):
        _item_settled(w, waiting)


def _loop_failed(w: _Run, loop: str, k: int, cap: int) -> None:
    """A loop whose ``k``-th iteration, at or past its cap (a resume's, after the cap was
    lowered), did not end it fails (its iterations stay); the reason names the cap."""
    why = (f"step {loop!r} did not end within repeat={cap} iterations: iteration {k} did not "
           "say it is done (return Done(value), or give until=)")
    inc = w.setbacks
    record = FailureRecord("LoopError", storable_text(why), 1)
    w.setbacks = _replace(inc, failures=MappingProxyType({**inc.failures, loop: record}),
                          errors=(*inc.errors, (loop, LoopError(why))))
    w.events.append(StepFailed(loop, 1, "LoopError", record.message, None))
    if not w.spec.limits.isolate_failures:
        w.halt(Halt("failed", loop, f"LoopError: {record.message}"))


def _skip(w: _Run, name: str, reason: str) -> None:
    """Skip ``name``, and every step or item that needs it, unless it joins ``"any"``."""
    # A dict of this skip's own, behind the proxy the rules read meanwhile.
    skips = dict(w.setbacks.skipped)
    w.setbacks = _replace(w.setbacks, skipped=MappingProxyType(skips))
    todo = [(name, reason)]
    while todo:
        step, why = todo.pop()
        if step in w.outputs or step in skips:  # (a collection below may record outputs)
            continue
        skips[step] = why
        only = w.spec.limits.only
        if only is not None and not selected(only, w.spec.shaped, step):
            w.spec = _replace(w.spec, held=w.spec.held - 1)  # settled, though never to start
        if w.record:
            w.events.append(StepSkipped(step, why))
        shaped = w.spec.shaped
        ref = shaped.items.get(step) if shaped is not None else None
        if ref is not None and not ref.iteration and (only is None or ref.step in only):
            _item_settled(w, ref.step)  # (a loop is skipped by its own dependency, not so)
        for child in _needing(w, step):
            if child in w.outputs or child in skips:
                continue
            why_child = _join_any(w, child) if _joins_any(w, child) else (
                f"it needs {step!r}, which was skipped")
            if why_child:
                todo.append((child, why_child))


def _needing(w: _Run, step: str) -> tuple[str, ...]:
    """What a skip of ``step`` reaches: its declared dependents (mapped ones included) and items."""
    declared = w.spec.declared_graph
    scheduled = w.spec.dependents.get(step, ())
    if step not in declared.index:
        only = w.spec.limits.only
        if only is not None:  # and the items a selective run holds that are chained to it
            scheduled = (*scheduled, *held_chained(declared, w.spec.graph, w.spec.shaped, only, step))
        return (*scheduled, *_body_maps_over(w, step))
    items = w.spec.shaped.items if w.spec.shaped is not None else {}
    return (*declared.dependents[step], *[c for c in scheduled if c in items])


def _body_maps_over(w: _Run, step: str) -> tuple[str, ...]:
    """The iteration ``L/m#k`` of each body map over ``step`` (``L/u#k``): a mapped step
    waits for its items, which are not grown yet, so nothing scheduled needs ``step``
    for it; a skip of ``step`` reaches it here."""
    shaped = w.spec.shaped
    if shaped is None or not shaped.body_maps:
        return ()
    ref = shaped.items.get(step)
    if ref is None or not ref.iteration or ref.step not in shaped.body_maps:
        return ()
    return tuple(name for m in shaped.body_maps[ref.step]
                 if (name := iteration_name(m, ref.iteration)) in shaped.items)


def _joins_any(w: _Run, step: str) -> bool:
    shape = w.spec.declared_graph.shapes.get(step)
    return shape is not None and shape.join == "any"


def _join_any(w: _Run, step: str) -> str:
    """A dependency of the ``join="any"`` step was skipped: ready once all are settled,
    if one ran; the reason to skip it too when none did; ``""`` while some are pending."""
    deps = w.spec.graph.deps[step]
    waiting = w.counts()
    left = waiting.pop(step, len(deps)) - 1
    if left:
        waiting[step] = left
        return ""
    if any(d in w.outputs for d in deps):
        only = w.spec.limits.only
        if only is None or step in only:  # (a join the run does not select never starts)
            w.ready_later(w.spec.graph.index[step])
        return ""
    return "every step it joins was skipped"


# -- starting attempts: plan, and the one way an attempt starts ----------------------


def _choose(spec: RunSpec, offset: int, ready: int, in_flight: int,
            inc: Setbacks) -> tuple[Start, ...]:
    """The starts :func:`plan` chooses: lowest ready bits first, within ``max_concurrency``."""
    if inc.halt is not None or not ready:
        return ()
    limits = spec.limits
    room = limits.max_concurrency
    if room is not None:
        room -= in_flight
        if room <= 0:
            return ()
    tries, delays, gate = inc.tries, inc.delays, limits.approval
    # One ready step, the whole batch of a chain: window.only_one and
    # window.single, inlined (see ekit_core.window).
    if not ready & (ready - 1) and not gate:
        name = spec.graph.names[offset + ready.bit_length() - 1]
        if name not in tries and name not in delays and not (spec.conditional and _asks(spec, name)):
            return (first_start(name),)
        asks = (name not in tries or name in inc.unanswered) and _asks(spec, name) and name not in inc.held
        return (Start(name, tries.get(name, 0) + 1, delays.get(name, 0.0), False, asks),)
    names = spec.graph.names
    conditional = spec.conditional  # (no step has a condition: no start asks one)
    if not (tries or delays or gate or conditional):  # plain first attempts: a fan-out's batch
        return tuple([first_start(names[offset + i]) for i in window.indices(ready, room)])
    starts = []
    for i in window.indices(ready, room):
        name = names[offset + i]
        # Its condition and approval are asked until they answer (see _unanswered).
        unanswered = name not in tries or name in inc.unanswered
        asks = conditional and unanswered and name not in inc.held and _asks(spec, name)
        starts.append(Start(name, tries.get(name, 0) + 1, delays.get(name, 0.0), gate and unanswered, asks))
    return tuple(starts)


def _asks(spec: RunSpec, name: str) -> bool:
    """Whether step (or item) ``name`` has a condition for the shell to ask before it begins.

    The caller asks it only until it has answered: before a first attempt,
    and again after an attempt whose condition raised (see :func:`_unanswered`).
    """
    shaped = spec.shaped
    if shaped is None or not spec.conditional:
        return False
    shapes = spec.declared_graph.shapes
    shape = shapes.get(name)
    if shape is None:
        ref = shaped.items.get(name)
        shape = None if ref is None else shapes.get(ref.step)
    return shape is not None and shape.when is not None


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
    if not (record or inc.delays or w.spec.limits.approval or w.spec.conditional):
        return
    gated = []
    for start in starts:
        name = start.name
        if name in inc.delays:
            inc = _replace(inc, delays=_without(inc.delays, name))
        if start.gated:
            gated.append(start)
        elif record:
            w.events.append(StepStarted(name, start.attempt, start.delay))
    w.setbacks = inc
    if gated:
        w.gated().update((start.name, start.delay) for start in gated)


def _launch(w: _Run) -> Batch:
    """What :func:`advance` adds to :func:`apply`: start what :func:`plan` would."""
    if w.done or w.fresh:
        w.settle()
    starts = _choose(w.spec, w.offset, w.ready, w.in_flight, w.setbacks)
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
    starts = _choose(state.spec, state._offset, state._ready, state._in_flight, inc)
    withdraw = _withdrawn(inc)
    return Batch(starts, withdraw) if starts or withdraw else _EMPTY


# -- the table: (phase, input) -> next phase, effect ----------------------------------

_EITHER_END = (Phase.READY, Phase.DELAYED, Phase.FAILED)

TRANSITIONS: Mapping[tuple[Phase | None, type | Trigger], Row] = MappingProxyType({
    (Phase.READY, Start): Row(
        (Phase.RUNNING, Phase.GATED), _start,
        "its attempt starts (not in a halted run, within `max_concurrency`); gated while "
        "it first asks its condition or approval (`Start.gates`)"),
    (Phase.DELAYED, Start): Row(
        (Phase.GATED,), _start, "its retry starts by waiting out its delay (`Start.gates`)"),
    (Phase.GATED, Began): Row((Phase.RUNNING,), _began, "its work begins: `StepStarted` now"),
    (Phase.RUNNING, Succeeded): Row(
        (Phase.RECORDED,), _succeeded,
        "its output and usage are recorded (dependency recorded, input recorded); a budget "
        "the usage reaches halts the run"),
    (Phase.GATED, Succeeded): Row(
        (Phase.RECORDED,), _began_and_succeeded,
        "as from running: its work began (a shell that does not report `Began`)"),
    (Phase.RUNNING, Failed): Row(
        _EITHER_END, _failed,
        "retried by its policy unless the run is halting (delayed by its backoff, or ready); "
        "else failed: the run halts, or only its branch waits (`isolate_failures`)"),
    (Phase.GATED, Failed): Row(
        _EITHER_END, _failed,
        "as from running; its condition or approval raised, so its next attempt asks again "
        "(`Setbacks.unanswered`)"),
    (Phase.GATED, Denied): Row(
        (Phase.READY,), _denied, "its approval was refused: the run halts (`denied`)"),
    (Phase.RUNNING, Interrupted): Row((Phase.READY,), _interrupted, "cancelled in flight"),
    (Phase.GATED, Interrupted): Row(
        (Phase.READY,), _interrupted, "withdrawn or cancelled before its work began"),
    (Phase.RUNNING, Asked): Row(
        (Phase.ASKED,), _asked, "its question is recorded; nothing that needs it starts"),
    (Phase.RUNNING, Ended): Row(
        (Phase.RECORDED,), _ended,
        "an iteration's output is recorded, and its loop records it as its own (iteration "
        "recorded)"),
    (Phase.GATED, Ended): Row(
        (Phase.RECORDED,), _began_and_ended,
        "as from running: its work began (a shell that does not report `Began`)"),
    (Phase.GATED, Asked): Row(
        (Phase.ASKED,), _began_and_asked,
        "as from running: its work began (a shell that does not report `Began`)"),
    (Phase.GATED, Skipped): Row(
        (Phase.SKIPPED,), _skipped, "its condition was false (dependency skipped)"),
    (None, Cancelled): Row((), _cancelled, "the run halts (`cancelled`); attempts in flight end"),
    (Phase.WAITING, Trigger.DEPENDENCY_RECORDED): Row(
        (Phase.WAITING, Phase.READY), _count_down, "counted down: ready at zero"),
    (Phase.COLLECTING, Trigger.DEPENDENCY_RECORDED): Row(
        (Phase.COLLECTING, Phase.RECORDED), _item_settled,
        "a mapped step whose items are settled records their outputs once its dependencies are"),
    (Phase.WAITING, Trigger.DEPENDENCY_SKIPPED): Row(
        (Phase.SKIPPED, Phase.WAITING, Phase.READY), _skip,
        "skipped, unless it joins alternatives (`join=\"any\"`): then ready once every "
        "dependency is settled and one ran, skipped if none did"),
    (Phase.LOOPING, Trigger.DEPENDENCY_SKIPPED): Row(
        (Phase.SKIPPED,), _skip, "a loop is skipped with its waiting first iteration"),
    (Phase.COLLECTING, Trigger.DEPENDENCY_SKIPPED): Row(
        (Phase.SKIPPED,), _skip, "a mapped step is skipped, whatever its items did"),
    (Phase.HELD, Trigger.DEPENDENCY_SKIPPED): Row(
        (Phase.SKIPPED,), _skip, "a step the run does not select is settled by the skip"),
    (Phase.WAITING, Trigger.INPUT_RECORDED): Row(
        (Phase.COLLECTING, Phase.RECORDED, Phase.FAILED), _expand,
        "a mapped step expands into its items (collected at once if all are settled; an "
        "input that has no items fails it with `MapError`)"),
    (Phase.COLLECTING, Trigger.ITEMS_SETTLED): Row(
        (Phase.COLLECTING, Phase.RECORDED), _item_settled,
        "its items' outputs, in order, are recorded as its own once its dependencies are"),
    (Phase.LOOPING, Trigger.ITERATION_RECORDED): Row(
        (Phase.LOOPING, Phase.RECORDED, Phase.FAILED), _iterated,
        "its next iteration is grown; an iteration that said it is done (`Ended`) ends it: "
        "its output is recorded as the loop's; at its cap (`repeat`) it fails with `LoopError`"),
    (Phase.GATED, Trigger.RUN_HALTED): Row(
        (Phase.GATED,), _withdrawn,
        "withdrawn: `plan` names it in `Batch.withdraw`, the shell interrupts it"),
})
"""The table of the fold: a step's phase and an input -> the phases it may move to and the
effect that moves it (see :mod:`ekit_core.phases`). The shell's inputs name their step
and are looked up here by :func:`_fold`; a pair with no row is refused. The triggers are
the effects' own consequences for *other* steps, which the property tests check against
their rows."""

def _phase_now(w: _Run, name: str) -> Phase:
    """The phase of step ``name`` in the working copy, pending bits applied."""
    w.bit(name)  # (unknown: refused; else settles)
    return _reading(w.spec, w.outputs, w.setbacks, (w.offset, w.ready, w.running), name)


def _by_phase(kind: type, rows: Mapping[Phase | None, Callable[[_Run, Any], None]]
              ) -> Callable[[_Run, Any], None]:
    """The fold's entry for inputs of ``kind``: read the phase of the input's step, run the
    effect of its row, refuse a phase with none."""
    if None in rows:  # an input about the run: one row, whatever any step's phase
        return rows[None]

    def fold_in(w: _Run, item: Any) -> None:
        phase = _phase_now(w, item.name)
        effect = rows.get(phase)
        if effect is None:
            raise _no_row(kind, item.name, phase)
        effect(w, item)

    fold_in.__name__ = fold_in.__qualname__ = f"fold_{kind.__name__}"
    return fold_in


def _compiled(table: Mapping[tuple[Phase | None, type | Trigger], Row]
              ) -> dict[type, Callable[[_Run, Any], None]]:
    """The table as the fold reads it: one entry per input type (one dict lookup per input).

    The entry of ``Succeeded`` is its running row's effect itself, whose first
    test (the bit of a step in flight, which it clears anyway) reads the phase
    of the hot path of every run; any other phase goes the general way,
    ``_succeeded_elsewhere``. The property tests check both against the table.
    """
    rows: dict[type, dict[Phase | None, Callable[[_Run, Any], None]]] = {}
    for (phase, kind), row in table.items():
        if isinstance(kind, type):
            rows.setdefault(kind, {})[phase] = row.effect
    compiled = {kind: _by_phase(kind, by_phase) for kind, by_phase in rows.items()}
    global _succeeded_elsewhere
    _succeeded_elsewhere = compiled[Succeeded]
    compiled[Succeeded] = _succeeded
    return compiled


_succeeded_elsewhere: Callable[[_Run, Any], None]
"""A success of a step that is not plainly running: its row by its phase (see ``_compiled``)."""

RULES: Mapping[type, Callable[[_Run, Any], None]] = MappingProxyType(_compiled(TRANSITIONS))
"""The table as the fold reads it: each kind of input and the entry that folds it in."""


def _rule_of(item: object) -> Callable[[_Run, Any], None]:
    """The entry of an input of a subclass of an input type (the table is keyed by exact type)."""
    for kind, rule in RULES.items():
        if isinstance(item, kind):
            return rule
    raise TransitionError(f"cannot fold {type(item).__name__} {item!r} into a state")


def _no_row(kind: type, name: str, phase: Phase | None) -> TransitionError:
    """The one refusal of an input its step's phase has no row for: step, phase, input."""
    takes = " or ".join(p.value for p, k in TRANSITIONS if k is kind and p is not None)
    return TransitionError(
        f"{kind.__name__} for step {name!r}, which is {phase}: no row of the phase table "
        f"takes {kind.__name__} there (only when {takes})")


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
    """The working copy of ``state`` with every input folded in by its row of :data:`TRANSITIONS`:
    its step's phase read, the row of (phase, input) looked up, its effect run."""
    w = _thaw(state, record)
    rules = RULES
    for item in inputs:
        rule = rules.get(type(item))
        (rule or _rule_of(item))(w, item)
    return w


def _freeze(w: _Run) -> State:
    """The state a fold ends in: pending bits applied, its outcome decided, frozen.

    The copy is anchored (its window, its countdowns read-only) and handed
    over whole: :func:`state_of_run` reads its fields by name.
    """
    if w.done or w.fresh:
        w.settle()
    gated: Mapping[str, float] = w.setbacks.gated
    if type(gated) is dict:  # the fold's own (see _Run.gated): frozen read-only
        w.setbacks = _replace(w.setbacks, gated=MappingProxyType(gated))
    outcome = None
    if not w.in_flight:  # else the run goes on: no need to ask
        total = len(w.spec.graph.names)
        settled = w.completed + len(w.setbacks.skipped)
        # (held: the steps a run with ``only`` never settles; 0 without it)
        outcome = outcome_of(settled, total - w.spec.held, 0, w.ready, w.setbacks)
        if outcome is not None and not w.before.settled:
            w.events.append(RunSettled(outcome, w.completed, total, w.cost, w.spec.held,
                                       len(w.setbacks.skipped)))
    both = w.ready | w.running
    if both and not both & 1:  # (the test of window.anchor, inlined: a chain's never moves)
        w.offset, w.ready, w.running = window.anchor(w.offset, w.ready, w.running)
    if type(w.waiting) is dict:  # the fold's own countdowns: frozen read-only
        w.waiting = MappingProxyType(w.waiting)
    return state_of_run(w, tuple(w.events) if w.record else (), outcome)


_StateTwin = twin(State)  # (see ekit_core._frozen)


def state_of_run(w: _Run, events: tuple[Event, ...], outcome: Outcome | None) -> State:
    """The :class:`~ekit_core.State` a transition's working copy ``w`` freezes into.

    Each field is ``w``'s field of the same name (its bit window anchored,
    its countdowns read-only, by the caller); ``events`` and ``outcome`` are
    what the caller decided. Equal to ``State(...)`` of those fields, built
    through a twin (see :mod:`ekit_core._frozen`): once per transition.
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
    made: State = state  # (not typing.cast: a Python call per value built; see _frozen)
    return made


# -- helpers -------------------------------------------------------------------------


def _without(table: Mapping[str, Any], name: str) -> MappingProxyType[str, Any]:
    return MappingProxyType({k: v for k, v in table.items() if k != name})
