"""What audit and replay share: the graph they explain, how they load checkpoints, how they print.

Both explain recorded checkpoints against a graph that the caller gives (a
:class:`~ekit_core.GraphSpec`, or a ``Workflow``, whose steps also carry
their version tags) or that the checkpoints record. This module owns

- the resolution of that graph (:func:`subject_of`, :func:`graph_of`,
  :func:`recorded_graph`) and of the steps' version tags (:func:`versions_of`);
- the one loading path for a checkpoint, the core's
  :func:`~ekit_core.transitions.resume_checkpoint` (:func:`load_checkpoint`),
  and its message for a checkpoint of another graph (:func:`mismatch`);
- what a step or item needed recorded before it (:func:`needs_of`), in a
  graph as its run-time shapes grew it;
- the one table renderer (:func:`table`) and number format (:func:`count`,
  :func:`usage_text`) of both reports' ``format()``.

Pure, like the rest of :mod:`ekit_core`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ekit_core.checkpoint import WorkflowCheckpoint
from ekit_core.compat import GraphMismatchError, graph_changes
from ekit_core.expansion import Expanded
from ekit_core.graph import GraphSpec
from ekit_core.transitions import resume_checkpoint
from ekit_core.usage import TokenUsage

__all__ = [
    "GraphSource",
    "Subject",
    "count",
    "findings",
    "graph_of",
    "load_checkpoint",
    "mismatch",
    "needs_of",
    "recorded_graph",
    "seconds_text",
    "source_line",
    "subject_of",
    "table",
    "usage_text",
    "versions_of",
]

GraphSource = Literal["given", "checkpoint"]
"""Where a report's graph came from: given by the caller, or recorded in the checkpoints."""


@dataclass(frozen=True, slots=True)
class Subject:
    """The graph a report explains, where it came from, and the steps' version tags.

    ``versions`` is ``None`` when they are not known (a bare ``GraphSpec``
    given without ``versions=``, or the graph recorded in a checkpoint): the
    recorded tags are then taken as current, so no tag counts as changed.
    """

    graph: GraphSpec
    source: GraphSource
    versions: Mapping[str, str] | None


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


def versions_of(graph_or_workflow: object) -> dict[str, Any] | None:
    """The version tags a ``Workflow``'s steps declare (``Step(version=...)``); ``None`` for a graph.

    Read from the ``steps`` attribute (each step's ``name`` and ``version``),
    so that the core needs nothing of the runtime. Tags are checked where
    they are used, by the rule a resume applies.
    """
    if isinstance(graph_or_workflow, GraphSpec):
        return None
    steps = getattr(graph_or_workflow, "steps", None)
    if not isinstance(steps, Iterable):
        return None
    tags: dict[str, Any] = {}
    for step in steps:
        name, tag = getattr(step, "name", None), getattr(step, "version", None)
        if isinstance(name, str) and tag is not None:
            tags[name] = tag
    return tags


def recorded_graph(checkpoint: WorkflowCheckpoint) -> GraphSpec:
    """The graph a checkpoint records; ``ValueError`` if it records none or an invalid one."""
    if checkpoint.graph is None:
        raise ValueError(
            "checkpoint records no graph (ExecutionKit or hand-made); give the workflow's graph"
        )
    return GraphSpec.of(checkpoint.graph, checkpoint.shapes)


def subject_of(
    graph_or_workflow: object,
    checkpoints: WorkflowCheckpoint | Sequence[WorkflowCheckpoint],
    versions: Mapping[str, str] | None = None,
) -> Subject:
    """The graph that one checkpoint, or a sequence, is explained against, and the tags to use.

    ``None`` means the graph recorded by the (last) checkpoint that records
    one. ``versions``, when given, overrides the tags a ``Workflow``'s steps
    declare. Raises ``ValueError`` for a graph that is neither a
    ``GraphSpec`` nor a ``Workflow``, and for ``None`` when no checkpoint
    records a graph.
    """
    if graph_or_workflow is not None:
        tags = versions if versions is not None else versions_of(graph_or_workflow)
        return Subject(graph_of(graph_or_workflow), "given", tags)
    if isinstance(checkpoints, WorkflowCheckpoint):
        return Subject(recorded_graph(checkpoints), "checkpoint", versions)
    with_graph = [cp for cp in checkpoints if cp.graph is not None]
    if not with_graph:
        raise ValueError("no checkpoint records a graph; give the workflow's graph")
    return Subject(recorded_graph(with_graph[-1]), "checkpoint", versions)


