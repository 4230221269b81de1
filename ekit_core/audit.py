"""Auditing a recorded checkpoint: what a resume would skip and run, and why.

This module owns the explanation of a resume. :func:`audit` reads one
checkpoint against a graph and returns an :class:`AuditReport` with one
:class:`StepAudit` row per step, in declaration order, and the
:class:`Anomaly` values it found. The rule it explains is invariant 1: the
steps a resume skips are exactly those with a recorded output; a recorded failure is
not an output, so a failed step runs again.

Everything here is pure: the same graph and checkpoint always give the same
report, and nothing it is given is changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Literal

from ekit_core.checkpoint import FailureRecord, WorkflowCheckpoint
from ekit_core.compat import graph_changes
from ekit_core.graph import GraphSpec
from ekit_core.transitions import initial_state
from ekit_core.usage import TokenUsage

__all__ = [
    "Anomaly",
    "AuditReport",
    "StepAudit",
    "audit",
    "graph_of",
    "load_checkpoint",
    "recorded_graph",
]

Action = Literal["skip", "run"]
Reason = Literal["recorded", "ready", "failed", "waiting"]
GraphSource = Literal["given", "checkpoint"]


@dataclass(frozen=True, slots=True)
class StepAudit:
    """What a resume from the audited checkpoint does with one step, and why.

    ``action`` is ``"skip"`` (its output is recorded) or ``"run"``.
    ``reason`` is ``"recorded"`` for a skip; for a run it is ``"failed"``
    (a failure is recorded, see ``failure``), ``"waiting"`` (never recorded and
    some dependencies are not recorded either, see ``waiting_on``) or
    ``"ready"`` (never recorded, every dependency recorded: it starts at once).
    ``usage`` is the step's recorded token usage, when the checkpoint has it.
    """

    name: str
    action: Action
    reason: Reason
    depends_on: tuple[str, ...]
    waiting_on: tuple[str, ...] = ()
    failure: FailureRecord | None = None
    usage: TokenUsage | None = None

    @property
    def why(self) -> str:
        """One human-readable line explaining ``action``."""
        if self.reason == "recorded":
            return "output recorded"
        parts = []
        if self.failure is not None:
            f = self.failure
            times = "once" if f.attempts == 1 else f"{f.attempts} times"
            parts.append(f"recorded as failed {times}: {f.error_type}: {f.message}")
        else:
            parts.append("never recorded")
        if self.waiting_on:
            parts.append("waiting on " + ", ".join(self.waiting_on))
        elif self.failure is None:
            parts.append("ready to start")
        return "; ".join(parts)

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
        }


AnomalyKind = Literal[
    "fingerprint_mismatch",
    "graph_fingerprint",
    "unknown_output",
    "missing_dependency",
    "unknown_failure",
    "context_collision",
    "budget_reached",
    "resume_refused",
]


@dataclass(frozen=True, slots=True)
class Anomaly:
    """Something in the checkpoint that a clean run of the graph would not have recorded.

    ``kind`` is one of:

    - ``"fingerprint_mismatch"``: the checkpoint was recorded from another graph;
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
      would refuse, with the core's reason.

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
            "steps": [s.to_dict() for s in self.steps],
            "anomalies": [a.to_dict() for a in self.anomalies],
        }

    def format(self) -> str:
        """A readable table: one line per step, then the anomalies."""
        source = (
            "graph given by the caller"
            if self.graph_source == "given"
            else "graph recorded in the checkpoint (no graph given)"
        )
        lines = [
            f"{source}, fingerprint {self.fingerprint}",
            f"checkpoint: format {self.format_version}, step_index {self.step_index}, "
            f"usage {_usage_text(self.cost)}",
            f"resume skips {len(self.skipped)} step(s), runs {len(self.to_run)}",
            "",
        ]
        header = ("STEP", "ACTION", "USAGE in/out/calls", "WHY")
        rows = [
            (s.name, s.action, "-" if s.usage is None else _usage_text(s.usage), s.why)
            for s in self.steps
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
        for row in [header, *rows]:
            lines.append(
                "  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True))
                + "  "
                + row[3]
            )
        lines.append("")
        if self.anomalies:
            lines.append(f"{len(self.anomalies)} anomaly(ies):")
            lines.extend(f"  {a.kind}: {a.message}" for a in self.anomalies)
        else:
            lines.append("no anomalies")
        return "\n".join(lines)


def _usage_text(usage: TokenUsage) -> str:
    return f"{usage.input_tokens}/{usage.output_tokens}/{usage.llm_calls}"


def graph_of(graph_or_workflow: object) -> GraphSpec:
    """The :class:`GraphSpec` of a graph, or of anything with a ``graph`` attribute holding one.

    Raises ``ValueError`` for anything else.
    """
    if isinstance(graph_or_workflow, GraphSpec):
        return graph_or_workflow
    graph = getattr(graph_or_workflow, "graph", None)
    if isinstance(graph, GraphSpec):
        return graph
    raise ValueError(
        "graph must be a GraphSpec or have a 'graph' attribute holding one (a Workflow), "
        f"got {type(graph_or_workflow).__name__}"
    )


def load_checkpoint(checkpoint: WorkflowCheckpoint | Mapping[str, Any]) -> WorkflowCheckpoint:
    """``checkpoint`` itself, or parsed from its dict (a ``CheckpointError`` if malformed)."""
    if isinstance(checkpoint, WorkflowCheckpoint):
        return checkpoint
    if isinstance(checkpoint, Mapping):
        return WorkflowCheckpoint.from_dict(dict(checkpoint))
    raise ValueError(
        f"checkpoint must be a WorkflowCheckpoint or its dict, got {type(checkpoint).__name__}"
    )


def recorded_graph(checkpoint: WorkflowCheckpoint) -> GraphSpec:
    """The graph a checkpoint records; ``ValueError`` if it records none or an invalid one."""
    if checkpoint.graph is None:
        raise ValueError(
            "checkpoint records no graph (ExecutionKit or hand-made); give the workflow's graph"
        )
    return GraphSpec.of(checkpoint.graph)


def audit(
    graph_or_workflow: GraphSpec | object | None,
    checkpoint: WorkflowCheckpoint | Mapping[str, Any],
    *,
    budget: TokenUsage | None = None,
) -> AuditReport:
    """Explain what resuming ``checkpoint`` into the graph would skip and run, and why.

    ``graph_or_workflow`` is a :class:`GraphSpec`, a ``Workflow`` (anything
    with a ``graph`` attribute holding one), or ``None`` to audit against the
    graph the checkpoint records (``report.graph_source == "checkpoint"``).
    ``checkpoint`` may be a :class:`WorkflowCheckpoint` or its dict.
    ``budget`` is the budget a resume would be given, if any: a checkpoint
    whose recorded usage already reaches it is reported (``budget_reached``).

    Everything a resume would refuse is an anomaly: a graph mismatch
    (``fingerprint_mismatch``, with the steps added, removed and changed), a
    context key that is also a step name (``context_collision``), and, as a
    backstop, anything else :func:`~ekit_core.initial_state` refuses
    (``resume_refused``).

    Raises ``ValueError`` for a graph that is neither, a malformed checkpoint
    (:class:`~ekit_core.CheckpointError`), ``None`` with a checkpoint that
    records no graph, or a ``budget`` that is not a non-negative
    :class:`~ekit_core.TokenUsage`.
    """
    cp = load_checkpoint(checkpoint)
    if graph_or_workflow is None:
        graph = recorded_graph(cp)
        source: GraphSource = "checkpoint"
    else:
        graph = graph_of(graph_or_workflow)
        source = "given"
    _check_budget(budget)
    anomalies = [
        *_graph_anomalies(graph, cp),
        *_record_anomalies(graph, cp),
        *_resume_anomalies(graph, cp, budget),
    ]
    return AuditReport(
        steps=_rows(graph, cp),
        anomalies=tuple(anomalies),
        graph_source=source,
        fingerprint=graph.fingerprint,
        recorded_fingerprint=cp.fingerprint,
        format_version=cp.format_version,
        step_index=cp.step_index,
        cost=cp.cost,
    )


def _check_budget(budget: object) -> None:
    if budget is None:
        return
    if not isinstance(budget, TokenUsage):
        raise ValueError(f"budget must be None or a TokenUsage, got {type(budget).__name__}")
    if min(budget.input_tokens, budget.output_tokens, budget.llm_calls) < 0:
        raise ValueError(f"budget counts must not be negative, got {budget!r}")


def _rows(graph: GraphSpec, cp: WorkflowCheckpoint) -> tuple[StepAudit, ...]:
    """One row per step: skipped exactly when its output is recorded (invariant 1).

    A step with an output is skipped even when a failure is recorded for it
    too: that failure is an old one, from an attempt before the one that
    succeeded.
    """
    outputs, usage, failures = cp.outputs, cp.step_usage, cp.failures
    rows = []
    for name in graph.names:
        deps = graph.deps[name]
        if name in outputs:
            rows.append(StepAudit(name, "skip", "recorded", deps, usage=usage.get(name)))
            continue
        waiting = tuple(d for d in deps if d not in outputs)
        failure = failures.get(name)
        reason: Reason = "failed" if failure is not None else "waiting" if waiting else "ready"
        rows.append(StepAudit(name, "run", reason, deps, waiting, failure, usage.get(name)))
    return tuple(rows)


def _graph_anomalies(graph: GraphSpec, cp: WorkflowCheckpoint) -> list[Anomaly]:
    """Does the checkpoint come from this graph, and does its recorded graph hash right?"""
    anomalies: list[Anomaly] = []
    changes = graph_changes(graph, cp)
    if changes is not None:
        anomalies.append(
            Anomaly(
                "fingerprint_mismatch",
                None,
                "checkpoint was recorded from a different graph: " + changes.describe(),
            )
        )
    if cp.graph is not None and cp.fingerprint is not None:
        # A recorded graph that does not hash to the recorded fingerprint was
        # edited after the fact; the mismatch check above trusts neither alone.
        try:
            own = GraphSpec.of(cp.graph).fingerprint
        except ValueError as exc:
            anomalies.append(
                Anomaly("graph_fingerprint", None, f"the recorded graph is invalid: {exc}")
            )
        else:
            if own != cp.fingerprint:
                anomalies.append(
                    Anomaly(
                        "graph_fingerprint",
                        None,
                        f"the recorded graph hashes to {own}, not to the recorded "
                        f"fingerprint {cp.fingerprint}",
                    )
                )
    return anomalies


def _record_anomalies(graph: GraphSpec, cp: WorkflowCheckpoint) -> list[Anomaly]:
    """Outputs and failures a clean run of ``graph`` would not have recorded."""
    outputs = cp.outputs
    anomalies: list[Anomaly] = []
    old_steps: Mapping[str, tuple[str, ...]] = cp.graph or {}
    for name in outputs:
        if name in graph.index:
            continue
        if name in old_steps:
            what = "a step of the recorded graph that this graph removed"
        elif name in cp.context:
            what = "a context key"
        else:
            what = "not a step (an initial-context key ExecutionKit kept among outputs?)"
        anomalies.append(
            Anomaly("unknown_output", name, f"output recorded for {name!r}: {what}")
        )
    for name in graph.names:
        if name in outputs:
            missing = [d for d in graph.deps[name] if d not in outputs]
            if missing:
                anomalies.append(
                    Anomaly(
                        "missing_dependency",
                        name,
                        f"output of {name!r} is recorded but not that of its "
                        f"dependenc{'y' if len(missing) == 1 else 'ies'} "
                        + ", ".join(map(repr, missing)),
                    )
                )
    for name in cp.failures:
        if name not in graph.index:
            anomalies.append(
                Anomaly("unknown_failure", name, f"failure recorded for {name!r}, not a step")
            )
    return anomalies


def _resume_anomalies(
    graph: GraphSpec, cp: WorkflowCheckpoint, budget: TokenUsage | None
) -> list[Anomaly]:
    """What a resume from ``cp`` would refuse, asked of the core itself.

    Context keys that collide with step names are reported one by one; then
    :func:`~ekit_core.initial_state` is asked to resume from the checkpoint
    without them, so that any other refusal (today's rules or one added to it
    later) is reported too rather than passing as clean. The graph mismatch
    is left out of that question: ``fingerprint_mismatch`` already says it,
    with the steps concerned.
    """
    colliding = [k for k in cp.context if k in graph.index]
    anomalies = [
        Anomaly(
            "context_collision",
            key,
            f"context key {key!r} is also a step name: a resume from this checkpoint "
            "is refused, since the step's output would be shadowed",
        )
        for key in colliding
    ]
    if colliding:
        kept = {k: v for k, v in cp.context.items() if k not in graph.index}
        cp = replace(cp, context=MappingProxyType(kept))
    try:
        state = initial_state(graph, cp, budget=budget, allow_graph_change=True)
    except ValueError as exc:
        anomalies.append(
            Anomaly("resume_refused", None, f"a resume from this checkpoint is refused: {exc}")
        )
        return anomalies
    halt = state.halt
    if halt is not None and halt.kind == "budget_exceeded" and budget is not None:
        anomalies.append(
            Anomaly(
                "budget_reached",
                None,
                f"the recorded usage {_usage_text(cp.cost)} already reaches the budget "
                f"{_usage_text(budget)}: a resume with it starts no step and raises "
                "BudgetExceeded",
            )
        )
    return anomalies
