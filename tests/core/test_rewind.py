"""Re-running work deliberately: ``rewind``, version tags and changed dependencies.

A step that runs again makes everything downstream of it run again; nothing
else does. Checked on random graphs (property tests) and on the case a user
reported: a dependency added to a step, resumed with allow_graph_change.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import Event, GraphSpec, StepOutdated, WorkflowCheckpoint, rewind
from ekit_core.rewind import downstream, outdated_steps
from ekit_runtime import Step, Workflow
from tests.support.strategies import dags


def recording(name: str, ran: list[str]) -> Callable[[object], str]:
    def run(context: object) -> str:
        ran.append(name)
        return name

    return run


def ran_steps(graph: GraphSpec, versions: dict[str, str] | None = None) -> tuple[Workflow, list[str]]:
    ran: list[str] = []
    steps = [
        Step(n, recording(n, ran), graph.deps[n], version=(versions or {}).get(n))
        for n in graph.names
    ]
    return Workflow(steps), ran


@settings(max_examples=100)
@given(dags(min_steps=1, max_steps=10), st.data())
def test_rewind_reruns_exactly_the_steps_and_their_descendants(
    graph: GraphSpec, data: st.DataObject
) -> None:
    chosen = data.draw(st.sets(st.sampled_from(graph.names), min_size=1), label="rewound")
    wf, ran = ran_steps(graph)
    full = wf.run_sync().checkpoint
    assert full is not None
    trimmed = rewind(wf, full, chosen)
    expected = set(downstream(graph, chosen))
    assert set(trimmed.outputs) == set(graph.names) - expected
    assert trimmed.step_index == len(trimmed.outputs) and trimmed.cost == full.cost
    ran.clear()
    wf.run_sync(resume_from=trimmed)
    assert sorted(ran) == sorted(expected)


@settings(max_examples=100)
@given(dags(min_steps=1, max_steps=10), st.data())
def test_a_bumped_version_reruns_that_step_and_everything_downstream(
    graph: GraphSpec, data: st.DataObject
) -> None:
    bumped = data.draw(st.sets(st.sampled_from(graph.names), min_size=1), label="bumped")
    wf, _ = ran_steps(graph, {n: "1" for n in graph.names})
    first = wf.run_sync().checkpoint
    assert first is not None and dict(first.versions) == {n: "1" for n in graph.names}
    again, ran = ran_steps(graph, {n: "2" if n in bumped else "1" for n in graph.names})
    events: list[Event] = []
    again.run_sync(resume_from=first, trace=events.append)
    assert sorted(ran) == sorted(downstream(graph, bumped))
    outdated = {e.name: e.reason for e in events if isinstance(e, StepOutdated)}
    assert set(outdated) == set(ran)
    assert all("version changed from '1' to '2'" in outdated[n] for n in bumped)


def test_a_dependency_added_to_a_recorded_step_reruns_it_and_its_dependents() -> None:
    old = GraphSpec.of({"fetch": [], "summary": ["fetch"], "email": ["summary"], "other": []})
    wf, _ = ran_steps(old)
    checkpoint = wf.run_sync().checkpoint
    assert checkpoint is not None
    new = GraphSpec.of({"fetch": [], "style": [], "summary": ["fetch", "style"],
                        "email": ["summary"], "other": []})
    changed, ran = ran_steps(new)
    events: list[Event] = []
    changed.run_sync(resume_from=checkpoint, allow_graph_change=True, trace=events.append)
    assert ran == ["style", "summary", "email"]
    reasons = {e.name: e.reason for e in events if isinstance(e, StepOutdated)}
    assert "dependencies changed" in reasons["summary"]
    assert reasons["email"] == "it depends on 'summary', which runs again"


def test_old_checkpoints_without_versions_still_load_and_resume() -> None:
    graph = GraphSpec.of({"a": [], "b": ["a"]})
    wf, ran = ran_steps(graph)
    cp = wf.run_sync().checkpoint
    assert cp is not None
    data = cp.to_dict()
    assert "versions" not in data  # nothing declared, nothing written
    ran.clear()
    wf.run_sync(resume_from=WorkflowCheckpoint.from_dict(data))
    assert ran == []


def test_rewind_refuses_unknown_steps_and_bad_arguments() -> None:
    graph = GraphSpec.of({"a": []})
    cp = WorkflowCheckpoint(1, {"a": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown step"):
        rewind(graph, cp, ["zz"])
    with pytest.raises(ValueError, match="GraphSpec or a Workflow"):
        rewind(object(), cp, ["a"])
    with pytest.raises(ValueError, match="version must be"):
        Step("x", lambda c: 1, version="")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"versions\.a"):
        WorkflowCheckpoint.from_dict({"step_index": 0, "outputs": {}, "cost": {
            "input_tokens": 0, "output_tokens": 0, "llm_calls": 0}, "versions": {"a": 3}})


def _diamond_ladder(levels: int) -> Workflow:
    steps = [Step("j0", lambda ctx: 0)]
    for i in range(1, levels + 1):
        steps += [
            Step(f"l{i}", lambda ctx: 0, (f"j{i - 1}",)),
            Step(f"r{i}", lambda ctx: 0, (f"j{i - 1}",)),
            Step(f"j{i}", lambda ctx: 0, (f"l{i}", f"r{i}")),
        ]
    return Workflow(steps)


def test_outdated_steps_walks_each_step_once_however_many_paths_reach_it() -> None:
    """40 diamonds in a row: 2**40 paths from the root, 121 steps to walk."""
    workflow = _diamond_ladder(40)
    recorded = workflow.run_sync().checkpoint
    outdated = outdated_steps(workflow.graph, recorded, {"j0": "2"})
    assert list(outdated) == list(workflow.graph.names)
    assert outdated["j0"] == "its version changed from None to '2'"
    assert outdated["j1"] in {"it depends on 'l1', which runs again", "it depends on 'r1', which runs again"}


def test_rewind_errors_name_what_was_passed() -> None:
    workflow = _diamond_ladder(1)
    recorded = workflow.run_sync().checkpoint
    assert isinstance(workflow.graph, GraphSpec)
    with pytest.raises(ValueError, match=r"graph must be a GraphSpec or a Workflow, got int$"):
        rewind(5, recorded, ["j0"])
    with pytest.raises(ValueError, match=r"checkpoint must be a WorkflowCheckpoint, got str$"):
        rewind(workflow, "cp", ["j0"])  # type: ignore[arg-type]
    with pytest.raises(ValueError) as info:
        rewind(workflow, recorded, ["nope", "j0", "zip"])
    assert str(info.value) == "cannot rewind unknown step(s): 'nope', 'zip'"
