"""The shell reports when a gated attempt begins; the trace marks the real start.

An attempt waiting out a retry delay or an approval has not begun its work:
``StepStarted`` (and so the OpenTelemetry span) comes when it does. The
retry sleep is injected, so no test waits for real.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ekit_core import Event, StepRetried, StepStarted
from ekit_runtime import Approval, RetryPolicy, Step, Workflow


def test_step_started_follows_the_retry_sleep_not_the_retry_decision() -> None:
    log: list[str] = []

    async def sleep(delay: float) -> None:
        log.append(f"sleep {delay}")

    def trace(event: Event) -> None:
        if isinstance(event, StepStarted | StepRetried):
            log.append(f"{type(event).__name__} {event.attempt}")

    calls: list[int] = []

    def flaky(context: dict[str, Any]) -> str:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("busy")
        return "ok"

    wf = Workflow([Step("s", flaky, retry=RetryPolicy(max_attempts=2, backoff_base=3.0))])
    state = asyncio.run(wf.runner(trace=trace, sleep=sleep).run())
    assert state.outputs["s"] == "ok"
    assert log == ["StepStarted 1", "StepRetried 1", "sleep 3.0", "StepStarted 2"]


def test_step_started_follows_the_approval_and_is_asked_once_per_step() -> None:
    log: list[str] = []

    def approve(name: str, metadata: Any) -> Approval:
        log.append(f"asked {name}")
        return Approval.allow()

    def trace(event: Event) -> None:
        if isinstance(event, StepStarted):
            log.append(f"started {event.name} {event.attempt}")

    calls: list[int] = []

    def flaky(context: dict[str, Any]) -> str:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("busy")
        return "ok"

    async def no_wait(delay: float) -> None:
        return None

    wf = Workflow([Step("s", flaky, retry=RetryPolicy(max_attempts=2, backoff_base=1.0))])
    saved: list[Any] = []
    runner = wf.runner(approval=approve, trace=trace, sleep=no_wait, checkpoint_fn=saved.append)
    asyncio.run(runner.run())
    # Approval on the first attempt only; each start reported after its gate.
    assert log == ["asked s", "started s 1", "started s 2"]
    # Beginning an attempt is not progress: no checkpoint for it.
    assert [cp.failures.get("s") is not None for cp in saved] == [True, True]
