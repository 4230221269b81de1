"""How a resume reads the graph a checkpoint records: compared, not hashed.

A checkpoint read with ``from_dict`` keeps a recorded graph as the two
strings it was written as and decodes the mapping only when something reads
``graph``; a checkpoint the core makes leaves its ``fingerprint`` to be
hashed when first read. Neither may change what a user sees: the values,
equality, ``to_dict`` and ``dataclasses.replace`` are those of a checkpoint
built field by field, and a resume accepts or refuses exactly the
checkpoints whose fingerprint says they are (or are not) of its graph.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from itertools import pairwise
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ekit_core import (
    GraphError,
    GraphMismatchError,
    GraphSpec,
    WorkflowCheckpoint,
    audit,
    checkpoint_of,
    initial_state,
)
from ekit_core.compat import recorded_from
from ekit_core.graph_text import read, spell
from ekit_runtime import Step, Workflow
from tests.support.strategies import dags


def _read_back(cp: WorkflowCheckpoint) -> WorkflowCheckpoint:
    return WorkflowCheckpoint.from_dict(json.loads(json.dumps(cp.to_dict())))


def _made(graph: GraphSpec, outputs: dict[str, Any]) -> WorkflowCheckpoint:
    """A checkpoint as the core makes one (its fingerprint not hashed yet)."""
    start = {"step_index": len(outputs), "outputs": outputs,
             "cost": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0}}
    return checkpoint_of(initial_state(graph, start))


def _field_values(cp: WorkflowCheckpoint) -> dict[str, Any]:
    return {f.name: getattr(cp, f.name) for f in dataclasses.fields(cp) if f.compare}


@st.composite
def changed(draw: st.DrawFn, graph: GraphSpec) -> dict[str, list[str]]:
    """``graph`` as another run may have recorded it: the same, declared in
    another order, a step's dependencies in another order, or another graph."""
    steps = {n: list(graph.deps[n]) for n in graph.names}
    change = draw(st.sampled_from(
        ["none", "reorder", "dep_order", "added", "removed", "dep", "moved", "renamed", "swapped"]
    ))
    if change == "reorder":
        steps = dict(draw(st.permutations(list(steps.items()))))
    elif change == "dep_order":
        several = [n for n, d in steps.items() if len(d) > 1]
        if several:
            steps[several[0]].reverse()
    elif change == "added":
        steps["extra"] = list(graph.names[:1])
    elif change == "removed" and len(steps) > 1:
        last = graph.names[-1]
        steps = {n: [d for d in ds if d != last] for n, ds in steps.items() if n != last}
    elif change == "moved":  # the same dependencies in a row, split between steps otherwise
        for x, y in pairwise(list(steps)):
            if steps[x] and steps[x][0] not in steps[y] and steps[x][0] != y:
                steps[y].insert(0, steps[x].pop(0))
                break
    elif change == "renamed":  # a step nothing depends on, under another name
        leaves = [n for n in steps if not graph.dependents[n]]
        steps = {("renamed" if n == leaves[-1] else n): ds for n, ds in steps.items()}
    elif change == "swapped":  # one dependency for another: the same count
        users = [n for n, ds in steps.items() if ds]
        if users:
            others = [n for n in steps if n != users[-1] and n not in steps[users[-1]]]
            if others:
                steps[users[-1]][0] = draw(st.sampled_from(others))
    elif change == "dep":
        first = graph.names[0]
        steps = {n: [] if n == first else ds for n, ds in steps.items()}
        if len(graph.names) > 1:
            steps[graph.names[-1]] = sorted({*steps[graph.names[-1]], first})
    return steps


@settings(max_examples=300)
@given(dags(), st.data(), st.booleans())
def test_a_recorded_graph_is_the_graph_of_the_same_fingerprint(
    graph: GraphSpec, data: st.DataObject, as_texts: bool
) -> None:
    # The reference is the hashing rule itself: a checkpoint is of this graph
    # exactly when the graph it records hashes to this graph's fingerprint,
    # whether it records it as two strings or (as older files do) a mapping.
    other = data.draw(changed(graph))
    try:
        GraphSpec.of(other)
    except GraphError:
        assume(False)  # a change that made a cycle
    recorded: dict[str, Any] = {"graph": other}
    if as_texts:
        steps, needs = spell(list(other), other)
        recorded = {"graph_steps": steps, "graph_needs": needs}
    text = json.dumps({
        "step_index": 0, "outputs": {}, "cost": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0},
        "fingerprint": GraphSpec.of(other).fingerprint, **recorded,
    })
    same = GraphSpec.of(other).fingerprint == graph.fingerprint
    compared = WorkflowCheckpoint.from_dict(json.loads(text))
    assert recorded_from(graph, compared) == same
    assert recorded_from(graph, compared) == same  # asked twice: the same answer
    built = WorkflowCheckpoint.from_dict(json.loads(text))
    assert dict(built.graph or {}) == {n: tuple(ds) for n, ds in other.items()}
    assert recorded_from(graph, built) == same
    # Whichever way each was answered, both still read as what was written.
    assert compared == built
    assert dict(compared.graph or {}) == dict(built.graph or {})


