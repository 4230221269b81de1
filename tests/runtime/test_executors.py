"""The default executor's sync-step rule: sync steps in threads, ``inline=True`` on the loop.

Issue 14's case: sync steps that block (most LLM SDK clients are sync) with
a timeout, next to an async step. The sync steps block on a
``threading.Event`` the test sets only after the run, standing for
``time.sleep``: so "still sleeping" is a fact, not a wall-clock guess.
"""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest

from ekit_core import Event, StepFailed, WorkflowCheckpoint
from ekit_runtime import Step, Workflow
from ekit_runtime.executors import BlockingStepWarning, LocalExecutor

TIMEOUT = 0.05
HOLD = 2.0  # how long a blocked sync step waits at most if the test never releases it


class Sleepers:
    """Sync steps that block in their threads until ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.finished: list[str] = []
        self.threads: dict[str, int] = {}

    def step(self, name: str) -> Callable[[dict[str, Any]], str]:
        def run(context: dict[str, Any]) -> str:
            self.threads[name] = threading.get_ident()
            self.release.wait(HOLD)
            self.finished.append(name)
            return f"<{name}>"

        return run


def test_sync_steps_time_out_at_their_deadline_without_blocking_an_async_sibling() -> None:
    sleepers = Sleepers()
    seen_by_async: list[list[str]] = []

    async def quick(context: dict[str, Any]) -> str:
        seen_by_async.append(list(sleepers.finished))
        return "quick"

    workflow = Workflow(
        [Step(f"sync{i}", sleepers.step(f"sync{i}"), timeout=TIMEOUT) for i in range(3)]
        + [Step("async", quick)]
    )
    failed: list[StepFailed] = []
    checkpoints: list[WorkflowCheckpoint] = []

    def trace(event: Event) -> None:
        if isinstance(event, StepFailed):
            failed.append(event)

    with pytest.raises(ExceptionGroup) as caught:
        workflow.run_sync(trace=trace, checkpoint_fn=checkpoints.append)
    # The run ended while every sync step was still blocked in its thread.
    assert sleepers.finished == [] and not sleepers.release.is_set()
    assert all(isinstance(e, TimeoutError) for e in caught.value.exceptions)
    assert sorted(e.name for e in failed) == ["sync0", "sync1", "sync2"]
    assert all(e.error_type.endswith("TimeoutError") for e in failed)  # a TimeoutError subclass
    for event in failed:
        assert event.duration is not None and TIMEOUT <= event.duration < HOLD / 4, event
    # The async sibling ran to success meanwhile, before any sync step returned.
    assert seen_by_async == [[]]
    assert dict(checkpoints[-1].outputs) == {"async": "quick"}
    # Each sync step ran in a pool thread, not on the loop's (this) thread.
    assert threading.get_ident() not in sleepers.threads.values()

    # A timed-out thread cannot be stopped: it runs on, and its result is dropped.
    sleepers.release.set()
    deadline = time.monotonic() + HOLD
    while len(sleepers.finished) < 3:
        assert time.monotonic() < deadline, "the timed-out threads never finished"
        time.sleep(0.001)
    assert sorted(sleepers.finished) == ["sync0", "sync1", "sync2"]
    assert "sync0" not in checkpoints[-1].outputs and set(checkpoints[-1].failures) == {
        "sync0",
        "sync1",
        "sync2",
    }


def test_an_inline_step_runs_on_the_loop_thread_and_a_plain_sync_step_does_not() -> None:
    threads: dict[str, int] = {}

    def record(name: str) -> Callable[[dict[str, Any]], str]:
        def run(context: dict[str, Any]) -> str:
            threads[name] = threading.get_ident()
            return name

        return run

    async def on_loop(context: dict[str, Any]) -> str:
        threads["loop"] = threading.get_ident()
        return "loop"

    workflow = Workflow(
        [
            Step("inline", record("inline"), inline=True),
            Step("threaded", record("threaded")),
            Step("loop", on_loop),
        ]
    )
    result = workflow.run_sync(executor=LocalExecutor(warn_after=60))
    assert dict(result.outputs) == {"inline": "inline", "threaded": "threaded", "loop": "loop"}
    assert threads["inline"] == threads["loop"] == threading.get_ident()
    assert threads["threaded"] != threads["loop"]


def test_a_slow_inline_step_warns_once_per_step_name() -> None:
    executor = LocalExecutor(warn_after=0.01)

    def slow(context: dict[str, Any]) -> str:
        time.sleep(0.02)  # the work being measured: it blocks the loop, as inline steps do
        return "slow"

    def fast(context: dict[str, Any]) -> str:
        return "fast"

    workflow = Workflow(
        [
            Step("slow_a", slow, inline=True),
            Step("slow_b", slow, inline=True, depends_on=("slow_a",)),
            Step("fast", fast, inline=True),
        ]
    )
    with pytest.warns(BlockingStepWarning) as record:
        workflow.run_sync(executor=executor)
        workflow.run_sync(executor=executor)
    messages = sorted(str(w.message) for w in record)
    assert len(messages) == 2, messages
    assert "'slow_a' ran inline" in messages[0] and "'slow_b' ran inline" in messages[1]
    assert "drop inline=True" in messages[0]


def test_a_sync_step_in_a_thread_does_not_warn() -> None:
    def slow(context: dict[str, Any]) -> str:
        time.sleep(0.02)  # as slow as the warned inline step above, but off the loop
        return "slow"

    with warnings.catch_warnings():
        warnings.simplefilter("error", BlockingStepWarning)
        result = Workflow([Step("slow", slow)]).run_sync(executor=LocalExecutor(warn_after=0.01))
    assert result.outputs["slow"] == "slow"


def test_local_executor_refuses_a_bad_pool_size() -> None:
    with pytest.raises(ValueError, match="max_threads"):
        LocalExecutor(max_threads=0)


def test_an_async_step_still_runs_on_the_loop_with_a_timeout() -> None:
    async def waits(context: dict[str, Any]) -> str:
        await asyncio.sleep(HOLD)
        return "late"

    with pytest.raises(TimeoutError):
        Workflow([Step("waits", waits, timeout=TIMEOUT)]).run_sync()


def test_a_sync_lambda_around_an_async_function_moves_to_the_loop_after_its_first_call() -> None:
    threads: list[int] = []

    async def ask(prompt: str) -> str:
        await asyncio.sleep(0)
        return prompt.upper()

    def wrapper(context: Any) -> Any:
        threads.append(threading.get_ident())
        return ask(context["q"])

    loop_thread: list[int] = []

    async def main() -> None:
        loop_thread.append(threading.get_ident())
        executor = LocalExecutor()
        for _ in range(3):
            wf = Workflow([Step("a", wrapper)])
            result = await wf.run({"q": "hi"}, executor=executor)
            assert result.outputs["a"] == "HI"

    asyncio.run(main())
    assert threads[0] != loop_thread[0]  # unknown at first: a thread
    assert threads[1:] == [loop_thread[0], loop_thread[0]]  # then on the loop


def test_a_coroutine_built_in_a_thread_after_cancellation_is_closed_not_leaked() -> None:
    entered, release = threading.Event(), threading.Event()
    built: list[Any] = []

    async def never_awaited() -> str:
        return "x"

    def slow_wrapper(context: Any) -> Any:
        entered.set()
        release.wait(HOLD)
        coroutine = never_awaited()
        built.append(coroutine)
        return coroutine

    executor = LocalExecutor()

    async def main() -> None:
        run = asyncio.create_task(Workflow([Step("a", slow_wrapper)]).run(executor=executor))
        assert await asyncio.to_thread(entered.wait, HOLD)  # the step is in its thread
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run

    asyncio.run(main())
    release.set()
    pool = executor._threads()
    pool.shutdown(wait=True)  # the thread has returned and the done-callback ran
    (coroutine,) = built
    assert coroutine.cr_frame is None  # closed: no "never awaited" warning at collection


def _run_a_sync_step_in_a_fork(conn: Any) -> None:
    result = Workflow([Step("s", lambda context: threading.get_ident())]).run_sync()
    conn.send(result.outputs["s"] != threading.get_ident())  # it ran in a thread of the child
    conn.close()


def test_a_forked_child_runs_sync_steps_with_the_default_executor() -> None:
    import multiprocessing

    Workflow([Step("warm", lambda context: 1)]).run_sync()  # the parent's pool now has a thread
    fork = multiprocessing.get_context("fork")
    parent, child = fork.Pipe()
    process = fork.Process(target=_run_a_sync_step_in_a_fork, args=(child,))
    process.start()
    try:
        assert parent.poll(10), "the forked child's sync step never ran"
        assert parent.recv() is True
    finally:
        process.join(5)
        if process.is_alive():
            process.kill()
    assert process.exitcode == 0
