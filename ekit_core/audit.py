"""Auditing a recorded checkpoint: what a resume would skip and run, and why.

This module owns the explanation of a resume. :func:`audit` reads one
checkpoint against a graph and returns an :class:`AuditReport` with one
:class:`StepAudit` row per step, in declaration order, and the
:class:`Anomaly` values it found. The rule it explains is invariant 1: the
steps a resume skips are exactly those with a recorded output that is not
outdated (a step whose version tag or dependencies changed runs again, with
everything downstream of it: :func:`~ekit_core.rewind.outdated_steps`); a
recorded failure is not an output, so a failed step runs again.

Each anomaly kind is found by one named check (``_CHECKS``, in the order
they are reported); each uses the core's own function for the rule it
checks, so that audit cannot drift from what a resume does. Everything here
is pure: the same graph and checkpoint always give the same report, and
nothing it is given is changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Literal, cast

from ekit_core import transitions as _rules
from ekit_core.checkpoint import CheckpointError, FailureRecord, WorkflowCheckpoint
from ekit_core.code import CacheHit, CodeDecision, code_changed, decide
from ekit_core.exchanges import Exchange
from ekit_core.expansion import (
    Expanded,
    bodies_of,
    body_iteration,
    children_per_item,
    compacted_iteration,
)
from ekit_core.graph import GraphSpec
from ekit_core.report import (
    GraphSource,
    count,
    findings,
    load_checkpoint,
    mismatch,
    needs_of,
    seconds_text,
    source_line,
    subject_of,
    table,
    usage_text,
)
from ekit_core.rewind import grown, outdated_steps, without, without_questions
from ekit_core.shapes import iteration_name
from ekit_core.times import when
from ekit_core.transitions import context_outputs, dependencies_recorded, initial_state
from ekit_core.usage import TokenUsage

__all__ = ["Anomaly", "AuditReport", "StepAudit", "audit", "changed_since_recorded"]

_NO_CODE = CodeDecision(MappingProxyType({}))

Action = Literal["skip", "run", "wait"]
Reason = Literal["recorded", "outdated", "ready", "failed", "waiting", "skipped", "mapped",
                 "asked", "denied", "looping"]


@dataclass(frozen=True, slots=True)
class StepAudit:
    """What a resume from the audited checkpoint does with one step, and why.

    ``action`` is ``"skip"`` (its output is recorded and up to date) or
    ``"run"``. ``reason`` is ``"recorded"`` for a skip; for a run it is
    ``"outdated"`` (its output is recorded, but its version tag or its
    dependencies changed, or one of its dependencies runs again: see
    ``outdated``), ``"failed"`` (a failure is recorded, see ``failure``),
    ``"waiting"`` (never recorded and some dependencies are not recorded
    either, see ``waiting_on``) or ``"ready"`` (never recorded, every
    dependency recorded: it starts at once). ``usage`` is the step's
    recorded token usage, when the checkpoint has it.

    In a graph with run-time shapes a row is a step or an item
    (``item_of`` names the mapped step of an item ``summarize[2]``).
    ``"skipped"`` is a skip recorded by a condition (``skipped`` says why),
    which a resume keeps: its action is ``"skip"``. ``"mapped"`` is a
    mapped step whose output is not recorded: it runs as its items, and is
    collected once they are and its own dependencies are too (``waiting_on``
    names those not recorded once its items are all settled); ``items`` is
    how many it has (``None`` while what it maps over is not recorded) and
    ``items_recorded`` how many of those are recorded or skipped.

    A loop (``repeat=``) is listed iteration by iteration: a row per
    recorded iteration (``item_of`` names the loop), then the iteration a
    resume runs next, then the loop's own row. ``"looping"`` is a loop whose
    output is not recorded: it runs as its iterations, and ``items_recorded``
    counts those done (compacted ones too), ``items`` its cap.

    A step (or item) that asked a person (``ekit_runtime.ask``, ``approve``)
    lists its questions and their answers in ``asked`` (who answered what,
    and when), whatever its action. One whose last question is unanswered
    has action ``"wait"`` and reason ``"asked"``: a resume leaves it waiting
    until an answer is recorded. One whose approval was denied has action
    ``"wait"`` and reason ``"denied"``: a resume ends denied without running it.

    ``duration`` is the seconds the attempt that made the step's recorded
    output took, when the checkpoint has it (``durations``).
    """

    name: str
    action: Action
    reason: Reason
    depends_on: tuple[str, ...]
    waiting_on: tuple[str, ...] = ()
    failure: FailureRecord | None = None
    usage: TokenUsage | None = None
    outdated: str | None = None
    skipped: str | None = None
    item_of: str | None = None
    items: int | None = None
    items_recorded: int = 0
    asked: tuple[Exchange, ...] = ()
    duration: float | None = None
    code: str | None = None
    cache_hit: CacheHit | None = None

    @property
    def why(self) -> str:
        """One human-readable line explaining ``action`` (and who answered what, if it asked)."""
        why = self._why()
        if self.code is not None:
            why = f"{why}; {self.code}"
        if self.cache_hit is not None:
            why = (f"{why}; handed back by the cache (entry {self.cache_hit.key[:12]}), "
                   f"saving {usage_text(self.cache_hit.saved)}")
        if not self.asked:
            return why
        return "; ".join([why, *(_answered(i, e) for i, e in enumerate(self.asked, 1)
                                 if e.answer is not None)])

    def _why(self) -> str:
        if self.reason == "asked":
            return (f"waits for a person's answer to question {len(self.asked)}: "
                    f"{self.asked[-1].question.prompt!r}")
        if self.reason == "denied":
            return "its approval was denied: a resume ends denied without running it"
        if self.reason == "recorded":
            return "output recorded"
        if self.reason == "skipped":
            return f"skipped: {self.skipped}"
        if self.reason == "mapped":
            return self._mapped_why()
        if self.reason == "looping":
            done = count(self.items_recorded)
            if self.waiting_on:
                return "waiting on " + ", ".join(self.waiting_on) + "; then iteration 1 runs"
            return (f"{done} iteration(s) done; iteration {self.items_recorded + 1} runs next "
                    f"(at most {count(self.items or 0)})")
        if self.outdated is not None:
            parts = [f"output recorded but outdated: {self.outdated}"]
        elif self.failure is not None:
            f = self.failure
            times = "once" if f.attempts == 1 else f"{count(f.attempts)} times"
            parts = [f"recorded as failed {times}: {f.error_type}: {f.message}"]
        else:
            parts = ["never recorded"]
        if self.waiting_on:
            parts.append("waiting on " + ", ".join(self.waiting_on))
        elif self.reason == "ready":
            parts.append("ready to start")
        return "; ".join(parts)

    def _mapped_why(self) -> str:
        """``why`` of a mapped step whose output is not recorded."""
        if self.items is None:
            waiting = ", ".join(self.waiting_on)
            return f"waiting on {waiting}; then expands into one item per element of its input"
        if not self.items:
            return "no items: collected empty once its dependencies are recorded"
        if not self.items_recorded:
            return f"would expand into {count(self.items)} item(s)"
        left = self.items - self.items_recorded
        if not left and self.waiting_on:
            return (f"{count(self.items)} item(s) recorded or skipped; waiting on "
                    + ", ".join(self.waiting_on) + ", then collected")
        return (f"{count(self.items_recorded)} of {count(self.items)} item(s) recorded or "
                f"skipped, {count(left)} to run; collected once all are")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe data."""
        return {
            "name": self.name,
            "action": self.action,
            "reason": self.reason,
            "why": self.why,
            "depends_on": list(self.depends_on),
            "waiting_on": list(self.waiting_on),
            "failure": None if self.failure is None else self.failure.to_dict(),
            "usage": None if self.usage is None else self.usage.to_dict(),
            "outdated": self.outdated,
            "skipped": self.skipped,
            "item_of": self.item_of,
            "items": self.items,
            "items_recorded": self.items_recorded,
            "asked": [e.to_dict() for e in self.asked],
            "duration": self.duration,
            "code": self.code,
            "cache_hit": None if self.cache_hit is None else self.cache_hit.to_dict(),
        }