@given(dags())
def test_a_checkpoint_read_back_is_equal_to_the_one_the_core_made(graph: GraphSpec) -> None:
    made = _made(graph, {n: n.upper() for n in graph.names[: len(graph) // 2]})
    back = _read_back(made)
    assert back == made
    assert _field_values(back) == _field_values(made)
    assert made.fingerprint == graph.fingerprint and dict(back.graph or {}) == dict(graph.deps)
    assert back.to_dict() == made.to_dict()
    assert _read_back(back).to_dict() == made.to_dict()


def test_a_resume_of_the_same_graph_hashes_nothing_until_a_fingerprint_is_read() -> None:
    def steps() -> list[Step]:
        return [Step(f"s{i}", lambda ctx: 1, (f"s{i - 1}",) if i else ()) for i in range(6)]

    saved: list[WorkflowCheckpoint] = []
    first = Workflow(steps())
    first.run_sync(checkpoint_fn=saved.append)
    text = json.dumps(saved[2].to_dict())
    resumed, later = Workflow(steps()), list[WorkflowCheckpoint]()
    result = resumed.run_sync(checkpoint_fn=later.append, resume_from=json.loads(text))
    assert result.ok and len(later) == 3
    assert resumed.graph._fingerprint is None  # compared with the recorded graph, not hashed
    # Read, the resumed run's checkpoints carry the graph's fingerprint.
    assert later[-1].fingerprint == first.graph.fingerprint == resumed.graph.fingerprint
    assert json.loads(json.dumps(later[-1].to_dict()))["fingerprint"] == first.graph.fingerprint


def test_a_fingerprint_edited_beside_an_intact_graph_resumes_and_is_put_right() -> None:
    calls: list[str] = []

    def workflow() -> Workflow:
        def step(name: str, deps: tuple[str, ...]) -> Step:
            def run(ctx: object) -> str:
                calls.append(name)
                return name

            return Step(name, run, deps)

        return Workflow([step("a", ()), step("b", ("a",)), step("c", ("b",))])

    saved: list[WorkflowCheckpoint] = []
    workflow().run_sync(checkpoint_fn=saved.append)
    data = saved[1].to_dict()
    data["fingerprint"] = GraphSpec.of({"other": []}).fingerprint
    calls.clear()
    later: list[WorkflowCheckpoint] = []
    result = workflow().run_sync(checkpoint_fn=later.append, resume_from=data)
    assert calls == ["c"] and result.outputs["c"] == "c"
    assert later[-1].fingerprint == workflow().graph.fingerprint
    assert [a.kind for a in audit(workflow(), data).anomalies] == ["graph_fingerprint"]
    # The same edit beside a changed graph is refused, naming the change.
    data["graph_needs"] = "|a|"  # c depends on nothing now
    with pytest.raises(GraphMismatchError, match="dependencies changed: 'c'"):
        workflow().run_sync(resume_from=data)


def test_replace_copy_and_unknown_names_behave_as_on_any_checkpoint() -> None:
    graph = GraphSpec.of({"a": [], "b": ["a"]})
    for cp in (_made(graph, {"a": 1}), _read_back(_made(graph, {"a": 1}))):
        moved = dataclasses.replace(cp, step_index=2)
        assert moved.graph == cp.graph and moved.fingerprint == graph.fingerprint
        assert copy.copy(cp) == cp
        assert not hasattr(cp, "nope")
        with pytest.raises(AttributeError, match="'WorkflowCheckpoint' object has no attribute 'nope'"):
            cp.nope  # type: ignore[attr-defined]  # noqa: B018


def test_a_graph_replaced_on_a_read_checkpoint_is_the_one_a_resume_checks() -> None:
    # dataclasses.replace must not carry over the parts of the graph it replaces.
    graph, other = GraphSpec.of({"a": [], "b": ["a"]}), GraphSpec.of({"a": [], "b": []})
    read = _read_back(_made(graph, {"a": 1, "b": 2}))
    moved = dataclasses.replace(read, graph=other.deps, fingerprint=other.fingerprint)
    assert dict(moved.graph or {}) == {"a": (), "b": ()}
    with pytest.raises(GraphMismatchError, match="dependencies changed: 'b'"):
        initial_state(graph, moved)
    # Without a fingerprint there is no claim, but b's dependencies changed: b runs again.
    bare = dataclasses.replace(read, graph=other.deps, fingerprint=None)
    state = initial_state(graph, bare)
    assert dict(state.outputs) == {"a": 1}
    assert dict(read.graph or {}) == dict(graph.deps)  # the checkpoint replaced from is unchanged


def test_a_reader_that_missed_the_graph_before_a_resume_matched_it_still_builds_it() -> None:
    # The interleaving of two threads: one reads ``graph`` (finds it unset and
    # goes to decode it from the texts) while another resumes, which sets it.
    graph = GraphSpec.of({"a": [], "b": ["a"]})
    cp = _read_back(_made(graph, {"a": 1}))
    assert recorded_from(graph, cp)
    assert cp._graph_texts is not None
    assert read(*cp._graph_texts) == graph.deps  # what the reader decodes after its miss
    data = cp.to_dict()
    assert cp.graph == graph.deps and (data["graph_steps"], data["graph_needs"]) == ("a|b", "|a")
