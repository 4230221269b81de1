"""The ExecutionKit-compatible Workflow API: run, checkpoint, resume."""

from __future__ import annotations

import asyncio
import copy
import json
import pickle
import threading
from dataclasses import FrozenInstanceError, dataclass
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ekit_runtime
from ekit_core import CheckpointError, GraphError, GraphSpec
from ekit_runtime import (
    PatternResult,
    Step,
    TokenUsage,
    Workflow,
    WorkflowCheckpoint,
    WorkflowResult,
)
from tests.support.helpers import Gates, until
from tests.support.strategies import dags


def test_executionkit_names_are_importable() -> None:
    for name in ("Step", "Workflow", "WorkflowCheckpoint", "WorkflowResult", "TokenUsage", "PatternResult"):
        assert name in ekit_runtime.__all__ and hasattr(ekit_runtime, name)
    step = Step("a", lambda c: 1)
    assert step.depends_on == () and dict(step.metadata) == {}
    with pytest.raises(FrozenInstanceError):
        step.name = "b"  # type: ignore[misc]
    assert Step("b", lambda c: 1, ["a"]).depends_on == ("a",)  # lists are accepted


def _body(ctx: object) -> int:  # importable by name, so a step holding it pickles
    return 1


def test_steps_given_no_metadata_share_one_empty_dict_that_refuses_writes() -> None:
    a, b = Step("a", _body), Step("b", _body, ("a",))
    assert a.metadata is b.metadata and a.metadata == {} and isinstance(a.metadata, dict)
    assert json.dumps(a.metadata) == "{}" and a == Step("a", _body, metadata={})
    for write in (lambda m: m.__setitem__("k", 1), lambda m: m.update(k=1), lambda m: m.pop("k"),
                  lambda m: m.setdefault("k", 1), lambda m: m.clear(), lambda m: m.popitem()):
        with pytest.raises(TypeError, match=r"pass metadata=\{\.\.\.\}"):
            write(a.metadata)
    assert a.metadata == {} and dict(Step("c", _body, metadata={"k": 1}).metadata) == {"k": 1}
    for mine in (copy.copy(a.metadata), copy.deepcopy(a.metadata), a.metadata.copy(), dict(a.metadata)):
        mine["k"] = 1  # a copy is a plain dict of its own
        assert type(mine) is dict and a.metadata == {}


def test_a_workflows_steps_and_graph_are_read_only() -> None:
    workflow = Workflow([Step("a", _body), Step("b", _body, ("a",))])
    with pytest.raises(AttributeError):
        workflow.steps = (Step("b", _body),)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        workflow.graph = GraphSpec.of({"b": []})  # type: ignore[misc]
    assert workflow.run_sync().outputs == {"a": 1, "b": 1}


def test_a_step_pickles_and_copies_as_the_same_step() -> None:
    plain = Step("a", _body)
    full = Step("b", _body, ("a",), metadata={"k": 1}, timeout=2.0, context="dependencies",
                inline=True, version="v1")
    for step in (plain, full):
        for copied in (pickle.loads(pickle.dumps(step)), copy.deepcopy(step), copy.copy(step)):
            assert copied == step and type(copied) is Step
    assert pickle.loads(pickle.dumps(plain)).metadata is plain.metadata  # still the shared one