def _answered(number: int, exchange: Exchange) -> str:
    """Who answered question ``number``, when, and what."""
    given = exchange.answer
    assert given is not None
    by = f" by {given.by}" if given.by else ""
    at = f" at {when(given.at)}" if given.at is not None else ""
    if given.approved is None:
        what = repr(given.value)
    else:
        what = ("approved" if given.approved else "denied") + (f" ({given.reason})" if given.reason else "")
    return f"question {number} ({exchange.question.prompt!r}) answered{by}{at}: {what}"


AnomalyKind = Literal[
    "fingerprint_mismatch",
    "graph_fingerprint",
    "unknown_output",
    "missing_dependency",
    "unknown_failure",
    "context_collision",
    "budget_reached",
    "resume_refused",
    "code_changed",
]


@dataclass(frozen=True, slots=True)
class Anomaly:
    """Something in the checkpoint that a clean run of the graph would not have recorded.

    ``kind`` is one of:

    - ``"fingerprint_mismatch"``: the checkpoint was recorded from another
      graph (the message is the one a resume refuses it with);
    - ``"graph_fingerprint"``: the graph the checkpoint records does not hash
      to the fingerprint it records (edited by hand, or corrupted);
    - ``"unknown_output"``: an output is recorded for a name that is not a step
      (a step since removed, or an initial-context key that ExecutionKit
      stored among the outputs);
    - ``"missing_dependency"``: a step's output is recorded but the output of
      one of its dependencies is not;
    - ``"unknown_failure"``: a failure is recorded for a name that is not a step;
    - ``"context_collision"``: a key of the recorded context is also a step
      name, so a resume from the checkpoint is refused;
    - ``"budget_reached"``: the recorded usage already reaches the budget
      given to :func:`audit`, so a resume with that budget starts no step;
    - ``"resume_refused"``: anything else a resume from the checkpoint
      would refuse, with the core's reason;
    - ``"code_changed"``: the code of a recorded step whose policy is
      ``"refuse"`` changed since recorded (see :mod:`ekit_core.code`): a
      resume raises :class:`~ekit_core.code.CodeChangedError`.

    ``step`` names the step or key concerned, ``None`` for the whole checkpoint.
    """

    kind: AnomalyKind
    step: str | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe data."""
        return {"kind": self.kind, "step": self.step, "message": self.message}


@dataclass(frozen=True, slots=True)
class AuditReport:
    """The audit of one checkpoint against one graph. ``clean`` when no anomaly was found.

    ``graph_source`` says where the graph came from: ``"given"`` by the caller,
    or ``"checkpoint"``, the graph the checkpoint recorded (when no graph was
    given).
    """

    steps: tuple[StepAudit, ...]
    anomalies: tuple[Anomaly, ...]
    graph_source: GraphSource
    fingerprint: str
    recorded_fingerprint: str | None
    format_version: int
    step_index: int
    cost: TokenUsage

    @property
    def clean(self) -> bool:
        """True when no anomaly was found."""
        return not self.anomalies

    @property
    def skipped(self) -> tuple[str, ...]:
        """Steps a resume skips, in declaration order."""
        return tuple(s.name for s in self.steps if s.action == "skip")

    @property
    def to_run(self) -> tuple[str, ...]:
        """Steps a resume runs, in declaration order."""
        return tuple(s.name for s in self.steps if s.action == "run")

    @property
    def waiting(self) -> tuple[str, ...]:
        """Steps (and items) that wait for a person's answer or whose approval was denied."""
        return tuple(s.name for s in self.steps if s.action == "wait")

    @property
    def outdated(self) -> tuple[str, ...]:
        """Steps whose recorded output a resume discards and runs again, in declaration order."""
        return tuple(s.name for s in self.steps if s.reason == "outdated")

    def step(self, name: str) -> StepAudit:
        """The row of step ``name``; ``KeyError`` if there is none."""
        for row in self.steps:
            if row.name == name:
                return row
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe data (outputs themselves are never included)."""
        return {
            "clean": self.clean,
            "graph_source": self.graph_source,
            "fingerprint": self.fingerprint,
            "recorded_fingerprint": self.recorded_fingerprint,
            "format_version": self.format_version,
            "step_index": self.step_index,
            "cost": self.cost.to_dict(),
            "skip": list(self.skipped),
            "run": list(self.to_run),
            "wait": list(self.waiting),
            "outdated": list(self.outdated),
            "steps": [s.to_dict() for s in self.steps],
            "anomalies": [a.to_dict() for a in self.anomalies],
        }

    def format(self) -> str:
        """A readable table: one line per step, then the anomalies."""
        outdated = f" ({count(len(self.outdated))} outdated)" if self.outdated else ""
        what = "step(s)"
        if any(s.item_of is not None or s.reason in ("skipped", "mapped") for s in self.steps):
            by_condition = sum(1 for s in self.steps if s.reason == "skipped")
            what = f"step(s) and item(s) ({count(by_condition)} skipped by a condition)"
        rows: list[tuple[str, ...]] = [
            (s.name, s.action, "-" if s.usage is None else usage_text(s.usage), s.why)
            for s in self.steps
        ]
        header: tuple[str, ...] = ("STEP", "ACTION", "USAGE in/out/calls", "WHY")
        if any(s.duration is not None for s in self.steps):  # (a column only when there are some)
            header = ("STEP", "ACTION", "USAGE in/out/calls", "TIME", "WHY")
            rows = [(*r[:3], "-" if s.duration is None else seconds_text(s.duration), r[3])
                    for r, s in zip(rows, self.steps, strict=True)]
        waits = f", waits on {count(len(self.waiting))} (a person's answer)" if self.waiting else ""
        return "\n".join([
            source_line(self.graph_source, self.fingerprint, plural=False),
            f"checkpoint: format {self.format_version}, step_index {count(self.step_index)}, "
            f"usage {usage_text(self.cost)}",
            f"resume skips {count(len(self.skipped))} {what}, runs "
            f"{count(len(self.to_run))}{outdated}{waits}",
            "",
            *table(header, rows),
            "",
            *findings([f"{a.kind}: {a.message}" for a in self.anomalies], "anomaly(ies)", "no anomalies"),
        ])


def audit(
    graph_or_workflow: GraphSpec | object | None,
    checkpoint: WorkflowCheckpoint | Mapping[str, Any],
    *,
    budget: TokenUsage | None = None,
    versions: Mapping[str, str] | None = None,
) -> AuditReport:
    """Explain what resuming ``checkpoint`` into the graph would skip and run, and why.

    ``graph_or_workflow`` is a :class:`GraphSpec`, a ``Workflow`` (anything
    with a ``graph`` attribute holding one; its steps' ``version`` tags are
    used too), or ``None`` to audit against the graph the checkpoint records
    (``report.graph_source == "checkpoint"``). ``checkpoint`` may be a
    :class:`WorkflowCheckpoint` or its dict. ``budget`` is the budget a
    resume would be given, if any: a checkpoint whose recorded usage already
    reaches it is reported (``budget_reached``). ``versions`` (step name ->
    tag) are the tags the resuming steps declare, for a bare ``GraphSpec``;
    without them a ``GraphSpec`` (or the recorded graph) is taken to keep
    the recorded tags.

    A recorded step whose tag differs from the checkpoint's ``versions``
    entry, or whose dependencies differ from the recorded graph's, is
    ``outdated``: it runs again, with everything downstream of it, as the
    resume would (with ``allow_graph_change=True``, for a changed graph).

    Everything a resume would refuse is an anomaly: a graph mismatch
    (``fingerprint_mismatch``, with the steps added, removed and changed), a
    context key that is also a step name (``context_collision``), and, as a
    backstop, anything else :func:`~ekit_core.initial_state` refuses
    (``resume_refused``).

    Raises ``ValueError`` for a graph that is neither, a malformed checkpoint
    (:class:`~ekit_core.CheckpointError`), ``None`` with a checkpoint that
    records no graph, a ``budget`` that is not a non-negative
    :class:`~ekit_core.TokenUsage`, or ``versions`` naming unknown steps or
    holding tags that are not strings.
    """
    audited, source = _audited(graph_or_workflow, checkpoint, budget, versions)
    graph, cp = audited.graph, audited.cp
    return AuditReport(
        steps=_with_hits(_with_code(_timed(_with_questions(_rows(audited), _kept_questions(audited)),
                                           cp.durations), audited.code), cp.cache_hits),
        anomalies=tuple(a for check in _CHECKS for a in check(audited)),
        graph_source=source,
        fingerprint=graph.fingerprint,
        recorded_fingerprint=cp.fingerprint,
        format_version=cp.format_version,
        step_index=cp.step_index,
        cost=cp.cost,
    )


@dataclass(frozen=True, slots=True)
class _Audited:
    """What every check reads: the graph, the checkpoint, the resume's arguments, what is outdated."""

    graph: GraphSpec
    cp: WorkflowCheckpoint
    budget: TokenUsage | None
    versions: Mapping[str, str]
    outdated: Mapping[str, str]
    # The outputs a resume keeps (outdated ones dropped), and in a shaped
    # graph the items they expand into, the skips it keeps, and the items
    # that all the recorded outputs expand into (the same when none is outdated).
    kept: Mapping[str, Any]
    items: Expanded
    skips: Mapping[str, str]
    recorded: Expanded
    # What a resume does with each step's code (ekit_core.code), for a workflow that fingerprints it.
    code: CodeDecision = _NO_CODE


