"""Whether a recorded checkpoint fits a graph: the fingerprint rule.

A checkpoint written by this library carries the graph it was made from and
that graph's fingerprint. Resuming it into a different graph could skip a
step whose inputs changed, so it is refused unless the caller opts in. A
checkpoint without a fingerprint (ExecutionKit's three keys, or hand-made)
carries no claim and is accepted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ekit_core.checkpoint import WorkflowCheckpoint
from ekit_core.graph import GraphSpec

__all__ = ["GraphChanges", "GraphMismatchError", "graph_changes"]


@dataclass(frozen=True, slots=True)
class GraphChanges:
    """How the graph a checkpoint was recorded from differs from another graph."""

    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[str, ...]
    recorded_fingerprint: str
    current_fingerprint: str

    def describe(self) -> str:
        """One line naming the steps added, removed and whose dependencies changed."""
        parts = []
        for label, names in (
            ("added", self.added),
            ("removed", self.removed),
            ("dependencies changed", self.changed),
        ):
            if names:
                parts.append(f"{label}: {', '.join(map(repr, names))}")
        if not parts:
            parts.append(
                f"recorded fingerprint {self.recorded_fingerprint} is not "
                f"{self.current_fingerprint}"
            )
        return "; ".join(parts)


class GraphMismatchError(ValueError):
    """A checkpoint was recorded from a different graph than the one resuming it.

    ``changes`` is the :class:`GraphChanges`. Pass ``allow_graph_change=True``
    to resume anyway.
    """

    def __init__(self, changes: GraphChanges) -> None:
        super().__init__(
            "checkpoint was recorded from a different workflow graph ("
            + changes.describe()
            + "); pass allow_graph_change=True to resume anyway"
        )
        self.changes = changes


def graph_changes(graph: GraphSpec, checkpoint: WorkflowCheckpoint) -> GraphChanges | None:
    """The differences between ``graph`` and the checkpoint's recorded graph.

    ``None`` when the checkpoint has no fingerprint or the fingerprints match.
    """
    recorded = checkpoint.fingerprint
    if recorded is None or recorded == graph.fingerprint:
        return None
    old: Mapping[str, tuple[str, ...]] = checkpoint.graph or {}
    added = tuple(n for n in graph.names if old and n not in old)
    removed = tuple(n for n in old if n not in graph.index)
    changed = tuple(
        n for n in graph.names if n in old and set(old[n]) != set(graph.deps[n])
    )
    return GraphChanges(added, removed, changed, recorded, graph.fingerprint)
