"""Rules of a resume that a planted bug once slipped past: each pinned by a test.

- a checkpoint whose ``join="any"`` step has every input skipped, yet is not
  itself recorded as skipped, is refused (naming ``skipped`` and the step);
- a denial followed by a later question of the same step is refused
  (naming the question's field), read from a dict or built as a value;
- answering a question already answered is refused, and the first answer
  stands, in the core and through ``Workflow.run(answers=...)``;
- a workflow that drops every ``version`` tag, resumed from a checkpoint
  that recorded some, runs the tagged steps (and what needs them) again.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import pytest

from ekit_core import Answer, CheckpointError, Exchange, Question, WorkflowCheckpoint, answer
from ekit_runtime import RunWaiting, Step, Workflow, ask

ran: list[str] = []


def _note(name: str) -> Any:
    def body(ctx: Any) -> Any:
        ran.append(name)
        return name

    return body


def _no(ctx: Any) -> bool:
    return False


def test_a_join_over_skipped_inputs_not_itself_skipped_is_refused() -> None:
    workflow = Workflow([
        Step("a", _note("a"), when=_no),
        Step("b", _note("b"), when=_no),
        Step("j", _note("j"), ("a", "b"), join="any"),
        Step("after", _note("after"), ("j",)),
    ])
    result = workflow.run_sync()
    assert result.checkpoint is not None
    data = copy.deepcopy(result.checkpoint.to_dict())
    assert data["skipped"]["j"] == "every step it joins was skipped"
    del data["skipped"]["j"], data["skipped"]["after"]
    ran.clear()
    with pytest.raises(CheckpointError, match="every step 'j' joins is skipped, yet it is not") as caught:
        workflow.run_sync(resume_from=data)
    assert caught.value.field == "skipped" and ran == []


def _asking() -> Workflow:
    def decide(ctx: Any) -> Any:
        ran.append("decide")
        return ask("which?")

    return Workflow([Step("decide", decide)])


def _waiting(workflow: Workflow, **options: Any) -> WorkflowCheckpoint:
    with pytest.raises(RunWaiting) as caught:
        workflow.run_sync(**options)
    return caught.value.checkpoint


def test_a_denial_followed_by_a_later_question_of_the_same_step_is_refused() -> None:
    workflow = _asking()
    data = _waiting(workflow).to_dict()
    question = data["asked"]["decide"][0]
    denied = {**question, "kind": "approval", "answer": {"approved": False, "reason": "no", "by": "ann"}}
    data["asked"]["decide"] = [denied, question]
    ran.clear()
    with pytest.raises(CheckpointError, match="is a denial, yet a later question follows") as caught:
        workflow.run_sync(resume_from=data)
    assert caught.value.field == "asked.decide[0]" and ran == []
    with pytest.raises(CheckpointError, match="denial"):
        WorkflowCheckpoint.from_dict(data)


def test_the_same_order_is_required_of_a_checkpoint_built_as_a_value() -> None:
    # Not read by from_dict: made with dataclasses.replace, and resumed as it is.
    workflow = _asking()
    waiting = _waiting(workflow)
    question = waiting.asked["decide"][0]
    denial = Exchange(Question("approval", "go?"), Answer.deny("no", by="ann"))
    unanswered = Exchange(Question("value", "first?"))
    for first, problem in ((denial, "a denial"), (unanswered, "unanswered")):
        made = replace(waiting, asked=MappingProxyType({"decide": (first, question)}))
        ran.clear()
        with pytest.raises(CheckpointError, match=f"is {problem}, yet a later question follows") as caught:
            workflow.run_sync(resume_from=made)
        assert caught.value.field == "asked.decide[0]" and ran == []


def test_answering_a_question_already_answered_is_refused_and_keeps_the_first_answer() -> None:
    workflow = _asking()
    waiting = _waiting(workflow)
    first = answer(waiting, "decide", Answer("left", by="ann"))
    with pytest.raises(ValueError, match="'decide' has no pending question"):
        answer(first, "decide", Answer("right", by="bob"))
    assert first.asked["decide"][0].answer == Answer("left", by="ann")
    # Through a resume: the answer recorded already is the one the step gets.
    with pytest.raises(ValueError, match="'decide' has no pending question"):
        workflow.run_sync(resume_from=first.to_dict(), answers={"decide": "right"})
    assert workflow.run_sync(resume_from=first.to_dict()).outputs["decide"] == "left"


def test_a_workflow_that_drops_every_version_tag_runs_the_tagged_steps_again() -> None:
    def make(tagged: bool) -> Workflow:
        return Workflow([
            Step("a", _note("a"), version="1" if tagged else None),
            Step("b", _note("b"), ("a",)),
            Step("c", _note("c")),
        ])

    result = make(tagged=True).run_sync()
    assert result.checkpoint is not None and dict(result.checkpoint.versions) == {"a": "1"}
    ran.clear()
    make(tagged=False).run_sync(resume_from=result.checkpoint.to_dict())
    assert sorted(ran) == ["a", "b"]