def test_bad_steps_and_graphs_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="run must be callable"):
        Step("a", 5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        Step("a", lambda c: 1, timeout=0)
    with pytest.raises(ValueError, match=r"steps\[1\] must be a Step"):
        Workflow([Step("a", lambda c: 1), "b"])  # type: ignore[list-item]
    with pytest.raises(GraphError, match="unknown step"):
        Workflow([Step("a", lambda c: 1, ("zz",))])
    with pytest.raises(ValueError, match=r"dependency cycle: (a -> b -> a|b -> a -> b)"):
        Workflow([Step("a", lambda c: 1, ("b",)), Step("b", lambda c: 1, ("a",))])


def test_sync_and_async_steps_see_context_and_outputs() -> None:
    seen: dict[str, dict[str, Any]] = {}

    async def a(ctx: dict[str, Any]) -> int:
        seen["a"] = ctx
        ctx["junk"] = "mutating my copy must not leak"
        return 1

    def b(ctx: dict[str, Any]) -> int:
        seen["b"] = ctx
        return int(ctx["a"]) + ctx["base"]

    wf = Workflow([Step("a", a), Step("b", b, ("a",))])
    result = wf.run_sync({"base": 10})
    assert isinstance(result, WorkflowResult)
    assert isinstance(result.outputs, MappingProxyType)
    assert dict(result.outputs) == {"a": 1, "b": 11}
    assert seen["a"] == {"base": 10, "junk": "mutating my copy must not leak"}
    assert seen["b"] == {"base": 10, "a": 1}


def test_context_dependencies_mode_sees_only_dependencies() -> None:
    seen: dict[str, dict[str, Any]] = {}

    def record(name: str) -> Any:
        def run(ctx: dict[str, Any]) -> str:
            seen[name] = ctx
            return name

        return run

    wf = Workflow([
        Step("a", record("a")),
        Step("b", record("b")),
        Step("c", record("c"), ("a",), context="dependencies"),
    ])
    wf.run_sync({"k": 1})
    assert seen["c"] == {"k": 1, "a": "a"}


def test_initial_context_colliding_with_step_names_fails_before_any_step() -> None:
    ran: list[str] = []
    wf = Workflow([Step("a", lambda c: ran.append("a")), Step("b", lambda c: ran.append("b"))])
    with pytest.raises(ValueError, match=r"\['a', 'b'\]") as info:
        wf.run_sync({"b": 1, "a": 2, "ok": 3})
    assert "'ok'" not in str(info.value)
    assert ran == []


def test_bad_run_arguments_fail_before_any_step() -> None:
    ran: list[str] = []
    wf = Workflow([Step("a", lambda c: ran.append("a"))])
    for kwargs, message in [
        ({"checkpoint_fn": 3}, "checkpoint_fn must be callable"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"resume_from": {"outputs": {}}}, "'step_index'"),
        ({"resume_from": "cp.json"}, "resume_from"),
    ]:
        with pytest.raises(ValueError, match=message):
            wf.run_sync(**kwargs)
    assert ran == []


def test_checkpoints_after_each_step_accumulate() -> None:
    wf = Workflow([
        Step("a", lambda c: PatternResult("A", cost=TokenUsage(1, 2, 1))),
        Step("b", lambda c: PatternResult("B", cost=TokenUsage(3, 4, 1)), ("a",)),
        Step("c", lambda c: "C", ("b",)),
    ])
    saved: list[WorkflowCheckpoint] = []
    result = wf.run_sync(checkpoint_fn=saved.append)
    assert [c.step_index for c in saved] == [1, 2, 3]
    assert [dict(c.outputs) for c in saved] == [
        {"a": "A"},
        {"a": "A", "b": "B"},
        {"a": "A", "b": "B", "c": "C"},
    ]
    assert [c.cost for c in saved] == [TokenUsage(1, 2, 1), TokenUsage(4, 6, 2), TokenUsage(4, 6, 2)]
    assert all(isinstance(c.outputs, MappingProxyType) for c in saved)
    assert saved[-1].step_usage["b"] == TokenUsage(3, 4, 1)
    assert result.cost == TokenUsage(4, 6, 2) and result.checkpoint == saved[-1]


def test_async_checkpoint_fn_is_awaited() -> None:
    saved: list[int] = []

    async def save(cp: WorkflowCheckpoint) -> None:
        await asyncio.sleep(0)
        saved.append(cp.step_index)

    Workflow([Step("a", lambda c: 1), Step("b", lambda c: 2, ("a",))]).run_sync(checkpoint_fn=save)
    assert saved == [1, 2]


def test_checkpoint_fn_error_propagates_and_leaves_no_tasks() -> None:
    class StoreDown(Exception):
        pass

    def save(cp: WorkflowCheckpoint) -> None:
        if cp.step_index == 2:
            raise StoreDown("disk full")

    gates = Gates()

    async def main() -> None:
        wf = Workflow([Step("a", lambda c: 1), Step("b", lambda c: 2), Step("slow", gates.step("slow"))])
        with pytest.raises(StoreDown):
            await wf.run(checkpoint_fn=save)
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())
    assert gates.finished == []  # the slow sibling was cancelled, not awaited forever


