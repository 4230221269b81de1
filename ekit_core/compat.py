"""Whether a recorded checkpoint fits a graph: the fingerprint rule.

A checkpoint written by this library carries the graph it was made from and
that graph's fingerprint. Resuming it into a different graph could skip a
step whose inputs changed, so it is refused unless the caller opts in. A
checkpoint without a fingerprint (ExecutionKit's three keys, or hand-made)
carries no claim and is accepted.

The recorded graph is the claim, the fingerprint its summary: a recorded
graph spelt exactly as the resuming one spells itself is the same graph,
found by comparing two pairs of strings, with nothing hashed or decoded.
Only a checkpoint without a recorded graph, or whose graph differs in the
order of its entries or of a step's dependencies, has its fingerprint
compared; its recorded graph is decoded first, so that a malformed one is
refused even beside a fingerprint that fits. (So a fingerprint
edited by hand next to an intact graph does not stop a resume; the
resumed run's checkpoints carry the right one, and ``ekit audit`` reports
the edited one as ``graph_fingerprint``.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ekit_core.checkpoint import WorkflowCheckpoint
from ekit_core.graph import GraphSpec
from ekit_core.shapes import Shape

__all__ = ["GraphChanges", "GraphMismatchError", "graph_changes", "recorded_from", "reshaped_steps"]


@dataclass(frozen=True, slots=True)
class GraphChanges:
    """How the graph a checkpoint was recorded from differs from another graph.

    ``reshaped`` names the steps whose run-time shape (map, key, condition,
    join) differs from the recorded one.
    """

    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[str, ...]
    recorded_fingerprint: str
    current_fingerprint: str
    reshaped: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line naming the steps added, removed and whose dependencies changed."""
        parts = []
        for label, names in (
            ("added", self.added),
            ("removed", self.removed),
            ("dependencies changed", self.changed),
            ("shape changed", self.reshaped),
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


def recorded_from(graph: GraphSpec, checkpoint: WorkflowCheckpoint) -> bool:
    """Whether ``checkpoint`` says it was recorded from ``graph``: its recorded
    graph equals ``graph``'s dependencies, or else its fingerprint is ``graph``'s."""
    if checkpoint._records_graph(graph):
        return True
    checkpoint.check_graph()  # before the fingerprint is trusted: a malformed graph raises here
    recorded = checkpoint.fingerprint
    return recorded is not None and recorded == graph.fingerprint


def graph_changes(graph: GraphSpec, checkpoint: WorkflowCheckpoint) -> GraphChanges | None:
    """The differences between ``graph`` and the checkpoint's recorded graph.

    ``None`` when the checkpoint has no fingerprint or says it was recorded
    from ``graph`` (:func:`recorded_from`).
    """
    if recorded_from(graph, checkpoint):
        return None
    recorded = checkpoint.fingerprint
    if recorded is None:
        return None
    old: Mapping[str, tuple[str, ...]] = checkpoint.graph or {}
    added = tuple(n for n in graph.names if old and n not in old)
    removed = tuple(n for n in old if n not in graph.index)
    changed = tuple(
        n for n in graph.names if n in old and set(old[n]) != set(graph.deps[n])
    )
    return GraphChanges(added, removed, changed, recorded, graph.fingerprint,
                        reshaped_steps(graph, checkpoint))


_PLAIN = Shape()


def reshaped_steps(graph: GraphSpec, checkpoint: WorkflowCheckpoint) -> tuple[str, ...]:
    """The steps of ``graph`` that the checkpoint's recorded graph has with another shape.

    A step mapped now and plain then (or the reverse), keyed, conditioned or
    joined otherwise: its recorded output (and its items) are not what it
    makes now. Empty for a checkpoint that records no graph (it claims no
    shapes), and for the steps the recorded graph does not have (added ones).
    """
    recorded = checkpoint.shapes
    if checkpoint.graph is None or recorded == graph.shapes:
        return ()
    old: Mapping[str, tuple[str, ...]] = checkpoint.graph
    shapes = graph.shapes
    return tuple(n for n in graph.names
                 if n in old and shapes.get(n, _PLAIN) != recorded.get(n, _PLAIN))
