"""A step that runs a child workflow (``Step(name, child=...)``), run by the runtime.

A real run cancelled in the child's k-th step resumes at the k-th and pays for
no recorded child step again; the child sees the parent step's inputs and its
own steps' outputs by their own names; usage rolls up to the parent step; the
run's budget stops a child naming it; a child's failure under
``isolate_failures`` leaves the parent and what needs it waiting, and the rest
runs; a child nested in a child, and a map and a loop inside a child; the
declarations refused, by name, when the workflow is built.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import pytest

from ekit_core import GraphError
from ekit_runtime import (
    BudgetExceeded,
    Child,
    Codec,
    Done,
    PatternResult,
    Repeat,
    Step,
    TokenUsage,
    Workflow,
    WorkflowCheckpoint,
)


@dataclass(frozen=True)
class Note:
    text: str


def _json(cp: WorkflowCheckpoint) -> dict[str, Any]:
    return json.loads(json.dumps(cp.to_dict()))


def _chain(n: int, calls: list[str], stop_at: int | None = None,
           reached: asyncio.Event | None = None) -> Workflow:
    """A child of ``n`` steps in a chain; each adds its number to what the one before made."""

    def step(k: int) -> Any:
        async def run(ctx: Any) -> Any:
            calls.append(f"s{k}")
            if k == stop_at and calls.count(f"s{k}") == 1:
                assert reached is not None
                reached.set()
                await asyncio.Event().wait()  # until cancelled
            before = ctx["topic"] if k == 1 else ctx[f"s{k - 1}"]
            return PatternResult(f"{before}+{k}", cost=TokenUsage(k, 1, 1))
        return run

    return Workflow([Step(f"s{k}", step(k), (f"s{k - 1}",) if k > 1 else ()) for k in range(1, n + 1)])


def test_a_run_cancelled_in_the_childs_kth_step_resumes_at_the_kth() -> None:
    calls: list[str] = []
    reached = asyncio.Event()
    child = _chain(9, calls, stop_at=7, reached=reached)
    workflow = Workflow([
        Step("topic", lambda ctx: "cats"),
        Step("research", depends_on=("topic",), child=child),
        Step("report", lambda ctx: f"report on {ctx['research']}", ("research",)),
    ])
    saved: list[WorkflowCheckpoint] = []

    async def interrupted() -> None:
        task = asyncio.ensure_future(workflow.run(checkpoint_fn=saved.append))
        await reached.wait()
        task.cancel()  # cancelling the run cancels its child's step in flight
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(interrupted())
    last = _json(saved[-1])
    assert [k for k in range(1, 10) if f"research/s{k}" in last["outputs"]] == list(range(1, 7))
    assert "research" not in last["outputs"]
    result = workflow.run_sync(resume_from=last)
    assert calls == [f"s{k}" for k in range(1, 8)] + ["s7", "s8", "s9"], \
        "a recorded child step ran again, or one was skipped"
    expected = "cats" + "".join(f"+{k}" for k in range(1, 10))
    assert result.outputs["research"] == expected
    assert result.outputs["report"] == f"report on {expected}"
    # usage rolls up to the parent step: the child's nine steps, whichever run paid
    assert result.usage_of("research") == TokenUsage(45, 9, 9)
    assert result.cost == TokenUsage(45, 9, 9)


def test_a_budget_reached_in_a_child_names_it_and_a_resume_pays_for_nothing_twice() -> None:
    calls: list[str] = []
    workflow = Workflow([
        Step("topic", lambda ctx: "cats"),
        Step("research", depends_on=("topic",), child=_chain(5, calls)),
    ])
    with pytest.raises(BudgetExceeded) as caught:
        workflow.run_sync(budget=TokenUsage(input_tokens=6))  # s1+s2+s3 use 6
    assert caught.value.step == "research"
    assert "child workflow of step 'research'" in str(caught.value)
    assert calls == ["s1", "s2", "s3"]
    result = workflow.run_sync(resume_from=caught.value.checkpoint)
    assert calls == ["s1", "s2", "s3", "s4", "s5"]
    assert result.usage_of("research") == TokenUsage(15, 5, 5)


def test_a_childs_failure_leaves_its_parent_waiting_under_isolate_failures() -> None:
    def broken(ctx: Any) -> Any:
        raise RuntimeError("the provider is down")

    child = Workflow([Step("fetch", lambda ctx: ctx["topic"] * 2),
                      Step("parse", broken, ("fetch",))])
    workflow = Workflow([
        Step("topic", lambda ctx: "ab"),
        Step("research", depends_on=("topic",), child=child),
        Step("report", lambda ctx: ctx["research"], ("research",)),
        Step("other", lambda ctx: "done", ("topic",)),
    ])
    result = workflow.run_sync(isolate_failures=True)
    assert list(result.failed) == ["research/parse"]
    assert result.not_started == ("research", "report")
    assert result.outputs["other"] == "done" and result.outputs["research/fetch"] == "abab"
    with pytest.raises(RuntimeError, match="provider is down"):
        workflow.run_sync()  # without it, the child's failure ends the run


def test_a_child_sees_its_inputs_and_its_own_steps_by_their_names() -> None:
    seen: dict[str, Any] = {}

    def parse(ctx: Any) -> Any:
        seen.update(topic=ctx["topic"], fetch=ctx["fetch"], has="fetch" in ctx)
        return f"parsed {ctx['fetch']}"

    child = Workflow([
        Step("fetch", lambda ctx: f"pages on {ctx['topic']}"),
        Step("parse", parse, ("fetch",), context="dependencies"),
        Step("check", lambda ctx: seen.update(all_fetch=ctx["fetch"]), ("fetch",)),
        Step("done", lambda ctx: ctx["parse"], ("parse", "check")),
    ])
    # The parent's workflow has a step named "fetch" too: the child's own wins inside it.
    workflow = Workflow([
        Step("topic", lambda ctx: "cats"),
        Step("fetch", lambda ctx: "the parent's fetch"),
        Step("research", depends_on=("topic",), child=child),
    ])
    result = workflow.run_sync()
    assert seen == {"topic": "cats", "fetch": "pages on cats", "has": True,
                    "all_fetch": "pages on cats"}
    assert result.outputs["research"] == "parsed pages on cats"
    # the same child runs alone, its inputs as the initial context
    assert child.run_sync({"topic": "cats"}).outputs["done"] == "parsed pages on cats"


def test_maps_loops_and_children_inside_a_child() -> None:
    inner = Workflow([Step("draft", lambda ctx: f"draft of {ctx['topic']}"),
                      Step("polish", lambda ctx: ctx["draft"] + "!", ("draft",))])

    def turn(ctx: Any) -> Any:
        it = ctx["agent"]
        return Done(it.number) if it.number == 3 else it.number

    body = Workflow([
        Step("plan", lambda ctx: ["a", "b"]),
        Step("tool", lambda ctx: ctx["plan"] * 2, ("plan",), map_over="plan"),
        Step("write", depends_on=("tool",), child=inner),
        Step("agent", turn, ("plan",), repeat=Repeat(5)),
        Step("sum", lambda ctx: [ctx["tool"], ctx["write"], ctx["agent"]], ("write", "agent")),
    ])
    workflow = Workflow([
        Step("topic", lambda ctx: "cats"),
        Step("research", depends_on=("topic",), child=Child(body, output="sum")),
    ])
    names = workflow.graph.names
    assert names.index("research/write/polish") < names.index("research/write") < names.index("research")
    result = workflow.run_sync()
    assert result.outputs["research"] == [["aa", "bb"], "draft of cats!", 3]
    outputs = result.checkpoint.outputs
    assert outputs["research/tool[1]"] == "bb" and outputs["research/agent#3"] == 3
    assert outputs["research/write/draft"] == "draft of cats"
    # every checkpoint of the run resumes to the same end, running only what it lacks
    saved: list[WorkflowCheckpoint] = []
    workflow.run_sync(checkpoint_fn=saved.append)
    for cp in saved:
        again = workflow.run_sync(resume_from=_json(cp))
        assert again.outputs["research"] == result.outputs["research"]


def test_what_a_child_step_refuses_is_refused_when_built_naming_it() -> None:
    child = Workflow([Step("x", lambda ctx: 1), Step("y", lambda ctx: 2)])
    with pytest.raises(GraphError, match=r"'research'.*2 last steps.*'x', 'y'"):
        Workflow([Step("research", child=child)])
    assert Workflow([Step("research", child=Child(child, output="y"))]).run_sync().outputs["research"] == 2
    with pytest.raises(GraphError, match="'research/z' is named like a step of the child workflow"):
        Workflow([Step("research", child=Child(child, "x")), Step("research/z", lambda ctx: 0)])
    with pytest.raises(GraphError, match="output 'nope' is no step"):
        Workflow([Step("research", child=Child(child, "nope"))])
    with pytest.raises(ValueError, match="step 'research': a step with a child workflow cannot take "
                                         "when"):
        Step("research", depends_on=("a",), child=Child(child, "x"), when=lambda ctx: True)
    with pytest.raises(GraphError, match="the body of a loop must end in its output"):
        Workflow([Step("research", child=Child(child, "x"), repeat=Repeat(3))])
    with pytest.raises(ValueError, match="takes no run"):
        Step("research", lambda ctx: 0, child=Child(child, "x"))
    with pytest.raises(ValueError, match="child must be an ekit Workflow"):
        Step("research", child=[child])


def test_a_childs_typed_output_comes_back_as_its_type_on_a_resume() -> None:
    def write(ctx: Any) -> Note:
        return Note(f"on {ctx['topic']}")

    child = Workflow([Step("write", write)])
    workflow = Workflow([Step("topic", lambda ctx: "cats"),
                         Step("notes", depends_on=("topic",), child=child),
                         Step("read", lambda ctx: ctx["notes"].text, ("notes",))],
                        codec=Codec())
    saved: list[WorkflowCheckpoint] = []
    workflow.run_sync(checkpoint_fn=saved.append)
    at = next(cp for cp in saved if "notes/write" in cp.outputs and "read" not in cp.outputs)
    result = workflow.run_sync(resume_from=_json(at))
    assert result.outputs["read"] == "on cats"


def test_a_child_is_drawn_as_a_nested_box() -> None:
    from ekit_runtime.cli import dot, mermaid

    inner = Workflow([Step("draft", lambda ctx: "d")])
    child = Workflow([Step("fetch", lambda ctx: 1), Step("write", depends_on=("fetch",), child=inner)])
    workflow = Workflow([Step("research", child=child), Step("report", lambda ctx: 0, ("research",))])
    text = mermaid(workflow.graph)
    box = text.index('subgraph c0["research"]')
    inner_box = text.index('subgraph c1["research/write"]')
    assert box < text.index('"research/fetch"') < inner_box < text.index('"research/write/draft"')
    assert text.count("end") == 2 and "research (child, output write)" in text
    assert 'subgraph cluster_1 { label="research/write";' in dot(workflow.graph)
    plain = Workflow([Step("a", lambda ctx: 0)])
    assert "subgraph" not in mermaid(plain.graph) + dot(plain.graph)


def test_progress_rolls_a_childs_tokens_up_to_its_step() -> None:
    import io

    from ekit_runtime import ProgressPrinter

    calls: list[str] = []
    inner = Workflow([Step("draft", lambda ctx: PatternResult("d", cost=TokenUsage(3, 1, 1)))])
    child = Workflow([Step("s1", lambda ctx: PatternResult("x", cost=TokenUsage(5, 5, 1))),
                      Step("write", depends_on=("s1",), child=inner)])
    workflow = Workflow([Step("topic", lambda ctx: "cats"),
                         Step("research", depends_on=("topic",), child=child)])
    out = io.StringIO()
    workflow.run_sync(trace=ProgressPrinter(out, graph=workflow, tty=False, tick=None))
    text = out.getvalue()
    assert "done research/write, its child workflow's output; 4 tokens in its steps this run" in text
    assert "done research, its child workflow's output; 14 tokens in its steps this run" in text
    assert not calls


def test_the_fingerprint_covers_the_child_and_its_steps_travel_by_pickle() -> None:
    import pickle

    def make(extra: bool) -> Workflow:
        steps = [Step("fetch", _fetch)] + ([Step("more", _fetch, ("fetch",))] if extra else [])
        return Workflow([Step("topic", _fetch), Step("research", depends_on=("topic",),
                                                     child=Workflow(steps))])

    assert make(False).graph.fingerprint != make(True).graph.fingerprint
    assert make(False).graph.fingerprint == make(False).graph.fingerprint
    moved = make(False).steps[1]
    assert moved.name == "research/fetch"
    again = pickle.loads(pickle.dumps(moved))  # (what an executor in another process needs)
    assert again.run({"topic": "cats"}) == "fetched"
    # a child workflow's on_code_change stays its steps' own
    child = Workflow([Step("fetch", _fetch)], on_code_change="refuse")
    parent = Workflow([Step("research", child=child)])
    assert parent.code_policies == {"research/fetch": "refuse"}


def _fetch(ctx: Any) -> str:
    return "fetched"


def test_a_step_with_a_child_cannot_be_added_to_a_running_graph() -> None:
    child = Workflow([Step("x", _fetch)])
    runner = Workflow([Step("a", _fetch)]).runner()
    with pytest.raises(ValueError, match="step 'late': a step with a child workflow cannot be added"):
        runner.add_steps([Step("late", child=child)])
