"""Each attempt is handed its durable identity: the executor gets an ``Attempt``, the step its key.

What users rely on: the number counts attempts across runs (a resume goes on
after the failures the checkpoint records, and an attempt that finished but
was never saved runs again under the same number), the key is
``run_id/step/number`` wherever the step runs (the loop, a thread, inline,
an executor of its own), ``before_attempt`` gates every attempt outside its
timeout, and old executors still run.
"""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import MutableMapping
from typing import Any

import pytest

from ekit_core import RetryPolicy
from ekit_runtime import Step, Workflow
from ekit_runtime.attempt import Attempt, AttemptKey, attempt_key
from ekit_runtime.executors import DEFAULT_EXECUTOR, Executor, LocalExecutor, busy_sync_steps

NO_WAIT = RetryPolicy(max_attempts=5, backoff_base=0)


class _Noting(Executor):
    """Runs every attempt in the default executor and keeps what it was handed."""

    def __init__(self) -> None:
        self.attempts: list[Attempt] = []

    async def run(self, attempt: Attempt) -> Any:
        self.attempts.append(attempt)
        return await DEFAULT_EXECUTOR.run(attempt)


def _failing(times: int) -> Any:
    calls = [0]

    async def step(ctx: MutableMapping[str, Any]) -> str:
        calls[0] += 1
        if calls[0] <= times:
            raise RuntimeError(f"failure {calls[0]}")
        return f"ok after {calls[0]}"

    return step


def test_the_executor_receives_the_step_its_context_the_number_and_the_key() -> None:
    noting = _Noting()
    wf = Workflow([
        Step("a", lambda ctx: 1, inline=True),
        Step("b", _failing(2), ("a",), retry=NO_WAIT, context="dependencies"),
    ])
    result = wf.run_sync({"topic": "t"}, executor=noting, run_id="run-1")
    assert result.outputs["b"] == "ok after 3"
    b = [x for x in noting.attempts if x.name == "b"]
    assert [x.number for x in b] == [1, 2, 3]
    assert [str(x.key) for x in b] == ["run-1/b/1", "run-1/b/2", "run-1/b/3"]
    assert all(x.step is wf.steps[1] and x.run_id == "run-1" for x in b)
    assert dict(b[0].context) == {"topic": "t", "a": 1}


def test_numbers_go_on_across_runs_after_the_recorded_failures() -> None:
    noting = _Noting()
    step = _failing(2)
    wf = Workflow([Step("s", step, retry=RetryPolicy(max_attempts=2, backoff_base=0))])
    saved: list[Any] = []
    with pytest.raises(RuntimeError, match="failure 2"):
        wf.run_sync(executor=noting, checkpoint_fn=saved.append, run_id="r")
    assert saved[-1].failures["s"].attempts == 2
    result = wf.run_sync(executor=noting, resume_from=saved[-1], run_id="r")
    assert result.outputs["s"] == "ok after 3"
    assert [x.number for x in noting.attempts] == [1, 2, 3]
    # The run's own retry count starts afresh (the policy counts this run),
    # the key does not: attempt 3 is never confused with attempt 1.
    assert [str(x.key) for x in noting.attempts][-1] == "r/s/3"


def test_the_key_is_set_wherever_a_step_runs_and_only_with_a_run_id() -> None:
    seen: dict[str, str] = {}

    def sync(name: str) -> Any:
        def body(ctx: Any) -> str:
            seen[name] = f"{threading.current_thread().name}|{attempt_key()}"
            return name

        return body

    async def on_loop(ctx: Any) -> str:
        await asyncio.sleep(0)
        seen["async"] = f"{threading.current_thread().name}|{attempt_key()}"
        return "async"

    wf = Workflow([
        Step("pooled", sync("pooled")),
        Step("inline", sync("inline"), inline=True),
        Step("own", sync("own"), executor=LocalExecutor(max_threads=1)),
        Step("async", on_loop),
        Step("timed", on_loop, timeout=30),
    ])
    wf.run_sync(run_id="id")
    keys = {k: v.split("|")[1] for k, v in seen.items()}
    assert keys == {"pooled": "id/pooled/1", "inline": "id/inline/1", "own": "id/own/1",
                    "async": "id/timed/1"}
    assert seen["pooled"].startswith("ekit-step") and seen["inline"].startswith("MainThread")

    async def unkeyed(ctx: Any) -> str:
        try:
            attempt_key()
        except LookupError as exc:
            return str(exc)
        return "set"

    result = Workflow([Step("u", unkeyed), Step("v", unkeyed, ("u",), timeout=30)]).run_sync()
    assert "run id" in result.outputs["u"] and "run id" in result.outputs["v"]
    with pytest.raises(LookupError):
        attempt_key()  # nothing leaks out of a run into its caller


