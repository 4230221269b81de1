"""A step's condition (and the run's approval) is asked before each attempt until it has answered.

A condition that raised has not answered: the retry asks it again, as a
resume does, so an uninterrupted run and a resumed one skip or run the same
steps. A condition that held has answered: a retry after the step's own
failure runs without asking again. The same holds for the approval callback,
which a retry after a raising condition or a raising approval must still ask.
The core decides (``Start.condition`` and ``Start.approval``); the shell
only asks, after waiting out the retry's delay. Sleeps are injected.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import Began, Failed, GraphSpec, RetryPolicy, Shape, Skipped, advance, initial_state
from ekit_core.results import APPROVAL
from ekit_runtime import Approval, Step, Workflow, WorkflowCheckpoint

RETRY = RetryPolicy(max_attempts=4, backoff_base=2.0)


class _Flaky:
    """A condition raising for its first ``raises`` calls, then answering ``answer``."""

    def __init__(self, raises: int, answer: bool, log: list[str]) -> None:
        self.raises, self.answer, self.log = raises, answer, log
        self.__qualname__ = "flaky_condition"

    def __call__(self, context: Any) -> bool:
        self.log.append("asked")
        if self.raises:
            self.raises -= 1
            raise ConnectionError("the flag service is down")
        return self.answer


def _workflow(condition: Any, log: list[str], step_raises: int = 0) -> Workflow:
    left = [step_raises]

    def escalate(context: Any) -> str:
        log.append("paid")
        if left[0]:
            left[0] -= 1
            raise ConnectionError("busy")
        return "escalated"

    return Workflow([
        Step("triage", lambda ctx: "low"),
        Step("escalate", escalate, ("triage",), retry=RETRY, when=condition),
    ])


def _run(workflow: Workflow, log: list[str], **options: Any) -> Any:
    async def sleep(seconds: float) -> None:
        log.append(f"sleep {seconds}")

    return asyncio.run(workflow.runner(sleep=sleep, **options).run())


def test_a_retry_after_a_raising_condition_asks_it_again_and_skips_the_step() -> None:
    log: list[str] = []
    state = _run(_workflow(_Flaky(raises=1, answer=False, log=log), log), log)
    assert "paid" not in log  # the condition would have said false: nothing is paid
    assert log == ["asked", "sleep 2.0", "asked"]  # asked again once the backoff is waited out
    assert "escalate" not in state.outputs and "escalate" in state.skipped


def test_a_retry_after_a_raising_condition_runs_the_step_once_it_holds() -> None:
    log: list[str] = []
    state = _run(_workflow(_Flaky(raises=2, answer=True, log=log), log), log)
    assert log == ["asked", "sleep 2.0", "asked", "sleep 4.0", "asked", "paid"]
    assert state.outputs["escalate"] == "escalated"


def test_a_condition_that_held_is_not_asked_again_when_the_step_itself_fails() -> None:
    log: list[str] = []
    state = _run(_workflow(_Flaky(raises=0, answer=True, log=log), log, step_raises=1), log)
    assert log == ["asked", "paid", "sleep 2.0", "paid"]
    assert state.outputs["escalate"] == "escalated"


def test_one_process_and_a_resume_after_the_raising_condition_agree() -> None:
    # Uninterrupted: the retry asks the condition, which says false.
    log: list[str] = []
    whole = _run(_workflow(_Flaky(raises=1, answer=False, log=log), log), log)
    # Interrupted after the raising condition: the run is stopped at its first
    # failure (one attempt), then resumed from what it saved.
    log_resumed: list[str] = []
    saved: list[WorkflowCheckpoint] = []
    once = Workflow([
        Step("triage", lambda ctx: "low"),
        Step("escalate", lambda ctx: log_resumed.append("paid"), ("triage",),
             retry=RetryPolicy(max_attempts=1), when=_Flaky(raises=1, answer=False, log=log_resumed)),
    ])
    with pytest.raises(ConnectionError):
        once.run_sync(checkpoint_fn=saved.append)
    resumed = _run(_workflow(_Flaky(raises=0, answer=False, log=log_resumed), log_resumed), log_resumed,
                   resume_from=saved[-1])
    assert "paid" not in log and "paid" not in log_resumed
    assert dict(whole.outputs) == dict(resumed.outputs)
    assert whole.skipped.keys() == resumed.skipped.keys() == {"escalate"}


def test_the_approval_is_still_asked_on_the_retry_after_a_raising_condition() -> None:
    log: list[str] = []

    def approve(name: str, metadata: Any) -> Approval:
        log.append(f"approval {name}")
        return Approval.deny("not today") if name == "escalate" else Approval.allow()

    state = _run(_workflow(_Flaky(raises=1, answer=True, log=log), log), log, approval=approve)
    assert "paid" not in log  # the retry did not slip past the approval
    assert log == ["approval triage", "asked", "sleep 2.0", "asked", "approval escalate"]
    assert state.outcome == "denied"


def test_a_raising_approval_is_asked_again_on_the_retry() -> None:
    log: list[str] = []
    calls = [0]

    def approve(name: str, metadata: Any) -> Approval:
        if name != "escalate":
            return Approval.allow()
        calls[0] += 1
        log.append("approval")
        if calls[0] == 1:
            raise ConnectionError("the approval service is down")
        return Approval.deny("no")

    state = _run(_workflow(None, log), log, approval=approve)
    assert "paid" not in log
    assert log == ["approval", "sleep 2.0", "approval"]
    assert state.outcome == "denied"


def test_each_mapped_item_asks_its_condition_until_it_answers() -> None:
    log: list[str] = []
    raised: set[str] = set()

    def wanted(context: Any) -> bool:
        item = str(context["tickets"])
        log.append(f"asked {item}")
        if item == "b" and item not in raised:
            raised.add(item)
            raise ConnectionError("flaky")
        return item != "b"

    def handle(context: Any) -> str:
        item = str(context["tickets"])
        log.append(f"paid {item}")
        return item.upper()

    wf = Workflow([
        Step("tickets", lambda ctx: ["a", "b", "c"]),
        Step("handle", handle, ("tickets",), map_over="tickets", when=wanted, retry=RETRY),
    ])
    state = _run(wf, log)
    assert "paid b" not in log
    assert log.count("asked b") == 2 and log.count("asked a") == 1 and log.count("asked c") == 1
    assert "handle[1]" in state.skipped


def _core_run() -> Any:
    graph = GraphSpec.of({"a": []}, shapes={"a": Shape(when="flag")})
    state, batch = advance(initial_state(graph, policies={"a": RetryPolicy(max_attempts=5)}), ())
    return state, batch


def test_the_core_marks_a_start_to_ask_the_condition_until_it_has_answered() -> None:
    state, batch = _core_run()
    assert [(s.attempt, s.condition) for s in batch.starts] == [(1, True)]
    # The condition raised: the retry asks it again.
    state, batch = advance(state, [Failed("a", ConnectionError())])
    assert [(s.attempt, s.condition) for s in batch.starts] == [(2, True)]
    # It held (the attempt began), then the step itself failed: answered, not asked again.
    state, _ = advance(state, [Began("a")])
    state, batch = advance(state, [Failed("a", ConnectionError())])
    assert [(s.attempt, s.condition) for s in batch.starts] == [(3, False)]
    state, batch = advance(state, [Failed("a", ConnectionError())])
    assert [(s.attempt, s.condition) for s in batch.starts] == [(4, False)]


def test_the_core_asks_only_the_approval_again_after_it_raised_behind_a_held_condition() -> None:
    graph = GraphSpec.of({"a": []}, shapes={"a": Shape(when="flag")})
    state, batch = advance(
        initial_state(graph, policies={"a": RetryPolicy(max_attempts=5)}, approval=True), ())
    assert [(s.condition, s.approval) for s in batch.starts] == [(True, True)]
    # The condition held, then the approval raised (Failed.gate): only the approval is unanswered.
    state, batch = advance(state, [Failed("a", ConnectionError(), gate=APPROVAL)])
    assert [(s.attempt, s.condition, s.approval) for s in batch.starts] == [(2, False, True)]
    state, batch = advance(state, [Failed("a", ConnectionError(), gate=APPROVAL)])
    assert [(s.attempt, s.condition, s.approval) for s in batch.starts] == [(3, False, True)]
    # The approval answered, then the step itself failed: neither is asked again.
    state, _ = advance(state, [Began("a")])
    state, batch = advance(state, [Failed("a", ConnectionError())])
    assert [(s.attempt, s.condition, s.approval) for s in batch.starts] == [(4, False, False)]


def test_a_raising_approval_behind_a_held_condition_asks_the_approval_only() -> None:
    log: list[str] = []
    calls = [0]

    def approve(name: str, metadata: Any) -> bool:
        if name == "escalate":
            calls[0] += 1
            log.append("approval")
            if calls[0] == 1:
                raise ConnectionError("the approval service is down")
        return True

    state = _run(_workflow(_Flaky(raises=0, answer=True, log=log), log), log, approval=approve)
    assert log == ["asked", "approval", "sleep 2.0", "approval", "paid"]
    assert state.outputs["escalate"] == "escalated"


def test_the_core_asks_a_condition_again_until_a_false_answer_is_recorded() -> None:
    state, _ = _core_run()
    state, batch = advance(state, [Failed("a", ConnectionError())])
    state, batch = advance(state, [Skipped("a", "condition flag was false")])
    assert batch.starts == () and "a" in state.skipped


def _paying(log: list[str]) -> Any:
    def escalate(context: Any) -> str:
        log.append("paid")
        return "escalated"

    return escalate


@settings(max_examples=60, deadline=None)
@given(raises=st.integers(0, 4), answer=st.booleans(), attempts=st.integers(1, 5), approval=st.booleans())
def test_a_condition_raising_k_times_is_asked_until_it_answers_and_a_resume_agrees(
    raises: int, answer: bool, attempts: int, approval: bool
) -> None:
    asked: list[str] = []
    approvals: list[str] = []

    def approve(name: str, metadata: Any) -> bool:
        approvals.append(name)
        return True

    def build(log: list[str], left: int) -> Workflow:
        policy = RetryPolicy(max_attempts=attempts, backoff_base=1.0)
        return Workflow([
            Step("triage", lambda ctx: "low"),
            Step("escalate", _paying(log), ("triage",), retry=policy,
                 when=_Flaky(raises=left, answer=answer, log=log)),
        ])

    options: dict[str, Any] = {"approval": approve} if approval else {}
    whole = _run(build(asked, raises), asked, **options)
    answered = raises < attempts  # the condition answered within the attempts
    assert asked.count("asked") == min(raises + 1, attempts)
    assert asked.count("paid") == (1 if answered and answer else 0)
    assert ("escalate" in whole.skipped) == (answered and not answer)
    if approval:  # asked once the condition held, never before, never twice
        assert approvals.count("escalate") == (1 if answered and answer else 0)
    # A run resumed after every failure, one attempt each, ends as the whole run did.
    saved: list[WorkflowCheckpoint] = []
    resumed_log: list[str] = []
    left = raises
    for _ in range(attempts):
        flow = Workflow([
            Step("triage", lambda ctx: "low"),
            Step("escalate", _paying(resumed_log), ("triage",),
                 when=_Flaky(raises=min(left, 1), answer=answer, log=resumed_log)),
        ])
        left = max(left - 1, 0)
        state = _run(flow, resumed_log, checkpoint_fn=saved.append,
                     resume_from=saved[-1] if saved else None, **options)
        if state.outcome == "failed":  # the condition raised: the next run resumes
            continue
        assert dict(state.outputs) == dict(whole.outputs) and state.skipped.keys() == whole.skipped.keys()
        break
    else:
        assert not answered
    assert resumed_log.count("paid") == asked.count("paid")
