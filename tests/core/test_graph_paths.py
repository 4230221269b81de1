"""The two ways a graph is validated agree: the one-loop proof for steps
declared in order, and the step-by-step checks that name any fault.

``GraphSpec.of_steps`` (what ``Workflow`` calls) tries the proof first and
falls back to the checks that ``GraphSpec.of`` runs; a graph the proof
accepts must be exactly the spec the checks build, and a graph it refuses
must get the checks' verdict (the same spec, or the same error). The
dependents a resume reads (``dependents_among``) must be the graph's
dependents cut down to the steps left to run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ekit_core import GraphError, GraphSpec
from ekit_core.graph import _in_order
from tests.support.strategies import dags

NAMES = ["a", "b", "c", "d", "e", "f"]


FAULTS = ["unknown", "self", "list", "str_deps", "non_str_dep", "name", "empty", "duplicate",
          "repeated_dep", "str_subclass_name", "iterator_deps"]


@dataclass
class Entry:
    """A step as the graph sees it: any object with these two attributes."""

    name: Any
    depends_on: Any


class Name(str):
    """A str subclass: not the plain shape, so the proof leaves it to the checks."""


@st.composite
def raw_graphs(draw: st.DrawFn) -> list[Entry]:
    """Steps as a caller may build them: in order or not, with at most one fault,
    so that the proof sees every fault on its own in a graph it would accept."""
    n = draw(st.integers(0, 6))
    names = NAMES[:n]
    in_order = draw(st.booleans())
    at = draw(st.integers(0, max(n - 1, 0)))
    fault = draw(st.sampled_from(["none", *FAULTS]))
    entries: list[Entry] = []
    for i, name in enumerate(names):
        earlier = names[:i] if in_order else names  # later ones: out of order, or a cycle
        deps = draw(st.lists(st.sampled_from(earlier), unique=True, max_size=3)) if earlier else []
        name_out: Any = name
        deps_out: Any = tuple(deps)
        here = fault if i == at else "none"
        if here == "unknown":
            deps_out = (*deps, "zz")
        elif here == "self":
            deps_out = (*deps, name)
        elif here == "list":
            deps_out = list(deps)
        elif here == "str_deps":
            deps_out = "ab"
        elif here == "non_str_dep":
            deps_out = (*deps, 7)
        elif here == "name":
            name_out = 3
        elif here == "empty":
            name_out = ""
        elif here == "duplicate" and entries:
            name_out = entries[0].name
        elif here == "repeated_dep" and deps:
            deps_out = (*deps, deps[0])
        elif here == "str_subclass_name":
            name_out = Name(name)
        elif here == "iterator_deps":
            deps_out = iter(deps)
        entries.append(Entry(name_out, deps_out))
    return entries


def _verdict(build: Any) -> tuple[str, Any]:
    try:
        spec = build()
    except GraphError as exc:
        return type(exc).__name__, (str(exc), exc.steps)
    return "spec", (spec.names, dict(spec.deps), dict(spec.index), spec.fingerprint,
                    dict(spec.dependents))


@given(raw_graphs())
@settings(max_examples=300)
@example([Entry("a", ()), Entry("b", ("a", "a"))])  # a dependency listed twice: kept once
@example([Entry("a", ()), Entry("", ("a",))])
@example([Entry("a", ()), Entry("b", ("a",)), Entry("a", ())])
def test_the_proof_and_the_checks_agree_on_every_graph(entries: list[Entry]) -> None:
    # Each side gets its own iterator of dependencies: one can be read once only.
    held = [(e.name, e.depends_on, list(e.depends_on) if isinstance(e.depends_on, Iterator) else None)
            for e in entries]
    steps = [Entry(n, d if kept is None else iter(kept)) for n, d, kept in held]
    pairs = [(n, d if kept is None else iter(kept)) for n, d, kept in held]
    assert _verdict(lambda: GraphSpec.of_steps(steps)) == _verdict(lambda: GraphSpec.of(pairs))


def test_steps_given_as_an_iterator_are_read_once_as_a_list() -> None:
    entries = [Entry("b", ()), Entry("a", ("b",)), Entry("c", ("a",)), Entry("a", ())]
    pairs = [(e.name, e.depends_on) for e in entries]
    for n in (3, 4):  # in order; then with a duplicate, where the proof gives up
        steps = iter(entries[:n])
        assert _verdict(lambda: GraphSpec.of_steps(steps)) == _verdict(  # noqa: B023
            lambda: GraphSpec.of(pairs[:n]))  # noqa: B023


def test_the_caches_are_not_constructor_arguments() -> None:
    spec = GraphSpec.of({"a": []})
    with pytest.raises(TypeError):
        GraphSpec(spec.names, spec.deps, spec.index, "sha256:x")  # type: ignore[call-arg]
    assert dataclasses.replace(spec, deps=MappingProxyType({"a": ()})).fingerprint == spec.fingerprint


def test_an_item_without_the_two_attributes_is_named_by_its_position() -> None:
    with pytest.raises(GraphError, match=r"steps\[1\] must have a name and a depends_on, got int"):
        GraphSpec.of_steps([Entry("a", ()), 5])


@given(dags())
def test_a_graph_declared_in_order_takes_the_one_loop_proof(graph: GraphSpec) -> None:
    # The proof is what keeps a resume cheap: it must not quietly stop applying.
    ordered = sorted(graph.names, key=lambda n: int(n[1:]))  # dags() only draws earlier deps
    assert _in_order([Entry(n, graph.deps[n]) for n in ordered]) is not None
    forward = any(graph.index[d] > graph.index[n] for n in graph.names for d in graph.deps[n])
    declared = [Entry(n, graph.deps[n]) for n in graph.names]
    assert (_in_order(declared) is None) == forward


@given(dags(), st.data())
def test_dependents_among_is_the_graphs_cut_down_to_the_steps_given(
    graph: GraphSpec, data: st.DataObject
) -> None:
    pending = data.draw(st.lists(st.sampled_from(graph.names), unique=True))
    pending.sort(key=graph.index.__getitem__)
    among = graph.dependents_among(pending)
    for name in pending:
        assert among[name] == tuple(c for c in graph.dependents[name] if c in pending)
    for parent, children in among.items():
        assert children == tuple(c for c in graph.dependents[parent] if c in pending)
