"""Replaying recorded checkpoints: is a sequence of them a legal execution of a graph?

This module owns the legality rule for a recorded sequence of checkpoints
(for example every checkpoint a ``checkpoint_fn`` saw, across a crash and
its resumes). :func:`replay` checks, against each checkpoint's predecessor:

- outputs only grow and never change: no recorded output disappears, and a
  step's output never takes a value other than the one first recorded;
- per-step usage never changes once recorded, and ``step_index`` and the
  accumulated ``cost`` never go down;
- each newly recorded step has all its dependencies recorded in the same
  checkpoint or an earlier one;
- after the first checkpoint, no output appears for a name that is not a step
  (the first may carry the initial-context keys an ExecutionKit checkpoint
  kept among its outputs);
- the record ends on the graph (every fingerprint is the graph's once one
  is; reported once per change).

One exception to the first two rules: a resume may drop the outputs that
were **outdated** when it began, as the runtime does: those of steps whose
version tag or code fingerprint changed between the two checkpoints
(``versions``, ``code_fingerprints``) or whose dependencies differ in the
new checkpoint's graph, and everything downstream of them
(:func:`~ekit_core.rewind.outdated_steps`), and with run-time shapes the
items the resume drops with them or sets aside for an early cutoff
(:func:`~ekit_core.transitions.kept_on_resume`, the rule the resume
follows). So may a rewind (:func:`~ekit_core.rewind.rewind`): the outputs
it lets go of are counted in ``redone``, which a loss does not raise. Such
a step runs again, so its new output is its first. The
timeline says which outputs were dropped and why (``TimelineEntry.outdated``, ``graph_changed``); any other
output dropped or changed is still a violation. Checkpoints recorded from an
earlier graph of the run are checked against the graph they record.

It returns a :class:`ReplayReport`: a timeline (which steps finished at
which checkpoint, where a resume began) and every :class:`Violation`, each
naming the checkpoint index and the step.

**Where a resume began.** Checkpoint ``i`` (``i >= 1``) begins a new run
segment when

1. it does not extend checkpoint ``i - 1`` (an output or a step's usage of
   ``i - 1`` is missing or different, outdated outputs aside): it was
   resumed from an older checkpoint, ``resumed_from`` being the latest
   earlier one it extends (``None`` if none; then it is a fresh run or a
   tampered record). The outputs it dropped are still violations, since
   they are lost; or
2. it was recorded with other version tags or another graph than
   checkpoint ``i - 1``: a run has one of each, so this is a new run; or
3. checkpoint ``i - 1`` is a *repeat* (it records nothing its predecessor
   did not: same outputs, usage, failures, cost and ``step_index``; for the
   first checkpoint, nothing at all) and checkpoint ``i`` is not: a repeat is
   the closing save a run makes when it is cancelled, crashes through
   ``KeyboardInterrupt`` or is denied with nothing new finished, so progress
   after it came from a run resumed from it (``resumed_from = i - 1``).

A resume from the latest checkpoint that left no repeat behind (a process
killed outright) is indistinguishable from the run going on, and is legal:
it is reported as one segment. Conversely, a halted run in which a step
waiting out a retry delay is stopped while a sibling still runs saves a
repeat too, and its sibling's completion is reported as a resume.

**Run-time shapes.** In a graph with mapped steps each checkpoint is read
against the graph as its recorded outputs grew it (the items
:func:`~ekit_core.expansion.expand` makes of them, see
:func:`~ekit_core.rewind.grown`): an item is a step of the timeline, needs
what it was expanded with (not its mapped step's declared dependencies), a
collected output needs its items, and a step joining ``"any"`` needs only
its dependencies not skipped (:func:`~ekit_core.report.needs_of`). An item
that the recorded input does not have is an ``unknown_step``. The timeline
also lists the skips each checkpoint newly records.

Each rule is one method of ``_Walk``. Pure and deterministic like the rest
of :mod:`ekit_core`. Checkpoints that came from one process are compared in
O(what changed) via :meth:`~ekit_core.WorkflowCheckpoint.delta_since`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

from ekit_core.checkpoint import CheckpointDelta, CheckpointError, WorkflowCheckpoint, same_output
from ekit_core.compat import graph_changes
from ekit_core.expansion import Expanded, compacted_iteration
from ekit_core.graph import GraphSpec
from ekit_core.report import (
    GraphSource,
    Subject,
    count,
    findings,
    load_checkpoint,
    needs_of,
    source_line,
    subject_of,
    table,
    usage_text,
)
from ekit_core.rewind import _dropping, grown, outdated_steps, without
from ekit_core.times import when
from ekit_core.transitions import context_outputs, kept_on_resume
from ekit_core.usage import TokenUsage

__all__ = ["ReplayReport", "TimelineEntry", "Violation", "replay"]

ViolationKind = Literal[
    "output_removed",
    "output_changed",
    "usage_changed",
    "step_index_decreased",
    "cost_decreased",
    "dependency_not_recorded",
    "unknown_step",
    "fingerprint_mismatch",
]


@dataclass(frozen=True, slots=True)
class Violation:
    """One way checkpoint ``index`` of the sequence breaks the legality rule.

    ``kind`` is one of ``"output_removed"``, ``"output_changed"``,
    ``"usage_changed"``, ``"step_index_decreased"``, ``"cost_decreased"``,
    ``"dependency_not_recorded"``, ``"unknown_step"`` and
    ``"fingerprint_mismatch"``. ``step`` names the step concerned, ``None``
    when the whole checkpoint is.
    """

    index: int
    step: str | None
    kind: ViolationKind
    message: str

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe data."""
        return {"index": self.index, "step": self.step, "kind": self.kind, "message": self.message}


