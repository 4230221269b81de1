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
- every recorded fingerprint is the graph's (reported once per change).

It returns a :class:`ReplayReport`: a timeline (which steps finished at
which checkpoint, where a resume began) and every :class:`Violation`, each
naming the checkpoint index and the step.

**Where a resume began.** Checkpoint ``i`` (``i >= 1``) begins a new run
segment when either

1. it does not extend checkpoint ``i - 1`` (an output or a step's usage of
   ``i - 1`` is missing or different): it was resumed from an older
   checkpoint, ``resumed_from`` being the latest earlier one it extends
   (``None`` if none; then it is a fresh run or a tampered record). The
   outputs it dropped are still violations, since they are lost; or
2. checkpoint ``i - 1`` is a *repeat* (it records nothing its predecessor
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

Pure and deterministic like the rest of :mod:`ekit_core`. Checkpoints that
came from one process are compared in O(what changed) via
:meth:`~ekit_core.WorkflowCheckpoint.delta_since`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ekit_core.audit import GraphSource, graph_of, load_checkpoint, recorded_graph
from ekit_core.checkpoint import CheckpointError, WorkflowCheckpoint, same_output
from ekit_core.compat import graph_changes
from ekit_core.graph import GraphSpec
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


@dataclass(frozen=True, slots=True)
class TimelineEntry:
    """What checkpoint ``index`` of the sequence records that its predecessor did not.

    ``finished`` are the outputs newly recorded (for the first checkpoint:
    all of them, step names only), in the order recorded; ``failed`` the
    steps whose failure record is new or changed. ``repeat`` is true when it
    records nothing new. ``resumed`` is true when a new run segment begins
    here (see the module docs for the rule), ``resumed_from`` then being the
    index of the checkpoint that run resumed from, if any in the sequence.
    ``segment`` counts segments from 0.
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
        source = (
            "graph given by the caller"
            if self.graph_source == "given"
            else "graph recorded in the checkpoints (no graph given)"
        )
        segments = (self.timeline[-1].segment + 1) if self.timeline else 0
        lines = [
            f"{source}, fingerprint {self.fingerprint}",
            f"{len(self.timeline)} checkpoint(s), {segments} run segment(s), "
            f"{len(self.violations)} violation(s)",
            "",
        ]
        header = ("#", "STEP_INDEX", "FINISHED", "NOTE")
        rows = []
        for e in self.timeline:
            notes = []
            if e.resumed:
                notes.append(
                    "resume began (from an unknown checkpoint)"
                    if e.resumed_from is None
                    else f"resume began (from checkpoint {e.resumed_from})"
                )
            if e.failed:
                notes.append("failed: " + ", ".join(e.failed))
            if e.repeat:
                notes.append("repeat: nothing new")
            rows.append(
                (str(e.index), str(e.step_index), ", ".join(e.finished) or "-", "; ".join(notes))
            )
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
        for row in [header, *rows]:
            cells = "  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True))
            lines.append(f"{cells}  {row[3]}".rstrip())
        lines.append("")
        if self.violations:
            lines.append(f"{len(self.violations)} violation(s):")
            lines.extend(
                f"  checkpoint {v.index}: {v.kind}: {v.message}" for v in self.violations
            )
        else:
            lines.append("no violations")
        return "\n".join(lines)


def _same(a: object, b: object) -> bool:
    # The rule delta_since uses: identity, then equality, then the JSON
    # encoding, so that a NaN output (not == to itself), or one whose == is
    # not a plain bool or raises, is not taken for a changed output.
    return same_output(a, b)


def _decreased(now: TokenUsage, before: TokenUsage) -> bool:
    return (
        now.input_tokens < before.input_tokens
        or now.output_tokens < before.output_tokens
        or now.llm_calls < before.llm_calls
    )


def _adds_nothing(cp: WorkflowCheckpoint, prev: WorkflowCheckpoint | None) -> bool:
    if prev is None:
        return not cp.outputs and not cp.failures and cp.step_index == 0 and cp.cost.is_zero()
    return (
        cp.step_index == prev.step_index
        and cp.cost == prev.cost
        and len(cp.outputs) == len(prev.outputs)
        and len(cp.step_usage) == len(prev.step_usage)
        and cp.failures == prev.failures
    )


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
    if graph_or_workflow is None:
        with_graph = [cp for cp in cps if cp.graph is not None]
        if not with_graph:
            raise ValueError("no checkpoint records a graph; give the workflow's graph")
        graph = recorded_graph(with_graph[-1])
        source: GraphSource = "checkpoint"
    else:
        graph = graph_of(graph_or_workflow)
        source = "given"

    violations: list[Violation] = []
    timeline: list[TimelineEntry] = []
    # First recorded value of each output and step usage, and where it was recorded.
    first: dict[str, tuple[Any, int]] = {}
    first_usage: dict[str, TokenUsage] = {}
    prev: WorkflowCheckpoint | None = None
    prev_repeat = False
    segment = 0
    for i, cp in enumerate(cps):
        def report(step: str | None, kind: ViolationKind, message: str, i: int = i) -> None:
            violations.append(Violation(i, step, kind, message))

        delta = cp.delta_since(prev)
        if delta.extends:
            new = [name for name, _ in delta.outputs]
            new_usage = [name for name, _ in delta.step_usage]
        else:
            assert prev is not None  # delta_since(None) always extends
            # A value that differs from its predecessor's is reported only when
            # it also differs from the first one recorded: a single tampered
            # checkpoint then yields one violation, not a second for the
            # checkpoint after it that holds the original again.
            for name, value in prev.outputs.items():
                if name not in cp.outputs:
                    report(
                        name, "output_removed",
                        f"output of {name!r}, recorded by checkpoint {first[name][1]}, "
                        "is no longer recorded",
                    )
                elif not _same(cp.outputs[name], value) and not _same(
                    cp.outputs[name], first[name][0]
                ):
                    report(
                        name, "output_changed",
                        f"output of {name!r} differs from the one checkpoint "
                        f"{first[name][1]} recorded",
                    )
            for name, usage in prev.step_usage.items():
                if name not in cp.step_usage:
                    # A dropped output already says its usage went with it.
                    if name in cp.outputs:
                        report(name, "usage_changed", f"usage of {name!r} is no longer recorded")
                elif cp.step_usage[name] != usage and cp.step_usage[name] != first_usage[name]:
                    report(
                        name, "usage_changed",
                        f"usage of {name!r} changed from {first_usage[name]} to "
                        f"{cp.step_usage[name]}",
                    )
            new = [name for name in cp.outputs if name not in prev.outputs]
            new_usage = [name for name in cp.step_usage if name not in prev.step_usage]

        # A name recorded again after it was dropped must come back unchanged.
        for name in new:
            earlier = first.get(name)
            if earlier is None:
                first[name] = (cp.outputs[name], i)
            elif not _same(cp.outputs[name], earlier[0]):
                report(
                    name, "output_changed",
                    f"output of {name!r} differs from the one checkpoint {earlier[1]} recorded",
                )
        for name in new_usage:
            usage = cp.step_usage[name]
            before = first_usage.setdefault(name, usage)
            if before != usage:
                report(name, "usage_changed", f"usage of {name!r} differs from {before} recorded")

        if prev is not None:
            if cp.step_index < prev.step_index:
                report(
                    None, "step_index_decreased",
                    f"step_index went down from {prev.step_index} to {cp.step_index}",
                )
            if _decreased(cp.cost, prev.cost):
                report(None, "cost_decreased", f"cost went down from {prev.cost} to {cp.cost}")

        finished = []
        for name in new:
            if name not in graph.index:
                if i > 0 and first[name][1] == i:
                    report(name, "unknown_step", f"output recorded for {name!r}, not a step")
                continue
            finished.append(name)
            missing = [d for d in graph.deps[name] if d not in cp.outputs]
            if missing:
                report(
                    name, "dependency_not_recorded",
                    f"{name!r} is recorded before its dependenc"
                    f"{'y' if len(missing) == 1 else 'ies'} " + ", ".join(map(repr, missing)),
                )

        if cp.fingerprint is not None and cp.fingerprint != graph.fingerprint and (
            prev is None or prev.fingerprint != cp.fingerprint
        ):
            changes = graph_changes(graph, cp)
            detail = changes.describe() if changes is not None else cp.fingerprint
            report(None, "fingerprint_mismatch", f"recorded from a different graph: {detail}")

        repeat = delta.extends and _adds_nothing(cp, prev)
        resumed = False
        resumed_from: int | None = None
        if prev is not None:
            if not delta.extends:
                resumed = True
                for j in range(i - 2, -1, -1):
                    if cp.delta_since(cps[j]).extends:
                        resumed_from = j
                        break
            elif prev_repeat and not repeat:
                resumed, resumed_from = True, i - 1
        if resumed:
            segment += 1
        failed = tuple(sorted(delta.failures, key=lambda n: graph.index.get(n, len(graph))))
        timeline.append(
            TimelineEntry(
                index=i,
                step_index=cp.step_index,
                finished=tuple(finished),
                failed=failed,
                cost=cp.cost,
                repeat=repeat,
                resumed=resumed,
                resumed_from=resumed_from,
                segment=segment,
            )
        )
        prev, prev_repeat = cp, repeat

    return ReplayReport(tuple(timeline), tuple(violations), source, graph.fingerprint)
