"""The runner launches steps by name, so it can drive a graph that grows while it runs.

``Runner.add_steps`` is the shell's side of :func:`ekit_core.growth.add_steps`:
steps added mid-run start as soon as their dependencies are recorded, even
when nothing else is in flight, their outputs reach the checkpoint under the
grown graph's fingerprint, and a resume with the grown workflow skips them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ekit_core import GraphError, TransitionError
from ekit_runtime import Step, Workflow, WorkflowCheckpoint


def _echo(name: str) -> Any:
    async def body(ctx: Any) -> str:
        return f"{name}({','.join(sorted(k for k in ctx if k != 'topic'))})"

    return body


def _grown(first: list[Step], added: list[Step], *, when: int) -> tuple[Any, list[WorkflowCheckpoint]]:
    saved: list[WorkflowCheckpoint] = []

    async def main() -> Any:
        runner = Workflow(first).runner(checkpoint_fn=saved.append)
        seen = 0
        async for _ in runner.states():
            seen += 1
            if seen == when:
                runner.add_steps(added)
        return runner

    return asyncio.run(main()), saved


def test_steps_added_mid_run_run_after_their_dependencies_and_are_checkpointed() -> None:
    first = [Step("a", _echo("a")), Step("b", _echo("b"), ("a",))]
    added = [Step("c", _echo("c"), ("a",), context="dependencies"),
             Step("d", _echo("d"), ("b", "c"), context="dependencies")]
    runner, saved = _grown(first, added, when=1)
    assert runner.state.outcome == "finished"
    assert dict(runner.state.outputs) == {"a": "a()", "b": "b(a)", "c": "c(a)", "d": "d(b,c)"}
    grown = Workflow([*first, *added])
    assert saved[-1].graph.fingerprint == grown.graph.fingerprint
    assert [s.name for s in runner.steps] == ["a", "b", "c", "d"]
    ran: list[str] = []
    again = Workflow([Step(s.name, lambda ctx, n=s.name: ran.append(n), s.depends_on) for s in grown.steps])
    assert again.run_sync(resume_from=saved[-1]).outputs["d"] == "d(b,c)"
    assert ran == []  # every added step is recorded: the resume pays for none


def test_a_step_added_when_nothing_is_in_flight_still_starts() -> None:
    # After the lone step 'a' the run waits on nothing; the added step is all there is.
    gate = asyncio.Event()

    async def main() -> Any:
        async def a(ctx: Any) -> str:
            return "a"

        async def waits(ctx: Any) -> str:
            await gate.wait()
            return "w"

        runner = Workflow([Step("a", a), Step("w", waits)]).runner()
        async for state in runner.states():
            if "a" in state.outputs and "late" not in state.graph.index:
                runner.add_steps([Step("late", _echo("late"), ("a",))])
                gate.set()
        return runner

    runner = asyncio.run(main())
    assert runner.state.outcome == "finished"
    assert runner.state.outputs["late"].startswith("late(")


def test_bad_additions_change_nothing() -> None:
    async def main() -> None:
        runner = Workflow([Step("a", _echo("a")), Step("b", _echo("b"), ("a",))]).runner()
        async for state in runner.states():
            if state.settled:
                continue
            before = runner.state
            with pytest.raises(GraphError, match="already in the graph"):
                runner.add_steps([Step("a", _echo("a"))])
            with pytest.raises(GraphError):
                runner.add_steps([Step("x", _echo("x"), ("y",)), Step("y", _echo("y"), ("x",))])
            with pytest.raises(ValueError, match=r"steps\[0\] must be a Step"):
                runner.add_steps(["c"])  # type: ignore[list-item]
            assert runner.state is before and [s.name for s in runner.steps] == ["a", "b"]
        with pytest.raises(TransitionError, match="settled"):
            runner.add_steps([Step("z", _echo("z"))])

    asyncio.run(main())
