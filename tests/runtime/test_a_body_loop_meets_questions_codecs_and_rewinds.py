"""A loop whose body is a child workflow, where other features meet it.

What users rely on: a question asked by a body step in iteration 2 parks the
run, and the answer resumes it in iteration 2 (no step of it recorded runs
again); a typed output (a codec's dataclass) carried from one iteration to the
next comes back as its type after a JSON round trip; rewinding ``agent/tool#2``
runs iteration 2 from its tool on and nothing before; a version bump of one
body step runs the loop again; with ``keep_last=1`` and a retry inside the
body, a bump sends no attempt key that earlier work had.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from ekit_core import RetryPolicy, WorkflowCheckpoint, rewind
from ekit_runtime import Codec, Done, Repeat, RunWaiting, Step, Workflow, ask
from ekit_runtime.attempt import attempt_key


@dataclass(frozen=True)
class Carried:
    total: int
    notes: tuple[str, ...]


def _json(cp: WorkflowCheckpoint | None) -> dict[str, Any]:
    assert cp is not None
    loaded: dict[str, Any] = json.loads(json.dumps(cp.to_dict()))
    return loaded


class Agent:
    def __init__(self, ask_at: int | None = None, fail_tool_at: int | None = None,
                 tool_version: str | None = None, keep_last: int | None = None) -> None:
        self.calls: list[str] = []
        self.keys: list[str] = []
        self.ask_at, self.fail_tool_at = ask_at, fail_tool_at
        self.tool_version, self.keep_last = tool_version, keep_last

    def _note(self, name: str) -> None:
        self.calls.append(name)
        self.keys.append(str(attempt_key()))

    def plan(self, ctx: Any) -> Carried:
        it = ctx["agent"]
        self._note(f"plan#{it.number}")
        previous = it.previous
        if previous is None:
            return Carried(ctx["task"], ())
        assert isinstance(previous, Carried), f"carried {type(previous).__name__}, not Carried"
        return Carried(previous.total + it.number, previous.notes)

    def tool(self, ctx: Any) -> Carried:
        k = ctx["agent"].number
        self._note(f"tool#{k}")
        plan = ctx["plan"]
        assert isinstance(plan, Carried)
        if k == self.fail_tool_at:
            self.fail_tool_at = None
            raise RuntimeError(f"tool failed in iteration {k}")
        note = str(ask("go on?", details={"iteration": k})) if k == self.ask_at else f"n{k}"
        return Carried(plan.total * 2, (*plan.notes, note))

    def fold(self, ctx: Any) -> Any:
        k = ctx["agent"].number
        self._note(f"fold#{k}")
        value = ctx["tool"]
        assert isinstance(value, Carried)
        return Done(value) if k == 4 else value

    def workflow(self) -> Workflow:
        body = Workflow([
            Step("plan", self.plan),
            Step("tool", self.tool, ("plan",), version=self.tool_version,
                 retry=RetryPolicy(max_attempts=2, backoff_base=0.0)),
            Step("fold", self.fold, ("tool",)),
        ], codec=Codec(Carried))
        return Workflow([
            Step("task", lambda ctx: 1),
            Step("agent", depends_on=("task",), child=body,
                 repeat=Repeat(max_iterations=6, keep_last=self.keep_last)),
            Step("report", lambda ctx: ctx["agent"].notes, ("agent",)),
        ], codec=Codec(Carried))


ALL = [f"{s}#{k}" for k in (1, 2, 3, 4) for s in ("plan", "tool", "fold")]


def test_a_question_in_iteration_2_parks_and_its_answer_resumes_in_iteration_2() -> None:
    agent = Agent(ask_at=2)
    with pytest.raises(RunWaiting) as parked:
        agent.workflow().run_sync(run_id="r")
    assert list(parked.value.questions) == ["agent/tool#2"]
    assert agent.calls == ["plan#1", "tool#1", "fold#1", "plan#2", "tool#2"]
    agent.calls.clear()
    with pytest.raises(RunWaiting):  # resumed unanswered: nothing runs again
        agent.workflow().run_sync(run_id="r", resume_from=_json(parked.value.checkpoint))
    assert agent.calls == ["tool#2"] or agent.calls == []
    agent.calls.clear()
    result = agent.workflow().run_sync(run_id="r", resume_from=_json(parked.value.checkpoint),
                                       answers={"agent/tool#2": "yes"})
    assert agent.calls == ALL[4:]
    assert result.outputs["report"] == ("n1", "yes", "n3", "n4")


def test_a_typed_output_carried_between_iterations_comes_back_as_its_type_after_json() -> None:
    agent = Agent()
    saved: list[WorkflowCheckpoint] = []
    whole = agent.workflow().run_sync(run_id="r", checkpoint_fn=saved.append)
    middle = next(cp for cp in saved if "agent/fold#2" in cp.outputs and "agent/plan#3" not in cp.outputs)
    stored = _json(middle)["outputs"]["agent/fold#2"]
    assert stored["$ekit"] == "type" and stored["type"].endswith(":Carried")
    agent.calls.clear()
    again = agent.workflow().run_sync(run_id="r", resume_from=_json(middle))
    assert agent.calls == ALL[6:]
    assert again.outputs["agent"] == whole.outputs["agent"]
    assert isinstance(again.outputs["agent"], Carried)


def test_rewinding_iteration_2s_tool_runs_from_there_and_nothing_before() -> None:
    agent = Agent()
    done = agent.workflow().run_sync(run_id="r")
    rewound = rewind(agent.workflow(), done.checkpoint, "agent/tool#2")  # type: ignore[arg-type]
    assert "agent/plan#2" in rewound.outputs and "agent/tool#2" not in rewound.outputs
    assert "agent/fold#4" not in rewound.outputs and "agent" not in rewound.outputs
    agent.calls.clear()
    again = agent.workflow().run_sync(run_id="r", resume_from=_json(rewound))
    assert agent.calls == ALL[4:]
    assert again.outputs["report"] == done.outputs["report"]


def test_a_bump_of_one_body_step_runs_the_loop_again() -> None:
    agent = Agent()
    done = agent.workflow().run_sync(run_id="r")
    agent.calls.clear()
    bumped = Agent(tool_version="2")
    again = bumped.workflow().run_sync(run_id="r", resume_from=_json(done.checkpoint))
    assert bumped.calls == ALL
    assert again.outputs["report"] == done.outputs["report"]


def test_a_bump_after_keep_last_sends_no_key_the_compacted_iterations_map_items_spent() -> None:
    """The items of a body's map in a compacted iteration are gone by name (counted only);
    a bump that runs the loop again must still number them past the keys they spent."""
    def build(keys: list[str], version: str) -> Workflow:
        def note(value: Any) -> Any:
            keys.append(str(attempt_key()))
            return value

        body = Workflow([
            Step("plan", lambda ctx: note([ctx["agent"].number, 10]), version=version),
            Step("tool", lambda ctx: note(ctx["plan"] + 1), ("plan",), map_over="plan"),
            Step("fold", lambda ctx: note(Done(3) if ctx["agent"].number == 3 else 0), ("tool",)),
        ])
        return Workflow([Step("agent", child=body, repeat=Repeat(5, keep_last=1))])

    first: list[str] = []
    done = build(first, "1").run_sync(run_id="r")
    assert done.checkpoint is not None and done.checkpoint.compacted.get("agent") == 2
    assert "r/agent/tool#1[0]/1" in first
    again: list[str] = []
    build(again, "2").run_sync(run_id="r", resume_from=_json(done.checkpoint))
    # (the kept iteration's items see the same input again: kept, as any map's; the compacted
    # iterations' are gone, and run again)
    assert {k.rsplit("/", 1)[0] for k in again} >= {"r/agent/tool#1[0]", "r/agent/tool#2[1]"}
    reused = sorted(set(first) & set(again))
    assert reused == [], f"work that ran again reused keys: {reused}"


def test_keep_last_1_with_a_retry_in_the_body_then_a_bump_sends_no_key_of_other_work() -> None:
    agent = Agent(fail_tool_at=2, keep_last=1)
    done = agent.workflow().run_sync(run_id="r")
    assert agent.calls.count("tool#2") == 2  # the retry
    assert len(set(agent.keys)) == len(agent.keys), "two attempts shared a key"
    assert done.checkpoint is not None and done.checkpoint.compacted.get("agent") == 3
    bumped = Agent(tool_version="2", keep_last=1)
    again = bumped.workflow().run_sync(run_id="r", resume_from=_json(done.checkpoint))
    assert bumped.calls == ALL
    # (the retried iteration was compacted: its failure still counts its spent attempts)
    reused = sorted(set(agent.keys) & set(bumped.keys))
    assert reused == [], f"work that ran again reused keys: {reused}"
    assert again.outputs["report"] == done.outputs["report"]
