"""Graph validation: every invalid shape is a ValueError naming the steps."""

from __future__ import annotations

import graphlib
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import CycleError, GraphError, GraphSpec, Succeeded, apply, initial_state, plan
from tests.support.strategies import dags


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


Pairs = list[tuple[str, list[str]]]


@st.composite
def graphs(draw: st.DrawFn, max_steps: int = 10) -> Pairs:
    """Random graphs as ``(name, deps)`` pairs, cyclic or not, without self-dependencies.

    A random DAG (edges go back along a shuffled order); half the time a
    ring over some of its steps is added, which closes a cycle of any length
    and leaves other steps on paths into or out of it, and a few arbitrary
    extra edges, which may close more.
    """
    n = draw(st.integers(1, max_steps))
    order = draw(st.permutations([f"s{i}" for i in range(n)]))
    deps: dict[str, list[str]] = {}
    for i, name in enumerate(order):
        deps[name] = draw(st.lists(st.sampled_from(order[:i]), unique=True, max_size=3)) if i else []
    if n > 1 and draw(st.booleans()):
        ring = draw(st.lists(st.sampled_from(order), min_size=2, unique=True))
        edges = list(zip(ring, [ring[-1], *ring[:-1]], strict=True))
        edges += draw(st.lists(st.tuples(st.sampled_from(order), st.sampled_from(order)), max_size=3))
        for step, dep in edges:
            if step != dep and dep not in deps[step]:
                deps[step].append(dep)
    declared = draw(st.permutations(order))
    return [(name, deps[name]) for name in declared]


def _graphlib_verdict(pairs: Pairs) -> bool:
    """Does graphlib find a cycle in ``pairs``?"""
    try:
        graphlib.TopologicalSorter({name: set(deps) for name, deps in pairs}).prepare()
    except graphlib.CycleError:
        return True
    return False


def _execution_order(graph: GraphSpec, data: st.DataObject) -> list[str]:
    """The order the core finishes steps in, one at a time, in an order drawn by hypothesis.

    Also checks, at each start, that every dependency of the step has finished.
    """
    state = initial_state(graph)
    finished: list[str] = []
    while not state.complete:
        batch = plan(state)
        for start in batch.starts:
            assert set(graph.deps[start.name]) <= set(finished), start.name
        state = apply(state, batch.starts)
        done = data.draw(st.sampled_from(state.running_steps()), label="finishes next")
        state = apply(state, [Succeeded(done, done)])
        finished.append(done)
    return finished


@settings(max_examples=300, deadline=None)
@given(graphs(), st.data())
def test_cycles_are_rejected_exactly_when_graphlib_finds_one(
    pairs: Pairs, data: st.DataObject
) -> None:
    deps = dict(pairs)
    cyclic = _graphlib_verdict(pairs)
    try:
        graph = GraphSpec.of(pairs)
    except CycleError as exc:
        assert cyclic, f"graphlib finds no cycle in {pairs}"
        cycle = exc.cycle
        # A real cycle of the input: closed, simple, and each step runs
        # before the next (the next depends on it).
        assert cycle[0] == cycle[-1] and len(cycle) >= 3
        assert len(set(cycle[:-1])) == len(cycle) - 1
        for before, after in pairwise(cycle):
            assert before in deps[after], (before, after, pairs)
        assert exc.steps == cycle[:-1]
        assert " -> ".join(cycle) in str(exc)
        return
    assert not cyclic, f"graphlib finds a cycle that GraphSpec accepted: {pairs}"
    assert graph.names == tuple(name for name, _ in pairs)
    order = _execution_order(graph, data)
    assert sorted(order) == sorted(graph.names)
    position = {name: i for i, name in enumerate(order)}
    for name in graph.names:
        assert graph.deps[name] == tuple(deps[name])
        for dep in deps[name]:  # as declared, not as the graph kept them
            assert position[dep] < position[name], (dep, name)
        assert set(graph.dependents[name]) == {m for m in graph.names if name in graph.deps[m]}


@given(graphs(max_steps=6), st.data())
def test_a_self_dependency_is_refused_where_graphlib_sees_a_cycle(
    pairs: Pairs, data: st.DataObject
) -> None:
    name = data.draw(st.sampled_from([n for n, _ in pairs]))
    looped = [(n, [*d, n] if n == name else d) for n, d in pairs]
    assert _graphlib_verdict(looped)
    with pytest.raises(GraphError, match=f"'{name}' depends on itself"):
        GraphSpec.of(looped)


def test_a_long_cycle_message_is_cut_but_the_cycle_is_whole() -> None:
    n = 200_000
    names = [f"step{i}" for i in range(n)]
    with pytest.raises(CycleError) as info:
        GraphSpec.of([(names[i], [names[i - 1]]) for i in range(n)])
    message = str(info.value)
    assert len(message) < 500
    assert message.startswith(f"dependency cycle of {n} steps: ")
    assert f"({n + 1 - 10} steps left out)" in message
    cycle = info.value.cycle
    assert len(cycle) == n + 1 and cycle[0] == cycle[-1] and set(cycle) == set(names)
    assert " -> ".join(cycle[:5]) in message and " -> ".join(cycle[-5:]) in message
    assert len(info.value.steps) == n


def test_a_cycle_of_ten_steps_is_shown_whole() -> None:
    names = [f"n{i}" for i in range(10)]
    with pytest.raises(CycleError) as info:
        GraphSpec.of([(names[i], [names[i - 1]]) for i in range(10)])
    assert str(info.value) == "dependency cycle: " + " -> ".join(info.value.cycle)
    assert "left out" not in str(info.value)


def test_an_unknown_dependency_suggests_the_closest_step() -> None:
    with pytest.raises(GraphError) as info:
        GraphSpec.of({"fetch": [], "summarize": ["fecth", "qqq"]})
    assert str(info.value) == (
        "step 'summarize' depends on unknown step(s): 'fecth' (did you mean 'fetch'?), 'qqq'"
    )
    assert info.value.steps == ("summarize", "fecth", "qqq")


def test_many_unknown_dependencies_and_duplicates_are_counted_not_all_listed() -> None:
    ghosts = [f"ghost{i}" for i in range(1000)]
    with pytest.raises(GraphError) as info:
        GraphSpec.of({"a": ghosts})
    assert len(str(info.value)) < 500 and "(990 names left out)" in str(info.value)
    assert info.value.steps == ("a", *ghosts)
    with pytest.raises(GraphError) as info:
        GraphSpec.of([(name, []) for name in ghosts] * 2)
    assert len(str(info.value)) < 500 and "(990 names left out)" in str(info.value)
    assert info.value.steps == tuple(sorted(ghosts))


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
