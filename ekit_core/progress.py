"""How far a run got: the one definition of progress every reader shows.

A run's units are its declared steps and, for a mapped step whose input
(what it maps over) is recorded, each of its items: a mapped step counts
once itself and once per item. Of those units, *recorded* ones have an
output in the checkpoint, *skipped* ones were skipped by a condition (a
skip is done, not recorded: eight items skipped are not eight escalations
made), *failed* ones have a failure recorded and no output; ``done`` is
recorded plus skipped. The worker's log, ``RunInfo.steps_done`` (``ekit
queue list``), the run's own log lines and ``ProgressPrinter`` (through
the counts ``RunStarted`` and ``RunSettled`` carry) and the dashboard all
read their numbers from here or from the core's counts that agree with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ekit_core.checkpoint import WorkflowCheckpoint
from ekit_core.graph import GraphSpec
from ekit_core.rewind import grown
from ekit_core.shapes import Shape

__all__ = ["Progress", "items_progress", "run_progress"]


@dataclass(frozen=True, slots=True)
class Progress:
    """Units recorded, skipped by a condition and failed, of ``total`` (``None``: not known)."""

    recorded: int
    skipped: int
    failed: int
    total: int | None

    @property
    def done(self) -> int:
        """Units that need nothing more: recorded or skipped."""
        return self.recorded + self.skipped

    def text(self) -> str:
        """``"7 of 9 steps done (2 skipped)"``: what every log line says of it."""
        total = "?" if self.total is None else f"{self.total:,}"
        skipped = f" ({self.skipped:,} skipped)" if self.skipped else ""
        return f"{self.done:,} of {total} steps done{skipped}"


def run_progress(checkpoint: WorkflowCheckpoint) -> Progress:
    """The whole run's progress as ``checkpoint`` records it (``total``: ``None`` without a graph).

    Reads no output but the mapped-over ones (how many items each makes),
    so that every save can afford it: O(mapped steps + failures).
    """
    skipped: Mapping[str, str] = checkpoint.skipped or {}
    outputs = checkpoint.outputs
    failed = sum(1 for name in checkpoint.failures if name not in outputs)
    graph = checkpoint.graph
    if graph is None:
        return Progress(checkpoint.step_index, len(skipped), failed, None)
    shapes: Mapping[str, Shape] = checkpoint.shapes or {}
    total = len(graph)
    for name in shapes:
        total += _item_count(name, shapes, outputs, skipped) or 0
    recorded, skips = checkpoint.step_index, len(skipped)
    return Progress(recorded, skips, failed, max(recorded + skips, total))


def _item_count(
    name: str, shapes: Mapping[str, Shape], outputs: Mapping[str, Any], skipped: Mapping[str, str]
) -> int | None:
    """How many items step ``name`` makes, ``None`` when not known yet (or it maps over nothing).

    A step mapped over a mapped step's items (an item-wise chain) has one item
    per item of that step, known as soon as its input is: its items run before
    that step's collection is recorded. A skipped mapped step has no items.
    """
    over = shapes[name].map_over
    if over is None:
        return None
    if name in skipped:
        return 0
    chained = shapes.get(over)
    if chained is not None and chained.map_over is not None:
        return _item_count(over, shapes, outputs, skipped)
    output = outputs.get(over)
    return len(output) if isinstance(output, list | tuple | Mapping) else None


def items_progress(graph: GraphSpec, checkpoint: WorkflowCheckpoint) -> dict[str, Progress]:
    """Each mapped step's items: recorded, skipped and failed, of how many its input makes.

    A mapped step whose input is not recorded yet has ``total`` ``None``; one
    skipped itself has no items (``total`` 0).
    """
    members = grown(graph, checkpoint.outputs).members
    found: dict[str, Progress] = {}
    outputs, skipped, failures = checkpoint.outputs, checkpoint.skipped, checkpoint.failures
    for name, shape in graph.shapes.items():
        if shape.map_over is None:
            continue
        if name in skipped:
            found[name] = Progress(0, 0, 0, 0)
            continue
        items = members.get(name)
        if items is None:
            found[name] = Progress(0, 0, 0, None)
            continue
        found[name] = Progress(
            sum(1 for i in items if i in outputs),
            sum(1 for i in items if i in skipped),
            sum(1 for i in items if i in failures and i not in outputs),
            len(items),
        )
    return found
