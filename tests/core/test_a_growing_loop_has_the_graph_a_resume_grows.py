"""A loop grown one iteration at a time, by appending, has the running graph a resume grows.

The transition that records iteration ``k`` grows ``k+1`` in O(1) (``_grow_next``: large
tables are appended to, see ``ekit_core.appending``); a resume grows the same iterations
from the checkpoint by the general path (``_grow_iterations``). After every fold, the
live state's running graph (names in order, each step's dependencies, its index) and its
items equal those of a state resumed from its checkpoint through JSON: with tables
copied (the default for small graphs) and appended to (``SMALL`` lowered to 0). And a
long loop's graph shares its tables with the graph before: growing copies nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import (
    Ended,
    GraphSpec,
    Shape,
    State,
    Succeeded,
    advance,
    appending,
    checkpoint_of,
    initial_state,
)
from ekit_core.appending import Appended, grown_names, grown_table, with_one
from ekit_core.ledger import Ledger


@contextmanager
def small(size: int) -> Iterator[None]:
    """Tables up to ``size`` entries are copied to grow (0: every table is appended to)."""
    before = appending.SMALL
    appending.SMALL = size
    try:
        yield
    finally:
        appending.SMALL = before


def _graph(cap: int, keep: int | None) -> GraphSpec:
    return GraphSpec.of({"a": [], "agent": ["a"], "z": ["agent"]},
                        {"agent": Shape(repeat=cap, keep_last=keep)})


def _running(state: State) -> tuple[list[str], dict[str, tuple[str, ...]], dict[str, int], dict[str, Any]]:
    graph, shaped = state.spec.graph, state.spec.shaped
    assert shaped is not None
    return list(graph.names), dict(graph.deps), dict(graph.index), dict(shaped.items)


def _run(graph: GraphSpec, ends_at: int, check: bool) -> State:
    state, _ = advance(initial_state(graph))
    while not state.settled:
        name = state.running_steps()[0]
        k = int(name.rpartition("#")[2]) if "#" in name else 0
        done = Ended(name, k) if k == ends_at else Succeeded(name, k)
        state, _ = advance(state, [done])
        if check and not state.settled:
            resumed = initial_state(graph, json.loads(json.dumps(checkpoint_of(state).to_dict())))
            assert _running(state) == _running(resumed)
    return state


@settings(max_examples=60, deadline=None)
@given(cap=st.integers(1, 12), ends_at=st.integers(1, 14), keep=st.sampled_from([None, 1, 3]),
       size=st.sampled_from([0, appending.SMALL]))
def test_each_fold_has_the_running_graph_of_its_resume(cap: int, ends_at: int, keep: int | None,
                                                      size: int) -> None:
    with small(size):
        _run(_graph(cap, keep), ends_at, check=True)


def test_a_long_loop_appends_to_its_tables_and_copies_none() -> None:
    n = 3 * appending.SMALL
    graph = _graph(n + 1, None)
    state, _ = advance(initial_state(graph))
    seen: list[State] = []
    while not state.settled:
        name = state.running_steps()[0]
        k = int(name.rpartition("#")[2]) if "#" in name else 0
        state, _ = advance(state, [Ended(name, k) if k == n else Succeeded(name, k)])
        seen.append(state)
    assert state.outcome == "finished" and state.outputs["agent"] == n
    late, later = seen[-3].spec, seen[-2].spec  # (the last two iterations' growths)
    assert isinstance(later.graph.index, Ledger) and isinstance(later.graph.names, Appended)
    assert later.graph.index._b is late.graph.index._b  # shared: appended, not copied
    assert later.graph.names[-1] == f"agent#{n}" and later.graph.deps[f"agent#{n}"] == ("a", f"agent#{n - 1}")
    assert dict(later.graph.index) == {name: i for i, name in enumerate(later.graph.names)}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 3)), min_size=1, max_size=30),
       st.sampled_from([0, 2, appending.SMALL]))
def test_grown_tables_read_as_copies_whatever_version_is_grown(growths: list[tuple[int, int]],
                                                              size: int) -> None:
    """Grown from any earlier version (a branch), each table reads as the dict or tuple a
    copy would have made, and the versions before it are unchanged."""
    with small(size):
        tables: list[tuple[Any, Any, dict[str, int], tuple[str, ...]]] = [
            (MappingProxyType({"s": 0}), ("s",), {"s": 0}, ("s",))]
        fresh = 0
        for pick, count in growths:
            table, names, model, model_names = tables[pick % len(tables)]
            added = {f"n{fresh + j}": fresh + j for j in range(count)}
            fresh += count
            if count == 1:
                (key, value), = added.items()
                grown = with_one(table, key, value)
            else:
                grown = grown_table(table, added)
            tables.append((grown, grown_names(names, tuple(added)), {**model, **added},
                           (*model_names, *added)))
        for table, names, model, model_names in tables:
            assert dict(table) == model and list(table) == list(model)
            assert all(table[k] == v and k in table for k, v in model.items())
            assert tuple(names) == model_names and names == model_names and len(names) == len(model_names)
            assert [names[i] for i in range(len(names))] == list(model_names)
