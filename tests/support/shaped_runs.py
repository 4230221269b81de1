"""Shaped workflows and runs shared by the tests of run-time shapes (maps, conditions, joins).

``shaped_result`` decides what a step or item does from its inputs alone, so that
every completion order must agree; ``run_to_end`` drives the core with it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ekit_core import (
    Ended,
    GraphSpec,
    Skipped,
    State,
    Succeeded,
    WorkflowCheckpoint,
    advance,
    checkpoint_of,
    initial_state,
)
from ekit_core.shapes import Shape
from ekit_runtime import Step, Workflow
from tests.support.strategies import shaped_dags


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:8]


# The random shaped graphs of every shapes property test (tests/support/strategies.py).
shaped_graphs = shaped_dags


def _template(state: State, name: str) -> tuple[str, Any]:
    """The declared step ``name`` runs as, and the input it maps over (None if not an item)."""
    shaped = state.spec.shaped
    if shaped is not None and name in shaped.items:
        ref = shaped.items[name]
        if ref.iteration:  # an iteration of a loop: its input is its dependencies'
            return ref.step, None
        source = state.outputs[ref.source]
        return ref.step, source if ref.pick is None else source[ref.pick]
    return name, None


def shaped_result(state: State, name: str) -> Succeeded | Skipped:
    """What step (or item) ``name`` does, decided by its inputs alone."""
    graph = state.spec.declared_graph
    step, item = _template(state, name)
    inputs = {d: state.outputs[d] for d in state.spec.graph.deps[name] if d in state.outputs}
    seed = _digest([name, inputs, item])
    shape = graph.shapes.get(step)
    if shape is not None and shape.when is not None and int(seed, 16) % 3 == 0:
        return Skipped(name, "condition cond was false")
    if shape is not None and shape.map_over is not None:
        return Succeeded(name, f"{name}:{seed}")
    output = [f"{name}:{seed}:{j}" for j in range(int(seed[:2], 16) % 4)]
    if shape is not None and shape.repeat is not None and (
            int(seed, 16) % 3 == 1 or name.endswith(f"#{shape.repeat}")):
        return Ended(name, output)  # (an iteration that ends its loop, by its cap at the latest)
    return Succeeded(name, output)


def all_skipped_chain() -> tuple[GraphSpec, State]:
    """``d`` maps over ``b``, which maps over ``a`` and whose only item was skipped (so
    ``d``'s was too); ``d`` also needs ``c``, not run yet. The graph, and that state."""
    graph = GraphSpec.of(
        {"a": (), "b": ("a",), "c": (), "d": ("b", "c")},
        {"b": Shape(map_over="a", when="cond"), "c": Shape(when="cond"), "d": Shape(map_over="b")},
    )
    state, _ = advance(initial_state(graph))
    state, _ = advance(state, [Succeeded("a", ["x"])])
    state, _ = advance(state, [Skipped("b[0]", "condition cond was false")])
    return graph, state


def pipeline(ran: list[str]) -> Workflow:
    def split(ctx: dict[str, Any]) -> list[str]:
        ran.append("split")
        return str(ctx["doc"]).split("|")

    def summarize(ctx: dict[str, Any]) -> str:
        ran.append(f"summarize {ctx['split']}")
        return str(ctx["split"]).upper()

    def critique(ctx: dict[str, Any]) -> str:
        ran.append(f"critique {ctx['summarize']}")
        return f"{ctx['summarize']}!"

    def merge(ctx: dict[str, Any]) -> str:
        ran.append("merge")
        return " ".join(ctx["critique"])

    return Workflow([
        Step("split", split),
        Step("summarize", summarize, ("split",), map_over="split", context="dependencies"),
        Step("critique", critique, ("summarize",), map_over="summarize", context="dependencies"),
        Step("merge", merge, ("critique",), context="dependencies"),
    ])


def run_to_end(graph: GraphSpec, resume_from: WorkflowCheckpoint | None = None
                ) -> tuple[dict[str, Any], set[str], WorkflowCheckpoint]:
    """Run ``graph`` with the core to its end, one name at a time; what ran, and the last checkpoint."""
    state, batch = advance(initial_state(graph, resume_from))
    pending, ran = list(batch.names), set()
    while pending:
        name = pending.pop(0)
        ran.add(name)
        state, batch = advance(state, [shaped_result(state, name)])
        pending += batch.names
    assert state.settled
    return dict(state.outputs), ran, checkpoint_of(state)


def cutoff_pipeline(calls: list[str], *, split_version: str, summary_version: str | None = None,
              item_key: str | None = None) -> Workflow:
    def summarize(ctx: Any) -> str:
        piece = ctx["split"]
        text = piece["text"] if isinstance(piece, dict) else piece
        calls.append(f"summarize {text}")
        return text.upper()

    def critique(ctx: Any) -> str:
        calls.append(f"critique {ctx['summarize']}")
        return ctx["summarize"] + "!"

    return Workflow([
        Step("split", lambda ctx: ctx["pieces"], version=split_version),
        Step("summarize", summarize, ("split",), map_over="split", item_key=item_key,
             version=summary_version, context="dependencies"),
        Step("critique", critique, ("summarize",), map_over="summarize", context="dependencies"),
        Step("merge", lambda ctx: " ".join(ctx["critique"]), ("critique",), context="dependencies"),
    ])
