"""A condition or an approval that raised asking for a wait is retried as a step's failure is.

Now that a retry asks a raising condition (and approval) again, its
failure is an attempt's failure like any other, so the wait it asks for
(an exception's ``retry_after``, a 429's ``Retry-After`` from the flag
service a condition calls) counts: the retry waits at least that long, and
a wait past ``max_retry_after`` is not retried. The condition's and the
approval's failures dropped the hint: the retry came after the bare backoff
and a refused wait was retried anyway. Sleeps are injected.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ekit_core import RetryPolicy
from ekit_runtime import Approval, Step, Workflow

POLICY = RetryPolicy(max_attempts=3, backoff_base=1.0, max_retry_after=60.0)


class Busy(Exception):
    def __init__(self, seconds: float) -> None:
        super().__init__(f"busy for {seconds}s")
        self.retry_after = seconds


def _once(seconds: float, then: Any) -> Any:
    left = [1]

    def gate(*args: Any) -> Any:
        if left[0]:
            left[0] -= 1
            raise Busy(seconds)
        return then

    return gate


def _run(workflow: Workflow, sleeps: list[float], **options: Any) -> Any:
    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    runner = workflow.runner(sleep=sleep, **options)
    asyncio.run(runner.run())
    return runner


def test_a_raising_condition_s_retry_waits_what_it_asked() -> None:
    sleeps: list[float] = []
    workflow = Workflow([Step("a", lambda ctx: 1, retry=POLICY, when=_once(30.0, True))])
    _run(workflow, sleeps)
    assert sleeps == [30.0]


def test_a_raising_condition_asking_too_long_a_wait_is_not_retried() -> None:
    sleeps: list[float] = []
    workflow = Workflow([Step("a", lambda ctx: 1, retry=POLICY, when=_once(600.0, True))])
    runner = _run(workflow, sleeps)
    assert sleeps == []
    assert runner.state.setbacks.halt is not None and runner.state.setbacks.halt.kind == "failed"
    assert "a" not in runner.state.outputs


def test_a_raising_approval_s_retry_waits_what_it_asked() -> None:
    sleeps: list[float] = []
    approve = _once(30.0, Approval(True))
    workflow = Workflow([Step("a", lambda ctx: 1, retry=POLICY)])
    _run(workflow, sleeps, approval=approve)
    assert sleeps == [30.0]