def test_before_attempt_gates_each_attempt_outside_its_timeout() -> None:
    order: list[str] = []

    async def admit(attempt: Attempt) -> None:
        order.append(f"admit {attempt.name} {attempt.number}")
        if attempt.number == 2:
            # Longer than the step's timeout (what is measured, not a
            # synchronisation): the wait is not the step's time.
            await asyncio.sleep(0.3)

    async def step(ctx: Any) -> str:
        order.append("run")
        if len(order) == 2:
            raise RuntimeError("once")
        return "done"

    wf = Workflow([Step("s", step, retry=NO_WAIT, timeout=0.2)])
    assert wf.run_sync(before_attempt=admit, run_id="g").outputs["s"] == "done"
    assert order == ["admit s 1", "run", "admit s 2", "run"]


def test_what_before_attempt_raises_fails_that_attempt_and_the_policy_decides() -> None:
    ran: list[int] = []

    def admit(attempt: Attempt) -> None:
        if attempt.number == 1:
            raise PermissionError("not now")

    def step(ctx: Any) -> str:
        ran.append(1)
        return "ok"

    wf = Workflow([Step("s", step, retry=NO_WAIT)])
    assert wf.run_sync(before_attempt=admit).outputs["s"] == "ok"
    assert ran == [1]
    with pytest.raises(PermissionError, match="not now"):
        Workflow([Step("s", step)]).run_sync(before_attempt=admit)
    assert ran == [1]  # the refused attempt never ran


def test_bad_run_id_and_before_attempt_are_refused_before_any_step() -> None:
    ran: list[str] = []
    wf = Workflow([Step("s", lambda ctx: ran.append("s"))])
    for bad in ("", 3, "\udc80"):
        with pytest.raises(ValueError, match="run_id"):
            wf.run_sync(run_id=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="before_attempt must be callable"):
        wf.run_sync(before_attempt="soon")  # type: ignore[arg-type]
    assert ran == []


def test_an_executor_written_for_run_step_context_still_runs_with_a_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        class Legacy(Executor):
            async def run(self, step: Step, context: MutableMapping[str, Any]) -> Any:  # type: ignore[override]
                return f"{step.name} saw {sorted(context)}"

    assert [w.category for w in caught] == [DeprecationWarning]
    assert "run(self, attempt)" in str(caught[0].message)
    wf = Workflow([Step("s", lambda ctx: "unused", context="dependencies")])
    assert wf.run_sync({"k": 1}, executor=Legacy()).outputs["s"] == "s saw ['k']"


def test_sync_steps_in_threads_are_counted_while_they_run() -> None:
    inside, release = threading.Event(), threading.Event()
    counts: list[int] = []

    def body(ctx: Any) -> str:
        inside.set()
        release.wait(30)
        return "ok"

    async def main() -> None:
        task = asyncio.ensure_future(Workflow([Step("s", body)]).run())
        await asyncio.to_thread(inside.wait, 30)
        counts.append(busy_sync_steps())
        release.set()
        await task
        counts.append(busy_sync_steps())

    asyncio.run(main())
    assert counts == [1, 0]


def test_attempt_keys_are_plain_values() -> None:
    key = AttemptKey("r", "s", 2)
    assert str(key) == "r/s/2" and key == AttemptKey("r", "s", 2)
    attempt = Attempt(Step("s", lambda ctx: 1), {}, 2)
    assert attempt.key is None and attempt.name == "s"
