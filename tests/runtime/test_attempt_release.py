"""What ``before_attempt`` returns, if callable, is given back exactly once when the attempt ends.

A queue worker's slot of a capped resource is held from ``before_attempt``
to the attempt's end: the runner calls the release once for every way an
attempt ends (it returned, raised, timed out, was cancelled with its run,
raised a ``BaseException``), and awaits an async release to its end even
while the run is being cancelled again. No test waits on time: steps wait on
events the test sets.
"""

from __future__ import annotations

import asyncio
import warnings
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from ekit_runtime import RetryPolicy, Step, Workflow
from ekit_runtime.attempt import Attempt


class Ledger:
    """A ``before_attempt`` that hands every attempt a release and counts both, per attempt key."""

    def __init__(self, *, asynchronous: bool = False) -> None:
        self.taken: Counter[str] = Counter()
        self.given: Counter[str] = Counter()
        self.asynchronous = asynchronous
        self.releasing = asyncio.Event()
        self.let_go: asyncio.Event | None = None  # an async release waits for it, if set

    def __call__(self, attempt: Attempt) -> Callable[[], Any]:
        key = str(attempt.key)
        self.taken[key] += 1
        if not self.asynchronous:
            return lambda: self.given.update([key])

        async def release() -> None:
            self.releasing.set()
            if self.let_go is not None:
                await self.let_go.wait()
            self.given[key] += 1

        return release

    def balanced(self) -> bool:
        return self.taken == self.given and all(n == 1 for n in self.given.values())


def _run(wf: Workflow, ledger: Any, **options: Any) -> Any:
    return asyncio.run(wf.run({}, run_id="r", before_attempt=ledger, **options))


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_release_is_called_once_for_each_attempt_that_returns_or_raises(asynchronous: bool) -> None:
    calls: list[int] = []

    async def flaky(ctx: Any) -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("busy")
        return "ok"

    def sync_step(ctx: Any) -> str:
        return "sync"

    ledger = Ledger(asynchronous=asynchronous)
    wf = Workflow([
        Step("flaky", flaky, retry=RetryPolicy(max_attempts=3, backoff_base=0.0)),
        Step("sync", sync_step),
    ])
    result = _run(wf, ledger)
    assert result.outputs == {"flaky": "ok", "sync": "sync"}
    assert ledger.balanced()
    assert set(ledger.given) == {"r/flaky/1", "r/flaky/2", "r/flaky/3", "r/sync/1"}


def test_a_release_is_called_once_for_a_failed_and_a_timed_out_attempt() -> None:
    never = asyncio.Event

    async def hangs(ctx: Any) -> None:
        await never().wait()

    async def fails(ctx: Any) -> None:
        raise ValueError("bad input")

    ledger = Ledger()
    wf = Workflow([Step("hangs", hangs, timeout=0.05), Step("fails", fails)])
    result = _run(wf, ledger, isolate_failures=True)
    assert set(result.failed) == {"hangs", "fails"}
    assert ledger.balanced() and set(ledger.given) == {"r/hangs/1", "r/fails/1"}


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_release_is_called_once_when_the_run_is_cancelled_mid_attempt(asynchronous: bool) -> None:
    ledger = Ledger(asynchronous=asynchronous)
    inside = asyncio.Event()
    both_inside = asyncio.Event()
    entered: list[str] = []

    async def waits(ctx: Any) -> None:
        inside.set()
        entered.append("x")
        if len(entered) == 2:
            both_inside.set()
        await asyncio.Event().wait()

    async def main() -> None:
        wf = Workflow([Step("a", waits), Step("b", waits)])
        run = asyncio.ensure_future(wf.run({}, run_id="r", before_attempt=ledger))
        await inside.wait()
        await both_inside.wait()
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run

    asyncio.run(main())
    assert ledger.balanced() and set(ledger.given) == {"r/a/1", "r/b/1"}


def test_an_async_release_finishes_even_when_the_run_is_cancelled_again_meanwhile() -> None:
    ledger = Ledger(asynchronous=True)
    ledger.let_go = asyncio.Event()
    inside = asyncio.Event()

    async def waits(ctx: Any) -> None:
        inside.set()
        await asyncio.Event().wait()

    async def main() -> None:
        assert ledger.let_go is not None
        run = asyncio.ensure_future(Workflow([Step("a", waits)]).run({}, run_id="r", before_attempt=ledger))
        await inside.wait()
        run.cancel()
        await ledger.releasing.wait()  # the release is under way, and waits for let_go
        for _ in range(3):
            run.cancel()  # Ctrl-C pressed again and again
            await asyncio.sleep(0)
        assert not ledger.given
        ledger.let_go.set()
        with pytest.raises(asyncio.CancelledError):
            await run

    asyncio.run(main())
    assert ledger.balanced() and set(ledger.given) == {"r/a/1"}


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
def test_a_release_is_called_once_when_the_step_raises_a_base_exception(exc_type: type) -> None:
    sibling_in = asyncio.Event()

    async def sibling(ctx: Any) -> None:
        sibling_in.set()
        await asyncio.Event().wait()

    async def raises(ctx: Any) -> None:
        await sibling_in.wait()
        raise exc_type()

    ledger = Ledger(asynchronous=True)
    wf = Workflow([Step("sibling", sibling), Step("raises", raises)])
    with pytest.raises(exc_type):
        _run(wf, ledger)
    assert ledger.balanced() and set(ledger.given) == {"r/sibling/1", "r/raises/1"}


def test_a_release_that_raises_is_a_warning_and_the_attempt_outcome_stands() -> None:
    def before(attempt: Attempt) -> Callable[[], None]:
        def release() -> None:
            raise ConnectionError("database gone")

        return release

    wf = Workflow([Step("a", lambda ctx: "done")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _run(wf, before)
    assert result.outputs == {"a": "done"}
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("release of attempt 'a'" in m and "database gone" in m for m in messages), messages


@pytest.mark.parametrize("returned", [None, True, 3, "text"])
def test_what_before_attempt_returns_if_not_callable_is_ignored(returned: object) -> None:
    def before(attempt: Attempt) -> object:
        return returned

    async def asynchronous_before(attempt: Attempt) -> object:
        return returned

    wf = Workflow([Step("a", lambda ctx: "done")])
    for hook in (before, asynchronous_before):
        assert _run(wf, hook).outputs == {"a": "done"}


def test_an_async_before_attempt_may_return_the_release_too() -> None:
    given: list[str] = []

    async def before(attempt: Attempt) -> Callable[[], Awaitable[None]]:
        async def release() -> None:
            given.append(attempt.name)

        return release

    wf = Workflow([Step("a", lambda ctx: "x"), Step("b", lambda ctx: "y", ("a",))])
    assert _run(wf, before).outputs == {"a": "x", "b": "y"}
    assert given == ["a", "b"]


def test_a_before_attempt_that_raises_has_nothing_to_release() -> None:
    def before(attempt: Attempt) -> None:
        raise ConnectionError("no admission")

    wf = Workflow([Step("a", lambda ctx: "x")])
    with pytest.raises(ConnectionError, match="no admission"):
        _run(wf, before)