def _audited(
    graph_or_workflow: object, checkpoint: object, budget: TokenUsage | None,
    versions: Mapping[str, str] | None,
) -> tuple[_Audited, GraphSource]:
    """The checkpoint loaded, the graph and tags resolved, the arguments checked."""
    try:
        cp = load_checkpoint(checkpoint)
    except CheckpointError:
        raise
    except ValueError as exc:
        raise ValueError(f"checkpoint: {exc}") from None
    subject = subject_of(graph_or_workflow, cp, versions)
    graph = subject.graph
    tags = subject.versions
    if tags is None:  # not known: the recorded ones, for the steps this graph has
        tags = {k: v for k, v in cp.versions.items() if k in graph.index}
    # The rules a run applies to these arguments, asked without the
    # checkpoint, so that bad arguments raise rather than read as a refusal.
    _rules.initial_state(graph, budget=budget, versions=tags)
    code = _code_of(graph_or_workflow, graph, cp)
    outdated = outdated_steps(graph, cp, tags, code.fingerprints)
    kept: Mapping[str, Any] = without(cp, graph, outdated).outputs
    if not graph.shapes:
        nothing = Expanded()
        return (_Audited(graph, cp, budget, tags, outdated, kept, nothing, {}, nothing, code),
                subject.source)
    # What a resume keeps, by the core's own rule: the items and skips below a
    # step that runs again go with it (some items set aside for an early cutoff).
    resumed = _rules.kept_on_resume(graph, cp, outdated, tags, code.fingerprints)
    kept, skips = resumed.outputs, resumed.skipped
    recorded = grown(graph, cp.outputs)
    items = recorded if len(kept) == len(cp.outputs) else grown(graph, kept)
    kept = _collected_at_start(graph, items, kept, skips)
    return (_Audited(graph, cp, budget, tags, outdated, kept, items, skips, recorded, code),
            subject.source)


