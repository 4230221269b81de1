"""A loop whose body is a child workflow: ``Step("agent", child=body, repeat=Repeat(...))``.

Each iteration ``k`` runs every step of the body as ``agent/s#k`` (the agent's
shape: a model call, a tool, a fold), each an attempt unit of its own; the
body's output step ends the loop (``Done``, ``until``) and carries the state
the next iteration sees. A crash inside iteration 3's tool step resumes there;
caps fail the loop by name; ``keep_last`` compacts whole iterations; a version
bump of a body step runs the loop again from its first iteration; ``ekit graph``
draws the cycle from the body's output to its first step.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from ekit_core import GraphError, LoopError
from ekit_runtime import (
    Child,
    Done,
    History,
    Iteration,
    Repeat,
    Step,
    Workflow,
    WorkflowCheckpoint,
    history,
)
from ekit_runtime.cli import dot, mermaid


def _json(cp: WorkflowCheckpoint) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(json.dumps(cp.to_dict()))
    return loaded


class Agent:
    """The body's steps, counting their calls; ``fail_tool_at`` raises once in that iteration."""

    def __init__(self, ends_at: int | None = 3, fail_tool_at: int | None = None,
                 tool_version: str | None = None) -> None:
        self.calls: list[str] = []
        self.ends_at, self.fail_tool_at = ends_at, fail_tool_at
        self.tool_version = tool_version

    def plan(self, ctx: Any) -> int:
        it: Iteration = ctx["agent"]
        self.calls.append(f"plan#{it.number}")
        carried: int = ctx["task"] if it.previous is None else it.previous
        return carried * 10 + it.number

    def tool(self, ctx: Any) -> int:
        k = ctx["agent"].number
        self.calls.append(f"tool#{k}")
        if k == self.fail_tool_at:
            self.fail_tool_at = None
            raise RuntimeError(f"tool failed in iteration {k}")
        return int(ctx["plan"]) + 1

    def fold(self, ctx: Any) -> Any:
        k = ctx["agent"].number
        self.calls.append(f"fold#{k}")
        value = ctx["tool"] * 2
        return Done(value) if k == self.ends_at else value

    def workflow(self, repeat: Repeat | None = None) -> Workflow:
        body = Workflow([
            Step("plan", self.plan),
            Step("tool", self.tool, ("plan",), version=self.tool_version),
            Step("fold", self.fold, ("tool", "plan")),
        ])
        return Workflow([
            Step("task", lambda ctx: 1),
            Step("agent", depends_on=("task",), child=body,
                 repeat=repeat or Repeat(max_iterations=5)),
            Step("report", lambda ctx: ["saw", ctx["agent"]], ("agent",)),
        ])


def _expected(ends_at: int) -> int:
    value = 1
    for k in range(1, ends_at + 1):
        value = ((value * 10 + k) + 1) * 2
    return value


def test_each_iteration_runs_the_body_whole_on_the_state_the_one_before_carried() -> None:
    agent = Agent(ends_at=3)
    saved: list[WorkflowCheckpoint] = []
    result = agent.workflow().run_sync(checkpoint_fn=saved.append)
    assert agent.calls == [f"{s}#{k}" for k in (1, 2, 3) for s in ("plan", "tool", "fold")]
    assert result.outputs["agent"] == _expected(3)
    assert result.outputs["report"] == ["saw", _expected(3)]
    # the body's steps show their last iteration's outputs; iterations stay in the checkpoint
    assert result.outputs["agent/fold"] == _expected(3)
    assert not any("#" in n for n in result.outputs)
    assert {f"agent/plan#{k}" for k in (1, 2, 3)} <= saved[-1].outputs.keys()


def test_a_crash_in_iteration_3s_tool_step_resumes_there_paying_for_nothing_recorded() -> None:
    agent = Agent(ends_at=4, fail_tool_at=3)
    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(RuntimeError, match="tool failed in iteration 3"):
        agent.workflow().run_sync(checkpoint_fn=saved.append)
    assert agent.calls[-2:] == ["plan#3", "tool#3"]
    last = _json(saved[-1])
    assert "agent/plan#3" in last["outputs"] and "agent/tool#3" not in last["outputs"]
    agent.calls.clear()
    result = agent.workflow().run_sync(resume_from=last)
    assert agent.calls == ["tool#3", "fold#3", "plan#4", "tool#4", "fold#4"]
    assert result.outputs["report"] == ["saw", _expected(4)]


def test_until_reads_the_bodys_output_and_a_cap_fails_the_loop_by_name() -> None:
    agent = Agent(ends_at=None)
    result = agent.workflow(Repeat(5, until=lambda out: out > 1000)).run_sync()
    assert result.outputs["agent"] == _expected(3)  # 11*2=24 -> 243*2... the first above 1000
    agent = Agent(ends_at=None)
    with pytest.raises(LoopError, match=r"'agent' did not end within repeat=2 iterations"):
        agent.workflow(Repeat(2)).run_sync()
    assert agent.calls[-1] == "fold#2" and "plan#3" not in agent.calls