def test_ready_steps_run_concurrently_and_outputs_map_to_names() -> None:
    gates = Gates()

    async def main() -> WorkflowResult:
        wf = Workflow([Step(n, gates.step(n)) for n in ("x", "y", "z")])
        run = asyncio.create_task(wf.run())
        await until(lambda: len(gates.started) == 3)  # all three in flight at once
        gates.release("z")
        await until(lambda: gates.finished == ["z"])
        gates.release("y", "x")
        return await run

    result = asyncio.run(main())
    assert dict(result.outputs) == {"x": "<x>", "y": "<y>", "z": "<z>"}


def test_blocking_sync_step_runs_in_a_thread_without_stalling_siblings() -> None:
    unblock = threading.Event()
    threads: dict[str, int] = {}

    def blocking(ctx: dict[str, Any]) -> str:
        threads["blocking"] = threading.get_ident()
        assert unblock.wait(timeout=30), "the async sibling never ran"
        return "done"

    async def sibling(ctx: dict[str, Any]) -> str:
        threads["sibling"] = threading.get_ident()
        unblock.set()  # only reachable if the loop is not stalled by `blocking`
        return "ran"

    wf = Workflow([Step("blocking", blocking, blocking=True), Step("sibling", sibling)])
    result = wf.run_sync()
    assert dict(result.outputs) == {"blocking": "done", "sibling": "ran"}
    assert threads["blocking"] != threads["sibling"]


def test_resume_skips_exactly_recorded_steps_and_restores_usage() -> None:
    calls: list[str] = []

    def step(name: str) -> Any:
        def run(ctx: dict[str, Any]) -> Any:
            calls.append(name)
            return PatternResult(name.upper(), cost=TokenUsage(10, 1, 1))

        return run

    wf = Workflow([Step("a", step("a")), Step("b", step("b"), ("a",)), Step("c", step("c"), ("b",))])
    saved: list[WorkflowCheckpoint] = []
    fresh = wf.run_sync({"topic": "t"}, checkpoint_fn=saved.append)
    for cp in saved:
        calls.clear()
        data = json.loads(json.dumps(cp.to_dict()))
        resumed = wf.run_sync(resume_from=WorkflowCheckpoint.from_dict(data))
        assert calls == [n for n in ("a", "b", "c") if n not in cp.outputs]
        assert dict(resumed.outputs) == dict(fresh.outputs)
        assert resumed.cost == fresh.cost
    calls.clear()
    assert dict(wf.run_sync(resume_from=saved[-1]).outputs) == dict(fresh.outputs)
    assert calls == []  # a checkpoint holding every step runs nothing


def test_initial_context_survives_in_the_checkpoint() -> None:
    seen: list[Any] = []
    wf = Workflow([Step("a", lambda c: 1), Step("b", lambda c: seen.append(c.get("topic")) or 2, ("a",))])
    saved: list[WorkflowCheckpoint] = []

    class Stop(Exception):
        pass

    def stop_after_a(cp: WorkflowCheckpoint) -> None:
        saved.append(cp)
        raise Stop

    with pytest.raises(Stop):
        wf.run_sync({"topic": "owls"}, checkpoint_fn=stop_after_a)
    assert dict(saved[0].context) == {"topic": "owls"}
    assert dict(saved[0].outputs) == {"a": 1}
    wf.run_sync(resume_from=saved[0])  # no context passed: the recorded one is used
    wf.run_sync({"topic": "bats"}, resume_from=saved[0])  # a new one wins for what runs now
    assert seen == ["owls", "bats"]


def test_executionkit_checkpoint_dict_resumes_with_context_in_outputs() -> None:
    seen: dict[str, Any] = {}

    def draft(ctx: dict[str, Any]) -> str:
        seen.update(ctx)
        return f"draft of {ctx['outline']} on {ctx['topic']}"

    wf = Workflow([Step("outline", lambda c: "never"), Step("draft", draft, ("outline",))])
    legacy = {
        "step_index": 1,
        "outputs": {"topic": "owls", "outline": "1. intro"},
        "cost": {"input_tokens": 5, "output_tokens": 7, "llm_calls": 1},
    }
    result = wf.run_sync(resume_from=WorkflowCheckpoint.from_dict(legacy))
    assert result.outputs["draft"] == "draft of 1. intro on owls"
    assert result.outputs["outline"] == "1. intro"
    assert result.cost == TokenUsage(5, 7, 1)
    assert seen["topic"] == "owls"