def _code_of(graph_or_workflow: object, graph: GraphSpec, cp: WorkflowCheckpoint) -> CodeDecision:
    """What a resume does with each step's code: read off a workflow that fingerprints it
    (its ``code_fingerprints()`` and ``code_policies``), decided by the core's rule."""
    policies = getattr(graph_or_workflow, "code_policies", None)
    current = getattr(graph_or_workflow, "code_fingerprints", None)
    if not policies or not callable(current):
        return _NO_CODE
    return decide(graph.names, cp.code_fingerprints, current(), policies, cp.outputs)


def _with_hits(rows: tuple[StepAudit, ...], hits: Mapping[str, CacheHit]) -> tuple[StepAudit, ...]:
    """The rows of the outputs a resume keeps that the cache handed back, saying so."""
    if not hits:
        return rows
    return tuple(replace(row, cache_hit=hits[row.name])
                 if row.action == "skip" and row.name in hits else row for row in rows)


def _with_code(rows: tuple[StepAudit, ...], code: CodeDecision) -> tuple[StepAudit, ...]:
    """The rows of the steps whose policy keeps them although their code changed, saying so
    (one that runs again all the same, with a dependency, says its code changed too)."""
    if not code.kept:
        return rows
    kept = set(code.kept)
    return tuple(replace(row, code="kept although the code changed since recorded" if row.action == "skip"
                         else "its code changed since recorded too (on_code_change='keep')")
                 if row.name in kept else row for row in rows)