def test_keep_last_compacts_whole_iterations_and_a_resume_still_ends_the_same() -> None:
    agent = Agent(ends_at=6)
    saved: list[WorkflowCheckpoint] = []
    result = agent.workflow(Repeat(8, keep_last=2)).run_sync(checkpoint_fn=saved.append)
    assert result.outputs["agent"] == _expected(6)
    for cp in saved:
        kept = {int(n.rsplit("#", 1)[1]) for n in cp.outputs if "#" in n}
        assert len(kept) <= 3 and all(k > cp.compacted.get("agent", 0) for k in kept)
    assert saved[-1].compacted == {"agent": 4}
    middle = next(cp for cp in saved if cp.compacted.get("agent") == 1 and "agent/tool#4" in cp.outputs
                  and "agent/fold#4" not in cp.outputs)
    agent.calls.clear()
    again = agent.workflow(Repeat(8, keep_last=2)).run_sync(resume_from=_json(middle))
    assert agent.calls[0] == "fold#4" and again.outputs["agent"] == _expected(6)


def test_a_body_step_reads_the_loops_history_and_a_dependent_reads_it_whole() -> None:
    seen: list[Any] = []

    def fold(ctx: Any) -> Any:
        seen.append(list(history("agent").items()))
        k = ctx["agent"].number
        return Done(k) if k == 3 else k

    body = Workflow([Step("plan", lambda ctx: ctx["agent"].number), Step("fold", fold, ("plan",))])

    def report(ctx: Any) -> Any:
        whole: History = history("agent")
        return [whole[k] for k in range(1, len(whole) + 1)]

    result = Workflow([
        Step("agent", child=body, repeat=Repeat(5)),
        Step("report", report, ("agent",)),
    ]).run_sync()
    assert seen == [[], [(1, 1)], [(1, 1), (2, 2)]]
    assert result.outputs["report"] == [1, 2, 3]


def test_a_version_bump_of_a_body_step_runs_the_loop_again_from_its_first_iteration() -> None:
    agent = Agent(ends_at=2)
    saved: list[WorkflowCheckpoint] = []
    agent.workflow().run_sync(checkpoint_fn=saved.append)
    for cp in (saved[-1], next(c for c in saved if "agent/tool#2" in c.outputs
                                and "agent" not in c.outputs)):
        bumped = Agent(ends_at=2, tool_version="2")
        result = bumped.workflow().run_sync(resume_from=_json(cp))
        # (the loop's work changed: it starts again, as a one-step loop does, plan#1 too)
        assert bumped.calls == [f"{s}#{k}" for k in (1, 2) for s in ("plan", "tool", "fold")]
        assert result.outputs["agent"] == _expected(2)


def test_tools_mapped_over_what_the_model_asked_run_per_iteration_and_resume_anywhere() -> None:
    calls: list[str] = []

    def model(ctx: Any) -> list[str]:
        it: Iteration = ctx["agent"]
        calls.append(f"model#{it.number}")
        return [f"q{it.number}.{i}" for i in range(it.number % 3)]  # 1, 2, 0, 1 tool calls

    def tool(ctx: Any) -> str:
        calls.append(f"tool:{ctx['model']}")
        return str(ctx["model"]).upper()

    def fold(ctx: Any) -> Any:
        it: Iteration = ctx["agent"]
        calls.append(f"fold#{it.number}")
        seen = [*(it.previous or []), *ctx["tool"]]
        return Done(seen) if it.number == 4 else seen

    body = Workflow([Step("model", model), Step("tool", tool, ("model",), map_over="model"),
                     Step("fold", fold, ("tool", "model"))])
    workflow = Workflow([Step("agent", child=body, repeat=Repeat(6, keep_last=2)),
                         Step("report", lambda ctx: ctx["agent"], ("agent",))])
    saved: list[WorkflowCheckpoint] = []
    result = workflow.run_sync(checkpoint_fn=saved.append)
    assert result.outputs["report"] == ["Q1.0", "Q2.0", "Q2.1", "Q4.0"]
    assert calls == ["model#1", "tool:q1.0", "fold#1", "model#2", "tool:q2.0", "tool:q2.1",
                     "fold#2", "model#3", "fold#3", "model#4", "tool:q4.0", "fold#4"]
    assert saved[-1].compacted == {"agent": 2, "agent/tool[]": 3}  # (iterations 1, 2: 3 items)
    for cp in saved:  # a resume from any checkpoint pays for nothing recorded
        recorded = {n for n in cp.outputs if "#" in n}
        calls.clear()
        again = workflow.run_sync(resume_from=_json(cp))
        assert again.outputs["report"] == result.outputs["report"]
        for name in recorded:
            step, _, k = name.partition("#")
            short = step.removeprefix("agent/")
            if "[" in k:  # an item: tool#k[i] ran on q{k}.{i}
                number, _, i = k.rstrip("]").partition("[")
                assert f"tool:q{number}.{i}" not in calls, (name, calls)
            elif short != "tool":  # (tool#k is collected, never run)
                assert f"{short}#{k}" not in calls, (name, calls)


