"""The graph as a checkpoint spells it: two strings, read back exactly, or refused by name.

``ekit_core.graph_text`` owns the rule; ``WorkflowCheckpoint.from_dict``
checks the strings, and a resume compares them with its own graph's
without decoding them. These tests attack both directions with names made
of the characters the rule must escape.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import CheckpointError, GraphMismatchError, GraphSpec, WorkflowCheckpoint, audit
from ekit_core.graph_text import GraphTextError, read, spell
from ekit_runtime import Step, Workflow
from ekit_runtime.stores import CorruptStoreError, JournalStore
from tests.support.strategies import dags

ZERO = {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0}
# Names built mostly of the separators and the escape, to reach every branch.
names = st.text(alphabet=st.sampled_from("|,\\ab\u00e9\n"), min_size=1, max_size=5)


@st.composite
def graphs(draw: st.DrawFn) -> dict[str, tuple[str, ...]]:
    """Name -> dependencies, in declaration order; dependencies among the names or not."""
    steps = draw(st.lists(names, unique=True, max_size=8))
    pool = steps + draw(st.lists(names, max_size=3))
    return {n: tuple(draw(st.lists(st.sampled_from(pool), max_size=3, unique=True))) if pool else ()
            for n in steps}


@settings(max_examples=400)
@given(graphs())
def test_what_is_spelt_reads_back_as_the_same_graph_in_the_same_order(
    graph: dict[str, tuple[str, ...]],
) -> None:
    steps, needs = spell(list(graph), graph)
    back = read(steps, needs)
    assert back == graph and list(back) == list(graph)


@settings(max_examples=400)
@given(graphs(), graphs())
def test_two_graphs_are_spelt_alike_exactly_when_they_are_the_same_in_the_same_order(
    one: dict[str, tuple[str, ...]], other: dict[str, tuple[str, ...]]
) -> None:
    # What lets a resume compare two strings instead of two graphs.
    same = list(one.items()) == list(other.items())
    assert (spell(list(one), one) == spell(list(other), other)) == same


@given(dags())
def test_a_graph_spec_spells_itself_as_spell_does_and_only_once(graph: GraphSpec) -> None:
    assert graph._texts is None
    texts = graph.texts
    assert texts == spell(graph.names, graph.deps) and graph.texts is texts
    assert read(*texts) == graph.deps


@settings(max_examples=300)
@given(st.lists(names, unique=True, min_size=1, max_size=8), st.data())
def test_a_graph_spec_of_names_that_need_escapes_reads_back_from_its_texts(
    steps: list[str], data: st.DataObject
) -> None:
    # GraphSpec.texts looks at the names only (its dependencies are names):
    # every escape must still be made.
    graph = GraphSpec.of({
        n: data.draw(st.lists(st.sampled_from(steps[:i]), unique=True, max_size=3)) if i else []
        for i, n in enumerate(steps)
    })
    assert read(*graph.texts) == graph.deps and graph.texts == spell(graph.names, graph.deps)


def test_an_example_spelling_and_its_escapes() -> None:
    graph = {"draft": (), "re|view": ("draft",), "a,b\\c": ("draft", "re|view")}
    assert spell(list(graph), graph) == (
        "draft|re\\|view|a\\,b\\\\c", "|draft|draft,re\\|view"
    )
    assert spell([], {}) == ("", "") and read("", "") == {}
    assert read("a", "") == {"a": ()}
    with pytest.raises(ValueError, match="must not be empty"):
        spell(["a", ""], {"a": (), "": ()})
    with pytest.raises(ValueError, match="must not be empty"):
        spell(["a"], {"a": ("",)})


@pytest.mark.parametrize(
    ("steps", "needs", "field", "fragment"),
    [
        ("a|b", "", "graph_needs", "1 lists of dependencies for 2 steps"),
        ("a", "|", "graph_needs", "2 lists of dependencies for 1 steps"),
        ("", "a", "graph_needs", "1 lists of dependencies for 0 steps"),
        ("a||b", "||", "graph_steps", "empty step name"),
        ("|a", "|", "graph_steps", "empty step name"),
        ("a,b", "", "graph_steps", "',' not escaped"),
        ("a|b", "|a,", "graph_needs", "empty dependency name"),
        ("a|b", "|,a", "graph_needs", "empty dependency name"),
        ("a|b", "|a,,a", "graph_needs", "empty dependency name"),
        ("a|a", "|", "graph_steps", "names step 'a' twice"),
        ("a\\", "", "graph_steps", "backslash that escapes none"),
        ("a\\b", "", "graph_steps", "backslash that escapes none"),
        ("a\\|b|a\\|b", "|", "graph_steps", "names step 'a|b' twice"),
        ("a\\,", "x\\", "graph_needs", "backslash that escapes none"),
        ("a\\|", "|", "graph_needs", "2 lists of dependencies for 1 steps"),
        ("x\\|y,z", "", "graph_steps", "',' not escaped"),
        ("x\\|", "\\,,", "graph_needs", "empty dependency name"),
        ("\\||", "|", "graph_steps", "empty step name"),
    ],
)
def test_malformed_texts_are_refused_naming_the_string(
    steps: str, needs: str, field: str, fragment: str
) -> None:
    with pytest.raises(GraphTextError, match=fragment) as raised:
        read(steps, needs)
    assert raised.value.field == field
    data = {"step_index": 0, "outputs": {}, "cost": ZERO, "graph_steps": steps, "graph_needs": needs}
    try:  # from_dict finds all but a repeated name at once; that one when first decoded
        cp = WorkflowCheckpoint.from_dict(data)
        cp.check_graph()
    except CheckpointError as err:
        assert (err.field, fragment in err.problem) == (field, True)
    else:
        raise AssertionError("a malformed graph text was read")


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"graph_steps": "a"}, "graph_needs"),
        ({"graph_needs": ""}, "graph_steps"),
        ({"graph_steps": ["a"], "graph_needs": ""}, "graph_steps"),
        ({"graph_steps": "a", "graph_needs": 0}, "graph_needs"),
        ({"graph_steps": "a", "graph_needs": "", "graph": {"a": []}}, "graph"),
    ],
)
def test_from_dict_names_a_missing_or_mistyped_text(extra: dict[str, Any], field: str) -> None:
    with pytest.raises(CheckpointError) as raised:
        WorkflowCheckpoint.from_dict({"step_index": 0, "outputs": {}, "cost": ZERO, **extra})
    assert raised.value.field == field


def _noop_workflow(graph: dict[str, tuple[str, ...]], ran: list[str]) -> Workflow:
    def body(name: str) -> Any:
        def run(context: object) -> str:
            ran.append(name)
            return name

        return run

    return Workflow([Step(n, body(n), d) for n, d in graph.items()])


@pytest.mark.parametrize("right_fingerprint", [True, False])
@pytest.mark.parametrize("allow_graph_change", [True, False])
def test_a_repeated_step_name_stops_a_resume_before_any_step_runs(
    right_fingerprint: bool, allow_graph_change: bool
) -> None:
    graph = {"a": (), "b": ("a",)}
    ran: list[str] = []
    fingerprint = GraphSpec.of(graph).fingerprint if right_fingerprint else "sha256:" + "0" * 64
    data = {"step_index": 1, "outputs": {"a": "a"}, "cost": ZERO, "fingerprint": fingerprint,
            "graph_steps": "a|b|a", "graph_needs": "|a|"}
    with pytest.raises(CheckpointError, match="names step 'a' twice") as raised:
        _noop_workflow(graph, ran).run_sync(resume_from=data, allow_graph_change=allow_graph_change)
    assert raised.value.field == "graph_steps" and ran == []
    with pytest.raises(CheckpointError, match="twice"):
        audit(GraphSpec.of(graph), data)


def test_a_repeated_step_name_is_told_with_the_file_it_is_in(tmp_path: Path) -> None:
    data = {"step_index": 1, "outputs": {"a": "a"}, "cost": ZERO,
            "graph_steps": "a|a", "graph_needs": "|"}
    journal = tmp_path / "run.jsonl"
    JournalStore(journal)(WorkflowCheckpoint.from_dict(data))  # written as read, undecoded
    with pytest.raises(CorruptStoreError, match="names step 'a' twice") as raised:
        JournalStore(journal).load()
    assert "line 1" in str(raised.value) and str(journal) in str(raised.value)
    (tmp_path / "cp.json").write_text(json.dumps(data))
    proc = subprocess.run(
        [sys.executable, "-m", "ekit_runtime", "audit", "cp.json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("ekit: cp.json:") and "names step 'a' twice" in proc.stderr
    assert "internal error" not in proc.stderr


def test_a_recorded_mapping_with_an_empty_name_is_refused_as_the_texts_would_be() -> None:
    for graph, field in (({"a": [""]}, "graph.a"), ({"": [], "a": []}, "graph")):
        with pytest.raises(CheckpointError, match="empty step name") as raised:
            WorkflowCheckpoint.from_dict({"step_index": 0, "outputs": {}, "cost": ZERO, "graph": graph})
        assert raised.value.field == field


def test_a_text_or_fingerprint_of_a_str_subclass_is_read_as_plain_text() -> None:
    # Its own == must not decide whether a recorded graph is the resuming one.
    class Agreeable(str):
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = str.__hash__

        def count(self, *args: Any) -> int:
            raise RuntimeError("not asked")

    graph = {"a": (), "b": ("a",)}
    data = {"step_index": 1, "outputs": {"a": "a"}, "cost": ZERO,
            "fingerprint": Agreeable("sha256:" + "0" * 64),
            "graph_steps": Agreeable("x|y"), "graph_needs": Agreeable("|x")}
    cp = WorkflowCheckpoint.from_dict(data)
    assert type(cp.fingerprint) is str and {type(t) for t in cp._graph_texts or ()} == {str}
    ran: list[str] = []
    with pytest.raises(GraphMismatchError):
        _noop_workflow(graph, ran).run_sync(resume_from=cp)
    assert ran == []


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab|,\\", max_size=8), st.text(alphabet="ab|,\\", max_size=8), st.booleans())
def test_any_texts_resume_or_are_refused_with_a_value_error_before_a_step_runs(
    steps: str, needs: str, right_fingerprint: bool
) -> None:
    # Hostile texts beside a fingerprint, this graph's or another's. The
    # rule: the texts are the claim, the fingerprint its summary, read only
    # when the texts are not this graph's. Nothing runs before a refusal.
    graph = {"a": (), "b": ("a",)}
    ran: list[str] = []
    fingerprint = GraphSpec.of(graph if right_fingerprint else {"z": ()}).fingerprint
    data = {"step_index": 1, "outputs": {"a": "A"}, "cost": ZERO,
            "fingerprint": fingerprint, "graph_steps": steps, "graph_needs": needs}
    spells_it = (steps, needs) == ("a|b", "|a")
    try:
        read(steps, needs)
    except GraphTextError:
        reads = False
    else:
        reads = True
    try:
        result = _noop_workflow(graph, ran).run_sync(resume_from=json.loads(json.dumps(data)))
    except ValueError:
        assert ran == [] and not spells_it
    else:
        assert ran == ["b"] and result.outputs == {"a": "A", "b": "b"}
        # Texts other than this graph's are decoded before the fingerprint is
        # trusted: malformed ones are refused whatever the fingerprint says.
        assert spells_it or (right_fingerprint and reads)


def test_a_checkpoint_of_names_that_need_escapes_resumes_and_round_trips() -> None:
    graph = {"fetch|1": (), "sum,all": ("fetch|1",), "back\\slash": ("fetch|1", "sum,all")}
    ran: list[str] = []
    saved: list[WorkflowCheckpoint] = []
    _noop_workflow(graph, ran).run_sync(checkpoint_fn=saved.append)
    data = json.loads(json.dumps(saved[1].to_dict()))
    assert data["graph_steps"] == "fetch\\|1|sum\\,all|back\\\\slash"
    cp = WorkflowCheckpoint.from_dict(data)
    assert cp.graph == graph and WorkflowCheckpoint.from_dict(cp.to_dict()) == cp
    ran.clear()
    result = _noop_workflow(graph, ran).run_sync(resume_from=cp)
    assert len(ran) == 1 and result.outputs == {n: n for n in graph}
    with pytest.raises(GraphMismatchError, match="dependencies changed: 'back\\\\\\\\slash'"):
        _noop_workflow({**graph, "back\\slash": ("fetch|1",)}, ran).run_sync(resume_from=cp)
