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
