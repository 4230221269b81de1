"""Every public numeric argument refuses a bad number with a ValueError naming it, before anything is paid.

NaN (which compares false with every bound, so slips past ``<`` checks), the
infinities, negatives, ``True``, text, and ints too large for a float
(``10**400``, which raised ``OverflowError`` wherever it first met a float)
are refused where they are given: a step's ``timeout`` and ``RetryPolicy``'s
numbers when built, a queue worker's when made, the queue's own arguments
before they reach its database, a run option before it is stored. A step
whose timeout was NaN "timed out after nan s" at once on every attempt while
its thread still made the paid call.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ekit_core import Failed, GraphSpec, RetryPolicy, advance, initial_state
from ekit_core.numbers import MAX_SECONDS
from ekit_runtime import LocalExecutor, ProgressPrinter, Step, Workflow
from ekit_runtime.queue import Limits, RunQueue, Worker
from tests.support.queue_backends import chain_checkpoints, queue, queue_url  # noqa: F401

BAD: list[Any] = [math.nan, math.inf, -math.inf, -1, 10**400, True, "1"]


def _ok(context: Any) -> str:
    return "ok"


def _core_retry_after(value: Any) -> Any:
    state, _ = advance(initial_state(GraphSpec.of({"a": []}), policies={"a": RetryPolicy()}), ())
    return advance(state, [Failed("a", ConnectionError(), retry_after=value)])


# No queue at all: a worker checks its arguments before it touches one.
_NO_QUEUE: Any = None

# (the field the error must name, a call that hands it the value)
SITES: list[tuple[str, Callable[[Any], Any]]] = [
    ("timeout", lambda v: Step("a", _ok, timeout=v)),
    ("backoff_base", lambda v: RetryPolicy(backoff_base=v)),
    ("backoff_cap", lambda v: RetryPolicy(backoff_cap=v)),
    ("backoff_factor", lambda v: RetryPolicy(backoff_factor=v)),
    ("jitter", lambda v: RetryPolicy(jitter=v)),
    ("max_retry_after", lambda v: RetryPolicy(max_retry_after=v)),
    ("lease_seconds", lambda v: Worker(_NO_QUEUE, {"w": Workflow([Step("a", _ok)])}, lease_seconds=v)),
    ("heartbeat", lambda v: Worker(_NO_QUEUE, {"w": Workflow([Step("a", _ok)])}, heartbeat=v)),
    ("poll", lambda v: Worker(_NO_QUEUE, {"w": Workflow([Step("a", _ok)])}, poll=v)),
    ("window", lambda v: Limits(window=v)),
    ("interval", lambda v: ProgressPrinter(interval=v)),
    ("tick", lambda v: ProgressPrinter(tick=v)),
    ("retry_after", _core_retry_after),
    ("warn_after", lambda v: LocalExecutor(warn_after=v)),
]


@given(site=st.sampled_from(SITES), bad=st.sampled_from(BAD))
def test_each_numeric_argument_refuses_a_bad_number_naming_itself(
    site: tuple[str, Callable[[Any], Any]], bad: Any
) -> None:
    field, call = site
    if field == "retry_after" and bad is math.inf:
        bad = 10**400  # (the core takes any finite wait; the policy decides how long is too long)
    with pytest.raises(ValueError, match=field) as refused:
        call(bad)
    assert "OverflowError" not in repr(refused.value)


@given(st.sampled_from([s for s in SITES if s[0] not in ("jitter", "backoff_factor", "retry_after")]))
def test_a_number_of_seconds_past_the_documented_longest_is_refused(
    site: tuple[str, Callable[[Any], Any]]
) -> None:
    field, call = site
    with pytest.raises(ValueError, match=field):
        call(MAX_SECONDS * 2)


def test_a_step_whose_timeout_is_nan_is_refused_naming_the_step_and_nothing_runs() -> None:
    calls: list[str] = []

    def paid(context: Any) -> str:
        calls.append("paid")
        return "answer"

    for bad in (math.nan, 10**400, math.inf, 0, -1.0):
        with pytest.raises(ValueError, match=r"step 'ask': timeout must be"):
            Workflow([Step("ask", paid, timeout=bad)])
    assert calls == []


def test_the_longest_timeout_and_a_huge_int_one_within_it_run_the_step_once() -> None:
    calls: list[str] = []

    def paid(context: Any) -> str:
        calls.append("paid")
        return "answer"

    for timeout in (MAX_SECONDS, float(MAX_SECONDS), 10**9 - 1):
        result = Workflow([Step("ask", paid, timeout=timeout)]).run_sync()
        assert result.outputs["ask"] == "answer"
    assert calls == ["paid"] * 3


def test_a_retry_policy_of_nan_cap_is_refused_not_run_without_backoff() -> None:
    with pytest.raises(ValueError, match=r"^RetryPolicy\.backoff_cap must be a finite number"):
        RetryPolicy(backoff_cap=math.nan)


def test_the_queue_refuses_bad_seconds_by_name_and_grants_nothing(queue: RunQueue) -> None:  # noqa: F811
    # (one queue per backend for every value: a fresh PostgreSQL database each is dear)
    run = queue.submit("w")
    for bad in [*BAD, MAX_SECONDS * 2]:
        calls: list[tuple[str, Callable[..., Any], tuple[Any, ...]]] = [
            ("lease_seconds", queue.claim, ("x", {"w": None}, bad)),
            ("lease_seconds", queue.claim_many, ("x", {"w": None}, bad, 2)),
            ("older_than", queue.prune, (bad,)),
            ("seconds", queue.announce, ("x", {"w": None}, bad)),
        ]
        for field, call, args in calls:
            with pytest.raises(ValueError, match=field):
                call(*args)
        assert queue.status(run).status == "queued"
    lease = queue.claim("x", {"w": None}, 30)
    assert lease is not None
    checkpoint = chain_checkpoints(1)[0]
    for bad in [*BAD, MAX_SECONDS * 2]:
        with pytest.raises(ValueError, match="lease_seconds"):
            queue.renew(lease, bad)
        with pytest.raises(ValueError, match="lease_seconds"):
            queue.save(lease, checkpoint, bad)
    assert queue.checkpoint(run) is None


def test_a_run_option_utf8_cannot_hold_is_refused_naming_the_option_before_it_is_stored(
    queue: RunQueue,  # noqa: F811
) -> None:
    for value in (["\ud800"], ["ok", "a\udfffb"]):
        with pytest.raises(ValueError, match=r"run option 'only': \[\d\] holds .* UTF-8") as refused:
            queue.submit("w", options={"only": value}, run_id="r1")
        assert not isinstance(refused.value, UnicodeError)
    with pytest.raises(ValueError, match="run option"):
        Worker(queue, {"w": Workflow([Step("a", _ok)])}, defaults={"only": ["\ud800"]})
    assert queue.runs() == []  # nothing stored, nothing half-stored


def test_a_workflow_run_refuses_bad_numbers_before_any_step_is_paid() -> None:
    calls: list[str] = []

    async def paid(context: Any) -> str:
        calls.append("paid")
        return "answer"

    async def main() -> None:
        for bad in BAD:
            with pytest.raises(ValueError, match="backoff_cap"):
                await Workflow([Step("ask", paid, retry=RetryPolicy(backoff_cap=bad))]).run()

    asyncio.run(main())
    assert calls == []


@pytest.mark.parametrize("bad", [10**400, math.inf, math.nan, -1], ids=lambda v: f"{v!r:.12}")
def test_a_checkpoint_recording_a_duration_no_float_holds_is_refused_naming_it(bad: Any) -> None:
    from ekit_core import WorkflowCheckpoint

    data = {"step_index": 1, "outputs": {"a": 1}, "durations": {"a": bad},
            "cost": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0}}
    with pytest.raises(ValueError, match=r"durations\.a"):
        WorkflowCheckpoint.from_dict(data)


@pytest.mark.parametrize("bad", [70000, -1, 10**400, True, "80", math.nan], ids=lambda v: f"{v!r:.12}")
def test_the_dashboard_refuses_a_port_out_of_range_naming_it(bad: Any, tmp_path: Any, capsys: Any) -> None:
    from ekit_runtime.cli import main
    from ekit_runtime.ui.server import make_server
    from ekit_runtime.ui.sources import QueueSource

    with pytest.raises(ValueError, match="port must be a whole number from 0 to 65535"):
        make_server(cast(QueueSource, None), port=bad)
    if isinstance(bad, int) and not isinstance(bad, bool):  # (what argparse's int can hand over)
        assert main(["ui", "--queue", str(tmp_path / "q.db"), "--port", str(bad)]) == 2
        assert "port must be a whole number from 0 to 65535" in capsys.readouterr().err


@pytest.mark.parametrize("field", ["input_tokens", "output_tokens", "llm_calls"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -1, 1.5, True, "1"], ids=repr)
def test_a_budget_count_that_is_no_count_is_refused_naming_it_before_any_step(field: str, bad: Any) -> None:
    from ekit_runtime import TokenUsage

    calls: list[str] = []
    workflow = Workflow([Step("ask", lambda ctx: calls.append("paid"))])
    with pytest.raises(ValueError, match=rf"budget\.{field} must be an int >= 0"):
        workflow.run_sync(budget=TokenUsage(**{field: bad}))
    assert calls == []  # a NaN budget was never reached: every step ran, unbudgeted
