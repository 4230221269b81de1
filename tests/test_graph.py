"""Graph validation: every invalid shape is a ValueError naming the steps."""

from __future__ import annotations

import graphlib
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ekit_core import CycleError, GraphError, GraphSpec
from tests.strategies import dags


def test_valid_graph_keeps_declaration_order_and_edges() -> None:
    g = GraphSpec.of({"b": ["a"], "a": [], "c": ("a", "b", "a")})
    assert g.names == ("b", "a", "c")
    assert g.deps["c"] == ("a", "b")  # duplicates dropped, order kept
    assert g.dependents["a"] == ("b", "c")
    assert len(g) == 3 and "a" in g and "z" not in g


@pytest.mark.parametrize(
    ("steps", "fragment", "named"),
    [
        ([("", [])], "must not be empty", ()),
        ([("a", []), ("a", [])], "duplicate step name(s): 'a'", ("a",)),
        ([("a", ["ghost"])], "unknown step(s): 'ghost'", ("a", "ghost")),
        ([("a", ["a"])], "'a' depends on itself", ("a",)),
        ([("a", "b"), ("b", [])], "not the string 'b'", ("a",)),
        ([(1, [])], "must be a str", ()),
        ([("a", [2])], "dependency names must be str", ("a",)),
        ([("a", 5)], "must be iterable", ("a",)),
        (["a"], "(name, depends_on) pair", ()),
    ],
)
def test_invalid_graphs_are_value_errors_naming_steps(
    steps: list[object], fragment: str, named: tuple[str, ...]
) -> None:
    with pytest.raises(GraphError) as info:
        GraphSpec.of(steps)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert fragment in str(info.value)
    assert info.value.steps == named


def test_cycle_error_prints_the_cycle_in_execution_order() -> None:
    with pytest.raises(CycleError) as info:
        GraphSpec.of({"x": [], "a": ["c", "x"], "b": ["a"], "c": ["b"]})
    cycle = info.value.cycle
    assert cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}
    assert " -> ".join(cycle) in str(info.value)
    deps = {"a": {"c"}, "b": {"a"}, "c": {"b"}}
    for before, after in pairwise(cycle):
        assert before in deps[after]  # each runs before the next


def test_two_step_cycle_message() -> None:
    with pytest.raises(CycleError, match=r"dependency cycle: (a -> b -> a|b -> a -> b)"):
        GraphSpec.of({"a": ["b"], "b": ["a"]})


@given(st.integers(2, 8), st.data())
def test_any_cycle_is_found_and_is_real(n: int, data: st.DataObject) -> None:
    names = [f"n{i}" for i in range(n)]
    deps = {name: [names[i - 1]] if i else [names[-1]] for i, name in enumerate(names)}
    order = data.draw(st.permutations(names))
    with pytest.raises(CycleError) as info:
        GraphSpec.of([(k, deps[k]) for k in order])
    cycle = info.value.cycle
    assert len(cycle) == n + 1
    for before, after in pairwise(cycle):
        assert before in deps[after]


@given(dags())
def test_valid_dags_agree_with_graphlib(graph: GraphSpec) -> None:
    sorter = graphlib.TopologicalSorter({n: set(graph.deps[n]) for n in graph.names})
    order = list(sorter.static_order())
    assert sorted(order) == sorted(graph.names)


@given(dags(), st.randoms(use_true_random=False))
def test_fingerprint_ignores_declaration_order_but_not_edges(graph: GraphSpec, rnd: object) -> None:
    pairs = [(n, graph.deps[n]) for n in graph.names]
    reordered = GraphSpec.of(list(reversed(pairs)))
    assert reordered.fingerprint == graph.fingerprint
    extra = GraphSpec.of([*pairs, ("zz_new", [])])
    assert extra.fingerprint != graph.fingerprint


def test_graph_dict_round_trip_and_bad_dicts() -> None:
    g = GraphSpec.of({"a": [], "b": ["a"]})
    assert GraphSpec.from_dict(g.to_dict()) == g
    for bad, field in [([], "JSON object"), ({}, "'steps'"), ({"steps": [{"x": 1}]}, "steps[0]"),
                       ({"steps": [{"name": "a", "depends_on": "b"}]}, "steps[0].depends_on")]:
        with pytest.raises(GraphError, match=field.replace("[", r"\[").replace("]", r"\]")):
            GraphSpec.from_dict(bad)