def test_executionkit_shaped_pattern_result_counts_usage() -> None:
    @dataclass(frozen=True)
    class ForeignUsage:
        input_tokens: int
        output_tokens: int
        llm_calls: int

    @dataclass(frozen=True)
    class ForeignResult:  # shaped like executionkit.PatternResult
        value: Any
        cost: ForeignUsage
        score: float | None = None

    @dataclass(frozen=True)
    class NotAResult:
        value: int
        cost: str

    wf = Workflow([
        Step("a", lambda c: ForeignResult("v", ForeignUsage(2, 3, 1))),
        Step("b", lambda c: NotAResult(1, "free")),
    ])
    result = wf.run_sync()
    assert result.outputs["a"] == "v"
    assert result.outputs["b"] == NotAResult(1, "free")
    assert result.cost == TokenUsage(2, 3, 1)


def test_malformed_checkpoint_is_named_and_nothing_runs() -> None:
    ran: list[str] = []
    wf = Workflow([Step("a", lambda c: ran.append("a"))])
    bad = {"step_index": 0, "outputs": {}, "cost": {"input_tokens": 0, "output_tokens": 0}}
    with pytest.raises(CheckpointError, match=r"'cost\.llm_calls'"):
        wf.run_sync(resume_from=bad)
    assert ran == []


@settings(max_examples=40, deadline=None)
@given(dags(max_steps=8), st.data())
def test_random_runs_with_random_cancellation_resume_to_fresh_outputs(
    graph: GraphSpec, data: st.DataObject
) -> None:
    """Random completion orders and a cancellation at a random point, then resume."""

    def make_workflow(log: list[str], gates: Gates | None) -> Workflow:
        def body(name: str) -> Any:
            async def run(ctx: dict[str, Any]) -> str:
                log.append(name)
                for dep in graph.deps[name]:
                    assert dep in ctx, f"{name} started before {dep} finished"
                if gates is not None:
                    await gates.events[name].wait()
                return f"{name}(" + ",".join(ctx[d] for d in sorted(graph.deps[name])) + ")"

            return run

        return Workflow([Step(n, body(n), graph.deps[n]) for n in graph.names])

    fresh = make_workflow([], None).run_sync()
    gates = Gates()
    log: list[str] = []
    saved: list[WorkflowCheckpoint] = []
    releases = data.draw(st.integers(0, len(graph.names)), label="releases before cancel")

    async def interrupted() -> None:
        wf = make_workflow(log, gates)
        run = asyncio.create_task(wf.run(checkpoint_fn=saved.append))
        released: set[str] = set()
        for _ in range(releases):
            await until(lambda: bool(set(log) - released) or run.done())
            waiting = sorted(set(log) - released)
            if not waiting:
                break
            name = data.draw(st.sampled_from(waiting), label="release")
            released.add(name)
            gates.release(name)
        await asyncio.sleep(0)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        assert asyncio.all_tasks() == {asyncio.current_task()}

    if releases < len(graph.names):
        asyncio.run(interrupted())
        last = saved[-1] if saved else None
        resumed_log: list[str] = []
        result = make_workflow(resumed_log, None).run_sync(resume_from=last)
        recorded = set(last.outputs) if last else set()
        assert set(resumed_log) == set(graph.names) - recorded
        assert dict(result.outputs) == dict(fresh.outputs)


def test_a_resume_merges_a_new_initial_context_over_the_recorded_one() -> None:
    seen: list[dict[str, Any]] = []
    wf = Workflow([
        Step("a", lambda c: "A"),
        Step("b", lambda c: seen.append(dict(c)) or "B", ("a",)),
    ])
    saved: list[WorkflowCheckpoint] = []

    class Stop(Exception):
        pass

    def stop_after_a(cp: WorkflowCheckpoint) -> None:
        saved.append(cp)
        raise Stop

    with pytest.raises(Stop):
        wf.run_sync({"tone": "dry", "length": 300}, checkpoint_fn=stop_after_a)
    resumed: list[WorkflowCheckpoint] = []
    result = wf.run_sync({"tone": "warm", "extra": 1}, resume_from=saved[0], checkpoint_fn=resumed.append)
    assert seen == [{"tone": "warm", "length": 300, "extra": 1, "a": "A"}]
    assert dict(resumed[-1].context) == {"tone": "warm", "length": 300, "extra": 1}
    assert result.outputs["a"] == "A"  # a recorded output is never recomputed or changed