def changed_since_recorded(
    graph_or_workflow: GraphSpec | object, checkpoint: WorkflowCheckpoint | Mapping[str, Any],
    *, versions: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Each step with something recorded whose work changed since, and how, in declaration order.

    A step changed when the ``version`` tag it declares now differs from the
    one recorded, or, for a ``Workflow`` that fingerprints code (anything with
    ``code_fingerprints()``), when its code's fingerprint differs from the
    recorded one (:mod:`ekit_core.code`: a fingerprint on one side only claims
    nothing). A step counts as recorded with its own output or an item's. Only
    the step's own work is compared: a step that runs again because a
    dependency changed is not listed (:func:`audit` says why it runs).
    ``versions`` overrides the tags, as :func:`audit`'s does. Pure: the
    workflow's fingerprints are what it computes from its code now.
    """
    cp = load_checkpoint(checkpoint)
    subject = subject_of(graph_or_workflow, cp, versions)
    tags = subject.versions if subject.versions is not None else {}
    prints = getattr(graph_or_workflow, "code_fingerprints", None)
    current: Mapping[str, str] = prints() if callable(prints) and cp.code_fingerprints else {}
    found: dict[str, str] = {}
    # A step with an item recorded: each output's name read once (not once per step).
    owners = {k[:k.index("[")] for k in cp.outputs if "[" in k}
    for name in subject.graph.names:
        if name not in cp.outputs and name not in owners and not _recorded(name, cp.outputs):
            continue
        old, new = cp.versions.get(name), tags.get(name)
        if old != new:
            found[name] = f"its version changed from {old!r} to {new!r}"
        elif current and code_changed(cp.code_fingerprints, current, name):
            found[name] = (f"its code changed (fingerprint {cp.code_fingerprints[name][:12]} "
                           f"is now {current[name][:12]})")
    return found


def _recorded(name: str, outputs: Mapping[str, object]) -> bool:
    """Whether an item of ``name`` is recorded (a name holding ``[`` itself: read in full)."""
    if "[" not in name:
        return False
    prefix = f"{name}["
    return any(k.startswith(prefix) for k in outputs)


def _collected_at_start(graph: GraphSpec, items: Expanded, kept: Mapping[str, Any],
                        skips: Mapping[str, str]) -> Mapping[str, Any]:
    """``kept`` and the mapped steps a resume collects as it starts: every item of theirs
    recorded or skipped (or none at all) and every dependency recorded, as the core does."""
    done = dict(kept)
    grew = True
    while grew:
        grew = False
        for name, members in items.members.items():
            if name in done or name in skips:
                continue
            # (a body map's iteration L/m#k is grown, not declared: its deps are the grown ones)
            needs = items.steps[name] if name in items.steps else graph.deps[name]
            settled = all(m in done or m in skips for m in members) and all(
                d in done for d in needs)
            if settled:
                done[name] = [done[m] for m in members if m in done]
                grew = True
        for name in children_per_item(graph) if graph.shapes else ():
            # (a child per item's parent: collected from its child's output step, no attempt)
            if name not in done and name not in skips and all(d in done for d in graph.deps[name]):
                done[name] = done[cast(str, graph.shapes[name].child)]
                grew = True
    return done if len(done) > len(kept) else kept


def _rows(a: _Audited) -> tuple[StepAudit, ...]:
    """One row per step: skipped exactly when its output is recorded and not outdated.

    A step with an output is skipped even when a failure is recorded for it
    too: that failure is an old one, from an attempt before the one that
    succeeded. What a step waits on is read from the outputs the resume
    keeps, outdated ones dropped.
    """
    graph, usage, failures = a.graph, a.cp.step_usage, a.cp.failures
    kept = a.kept
    if graph.shapes:
        return _shaped_rows(a)
    rows = []
    for name in graph.names:
        deps = graph.deps[name]
        if name in kept:
            rows.append(StepAudit(name, "skip", "recorded", deps, usage=usage.get(name)))
            continue
        ready = dependencies_recorded(graph, kept, name)
        waiting = () if ready else tuple(d for d in deps if d not in kept)
        if name in a.outdated:
            rows.append(StepAudit(name, "run", "outdated", deps, waiting, None, usage.get(name),
                                  a.outdated[name]))
            continue
        failure = failures.get(name)
        reason: Reason = "failed" if failure is not None else "ready" if ready else "waiting"
        rows.append(StepAudit(name, "run", reason, deps, waiting, failure, usage.get(name)))
    return tuple(rows)


def _shaped_rows(a: _Audited) -> tuple[StepAudit, ...]:
    """:func:`_rows` in a graph with run-time shapes: each mapped step's items right
    before its own row (what a resume expands them into, from the outputs it keeps)."""
    rows = []
    members, skips = a.items.members, a.skips
    bodies = bodies_of(a.graph)
    for name in a.graph.names:
        for member in members.get(name, ()):
            if name not in skips or member in a.kept or member in skips:
                ref = a.items.items[member]
                rows.append(_shaped_row(a, member, a.items.steps[member], ref.step))
        shape = a.graph.shapes.get(name)
        if shape is not None and shape.repeat is not None:
            loop_rows = _loop_rows(a, name, shape.repeat, bodies.get(name))
            if name in bodies:  # (its body's own rows: each records its last iteration's)
                loop_rows[-1:-1] = [_body_row(a, t) for t in bodies[name]]
            rows.extend(loop_rows)
            continue
        if name in a.items.items or any(name in body for body in bodies.values()):
            continue  # (a body step: told with its loop, above)
        rows.append(_shaped_row(a, name, a.graph.deps[name], None))
    return tuple(rows)


def _iteration_rows(a: _Audited, loop: str, body: tuple[str, ...], k: int) -> list[StepAudit]:
    """The rows of iteration ``k`` of a loop whose body is a child: each body step's
    iteration, the items of a body map's before it."""
    grown_k = Expanded()
    body_iteration(a.graph, loop, body, k, grown_k)
    rows = []
    for name, deps in grown_k.steps.items():
        for member in a.items.members.get(name, ()):
            rows.append(_shaped_row(a, member, a.items.steps[member], name))
        rows.append(_shaped_row(a, name, deps, grown_k.items[name].step))
    return rows


def _loop_rows(a: _Audited, loop: str, cap: int, body: tuple[str, ...] | None = None
               ) -> list[StepAudit]:
    """A loop's rows: each iteration a resume keeps, the one it runs next, the loop's own
    (a body's iterations: every body step's, see ``_iteration_rows``)."""
    if body is not None:
        return _body_loop_rows(a, loop, cap, body)
    deps = a.graph.deps[loop]
    compacted = a.cp.compacted.get(loop, 0) if loop in a.cp.compacted and loop not in a.outdated \
        else 0
    done = compacted
    rows = []
    while iteration_name(loop, done + 1) in a.kept:
        done += 1
        name = iteration_name(loop, done)
        rows.append(_shaped_row(a, name, (*deps, iteration_name(loop, done - 1)) if done > 1 else deps,
                                loop))
    own = _shaped_row(a, loop, deps, None)
    # (a recorded failure is no output: below its cap, the loop goes on where it was)
    if own.action == "run" and own.reason in ("ready", "waiting", "failed") and loop not in a.skips:
        if done < cap:  # (at its cap, the loop's own row says it fails again)
            nxt = iteration_name(loop, done + 1)
            rows.append(_shaped_row(a, nxt, (*deps, iteration_name(loop, done)) if done else deps,
                                    loop))
            own = replace(own, reason="looping", items=cap, items_recorded=done, failure=None)
        else:
            own = replace(own, reason="failed", failure=a.cp.failures.get(loop))
    return [*rows, own]


def _body_row(a: _Audited, step: str) -> StepAudit:
    """A body step's own row: recorded, or it runs as its iterations (``looping``) with its loop."""
    row = _shaped_row(a, step, a.graph.deps[step], None)
    if row.action == "run" and row.reason in ("ready", "waiting", "mapped"):
        return replace(row, reason="looping", waiting_on=(), items=None, items_recorded=0)
    return row


def _body_loop_rows(a: _Audited, loop: str, cap: int, body: tuple[str, ...]) -> list[StepAudit]:
    """:func:`_loop_rows` of a loop whose body is a child: told by its output step's iterations."""
    exit_step = cast(str, a.graph.shapes[loop].child)
    compacted = a.cp.compacted.get(loop, 0) if loop in a.cp.compacted and loop not in a.outdated \
        else 0
    done = compacted
    while iteration_name(exit_step, done + 1) in a.kept:
        done += 1
    rows = [row for k in range(compacted + 1, done + 1) for row in _iteration_rows(a, loop, body, k)]
    own = _shaped_row(a, loop, a.graph.deps[loop], None)
    if own.action == "run" and loop not in a.skips:
        if done < cap:
            rows += _iteration_rows(a, loop, body, done + 1)
            own = replace(own, reason="looping", waiting_on=(), items=cap, items_recorded=done,
                          failure=None)
        else:
            own = replace(own, reason="failed", failure=a.cp.failures.get(loop))
    return [*rows, own]


def _shaped_row(a: _Audited, name: str, deps: tuple[str, ...], item_of: str | None) -> StepAudit:
    """The row of one step or item of a shaped graph (see :class:`StepAudit`)."""
    kept, skips, usage = a.kept, a.skips, a.cp.step_usage.get(name)
    if name in kept:
        return StepAudit(name, "skip", "recorded", deps, usage=usage, item_of=item_of)
    if name in skips:
        return StepAudit(name, "skip", "skipped", deps, usage=usage, skipped=skips[name],
                         item_of=item_of)
    shape = a.graph.shapes.get(name) if item_of is None else None
    joins_any = shape is not None and shape.join == "any"
    waiting = tuple(d for d in deps if d not in kept and not (joins_any and d in skips))
    if name in a.outdated:
        return StepAudit(name, "run", "outdated", deps, waiting, None, usage, a.outdated[name])
    failure = a.cp.failures.get(name)
    members = a.items.members.get(name)
    if shape is not None and shape.map_over is not None and (members is not None or failure is None):
        done = 0 if members is None else sum(1 for m in members if m in kept or m in skips)
        # Its items settled (or none), it still waits for its own dependencies.
        settled = members is None or done == len(members)
        return StepAudit(name, "run", "mapped", deps, waiting if settled else (),
                         usage=usage, items=None if members is None else len(members),
                         items_recorded=done)
    reason: Reason = "failed" if failure is not None else "waiting" if waiting else "ready"
    return StepAudit(name, "run", reason, deps, waiting, failure, usage, item_of=item_of)


def _timed(rows: tuple[StepAudit, ...], durations: Mapping[str, float]) -> tuple[StepAudit, ...]:
    """The rows with the recorded duration of each step (or item) that has one."""
    if not durations:
        return rows
    return tuple(row if (d := durations.get(row.name)) is None else replace(row, duration=d)
                 for row in rows)


def _kept_questions(a: _Audited) -> Mapping[str, tuple[Exchange, ...]]:
    """The questions a resume keeps: not those below an outdated step, nor those of a step
    whose work changed since it asked, or below one (the core's rule: the new code asks its own)."""
    kept = without(a.cp, a.graph, a.outdated)
    return without_questions(kept, _rules.changed_work(a.graph, a.cp, a.versions,
                                                       a.code.fingerprints, a.code.kept)).asked


def _with_questions(rows: tuple[StepAudit, ...], asked: Mapping[str, tuple[Exchange, ...]]
                    ) -> tuple[StepAudit, ...]:
    """The rows of the steps that asked a person, with the questions a resume keeps (those
    below an outdated step go): waiting or denied ones are neither skipped nor run (the
    core's rule: :mod:`ekit_core.human`)."""
    if not asked:
        return rows
    out = []
    for row in rows:
        exchanges = asked.get(row.name)
        if exchanges and row.action == "run" and row.reason not in ("outdated", "mapped"):
            last = exchanges[-1].answer
            if last is None:
                row = replace(row, action="wait", reason="asked")
            elif last.approved is False:
                row = replace(row, action="wait", reason="denied")
        out.append(row if not exchanges else replace(row, asked=exchanges))
    return tuple(out)


# -- the checks, one per anomaly kind ------------------------------------------------


def _from_another_graph(a: _Audited) -> Iterator[Anomaly]:
    """``fingerprint_mismatch``: the checkpoint's fingerprint is another graph's (as a resume says)."""
    message = mismatch(a.graph, a.cp)
    if message is not None:
        yield Anomaly("fingerprint_mismatch", None, message)


def _recorded_graph_hashes_right(a: _Audited) -> Iterator[Anomaly]:
    """``graph_fingerprint``: the recorded graph must be valid and hash to the recorded fingerprint."""
    cp = a.cp
    if cp.graph is None or cp.fingerprint is None:
        return
    # A recorded graph that does not hash to the recorded fingerprint was
    # edited after the fact; the mismatch check trusts neither alone.
    try:
        own = GraphSpec.of(cp.graph, cp.shapes).fingerprint
    except ValueError as exc:
        yield Anomaly("graph_fingerprint", None, f"the recorded graph is invalid: {exc}")
        return
    if own != cp.fingerprint:
        yield Anomaly(
            "graph_fingerprint", None,
            f"the recorded graph hashes to {own}, not to the recorded fingerprint {cp.fingerprint}",
        )


def _outputs_are_steps(a: _Audited) -> Iterator[Anomaly]:
    """``unknown_output``: outputs that are not steps (ExecutionKit's context, or removed steps)."""
    old_steps: Mapping[str, tuple[str, ...]] = a.cp.graph or {}
    for name in context_outputs(a.graph, a.cp.outputs):
        if name in old_steps:
            what = "a step of the recorded graph that this graph removed"
        elif name in a.cp.context:
            what = "a context key"
        else:
            what = "not a step (an initial-context key ExecutionKit kept among outputs?)"
        yield Anomaly("unknown_output", name, f"output recorded for {name!r}: {what}")


def _dependencies_recorded_first(a: _Audited) -> Iterator[Anomaly]:
    """``missing_dependency``: a recorded step must have every dependency recorded.

    Every dependency it had when it was recorded, that is: one the graph
    has added since is no anomaly (the step is outdated, and runs again).
    """
    outputs = a.cp.outputs
    recorded: Mapping[str, tuple[str, ...]] = a.cp.graph or {}
    compacted = a.cp.compacted
    for name, deps in _recorded_needs(a):
        if name in outputs and not all(d in outputs for d in deps):
            # (a compacted iteration is recorded: its output let go of on purpose)
            deps = tuple(d for d in deps
                         if not (compacted and compacted_iteration(d, compacted, a.cp.shapes)))
            had = recorded.get(name, deps)
            # (items are in no recorded graph: the expansion made them)
            missing = [d for d in deps if d not in outputs and (d in had or d not in a.graph.index)
                       and not _compacted(a.cp, d)]
            if not missing:
                continue
            yield Anomaly(
                "missing_dependency", name,
                f"output of {name!r} is recorded but not that of its "
                f"dependenc{'y' if len(missing) == 1 else 'ies'} " + ", ".join(map(repr, missing)),
            )


def _compacted(cp: WorkflowCheckpoint, name: str) -> bool:
    """Whether ``name`` is an iteration ``cp`` compacted (``keep_last``): recorded, its
    output let go of on purpose."""
    return compacted_iteration(name, cp.compacted, cp.shapes) is not None


def _recorded_needs(a: _Audited) -> Iterator[tuple[str, tuple[str, ...]]]:
    """Each step's (and, in a shaped graph, each recorded item's) needs (:func:`needs_of`)."""
    graph = a.graph
    if not graph.shapes:
        yield from ((n, graph.deps[n]) for n in graph.names)
        return
    skips, items = a.cp.skipped, a.recorded
    yield from items.steps.items()
    for name in graph.names:
        yield name, needs_of(graph, items, skips, name)


def _failures_are_steps(a: _Audited) -> Iterator[Anomaly]:
    """``unknown_failure``: a failure recorded for a name that is not a step (nor an item)."""
    items = a.recorded.items
    for name in a.cp.failures:
        if name not in a.graph.index and name not in items:
            yield Anomaly("unknown_failure", name, f"failure recorded for {name!r}, not a step")


def _context_keys_are_not_steps(a: _Audited) -> Iterator[Anomaly]:
    """``context_collision``: a context key that names a step, which a resume refuses."""
    for key in a.cp.context:
        if key in a.graph.index:
            yield Anomaly(
                "context_collision", key,
                f"context key {key!r} is also a step name: a resume from this checkpoint "
                "is refused, since the step's output would be shadowed",
            )


def _resume_accepts(a: _Audited) -> Iterator[Anomaly]:
    """``resume_refused``, ``budget_reached``: what a resume from the checkpoint refuses, asked of the core.

    :func:`~ekit_core.initial_state` is asked to resume from the checkpoint
    without the context keys that collide with step names (reported one by
    one above), so that any other refusal (today's rules or one added to it
    later) is reported too rather than passing as clean. The graph mismatch
    is left out of that question: ``fingerprint_mismatch`` already says it,
    with the steps concerned.
    """
    graph, cp, budget = a.graph, a.cp, a.budget
    if any(k in graph.index for k in cp.context):
        kept = {k: v for k, v in cp.context.items() if k not in graph.index}
        cp = replace(cp, context=MappingProxyType(kept))
    try:
        state = initial_state(graph, cp, budget=budget, allow_graph_change=True, versions=a.versions,
                              code_fingerprints=a.code.fingerprints, code_kept=a.code.kept)
    except ValueError as exc:
        yield Anomaly("resume_refused", None, f"a resume from this checkpoint is refused: {exc}")
        return
    halt = state.halt
    if halt is not None and halt.kind == "budget_exceeded" and budget is not None:
        yield Anomaly(
            "budget_reached", None,
            f"the recorded usage {usage_text(cp.cost)} already reaches the budget "
            f"{usage_text(budget)}: a resume with it starts no step and raises BudgetExceeded",
        )


def _code_refused(a: _Audited) -> Iterator[Anomaly]:
    """Recorded steps whose code changed and whose policy refuses the resume."""
    for name in a.code.refused:
        yield Anomaly("code_changed", name,
                      f"the code of step {name!r} changed since recorded and its on_code_change is "
                      "'refuse': a resume raises CodeChangedError")


_CHECKS: tuple[Callable[[_Audited], Iterator[Anomaly]], ...] = (
    _from_another_graph,
    _recorded_graph_hashes_right,
    _outputs_are_steps,
    _dependencies_recorded_first,
    _failures_are_steps,
    _context_keys_are_not_steps,
    _resume_accepts,
    _code_refused,
)
"""Every check an audit makes, in the order its anomalies are reported."""
