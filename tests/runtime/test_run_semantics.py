"""Scheduling and failure semantics carried out by the runtime.

Eager starts, max_concurrency, failures, cancellation, retries and timeouts,
budgets and approval. Completion order is controlled with gates, never with
wall-clock sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from ekit_runtime import (
    Approval,
    ApprovalDenied,
    BudgetExceeded,
    PatternResult,
    RetryPolicy,
    Step,
    TokenUsage,
    Workflow,
    WorkflowCheckpoint,
)
from tests.support.helpers import Gates, until


def test_a_step_starts_when_its_own_dependencies_finish() -> None:
    gates = Gates()
    wf = Workflow([
        Step("fast", gates.step("fast")),
        Step("slow", gates.step("slow")),
        Step("after_fast", gates.step("after_fast"), ("fast",)),
    ])
    saved: list[WorkflowCheckpoint] = []

    async def main() -> None:
        run = asyncio.create_task(wf.run(checkpoint_fn=saved.append))
        await until(lambda: len(gates.started) == 2)
        gates.release("fast")
        await until(lambda: "after_fast" in gates.started)
        assert "slow" in gates.running()  # it did not wait for its unrelated sibling
        assert [c.step_index for c in saved] == [1]
        gates.release("after_fast", "slow")
        await run

    asyncio.run(main())
    assert saved[-1].step_index == 3


def test_max_concurrency_bounds_steps_in_flight() -> None:
    gates = Gates()
    names = [f"s{i}" for i in range(7)]
    wf = Workflow([Step(n, gates.step(n)) for n in names])
    peak = 0

    async def main() -> None:
        nonlocal peak
        run = asyncio.create_task(wf.run(max_concurrency=3))
        released = 0
        while released < len(names):
            expected = min(3, len(names) - released)
            await until(lambda n=expected: len(gates.running()) == n)
            peak = max(peak, len(gates.running()))
            # Declaration order decides who starts first.
            assert gates.started == names[: len(gates.started)]
            gates.release(names[released])
            released += 1
            await until(lambda n=released: len(gates.finished) == n)
        await run

    asyncio.run(main())
    assert peak == 3


class Broken(Exception):
    pass


def test_a_failure_lets_siblings_finish_saves_them_then_raises_the_step_error() -> None:
    gates = Gates()

    async def fails(ctx: dict[str, Any]) -> None:
        await gates.events["fail"].wait()
        raise Broken("model returned garbage")

    wf = Workflow([
        Step("sibling", gates.step("sibling")),
        Step("bad", fails),
        Step("later", gates.step("later"), ("bad",)),
        Step("after_sibling", gates.step("after_sibling"), ("sibling", "bad")),
    ])
    saved: list[WorkflowCheckpoint] = []

    async def main() -> None:
        run = asyncio.create_task(wf.run(checkpoint_fn=saved.append))
        await until(lambda: "sibling" in gates.started)
        gates.release("fail")
        await until(lambda: bool(saved))
        assert not run.done()  # the sibling is still in flight
        gates.release("sibling")
        with pytest.raises(Broken) as info:
            await run
        assert any("step 'bad'" in note for note in info.value.__notes__)

    asyncio.run(main())
    final = saved[-1]
    assert dict(final.outputs) == {"sibling": "<sibling>"}
    record = final.failures["bad"]
    assert (record.error_type, record.message, record.attempts) == ("Broken", "model returned garbage", 1)
    assert "later" not in gates.started and "after_sibling" not in gates.started
    # The failure is not an output: resuming runs "bad" again, and not "sibling".
    calls: list[str] = []
    fixed = Workflow([
        Step("sibling", lambda c: calls.append("sibling")),
        Step("bad", lambda c: calls.append("bad") or "ok"),
        Step("later", lambda c: "L", ("bad",)),
        Step("after_sibling", lambda c: "A", ("sibling", "bad")),
    ])
    result = fixed.run_sync(resume_from=final)
    assert calls == ["bad"] and result.outputs["sibling"] == "<sibling>"


def test_several_failures_raise_an_exception_group() -> None:
    gates = Gates()

    def failing(name: str) -> Any:
        async def run(ctx: dict[str, Any]) -> None:
            await gates.events[name].wait()
            raise Broken(name)

        return run

    wf = Workflow([Step("x", failing("x")), Step("y", failing("y"))])

    async def main() -> None:
        run = asyncio.create_task(wf.run())
        await asyncio.sleep(0)
        gates.release("x", "y")
        with pytest.raises(ExceptionGroup) as info:
            await run
        assert sorted(str(e) for e in info.value.exceptions) == ["x", "y"]
        assert "'x'" in str(info.value) and "'y'" in str(info.value)
        assert info.value.subgroup(Broken) is not None

    asyncio.run(main())


def test_cancelling_run_saves_finished_work_and_leaves_no_tasks() -> None:
    gates = Gates()
    wf = Workflow([
        Step("done", gates.step("done")),
        Step("busy", gates.step("busy")),
        Step("next", gates.step("next"), ("done",)),
    ])
    saved: list[WorkflowCheckpoint] = []
    save_cancelled: list[bool] = []

    async def slow_save(cp: WorkflowCheckpoint) -> None:
        try:
            for _ in range(5):
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            save_cancelled.append(True)
            raise
        saved.append(cp)

    async def main() -> None:
        run = asyncio.create_task(wf.run(checkpoint_fn=slow_save))
        await until(lambda: len(gates.started) == 2)
        gates.release("done")
        await until(lambda: bool(saved))
        await until(lambda: "next" in gates.started)
        run.cancel()
        await asyncio.sleep(0)
        run.cancel()  # a second cancel while the final save runs must not cut it off
        with pytest.raises(asyncio.CancelledError):
            await run
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())
    assert save_cancelled == []
    final = saved[-1]
    assert dict(final.outputs) == {"done": "<done>"}
    assert "busy" not in final.failures  # cancellation is not a failure
    assert gates.finished == ["done"]


@pytest.mark.parametrize("sibling", [False, True])
def test_cancelling_run_is_not_lost_when_a_step_swallows_its_cancellation(sibling: bool) -> None:
    """The runner awaits a lone task directly, so asyncio hands the run's
    cancellation to the step; a step that swallows it must not make the run
    go on to the next step (nor return as if it had finished). With a
    sibling in flight the runner waits on its own future instead: the same."""
    started: list[str] = []

    async def waits(ctx: dict[str, Any]) -> str:
        await asyncio.Event().wait()
        return "never"

    async def swallows(ctx: dict[str, Any]) -> str:
        run.cancel()  # the run is cancelled while it awaits this step alone
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return "stopped"
        return "never"

    async def after(ctx: dict[str, Any]) -> str:
        started.append("after")
        return "after"

    steps = [Step("slow", swallows), Step("after", after, ("slow",))]
    wf = Workflow([Step("sibling", waits), *steps] if sibling else steps)
    saved: list[WorkflowCheckpoint] = []
    run: asyncio.Task[Any]

    async def main() -> None:
        nonlocal run
        run = asyncio.create_task(wf.run(checkpoint_fn=saved.append))
        with pytest.raises(asyncio.CancelledError):
            await run

    asyncio.run(main())
    assert started == []
    assert dict(saved[-1].outputs) == {"slow": "stopped"}  # what it returned is kept


def test_keyboard_interrupt_in_a_step_saves_a_final_checkpoint() -> None:
    saved: list[WorkflowCheckpoint] = []

    def interrupt(ctx: dict[str, Any]) -> None:
        raise KeyboardInterrupt

    wf = Workflow([Step("a", lambda c: 1), Step("b", interrupt, ("a",))])
    with pytest.raises(KeyboardInterrupt):
        wf.run_sync(checkpoint_fn=saved.append)
    assert dict(saved[-1].outputs) == {"a": 1}


def test_retries_are_decided_by_policy_and_visible_in_the_checkpoint() -> None:
    delays: list[float] = []

    async def fake_sleep(delay: float) -> None:
        delays.append(delay)  # the delay the core chose, not waited for

    attempts: list[int] = []

    def flaky(ctx: dict[str, Any]) -> str:
        attempts.append(len(attempts) + 1)
        if len(attempts) < 3:
            raise ConnectionError(f"attempt {len(attempts)}")
        return "ok"

    policy = RetryPolicy(max_attempts=4, backoff_base=0.5, backoff_cap=0.75, retry_on=(ConnectionError,))
    wf = Workflow([Step("flaky", flaky, retry=policy)])
    saved: list[WorkflowCheckpoint] = []
    state = asyncio.run(wf.runner(checkpoint_fn=saved.append, sleep=fake_sleep).run())
    assert state.outputs["flaky"] == "ok"
    assert attempts == [1, 2, 3]
    assert delays == [0.5, 0.75]
    assert [(c.failures["flaky"].attempts, c.failures["flaky"].message) for c in saved[:2]] == [
        (1, "attempt 1"),
        (2, "attempt 2"),
    ]
    assert saved[-1].outputs["flaky"] == "ok"


def test_errors_outside_retry_on_are_not_retried() -> None:
    attempts: list[int] = []

    def wrong(ctx: dict[str, Any]) -> None:
        attempts.append(1)
        raise KeyError("not retryable")

    wf = Workflow([Step("s", wrong, retry=RetryPolicy(max_attempts=5, retry_on=(ConnectionError,)))])
    with pytest.raises(KeyError):
        wf.run_sync()
    assert attempts == [1]


def test_a_timeout_is_a_failure_the_policy_retries() -> None:
    attempts: list[int] = []

    async def hangs_once(ctx: dict[str, Any]) -> str:
        attempts.append(1)
        if len(attempts) == 1:
            await asyncio.Event().wait()  # never set: only the timeout ends it
        return "second time lucky"

    wf = Workflow([
        Step("s", hangs_once, timeout=0.05, retry=RetryPolicy(max_attempts=2, backoff_base=0)),
    ])
    saved: list[WorkflowCheckpoint] = []
    assert wf.run_sync(checkpoint_fn=saved.append).outputs["s"] == "second time lucky"
    assert saved[0].failures["s"].error_type == "StepTimeoutError"  # a TimeoutError subclass
    single = Workflow([Step("s", lambda c: asyncio.Event().wait(), timeout=0.05)])
    with pytest.raises(TimeoutError):
        single.run_sync()


def test_budget_stops_new_starts_and_a_larger_budget_finishes_the_run() -> None:
    calls: list[str] = []

    def llm(name: str) -> Any:
        def run(ctx: dict[str, Any]) -> Any:
            calls.append(name)
            return PatternResult(name, cost=TokenUsage(100, 50, 1))

        return run

    names = ["a", "b", "c", "d"]
    wf = Workflow([Step(n, llm(n), (names[i - 1],) if i else ()) for i, n in enumerate(names)])
    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(BudgetExceeded) as info:
        wf.run_sync(checkpoint_fn=saved.append, budget=TokenUsage(output_tokens=100))
    assert isinstance(info.value.checkpoint, WorkflowCheckpoint)
    assert calls == ["a", "b"]
    assert info.value.checkpoint.step_index == 2 and info.value.cost == TokenUsage(200, 100, 2)
    assert info.value.checkpoint == saved[-1]
    calls.clear()
    result = wf.run_sync(resume_from=info.value.checkpoint, budget=TokenUsage(output_tokens=1000))
    assert calls == ["c", "d"]
    assert result.cost == TokenUsage(400, 200, 4)


def test_approval_denial_stops_the_run_resumably() -> None:
    asked: list[tuple[str, Mapping[str, Any]]] = []

    async def approve(name: str, metadata: Mapping[str, Any]) -> Approval:
        asked.append((name, dict(metadata)))
        await asyncio.sleep(0)
        return Approval.deny("needs a human") if metadata.get("costly") else Approval.allow()

    wf = Workflow([
        Step("cheap", lambda c: 1),
        Step("costly", lambda c: 2, ("cheap",), metadata={"costly": True}),
        Step("last", lambda c: 3, ("costly",)),
    ])
    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(ApprovalDenied) as info:
        wf.run_sync(checkpoint_fn=saved.append, approval=approve)
    assert (info.value.step, info.value.reason) == ("costly", "needs a human")
    assert "costly" not in info.value.checkpoint.outputs
    assert dict(info.value.checkpoint.outputs) == {"cheap": 1}
    assert asked == [("cheap", {}), ("costly", {"costly": True})]
    result = wf.run_sync(resume_from=info.value.checkpoint, approval=lambda name, meta: True)
    assert dict(result.outputs) == {"cheap": 1, "costly": 2, "last": 3}


def test_an_approval_callback_returning_junk_is_a_clear_error() -> None:
    wf = Workflow([Step("a", lambda c: 1)])
    with pytest.raises(ValueError, match="expected a bool or an Approval"):
        wf.run_sync(approval=lambda name, meta: "yes")


def test_trace_callback_errors_do_not_corrupt_the_run() -> None:
    from ekit_runtime import TraceCallbackWarning

    def bad_trace(event: object) -> None:
        raise RuntimeError("tracer down")

    wf = Workflow([Step("a", lambda c: 1), Step("b", lambda c: 2, ("a",))])
    with pytest.warns(TraceCallbackWarning, match="tracer down"):
        result = wf.run_sync(trace=bad_trace)
    assert dict(result.outputs) == {"a": 1, "b": 2}


def test_a_halt_cancels_an_attempt_waiting_out_its_retry_delay() -> None:
    release_bad = asyncio.Event()
    attempts: list[int] = []

    async def flaky(ctx: dict[str, Any]) -> str:
        attempts.append(1)
        raise ConnectionError("try later")

    async def bad(ctx: dict[str, Any]) -> None:
        await release_bad.wait()
        raise Broken("fatal")

    # The retry would wait 1000 s: the test only ends quickly if the halt
    # caused by "bad" cancels that wait instead of sleeping it out.
    policy = RetryPolicy(max_attempts=3, backoff_base=1000, backoff_cap=1000)
    wf = Workflow([Step("flaky", flaky, retry=policy), Step("bad", bad)])
    saved: list[WorkflowCheckpoint] = []

    async def main() -> None:
        run = asyncio.create_task(wf.run(checkpoint_fn=saved.append))
        # Once the failure is saved, the retry attempt is in flight, sleeping.
        await until(lambda: bool(saved) and "flaky" in saved[-1].failures)
        release_bad.set()
        with pytest.raises(Broken):
            await asyncio.wait_for(run, timeout=5)
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())
    assert attempts == [1]
    assert saved[-1].failures["flaky"].attempts == 1
    assert saved[-1].failures["bad"].error_type == "Broken"
    assert "flaky" not in saved[-1].outputs