def _no_reasons() -> Mapping[str, str]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class TimelineEntry:
    """What checkpoint ``index`` of the sequence records that its predecessor did not.

    ``finished`` are the outputs newly recorded (for the first checkpoint:
    all of them, step names only), in the order recorded; ``failed`` the
    steps whose failure record is new or changed. ``repeat`` is true when it
    records nothing new. ``resumed`` is true when a new run segment begins
    here (see the module docs for the rule), ``resumed_from`` then being the
    index of the checkpoint that run resumed from, if any in the sequence.
    ``segment`` counts segments from 0. ``outdated`` maps each output of the
    predecessor that this checkpoint legally dropped to the reason (a
    changed version tag or dependencies, or a dependency that runs again);
    ``graph_changed`` says how its graph differs from the predecessor's.
    ``skipped`` maps the steps and items it newly records as skipped by a
    condition to the reason. ``asked`` maps the steps and items that newly
    wait for a person's answer here to the question's prompt; ``answered``
    those whose answers are new here to who answered what (see
    :mod:`ekit_core.human`).
    """

    index: int
    step_index: int
    finished: tuple[str, ...]
    failed: tuple[str, ...]
    cost: TokenUsage
    repeat: bool
    resumed: bool
    resumed_from: int | None
    segment: int
    outdated: Mapping[str, str] = field(default_factory=_no_reasons)
    graph_changed: str | None = None
    skipped: Mapping[str, str] = field(default_factory=_no_reasons)
    asked: Mapping[str, str] = field(default_factory=_no_reasons)
    answered: Mapping[str, str] = field(default_factory=_no_reasons)

    @property
    def note(self) -> str:
        """One line saying what else happened here: a resume, a graph change, outdated outputs, failures."""
        notes = []
        if self.resumed:
            notes.append(
                "resume began (from an unknown checkpoint)"
                if self.resumed_from is None
                else f"resume began (from checkpoint {self.resumed_from})"
            )
        if self.graph_changed is not None:
            notes.append(f"graph changed ({self.graph_changed})")
        if self.outdated:
            notes.append(
                "outdated: " + ", ".join(f"{n} ({why})" for n, why in self.outdated.items())
            )
        if self.skipped:
            notes.append("skipped: " + ", ".join(self.skipped))
        if self.failed:
            notes.append("failed: " + ", ".join(self.failed))
        if self.answered:
            notes.append("answered: " + ", ".join(f"{n} ({a})" for n, a in self.answered.items()))
        if self.asked:
            notes.append("waits for an answer: " + ", ".join(
                f"{n} ({prompt!r})" for n, prompt in self.asked.items()))
        if self.repeat:
            notes.append("repeat: nothing new")
        return "; ".join(notes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe data."""
        return {
            "index": self.index,
            "step_index": self.step_index,
            "finished": list(self.finished),
            "failed": list(self.failed),
            "cost": self.cost.to_dict(),
            "repeat": self.repeat,
            "resumed": self.resumed,
            "resumed_from": self.resumed_from,
            "segment": self.segment,
            "outdated": dict(self.outdated),
            "graph_changed": self.graph_changed,
            "skipped": dict(self.skipped),
            "asked": dict(self.asked),
            "answered": dict(self.answered),
        }


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """The timeline of a recorded sequence of checkpoints and every violation in it.

    ``ok`` when there is no violation. ``graph_source`` is ``"given"`` or
    ``"checkpoint"`` (the graph recorded by the last checkpoint that has one).
    """

    timeline: tuple[TimelineEntry, ...]
    violations: tuple[Violation, ...]
    graph_source: GraphSource
    fingerprint: str

    @property
    def ok(self) -> bool:
        """True when the sequence is a legal execution of the graph."""
        return not self.violations

    @property
    def resumes(self) -> tuple[int, ...]:
        """Indices of the checkpoints where a new run segment begins."""
        return tuple(e.index for e in self.timeline if e.resumed)

    def finished_at(self, step: str) -> int | None:
        """Index of the first checkpoint recording ``step``'s output, ``None`` if none does."""
        for entry in self.timeline:
            if step in entry.finished:
                return entry.index
        return None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe data."""
        return {
            "ok": self.ok,
            "graph_source": self.graph_source,
            "fingerprint": self.fingerprint,
            "checkpoints": len(self.timeline),
            "resumes": list(self.resumes),
            "timeline": [e.to_dict() for e in self.timeline],
            "violations": [v.to_dict() for v in self.violations],
        }

    def format(self) -> str:
        """A readable timeline, then the violations."""
        segments = (self.timeline[-1].segment + 1) if self.timeline else 0
        rows = [
            (count(e.index), count(e.step_index), usage_text(e.cost), ", ".join(e.finished) or "-",
             e.note)
            for e in self.timeline
        ]
        return "\n".join([
            source_line(self.graph_source, self.fingerprint, plural=True),
            f"{count(len(self.timeline))} checkpoint(s), {count(segments)} run segment(s), "
            f"{count(len(self.violations))} violation(s)",
            "",
            *table(("#", "STEP_INDEX", "USAGE in/out/calls", "FINISHED", "NOTE"), rows),
            "",
            *findings(
                [f"checkpoint {v.index}: {v.kind}: {v.message}" for v in self.violations],
                "violation(s)", "no violations",
            ),
        ])


def replay(
    graph_or_workflow: GraphSpec | object | None,
    checkpoints: Iterable[WorkflowCheckpoint | Mapping[str, Any]],
) -> ReplayReport:
    """Check that ``checkpoints``, in the order recorded, are a legal execution of the graph.

    ``graph_or_workflow`` is a :class:`GraphSpec`, a ``Workflow`` (anything
    with a ``graph`` attribute holding one), or ``None`` for the graph
    recorded by the last checkpoint that records one. Each checkpoint may be
    a :class:`WorkflowCheckpoint` or its dict. See the module docs for the
    rules checked and for where a resume is said to begin.

    Raises :class:`~ekit_core.CheckpointError` naming the index and field of a
    malformed checkpoint, and ``ValueError`` for a bad graph or for ``None``
    when no checkpoint records a graph. Violations are returned, not raised.
    """
    cps: list[WorkflowCheckpoint] = []
    for i, raw in enumerate(checkpoints):
        try:
            cps.append(load_checkpoint(raw))
        except CheckpointError as exc:
            raise type(exc)(f"[{i}].{exc.field}", exc.problem) from None
        except ValueError as exc:
            raise ValueError(f"checkpoint [{i}]: {exc}") from None
    subject = subject_of(graph_or_workflow, cps)
    walk = _Walk(subject, cps)
    for i, cp in enumerate(cps):
        walk.step(i, cp)
    return ReplayReport(
        tuple(walk.timeline), tuple(walk.violations), subject.source, subject.graph.fingerprint
    )


_NO_ITEMS = Expanded()


def _decreased(now: TokenUsage, before: TokenUsage) -> bool:
    return (
        now.input_tokens < before.input_tokens
        or now.output_tokens < before.output_tokens
        or now.llm_calls < before.llm_calls
    )


def _adds_nothing(cp: WorkflowCheckpoint, prev: WorkflowCheckpoint | None) -> bool:
    """Whether ``cp`` (which extends ``prev``) is a repeat: the closing save of a stopped run."""
    if prev is None:
        return (not cp.outputs and not cp.failures and not cp.skipped and cp.step_index == 0
                and cp.cost.is_zero() and not cp.asked)
    return (
        cp.step_index == prev.step_index
        and cp.cost == prev.cost
        and len(cp.outputs) == len(prev.outputs)
        and len(cp.step_usage) == len(prev.step_usage)
        and cp.failures == prev.failures
        and len(cp.skipped) == len(prev.skipped)
        and (cp.asked is prev.asked or cp.asked == prev.asked)
    )


def _questions_new(cp: WorkflowCheckpoint, base: WorkflowCheckpoint | None
                   ) -> tuple[dict[str, str], dict[str, str]]:
    """The questions ``cp`` newly waits on (name -> prompt) and the answers it newly
    records (name -> who answered what), against ``base``."""
    mine, theirs = cp.asked, base.asked if base is not None else {}
    if mine is theirs or not mine:
        return {}, {}
    asked, answered = {}, {}
    for name, exchanges in mine.items():
        before = theirs.get(name, ())
        for k, exchange in enumerate(exchanges):
            earlier = before[k] if k < len(before) else None
            if earlier is None and exchange.answer is None:
                asked[name] = exchange.question.prompt
            given = exchange.answer
            if given is not None and (earlier is None or earlier.answer != given):
                what = repr(given.value) if given.approved is None else (
                    "approved" if given.approved else "denied")
                answered[name] = f"{what} by {given.by or 'someone'}" + (
                    f" at {when(given.at)}" if given.at is not None else "")
    return asked, answered


def _with_items(graph: GraphSpec, earlier: WorkflowCheckpoint, kept: WorkflowCheckpoint,
                outdated: Mapping[str, str]) -> dict[str, str]:
    """``outdated`` and the items a resume dropped beside them, each with why, in recorded order."""
    reasons = dict(outdated)
    items = grown(graph, earlier.outputs).items
    for name in earlier.outputs:
        if name in kept.outputs or name in reasons:
            continue
        ref = items.get(name)
        owner = repr(ref.step) if ref is not None else "a mapped step"
        reasons[name] = (f"an item of {owner}, set aside until its input is recorded again"
                         if name in kept.superseded else f"an item of {owner}, which runs again")
    return reasons


def _rewound(earlier: WorkflowCheckpoint, cp: WorkflowCheckpoint) -> dict[str, str]:
    """The outputs of ``earlier`` that ``cp`` let go of and counts as redone (a rewind:
    :attr:`~ekit_core.WorkflowCheckpoint.redone`), each with why."""
    if cp.redone is earlier.redone or not cp.redone or cp.redone == earlier.redone:
        return {}  # (what nearly every pair of checkpoints says, at once)
    before, now = earlier.redone, cp.redone
    return {n: "rewound: its output was let go, to run again" for n in earlier.outputs
            if n not in cp.outputs and now.get(n, 0) > before.get(n, 0)}


def _compacted(cp: WorkflowCheckpoint, name: str) -> bool:
    """Whether ``name`` is an iteration ``cp`` compacted (recorded, its output let go of)."""
    return compacted_iteration(name, cp.compacted, cp.shapes) is not None


def _uncompacted(earlier: WorkflowCheckpoint, base: WorkflowCheckpoint,
                 names: Iterable[str]) -> list[str]:
    """The iterations among ``names`` that ``earlier`` counts as compacted and ``base`` (what
    a resume kept of it) no longer does: their loop starts again from its first iteration,
    so they run again, and what they record next is their first output. (A loop whose body
    is a workflow counts its body steps' iterations ``L/s#k`` and its maps' items
    ``L/m#k[key]`` under the loop's own name.)"""
    compacted, shapes = earlier.compacted, earlier.shapes
    found = []
    for name in names:
        at = compacted_iteration(name, compacted, shapes)
        if at is not None and at[1] > base.compacted.get(at[0], 0):
            found.append(name)
    return found


def _compacted_by(earlier: WorkflowCheckpoint, cp: WorkflowCheckpoint) -> WorkflowCheckpoint:
    """``earlier`` with the iterations ``cp`` compacts dropped (``keep_last``: a loop lets go
    of its oldest iterations' outputs on purpose, counting them), and ``cp``'s count.

    Only a count that grows compacts: one that shrinks, or names no loop of the
    checkpoint's shapes, changes nothing, so what it dropped is a loss.
    """
    now, before = cp.compacted, earlier.compacted
    loops = {loop: n for loop, n in now.items() if not loop.endswith("[]")}  # (items counted)
    upto = {loop: n for loop, n in loops.items() if n >= before.get(loop, 0)
            and loop in cp.shapes and cp.shapes[loop].keep_last is not None}
    if len(upto) != len(loops) or any(loop not in now for loop in before):
        return earlier
    gone = {name for name in earlier.outputs
            if compacted_iteration(name, upto, cp.shapes) is not None}
    outputs = {k: v for k, v in earlier.outputs.items() if k not in gone}
    dropped = _dropping(earlier, gone, outputs, earlier.step_index, skipped=earlier.skipped,
                        superseded=earlier.superseded)
    return replace(dropped, compacted=now)


def _same_run(a: WorkflowCheckpoint, b: WorkflowCheckpoint) -> bool:
    """Whether two checkpoints could come from one run: the same version tags, code (its
    fingerprints, where recorded on both sides) and graph."""
    if a.versions is not b.versions and a.versions != b.versions:
        return False
    if (a.code_fingerprints is not b.code_fingerprints and a.code_fingerprints
            and b.code_fingerprints and a.code_fingerprints != b.code_fingerprints):
        return False
    return a.fingerprint is None or b.fingerprint is None or a.fingerprint == b.fingerprint


class _Walk:
    """What replay carries from one checkpoint to the next, and one method per rule it checks."""

    def __init__(self, subject: Subject, cps: Sequence[WorkflowCheckpoint]) -> None:
        self.graph = subject.graph
        self.cps = cps
        self.violations: list[Violation] = []
        self.timeline: list[TimelineEntry] = []
        # First recorded value of each output and step usage, and where it was recorded.
        self.first: dict[str, tuple[Any, int]] = {}
        self.first_usage: dict[str, TokenUsage] = {}
        self.graphs: dict[str, GraphSpec] = {self.graph.fingerprint: self.graph}
        # The record may start on earlier graphs of the run, and must end on this one.
        self.ends_on_graph = any(cp.fingerprint == self.graph.fingerprint for cp in cps)
        self.on_graph = False
        self.prev: WorkflowCheckpoint | None = None
        self.prev_repeat = False
        self.segment = 0
        self.mapped_over: dict[str, set[str]] = {}
        self.expanded: tuple[tuple[object, ...], Expanded] | None = None

    def report(self, i: int, step: str | None, kind: ViolationKind, message: str) -> None:
        self.violations.append(Violation(i, step, kind, message))

    def graph_at(self, cp: WorkflowCheckpoint) -> GraphSpec:
        """The graph ``cp`` was recorded from: the one it records, when that is another."""
        fp = cp.fingerprint
        if fp is None or cp.graph is None:
            return self.graph
        known = self.graphs.get(fp)
        if known is None:
            try:
                known = GraphSpec.of(cp.graph, cp.shapes)
            except ValueError:  # an invalid record: judge it by the graph given
                known = self.graph
            self.graphs[fp] = known
        return known

    def items_of(self, graph: GraphSpec, cp: WorkflowCheckpoint) -> Expanded:
        """The items ``cp``'s outputs expand ``graph`` into (none without shapes).

        Kept for the next checkpoint while the outputs mapped over are the
        same objects (checkpoints of one process share them), so a run's
        record costs one expansion per output mapped over, not per checkpoint.
        """
        if not graph.shapes:
            return _NO_ITEMS
        over = self.mapped_over.get(graph.fingerprint)
        if over is None:
            over = self.mapped_over[graph.fingerprint] = {
                s.map_over for s in graph.shapes.values() if s.map_over is not None}
        key = (graph.fingerprint, *(id(v) for k, v in cp.outputs.items() if k in over))
        if any(shape.repeat is not None for shape in graph.shapes.values()):
            key += (id(cp),)  # (a loop grows by its recorded iterations: one expansion each)
        if self.expanded is None or self.expanded[0] != key:
            self.expanded = (key, grown(graph, cp.outputs))
        return self.expanded[1]

    def base(self, earlier: WorkflowCheckpoint, cp: WorkflowCheckpoint, graph: GraphSpec
             ) -> tuple[WorkflowCheckpoint, dict[str, str]]:
        """``earlier`` as the run that recorded ``cp`` resumed it: outdated outputs dropped.

        With run-time shapes, by the rule the resume itself follows
        (:func:`~ekit_core.transitions.kept_on_resume`): the items of a
        mapped step that runs again go too (or are set aside for an early
        cutoff), and are named among the outdated with their reason.
        """
        if cp.compacted is not earlier.compacted and cp.compacted != earlier.compacted:
            earlier = _compacted_by(earlier, cp)
        if _same_run(earlier, cp):
            rewound = _rewound(earlier, cp)
            return (without(earlier, graph, rewound), rewound) if rewound else (earlier, {})
        # (a step kept although its code changed records its old fingerprint: not outdated)
        code = cp.code_fingerprints
        outdated = outdated_steps(graph, earlier, cp.versions, code)
        plain = without(earlier, graph, outdated) if outdated else earlier
        if not graph.shapes:
            return plain, outdated
        try:
            kept = kept_on_resume(graph, earlier, outdated, cp.versions, code)
        except ValueError:  # a record no run could make: judged by the plain rule
            return plain, outdated
        return kept, _with_items(graph, earlier, kept, outdated)

    def step(self, i: int, cp: WorkflowCheckpoint) -> None:
        """Check checkpoint ``i`` against its predecessor (outdated outputs dropped), then add its entry."""
        prev = self.prev
        graph = self.graph_at(cp)
        base, outdated = (None, {}) if prev is None else self.base(prev, cp, graph)
        for name in outdated:  # it runs again: its next output is its first
            self.first.pop(name, None)
            self.first_usage.pop(name, None)
        if base is not None and prev is not None and prev.compacted:
            for name in _uncompacted(prev, base, {*self.first, *self.first_usage}):  # run again
                self.first.pop(name, None)
                self.first_usage.pop(name, None)
        delta = cp.delta_since(base)
        if delta.extends:
            new = [name for name, _ in delta.outputs]
            new_usage = [name for name, _ in delta.step_usage]
        else:
            assert base is not None  # delta_since(None) always extends
            self.outputs_kept(i, base, cp)
            self.usage_kept(i, base, cp)
            new = [name for name in cp.outputs if name not in base.outputs]
            new_usage = [name for name in cp.step_usage if name not in base.step_usage]
        self.come_back_unchanged(i, cp, new, new_usage)
        if base is not None:
            self.counts_grow(i, base, cp)
        items = self.items_of(graph, cp)
        run_graph = graph.extended(items.steps) if items.steps else graph
        self.recorded_names_are_steps(i, run_graph, cp, new)
        finished = [name for name in new if name in run_graph.index]
        self.dependencies_first(i, graph, items, cp, finished)
        self.ends_on_the_graph(i, prev, cp)
        self.add_entry(i, cp, base, delta, finished, outdated, graph)

    # -- the rules ------------------------------------------------------------------

    def outputs_kept(self, i: int, base: WorkflowCheckpoint, cp: WorkflowCheckpoint) -> None:
        """``output_removed``, ``output_changed``: outputs only grow and never change.

        A value that differs from its predecessor's is reported only when it
        also differs from the first one recorded: a single tampered
        checkpoint then yields one violation, not a second for the
        checkpoint after it that holds the original again.
        """
        first = self.first
        for name, value in base.outputs.items():
            if name not in cp.outputs:
                self.report(i, name, "output_removed",
                            f"output of {name!r}, recorded by checkpoint {first[name][1]}, "
                            "is no longer recorded")
            elif not same_output(cp.outputs[name], value) and not same_output(
                cp.outputs[name], first[name][0]
            ):
                self.report(i, name, "output_changed",
                            f"output of {name!r} differs from the one checkpoint "
                            f"{first[name][1]} recorded")

    def usage_kept(self, i: int, base: WorkflowCheckpoint, cp: WorkflowCheckpoint) -> None:
        """``usage_changed``: a step's recorded usage never changes (nor goes while its output stays)."""
        for name, usage in base.step_usage.items():
            now = cp.step_usage.get(name)
            if now is None:
                # A dropped output already says its usage went with it.
                if name in cp.outputs:
                    self.report(i, name, "usage_changed", f"usage of {name!r} is no longer recorded")
            elif now != usage and now != self.first_usage[name]:
                self.report(i, name, "usage_changed",
                            f"usage of {name!r} changed from {usage_text(self.first_usage[name])} "
                            f"to {usage_text(now)}")

    def come_back_unchanged(self, i: int, cp: WorkflowCheckpoint, new: list[str],
                            new_usage: list[str]) -> None:
        """``output_changed``, ``usage_changed``: a name recorded again after it was dropped."""
        for name in new:
            earlier = self.first.get(name)
            if earlier is None:
                self.first[name] = (cp.outputs[name], i)
            elif not same_output(cp.outputs[name], earlier[0]):
                self.report(i, name, "output_changed",
                            f"output of {name!r} differs from the one checkpoint {earlier[1]} recorded")
        for name in new_usage:
            usage = cp.step_usage[name]
            before = self.first_usage.setdefault(name, usage)
            if before != usage:
                self.report(i, name, "usage_changed",
                            f"usage of {name!r} differs from {usage_text(before)} recorded")

    def counts_grow(self, i: int, prev: WorkflowCheckpoint, cp: WorkflowCheckpoint) -> None:
        """``step_index_decreased``, ``cost_decreased``: neither ever goes down (outdated outputs aside)."""
        if cp.step_index < prev.step_index:
            self.report(i, None, "step_index_decreased",
                        f"step_index went down from {count(prev.step_index)} to {count(cp.step_index)}")
        if _decreased(cp.cost, prev.cost):
            self.report(i, None, "cost_decreased",
                        f"cost went down from {usage_text(prev.cost)} to {usage_text(cp.cost)}")

    def recorded_names_are_steps(self, i: int, graph: GraphSpec, cp: WorkflowCheckpoint,
                                 new: list[str]) -> None:
        """``unknown_step``: after the first checkpoint, a new output must be a step's.

        The first checkpoint's other outputs were the run's context
        (ExecutionKit's rule); a name dropped and recorded again is not news.
        """
        if i == 0:
            return
        for name in context_outputs(graph, {name: None for name in new}):
            if self.first[name][1] == i:
                self.report(i, name, "unknown_step", f"output recorded for {name!r}, not a step")

    def dependencies_first(self, i: int, graph: GraphSpec, items: Expanded, cp: WorkflowCheckpoint,
                           finished: list[str]) -> None:
        """``dependency_not_recorded``: a step (or item) is recorded with or after all it needs."""
        outputs, skipped = cp.outputs, cp.skipped
        for name in finished:
            needs = needs_of(graph, items, skipped, name)
            if not all(d in outputs for d in needs):
                missing = [d for d in needs if d not in outputs and not _compacted(cp, d)]
                if not missing:
                    continue
                self.report(i, name, "dependency_not_recorded",
                            f"{name!r} is recorded before its dependenc"
                            f"{'y' if len(missing) == 1 else 'ies'} " + ", ".join(map(repr, missing)))

    def ends_on_the_graph(self, i: int, prev: WorkflowCheckpoint | None, cp: WorkflowCheckpoint) -> None:
        """``fingerprint_mismatch``: once a checkpoint is on the graph, every later one is.

        Checkpoints before it may come from earlier graphs of the run (a
        resume with ``allow_graph_change``); a record never on the graph is
        reported at each change of fingerprint.
        """
        fp = cp.fingerprint
        if fp is None or fp == self.graph.fingerprint:
            self.on_graph = self.on_graph or fp is not None
            return
        if (self.ends_on_graph and not self.on_graph) or (prev is not None and prev.fingerprint == fp):
            return
        changes = graph_changes(self.graph, cp)
        if changes is None:  # a resume takes it (its recorded graph is this one), but the record lies
            self.report(i, None, "fingerprint_mismatch",
                        f"its fingerprint {fp} is not that of the graph it records, which is this "
                        f"one ({self.graph.fingerprint})")
        else:
            self.report(i, None, "fingerprint_mismatch",
                        f"recorded from a different graph: {changes.describe()}")

    # -- the timeline ---------------------------------------------------------------

    def add_entry(self, i: int, cp: WorkflowCheckpoint, base: WorkflowCheckpoint | None,
                  delta: CheckpointDelta, finished: list[str], outdated: Mapping[str, str],
                  graph: GraphSpec) -> None:
        """The timeline entry of checkpoint ``i``: what is new, and whether a run segment begins."""
        prev = self.prev
        repeat = delta.extends and _adds_nothing(cp, base)
        resumed, resumed_from = False, None
        if prev is not None:
            if not delta.extends and ((_same_run(prev, cp) and not outdated) or self.lost(i)):
                resumed, resumed_from = True, self.resumed_from(i, cp, graph)
            elif not delta.extends or not _same_run(prev, cp) or (self.prev_repeat and not repeat):
                # (Another run that kept all but its outdated outputs resumed from i - 1,
                # whether or not what it kept compares as a prefix of cp.)
                resumed, resumed_from = True, i - 1
        self.segment += resumed
        changes = None if prev is None else graph_changes(graph, prev)
        failed = tuple(sorted(delta.failures, key=lambda n: graph.index.get(n, len(graph))))
        before: Mapping[str, str] = {} if base is None else base.skipped
        skipped = {n: why for n, why in cp.skipped.items() if n not in before}
        asked, answered = _questions_new(cp, base)
        self.timeline.append(TimelineEntry(
            i, cp.step_index, tuple(finished), failed, cp.cost, repeat, resumed, resumed_from,
            self.segment, MappingProxyType(dict(outdated)),
            None if changes is None else changes.describe(), MappingProxyType(skipped),
            MappingProxyType(asked), MappingProxyType(answered),
        ))
        self.prev, self.prev_repeat = cp, repeat

    def lost(self, i: int) -> bool:
        """Whether checkpoint ``i`` dropped or changed an output it had no reason to."""
        return any(v.index == i and v.kind in ("output_removed", "output_changed")
                   for v in self.violations)

    def resumed_from(self, i: int, cp: WorkflowCheckpoint, graph: GraphSpec) -> int | None:
        """The latest checkpoint before ``i - 1`` that ``cp`` extends (outdated outputs aside)."""
        for j in range(i - 2, -1, -1):
            if cp.delta_since(self.base(self.cps[j], cp, graph)[0]).extends:
                return j
        return None
