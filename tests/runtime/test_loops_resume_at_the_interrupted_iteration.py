"""A loop (``repeat=``) run by the runtime: each iteration an attempt unit of its own.

A real run cancelled in the middle of an iteration resumes at that iteration
and pays for no recorded one again; a retry and a question inside an
iteration; a cap that fails the loop naming it; ``until``; a step mapped
over the loop's output; ``keep_last`` keeping the checkpoints bounded.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from ekit_core import LoopError
from ekit_runtime import (
    Done,
    Iteration,
    Repeat,
    RetryPolicy,
    RunWaiting,
    Step,
    Workflow,
    WorkflowCheckpoint,
    ask,
)


async def _first(ctx: Any) -> int:
    return 1


def _json(cp: WorkflowCheckpoint) -> dict[str, Any]:
    return json.loads(json.dumps(cp.to_dict()))


def test_a_run_cancelled_mid_iteration_resumes_at_that_iteration() -> None:
    calls: list[int] = []
    in_third = asyncio.Event()

    async def agent(ctx: Any) -> Any:
        it: Iteration = ctx["agent"]
        calls.append(it.number)
        if it.number == 3 and calls.count(3) == 1:
            in_third.set()
            await asyncio.Event().wait()  # until cancelled
        state = it.previous + it.number
        return Done(state) if it.number == 5 else state

    async def after(ctx: Any) -> Any:
        return ["saw", ctx["agent"]]

    saved: list[WorkflowCheckpoint] = []

    async def interrupted() -> None:
        task = asyncio.ensure_future(workflow.run(checkpoint_fn=saved.append))
        await in_third.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    workflow = Workflow([Step("a", _first),
                         Step("agent", _carrying(agent), ("a",), repeat=Repeat(10)),
                         Step("z", after, ("agent",))])
    asyncio.run(interrupted())
    last = _json(saved[-1])
    assert [k for k in (1, 2, 3) if f"agent#{k}" in last["outputs"]] == [1, 2]
    assert calls == [1, 2, 3]
    result = workflow.run_sync(resume_from=last)
    assert calls == [1, 2, 3, 3, 4, 5], "a recorded iteration ran again, or one was skipped"
    assert result.outputs["agent"] == 1 + 1 + 2 + 3 + 4 + 5
    assert result.outputs["z"] == ["saw", 16]
    assert "agent#3" not in result.outputs  # (iterations, as items, are in the checkpoint)
    assert result.checkpoint.outputs["agent#5"] == 16


def _carrying(body: Any) -> Any:
    """``body`` with the first iteration's ``previous`` taken from ``a``'s output."""
    async def run(ctx: Any) -> Any:
        it: Iteration = ctx["agent"]
        if it.previous is None:
            ctx = {**ctx, "agent": Iteration(it.number, ctx["a"])}
        return await body(ctx)
    return run


def test_a_retry_and_a_question_inside_an_iteration() -> None:
    calls: list[tuple[int, str]] = []

    def agent(ctx: Any) -> Any:
        it: Iteration = ctx["agent"]
        calls.append((it.number, "start"))
        if it.number == 2 and calls.count((2, "start")) == 1:
            raise ConnectionError("flaky")
        if it.number == 3:
            reply = ask("continue?")
            return Done(f"{it.previous}+{reply}")
        return f"{it.previous}>{it.number}"

    workflow = Workflow([Step("agent", agent, repeat=Repeat(5),
                              retry=RetryPolicy(max_attempts=2, backoff_base=0))])
    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(RunWaiting):
        workflow.run_sync(checkpoint_fn=saved.append)
    assert calls == [(1, "start"), (2, "start"), (2, "start"), (3, "start")]
    result = workflow.run_sync(resume_from=_json(saved[-1]), answers={"agent#3": "yes"})
    assert result.outputs["agent"] == "None>1>2+yes"
    assert calls[4:] == [(3, "start")], "only the waiting iteration runs again"


def test_a_loop_that_never_says_it_is_done_fails_at_its_cap_naming_the_step() -> None:
    calls: list[int] = []

    def agent(ctx: Any) -> int:
        calls.append(ctx["agent"].number)
        return ctx["agent"].number

    workflow = Workflow([Step("agent", agent, repeat=Repeat(3))])
    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(LoopError, match=r"step 'agent' did not end within repeat=3"):
        workflow.run_sync(checkpoint_fn=saved.append)
    assert calls == [1, 2, 3]
    assert saved[-1].failures["agent"].error_type == "LoopError"
    with pytest.raises(LoopError):  # a resume fails again, paying for no iteration
        workflow.run_sync(resume_from=_json(saved[-1]))
    assert calls == [1, 2, 3]


def test_until_ends_the_loop_and_a_mapped_step_runs_over_its_output() -> None:
    def agent(ctx: Any) -> list[str]:
        return [*(ctx["agent"].previous or []), f"n{ctx['agent'].number}"]

    def shout(ctx: Any) -> str:
        return str(ctx["agent"]).upper()

    workflow = Workflow([
        Step("agent", agent, repeat=Repeat(10, until=lambda out: len(out) == 3)),
        Step("shout", shout, ("agent",), map_over="agent"),
    ])
    result = workflow.run_sync()
    assert result.outputs["agent"] == ["n1", "n2", "n3"]
    assert result.outputs["shout"] == ["N1", "N2", "N3"]


def test_keep_last_keeps_a_long_loops_checkpoints_bounded() -> None:
    def agent(ctx: Any) -> Any:
        it: Iteration = ctx["agent"]
        return Done(it.number) if it.number == 60 else "x" * 100

    workflow = Workflow([Step("agent", agent, repeat=Repeat(100, keep_last=2))])
    saved: list[WorkflowCheckpoint] = []
    result = workflow.run_sync(checkpoint_fn=saved.append)
    assert result.outputs["agent"] == 60
    sizes = [len(json.dumps(cp.to_dict())) for cp in saved]
    assert max(sizes[10:]) - min(sizes[10:]) < 100, sizes
    assert result.checkpoint.compacted == {"agent": 58}
    assert sorted(n for n in result.checkpoint.outputs if "#" in n) == ["agent#59", "agent#60"]


def test_an_iteration_is_named_apart_from_items_when_built() -> None:
    with pytest.raises(ValueError, match="named like an iteration"):
        Workflow([Step("agent", _first, repeat=Repeat(2)), Step("agent#1", _first)])


def test_progress_and_events_name_each_iteration_and_a_rewind_reruns_from_one() -> None:
    import io

    from ekit_core import rewind
    from ekit_core.events import StepFinished, StepStarted
    from ekit_runtime import ProgressPrinter

    calls: list[int] = []

    def agent(ctx: Any) -> Any:
        it: Iteration = ctx["agent"]
        calls.append(it.number)
        return Done(it.number) if it.number == 4 else it.number

    workflow = Workflow([Step("agent", agent, repeat=Repeat(6)),
                         Step("after", lambda ctx: ctx["agent"] * 10, ("agent",))])
    events: list[Any] = []
    log = io.StringIO()
    printer = ProgressPrinter(log)

    def trace(event: Any) -> None:
        events.append(event)
        printer(event)

    result = workflow.run_sync(trace=trace)
    assert [e.name for e in events if isinstance(e, StepStarted)] == [
        "agent#1", "agent#2", "agent#3", "agent#4", "after"]
    assert [e.name for e in events if isinstance(e, StepFinished)][-2:] == ["agent", "after"]
    assert "agent#3" in log.getvalue() and "run finished: 6/6 steps" in log.getvalue()
    # Rewound to iteration 3: it, what follows it and what needs the loop run again.
    rewound = rewind(workflow, result.checkpoint, "agent#3")
    assert sorted(n for n in rewound.outputs) == ["agent#1", "agent#2"]
    again = workflow.run_sync(resume_from=_json(rewound))
    assert calls == [1, 2, 3, 4, 3, 4] and again.outputs["after"] == 40


def test_an_until_that_raises_fails_that_attempt_and_a_bad_repeat_is_refused() -> None:
    asked: list[int] = []

    def until(output: int) -> bool:
        asked.append(output)
        if len(asked) == 1:
            raise RuntimeError("until broke")
        return output >= 2

    workflow = Workflow([Step("agent", lambda ctx: ctx["agent"].number,
                              repeat=Repeat(5, until=until),
                              retry=RetryPolicy(max_attempts=2, backoff_base=0))])
    result = workflow.run_sync()
    assert result.outputs["agent"] == 2 and asked == [1, 1, 2]
    assert result.checkpoint.failures["agent#1"].message == "until broke"
    with pytest.raises(ValueError, match="max_iterations"):
        Repeat(0)
    with pytest.raises(ValueError, match="repeat cannot be combined with map_over"):
        Workflow([Step("a", _first), Step("b", _first, ("a",), map_over="a", repeat=Repeat(2))])