# resume_checkpoint reads its graph only to refuse a checkpoint of another
# graph, which allow_graph_change=True skips: audit and replay report that as
# a finding (with the same message, see mismatch) instead of raising.
_PARSE_ONLY = GraphSpec.of(())


def load_checkpoint(checkpoint: object) -> WorkflowCheckpoint:
    """``checkpoint`` itself, or parsed from its dict, by the loading path a resume takes.

    ``None`` is a checkpoint of nothing recorded, as for a resume. Raises
    :class:`~ekit_core.CheckpointError` naming the field of a malformed
    dict, and ``ValueError`` for anything that is neither.
    """
    return resume_checkpoint(_PARSE_ONLY, checkpoint, allow_graph_change=True)


def mismatch(graph: GraphSpec, checkpoint: WorkflowCheckpoint) -> str | None:
    """The message a resume gives when it refuses ``checkpoint`` as another graph's; ``None`` if not."""
    changes = graph_changes(graph, checkpoint)
    return None if changes is None else str(GraphMismatchError(changes))


def needs_of(graph: GraphSpec, items: Expanded, skipped: Mapping[str, str], name: str
             ) -> tuple[str, ...]:
    """What must be recorded before step or item ``name`` is: its dependencies, as the run grew.

    ``items`` is what the recorded outputs expand the graph into
    (:func:`~ekit_core.rewind.grown`). An item needs what it was expanded
    with; a mapped step (its collected output) its dependencies and its
    items not ``skipped``; a step joining ``"any"`` its dependencies not
    skipped. In a graph without shapes, its dependencies.
    """
    deps = items.steps.get(name)
    if deps is not None:
        return deps
    deps = graph.deps[name]
    shape = graph.shapes.get(name)
    if shape is None:
        return deps
    if shape.join == "any":
        return tuple(d for d in deps if d not in skipped)
    members = items.members.get(name, ())
    return (*deps, *(m for m in members if m not in skipped)) if members else deps


# -- printing ---------------------------------------------------------------------


def count(n: int) -> str:
    """A count as every report and command prints it: with thousands separators (``12,345``)."""
    return f"{n:,}"


def usage_text(usage: TokenUsage) -> str:
    """Usage as ``in/out/calls`` (``12,000/900/3``), the form ``ekit audit --budget`` reads."""
    return f"{usage.input_tokens:,}/{usage.output_tokens:,}/{usage.llm_calls:,}"


def seconds_text(seconds: float) -> str:
    """A duration as people read it: ``850µs``, ``12.5ms``, ``3.20s``, ``4m05s``, ``2h03m``."""
    if seconds < 0.001:
        return f"{seconds * 1e6:.0f}µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f}ms"
    if seconds < 60:
        return f"{seconds:.2f}s"
    whole = round(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600:,}h{whole % 3600 // 60:02d}m"


def source_line(source: GraphSource, fingerprint: str, *, plural: bool) -> str:
    """The first line of a report: where its graph came from, and the graph's fingerprint."""
    if source == "given":
        where = "graph given by the caller"
    else:
        where = f"graph recorded in the checkpoint{'s' if plural else ''} (no graph given)"
    return f"{where}, fingerprint {fingerprint}"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """Aligned lines: each column padded to its widest cell, the last one left to run free."""
    every = [tuple(header), *(tuple(r) for r in rows)]
    widths = [max(len(r[i]) for r in every) for i in range(len(header) - 1)]
    lines = []
    for row in every:
        cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=False)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return lines


def findings(found: Sequence[str], what: str, none: str) -> list[str]:
    """The closing lines of a report: ``none``, or how many of ``what`` were found, one per line."""
    if not found:
        return [none]
    return [f"{count(len(found))} {what}:", *(f"  {line}" for line in found)]
