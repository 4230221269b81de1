"""A child workflow per item of a map: ``Step("research", ("topics",), child=wf, map_over="topics")``.

Each item ``key`` runs every step ``s`` of the child as a step of its own,
``research/s[key]``, depending on the same item's steps; each child step sees
the item under the name its parent maps over, and ``research`` is the list (or
mapping) of the child's output per item. A crash in one item's step resumes
there; a rewind of one item's step runs that item's rest again; zero items make
``[]`` at once; audit and replay accept every checkpoint.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from ekit_core import GraphError, audit, replay, rewind
from ekit_runtime import PatternResult, Step, TokenUsage, Workflow, WorkflowCheckpoint


def _json(cp: WorkflowCheckpoint) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(json.dumps(cp.to_dict()))
    return loaded


class Research:
    def __init__(self, topics: list[str], fail_on: str | None = None) -> None:
        self.calls: list[str] = []
        self.topics, self.fail_on = topics, fail_on

    def fetch(self, ctx: Any) -> Any:
        topic = ctx["topics"]  # the item, under the name the parent maps over
        self.calls.append(f"fetch:{topic}")
        return PatternResult(topic * 2, cost=TokenUsage(3, 1, 1))

    def summary(self, ctx: Any) -> str:
        topic = ctx["topics"]
        self.calls.append(f"summary:{topic}")
        if topic == self.fail_on:
            self.fail_on = None
            raise RuntimeError(f"summary of {topic} failed")
        return f"{ctx['fetch'].upper()} ({ctx['brief']})"

    def workflow(self) -> Workflow:
        child = Workflow([Step("fetch", self.fetch), Step("summary", self.summary, ("fetch",))])
        return Workflow([
            Step("brief", lambda ctx: "short"),
            Step("topics", lambda ctx: self.topics),
            Step("research", depends_on=("topics", "brief"), child=child, map_over="topics"),
            Step("report", lambda ctx: " / ".join(ctx["research"]), ("research",)),
        ])


def test_each_item_runs_the_child_whole_and_the_parent_collects_its_outputs() -> None:
    research = Research(["tides", "moon"])
    workflow = research.workflow()
    saved: list[WorkflowCheckpoint] = []
    result = workflow.run_sync(checkpoint_fn=saved.append)
    assert result.outputs["research"] == ["TIDESTIDES (short)", "MOONMOON (short)"]
    assert result.outputs["report"] == "TIDESTIDES (short) / MOONMOON (short)"
    assert sorted(research.calls) == ["fetch:moon", "fetch:tides", "summary:moon", "summary:tides"]
    assert result.checkpoint is not None and result.checkpoint.outputs["research/fetch[1]"] == "moonmoon"
    assert result.usage_of("research") == TokenUsage(6, 2, 2)
    assert replay(workflow.graph, saved).ok and audit(workflow.graph, saved[-1]).clean
    assert workflow.graph.shapes["research"].map_over == "topics"


def test_a_crash_in_one_items_step_resumes_there_paying_for_nothing_recorded() -> None:
    research = Research(["tides", "moon", "sun"], fail_on="moon")
    workflow = research.workflow()
    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(RuntimeError, match="summary of moon failed"):
        workflow.run_sync(checkpoint_fn=saved.append)
    last = _json(saved[-1])
    recorded = {n for n in last["outputs"] if n.startswith("research/") and n.endswith("]")}
    assert "research/summary[1]" not in recorded and "research/fetch[1]" in recorded
    research.calls.clear()
    result = workflow.run_sync(resume_from=last)
    assert "summary:moon" in research.calls and "fetch:moon" not in research.calls
    for name in recorded:  # no recorded step of any item runs again
        step, key = name.removeprefix("research/").rstrip("]").split("[")
        assert f"{step}:{research.topics[int(key)]}" not in research.calls
    assert result.outputs["research"] == ["TIDESTIDES (short)", "MOONMOON (short)", "SUNSUN (short)"]


def test_no_items_make_an_empty_list_at_once() -> None:
    research = Research([])
    result = research.workflow().run_sync()
    assert result.outputs["research"] == [] and result.outputs["report"] == ""
    assert research.calls == []


def test_a_rewind_of_one_items_step_runs_that_items_rest_again() -> None:
    research = Research(["tides", "moon"])
    workflow = research.workflow()
    done = workflow.run_sync().checkpoint
    assert done is not None
    rewound = rewind(workflow.graph, done, "research/fetch[0]")
    assert "research/fetch[1]" in rewound.outputs and "research/summary[1]" in rewound.outputs
    assert not {"research/fetch[0]", "research/summary[0]", "research", "report"} & rewound.outputs.keys()
    assert audit(workflow.graph, rewound).clean
    research.calls.clear()
    result = workflow.run_sync(resume_from=_json(rewound))
    assert research.calls == ["fetch:tides", "summary:tides"]
    assert result.outputs["report"] == "TIDESTIDES (short) / MOONMOON (short)"


def test_what_a_child_per_item_refuses_is_refused_when_built_naming_it() -> None:
    from ekit_runtime import Repeat

    shaped = Workflow([Step("fetch", lambda ctx: [1]),
                       Step("each", lambda ctx: 0, ("fetch",), map_over="fetch")])
    with pytest.raises(GraphError, match=r"'research/each' of the child of mapped step 'research' "
                                         r"cannot take a shape of its own \(yet\)"):
        Workflow([Step("topics", lambda ctx: [1]),
                  Step("research", depends_on=("topics",), child=shaped, map_over="topics")])
    with pytest.raises(ValueError, match="cannot take both map_over and repeat"):
        Step("research", depends_on=("topics",), child=shaped, map_over="topics", repeat=Repeat(2))