def test_ekit_graph_draws_the_cycle_from_the_bodys_output_to_its_first_step() -> None:
    graph = Agent().workflow(Repeat(5, keep_last=2)).graph
    lines = mermaid(graph).splitlines()
    ids = {line.split('["')[1].split(" (")[0].rstrip('"]'): line.split("[")[0].strip()
           for line in lines if '["' in line}
    assert f"    {ids['agent/fold']} -->|next| {ids['agent/plan']}" in lines
    assert any('agent (repeat up to 5, keep last 2, child, output fold)' in line for line in lines)
    assert sum(1 for line in dot(graph).splitlines() if 'label="next"' in line) == 1


def test_what_a_loop_body_refuses_is_refused_when_built_naming_it() -> None:
    two_ends = Workflow([Step("x", lambda ctx: 1), Step("y", lambda ctx: 2)])
    with pytest.raises(GraphError, match=r"'agent'.*must end in its output 'agent/x' alone.*'agent/y'"):
        Workflow([Step("agent", child=Child(two_ends, "x"), repeat=Repeat(3))])
    mapped = Workflow([Step("plan", lambda ctx: [1, 2]),
                       Step("each", lambda ctx: ctx["plan"], ("plan",), map_over="plan")])
    with pytest.raises(GraphError, match=r"'agent/each' of the body of loop 'agent' cannot take "
                                         r"map_over on its output \(yet\)"):
        Workflow([Step("agent", child=mapped, repeat=Repeat(3))])
    cached = Workflow([Step("plan", lambda ctx: 1, cache=True)])
    with pytest.raises(ValueError, match=r"'agent/plan' of the body of loop 'agent': cache=True"):
        Workflow([Step("agent", child=cached, repeat=Repeat(3))])


def test_a_skipped_loop_skips_its_body_and_its_checkpoint_resumes_audits_and_replays() -> None:
    from ekit_core import audit, replay

    body = Workflow([Step("plan", lambda ctx: 1), Step("fold", lambda ctx: Done(2), ("plan",))])
    workflow = Workflow([Step("gate", lambda ctx: 1, when=lambda ctx: False),
                         Step("agent", depends_on=("gate",), child=body, repeat=Repeat(3)),
                         Step("report", lambda ctx: 3, ("agent",))])
    saved: list[WorkflowCheckpoint] = []
    result = workflow.run_sync(checkpoint_fn=saved.append)
    assert result.outputs == {}
    assert {"agent", "agent/plan", "agent/fold", "agent/plan#1", "agent/fold#1", "report"} <= \
        result.checkpoint.skipped.keys()
    assert workflow.run_sync(resume_from=_json(saved[-1])).outputs == {}
    assert audit(workflow.graph, saved[-1]).clean and replay(workflow.graph, saved).ok


def test_a_question_inside_an_iteration_waits_and_its_answer_resumes_there_usage_rolled_up() -> None:
    from ekit_core import Answer, answer
    from ekit_runtime import BudgetExceeded, PatternResult, RunWaiting, TokenUsage, ask

    calls: list[str] = []

    def plan(ctx: Any) -> Any:
        k = ctx["agent"].number
        calls.append(f"plan#{k}")
        return PatternResult(k, cost=TokenUsage(10, 1, 1))

    def approve(ctx: Any) -> Any:
        k = ctx["agent"].number
        calls.append(f"approve#{k}")
        return ask(f"go on with {ctx['plan']}?") if k == 2 else "auto"

    def fold(ctx: Any) -> Any:
        k = ctx["agent"].number
        return Done([k, ctx["approve"]]) if k == 3 else [k, ctx["approve"]]

    body = Workflow([Step("plan", plan), Step("approve", approve, ("plan",)),
                     Step("fold", fold, ("approve",))])
    workflow = Workflow([Step("agent", child=body, repeat=Repeat(5))])
    with pytest.raises(RunWaiting) as waiting:
        workflow.run_sync()
    assert list(waiting.value.questions) == ["agent/approve#2"]
    calls.clear()
    answered = answer(waiting.value.checkpoint, "agent/approve#2", Answer("yes"))
    result = workflow.run_sync(resume_from=_json(answered))
    assert calls == ["approve#2", "plan#3", "approve#3"]
    assert result.outputs["agent"] == [3, "auto"]
    assert result.usage_of("agent") == TokenUsage(30, 3, 3)
    with pytest.raises(BudgetExceeded, match="loop 'agent'") as halted:
        Workflow([Step("agent", child=Workflow([Step("plan", plan), Step("fold", lambda ctx: 0, ("plan",))]),
                       repeat=Repeat(9))]).run_sync(budget=TokenUsage(llm_calls=2))
    assert halted.value.step == "agent"
