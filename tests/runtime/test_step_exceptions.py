"""Whatever a step raises, finished work reaches the final checkpoint.

Each family here once lost work or looped: a ``BaseException`` that is not an
``Exception`` finishing beside a sibling, a failure message no store can
encode, a step raising ``CancelledError`` itself, a final save that raises on
a failed run, and a step finishing while the run is being cancelled. Every
step runs both ways the runner can start it: as its own task (a plain async
step) and wrapped (a timeout set), since those read outcomes differently.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import (
    JournalStore,
    JsonFileStore,
    RetryPolicy,
    SqliteStore,
    Step,
    StepCancelledError,
    Workflow,
    WorkflowCheckpoint,
)
from tests.support.helpers import Gates, until

WRAPPED = [None, 30.0]  # timeout=None runs the coroutine as the task; a timeout wraps it


class Custom(BaseException):
    """A BaseException that is neither an Exception nor one asyncio treats specially."""


def _together(
    names: list[str], release: asyncio.Event, bodies: dict[str, Callable[[], Any]]
) -> dict[str, Callable[[dict[str, Any]], Any]]:
    """Steps that all wait on one event, so that they finish in the same loop turn."""

    def make(name: str) -> Callable[[dict[str, Any]], Any]:
        async def run(context: dict[str, Any]) -> Any:
            await release.wait()
            return bodies[name]()

        return run

    return {n: make(n) for n in names}


@pytest.mark.parametrize("timeout", WRAPPED)
@pytest.mark.parametrize("raiser_first", [True, False])
@pytest.mark.parametrize("error", [Custom, GeneratorExit])
def test_a_base_exception_beside_a_sibling_keeps_the_sibling_output(
    timeout: float | None, raiser_first: bool, error: type[BaseException]
) -> None:
    def boom() -> Any:
        raise error("step gave up")

    bodies: dict[str, Callable[[], Any]] = {"raiser": boom, "good": lambda: "kept"}
    for i in range(3):  # more siblings, so the raiser is neither only first nor only last
        bodies[f"good{i}"] = lambda i=i: f"kept{i}"
    order = ["raiser", "good", "good0", "good1", "good2"]
    if not raiser_first:
        order = [*order[1:], "raiser"]
    saved: list[WorkflowCheckpoint] = []

    async def main() -> None:
        release = asyncio.Event()
        fns = _together(order, release, bodies)
        wf = Workflow([Step(n, fns[n], timeout=timeout) for n in order])
        run = asyncio.create_task(wf.run(checkpoint_fn=saved.append))
        await asyncio.sleep(0)
        release.set()
        with pytest.raises(error):
            await run

    asyncio.run(main())
    final = saved[-1]
    assert dict(final.outputs) == {"good": "kept", **{f"good{i}": f"kept{i}" for i in range(3)}}
    assert "raiser" not in final.outputs and "raiser" not in final.failures


@pytest.mark.parametrize("timeout", WRAPPED)
def test_a_base_exception_keeps_outputs_of_every_finished_step_across_turns(
    timeout: float | None,
) -> None:
    # A chain step finishes a turn earlier; a sibling finishes in the same turn
    # as the raiser; a third is still running and is interrupted.
    gates = Gates()

    async def raiser(context: dict[str, Any]) -> Any:
        await gates.events["go"].wait()
        raise Custom("gone")

    async def sibling(context: dict[str, Any]) -> str:
        await gates.events["go"].wait()
        return "sib"

    saved: list[WorkflowCheckpoint] = []
    wf = Workflow([
        Step("first", gates.step("first"), timeout=timeout),
        Step("raiser", raiser, ("first",), timeout=timeout),
        Step("sibling", sibling, ("first",), timeout=timeout),
        Step("slow", gates.step("slow"), ("first",), timeout=timeout),
    ])

    async def main() -> None:
        run = asyncio.create_task(wf.run(checkpoint_fn=saved.append))
        await until(lambda: "first" in gates.started)
        gates.release("first")
        await until(lambda: "slow" in gates.started)
        gates.release("go")
        with pytest.raises(Custom):
            await run

    asyncio.run(main())
    assert dict(saved[-1].outputs) == {"first": "<first>", "sibling": "sib"}
    resumed: list[str] = []

    def recording(name: str) -> Callable[[Any], str]:
        def run(context: Any) -> str:
            resumed.append(name)
            return name

        return run

    again = Workflow([
        Step("first", recording("first")),
        *(Step(n, recording(n), ("first",)) for n in ("raiser", "sibling", "slow")),
    ])
    again.run_sync(resume_from=saved[-1])
    assert sorted(resumed) == ["raiser", "slow"]


def _raise_generator_exit(context: Any) -> None:
    raise GeneratorExit("step gave up")


async def _async_raise_generator_exit(context: Any) -> None:
    await asyncio.sleep(0)
    raise GeneratorExit("step gave up")


@pytest.mark.parametrize("timeout", WRAPPED)
@pytest.mark.parametrize("body", [_raise_generator_exit, _async_raise_generator_exit])
@pytest.mark.parametrize("driver", ["run_sync", "awaited", "iterate"])
def test_a_generator_exit_from_the_only_step_in_flight_ends_the_run_as_itself(
    timeout: float | None, body: Callable[[Any], Any], driver: str
) -> None:
    """With one task in flight the runner awaits it directly, and asyncio throws
    the step's GeneratorExit into the task driving the run, which makes Python
    close the run's coroutines: the run must still end by that GeneratorExit,
    not by "coroutine ignored GeneratorExit" (or, iterating, by "asynchronous
    generator is already running"), with what finished saved."""
    saved: list[WorkflowCheckpoint] = []
    wf = Workflow([
        Step("first", lambda context: "done"),
        Step("raiser", body, ("first",), timeout=timeout),
    ])

    async def awaited() -> None:
        await wf.run(checkpoint_fn=saved.append)

    async def iterated() -> None:
        async with contextlib.aclosing(wf.iterate(checkpoint_fn=saved.append)) as states:
            async for _ in states:
                pass

    with pytest.raises(GeneratorExit, match="step gave up"):
        if driver == "run_sync":  # the run's own coroutine is the task's
            wf.run_sync(checkpoint_fn=saved.append)
        else:
            asyncio.run(awaited() if driver == "awaited" else iterated())
    assert dict(saved[-1].outputs) == {"first": "done"}
    assert "raiser" not in saved[-1].failures  # not the step's failure: a resume runs it again


BAD_NAME = "report-\udc80.txt"  # what os.listdir returns for a name that is not UTF-8


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[Callable[[str], Any]]:
    made: list[Any] = []

    def make(kind: str) -> Any:
        store = {
            "list": lambda: None,
            "json": lambda: JsonFileStore(tmp_path / "run.json"),
            "journal": lambda: JournalStore(tmp_path / "run.jsonl"),
            "sqlite": lambda: SqliteStore(tmp_path / "run.db", run_id="r"),
        }[kind]()
        made.append(store)
        return store

    yield make
    for store in made:
        if hasattr(store, "close"):
            store.close()


@pytest.mark.parametrize("store_kind", ["list", "json", "journal", "sqlite"])
@pytest.mark.parametrize("timeout", WRAPPED)
def test_a_failure_message_no_store_can_encode_is_escaped_and_retried(
    make_store: Callable[[str], Any], store_kind: str, timeout: float | None
) -> None:
    store = make_store(store_kind)
    saved: list[WorkflowCheckpoint] = []
    attempts: list[int] = []

    async def flaky(context: dict[str, Any]) -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise OSError(f"cannot open {BAD_NAME}")
        return "read"

    async def sibling(context: dict[str, Any]) -> str:
        return "sib"

    def save(cp: WorkflowCheckpoint) -> None:
        saved.append(cp)
        if store is not None:
            store(cp)

    policy = RetryPolicy(max_attempts=3, backoff_base=0.0)
    wf = Workflow([
        Step("flaky", flaky, retry=policy, timeout=timeout),
        Step("sibling", sibling, timeout=timeout),
    ])
    result = wf.run_sync(checkpoint_fn=save)
    assert dict(result.outputs) == {"flaky": "read", "sibling": "sib"}
    assert len(attempts) == 3  # the policy's attempts all happened
    record = saved[1].failures["flaky"]
    assert record.message == "cannot open report-\\udc80.txt" and record.error_type == "OSError"
    assert "sibling" in saved[0].outputs or "sibling" in saved[1].outputs
    if store is not None:
        loaded = store.load()
        assert dict(loaded.outputs) == dict(result.outputs)
        assert loaded.failures["flaky"].attempts == 2


@pytest.mark.parametrize("store_kind", ["json", "journal", "sqlite"])
def test_a_final_unencodable_failure_is_stored_and_raised_as_the_step_error(
    make_store: Callable[[str], Any], store_kind: str
) -> None:
    store = make_store(store_kind)

    def broken(context: dict[str, Any]) -> str:
        raise OSError(f"cannot open {BAD_NAME}")

    class Weird(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text for you")

    def weirder(context: dict[str, Any]) -> str:
        raise Weird()

    wf = Workflow([Step("broken", broken), Step("weird", weirder), Step("fine", lambda c: 1)])
    with pytest.raises(ExceptionGroup) as info:
        wf.run_sync(checkpoint_fn=store)
    assert {type(e) for e in info.value.exceptions} == {OSError, Weird}
    loaded = store.load()
    assert loaded.outputs == {"fine": 1}
    assert loaded.failures["broken"].message == "cannot open report-\\udc80.txt"
    assert "unprintable Weird" in loaded.failures["weird"].message


def test_a_loaded_failure_record_with_a_lone_surrogate_can_be_saved_again(tmp_path: Path) -> None:
    # JSON can spell a lone surrogate as an escape; what the parser returns
    # must still reach every store.
    data = {"step_index": 0, "outputs": {}, "cost": {"input_tokens": 0, "output_tokens": 0,
            "llm_calls": 0}, "failures": {"a": {"error_type": "E", "message": "x\udc80"}}}
    checkpoint = WorkflowCheckpoint.from_dict(data)
    assert checkpoint.failures["a"].message == "x\\udc80"
    store = JournalStore(tmp_path / "j.jsonl")
    store(checkpoint)
    assert store.load() == checkpoint


@pytest.mark.parametrize("timeout", WRAPPED)
@pytest.mark.parametrize("max_attempts", [1, 3])
def test_a_step_raising_cancelled_error_itself_fails_by_its_policy(
    timeout: float | None, max_attempts: int
) -> None:
    calls: list[int] = []
    saved: list[WorkflowCheckpoint] = []

    async def self_cancelling(context: dict[str, Any]) -> str:
        calls.append(1)
        raise asyncio.CancelledError("the client gave up on its own")

    wf = Workflow([
        Step("sc", self_cancelling, timeout=timeout,
             retry=RetryPolicy(max_attempts=max_attempts, backoff_base=0.0)),
        Step("other", lambda c: "o"),
    ])
    with pytest.raises(StepCancelledError, match="'sc' raised CancelledError") as info:
        wf.run_sync(checkpoint_fn=saved.append)
    assert len(calls) == max_attempts  # never restarted beyond its policy
    assert isinstance(info.value.__cause__, asyncio.CancelledError)
    assert len(saved) <= max_attempts + 2
    final = saved[-1]
    assert final.outputs == {"other": "o"}
    assert final.failures["sc"].error_type == "StepCancelledError"
    assert final.failures["sc"].attempts == max_attempts


def test_a_self_cancelling_step_that_recovers_on_retry_finishes_the_run() -> None:
    calls: list[int] = []

    async def once(context: dict[str, Any]) -> str:
        calls.append(1)
        if len(calls) == 1:
            raise asyncio.CancelledError()
        return "second time"

    wf = Workflow([Step("s", once, retry=RetryPolicy(max_attempts=2, backoff_base=0.0))])
    assert dict(wf.run_sync().outputs) == {"s": "second time"}


def test_cancelling_the_run_still_interrupts_rather_than_fails() -> None:
    gates = Gates()
    saved: list[WorkflowCheckpoint] = []
    wf = Workflow([Step("slow", gates.step("slow"))])

    async def main() -> None:
        run = asyncio.create_task(wf.run(checkpoint_fn=saved.append))
        await until(lambda: "slow" in gates.started)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run

    asyncio.run(main())
    assert saved[-1].failures == {} and saved[-1].outputs == {}


def test_when_the_final_save_of_a_failed_run_raises_both_errors_are_shown() -> None:
    calls: list[WorkflowCheckpoint] = []

    def save(cp: WorkflowCheckpoint) -> None:
        calls.append(cp)
        if cp.failures:
            raise OSError("disk full")

    def fails(context: dict[str, Any]) -> str:
        raise KeyError("the step's own problem")

    wf = Workflow([Step("a", lambda c: 1), Step("b", fails, ("a",))])
    with pytest.raises(OSError, match="disk full") as info:
        wf.run_sync(checkpoint_fn=save)
    notes = "\n".join(info.value.__notes__)
    assert "step 'b' raised KeyError" in notes
    assert "the checkpoint it last accepted stands" in notes
    assert isinstance(info.value.__context__, KeyError)
    assert calls[-1].failures and calls[-2].outputs == {"a": 1}


def test_a_step_finishing_while_an_async_save_is_cancelled_keeps_its_output() -> None:
    # The window a mutation run found: step "b" finishes while the run awaits
    # an async checkpoint_fn, then the run is cancelled. Its output must be in
    # the final checkpoint, not turned into an interruption.
    gates = Gates()
    saved: list[WorkflowCheckpoint] = []
    in_save = asyncio.Event()
    hold = asyncio.Event()

    async def save(cp: WorkflowCheckpoint) -> None:
        saved.append(cp)
        if len(saved) == 1:
            in_save.set()
            await hold.wait()  # never set: the run is cancelled here

    wf = Workflow([Step("a", gates.step("a")), Step("b", gates.step("b"))])

    async def main() -> None:
        run = asyncio.create_task(wf.run(checkpoint_fn=save))
        await until(lambda: len(gates.started) == 2)
        gates.release("a")
        await in_save.wait()
        gates.release("b")
        await until(lambda: "b" in gates.finished)
        # all_tasks() holds only unfinished tasks: wait until b's is done too.
        await until(lambda: not any("Gates.step" in repr(t.get_coro()) for t in asyncio.all_tasks()))
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run

    asyncio.run(main())
    assert dict(saved[0].outputs) == {"a": "<a>"}
    assert dict(saved[-1].outputs) == {"a": "<a>", "b": "<b>"}
