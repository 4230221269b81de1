"""Hypothesis strategies shared by the property tests: random DAGs."""

from __future__ import annotations

from hypothesis import strategies as st

from ekit_core import GraphSpec


@st.composite
def dags(draw: st.DrawFn, min_steps: int = 1, max_steps: int = 12) -> GraphSpec:
    """A random DAG: each step depends on a random subset of earlier steps.

    Declaration order is shuffled so that it is not always a topological order.
    """
    n = draw(st.integers(min_steps, max_steps))
    names = [f"s{i}" for i in range(n)]
    deps: dict[str, list[str]] = {}
    for i, name in enumerate(names):
        deps[name] = draw(st.lists(st.sampled_from(names[:i]), unique=True, max_size=3)) if i else []
    order = draw(st.permutations(names))
    return GraphSpec.of([(name, deps[name]) for name in order])


@st.composite
def shaped_dags(draw: st.DrawFn, min_steps: int = 2, max_steps: int = 7) -> GraphSpec:
    """A random DAG with run-time shapes: steps that map over a dependency (item-wise
    chains too), conditional steps (mapped ones too: per-item conditions), and joins
    over alternatives (``join="any"``). Every condition is named ``cond``."""
    from ekit_core.shapes import Shape

    size = draw(st.integers(min_steps, max_steps), label="steps")
    deps: dict[str, tuple[str, ...]] = {}
    shapes: dict[str, Shape] = {}
    for i in range(size):
        name = f"s{i}"
        earlier = list(deps)
        parents = tuple(draw(st.lists(st.sampled_from(earlier), max_size=3, unique=True))) if earlier else ()
        deps[name] = parents
        kind = draw(st.sampled_from(["plain", "plain", "map", "when", "join"]))
        if kind == "map" and parents:
            over = draw(st.sampled_from(parents))
            shapes[name] = Shape(map_over=over, when="cond" if draw(st.booleans()) else None)
        elif kind == "when":
            shapes[name] = Shape(when="cond")
        elif kind == "join" and len(parents) >= 2:
            shapes[name] = Shape(join="any")
    return GraphSpec.of(deps, shapes)
