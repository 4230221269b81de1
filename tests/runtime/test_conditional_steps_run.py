"""A step that runs only on a condition: skipped for good, with its reason, and what needs it too.

What users rely on: a false condition records the step as skipped (never
run, on this run or on a resume, and never asked again), passes the skip to
every step that needs it, except a join over alternatives, which runs on
whatever ran; a condition that raises fails its step; per-item conditions
leave the skipped items out of the collected output.
"""

from __future__ import annotations

from typing import Any

import pytest

from ekit_core import StepSkipped
from ekit_runtime import Step, Workflow, WorkflowCheckpoint


def _router(asked: list[str]) -> Workflow:
    def urgent(ctx: Any) -> bool:
        asked.append("urgent")
        return bool(ctx["route"] == "urgent")

    def calm(ctx: Any) -> bool:
        asked.append("calm")
        return bool(ctx["route"] != "urgent")

    return Workflow([
        Step("route", lambda ctx: "urgent" if "!" in ctx["ticket"] else "calm"),
        Step("escalate", lambda ctx: "paged on-call", ("route",), when=urgent),
        Step("notify", lambda ctx: "told the manager", ("escalate",)),
        Step("reply", lambda ctx: "a polite reply", ("route",), when=calm),
        Step("close", lambda ctx: sorted(k for k in ctx if k in ("notify", "reply")),
             ("notify", "reply"), join="any", context="dependencies"),
    ])


def test_a_false_condition_skips_the_branch_and_the_join_sees_what_ran() -> None:
    asked: list[str] = []
    events: list[Any] = []
    result = _router(asked).run_sync({"ticket": "printer jammed"}, trace=events.append)
    assert result.outputs["close"] == ["reply"]
    assert "escalate" not in result.outputs and "notify" not in result.outputs
    assert result.checkpoint is not None
    skipped = dict(result.checkpoint.skipped)
    assert set(skipped) == {"escalate", "notify"}
    assert skipped["escalate"].startswith("condition ") and skipped["escalate"].endswith("urgent was false")
    assert skipped["notify"] == "it needs 'escalate', which was skipped"
    assert {e.name: e.reason for e in events if isinstance(e, StepSkipped)}.keys() == {"escalate", "notify"}
    assert result.checkpoint.format_version == 2

    asked.clear()
    urgent = _router(asked).run_sync({"ticket": "server down!"})
    assert urgent.outputs["close"] == ["notify"] and urgent.outputs["notify"] == "told the manager"


def test_a_skip_is_never_asked_again_on_resume() -> None:
    asked: list[str] = []
    wf = _router(asked)
    saved: list[WorkflowCheckpoint] = []
    wf.run_sync({"ticket": "printer jammed"}, checkpoint_fn=saved.append)
    mid = next(cp for cp in saved if "escalate" in cp.skipped and "close" not in cp.outputs)
    asked.clear()
    result = wf.run_sync(resume_from=mid.to_dict())
    assert "urgent" not in asked  # recorded as skipped: its condition is not evaluated again
    assert result.outputs["close"] == ["reply"]


def test_every_joined_branch_skipped_skips_the_join() -> None:
    wf = Workflow([
        Step("a", lambda ctx: 1, when=lambda ctx: False),
        Step("b", lambda ctx: 2, when=lambda ctx: False),
        Step("j", lambda ctx: "ran", ("a", "b"), join="any"),
        Step("after", lambda ctx: "ran too", ("j",)),
    ])
    result = wf.run_sync()
    assert result.checkpoint is not None
    assert set(result.checkpoint.skipped) == {"a", "b", "j", "after"}
    assert result.checkpoint.skipped["j"] == "every step it joins was skipped"
    assert result.ok and dict(result.outputs) == {}


def test_a_condition_that_raises_fails_its_step() -> None:
    def broken(ctx: Any) -> bool:
        raise KeyError("no such field")

    with pytest.raises(KeyError) as caught:
        Workflow([Step("a", lambda ctx: 1, when=broken)]).run_sync()
    assert any("condition of step 'a'" in note for note in caught.value.__notes__)


def test_per_item_conditions_leave_skipped_items_out() -> None:
    wf = Workflow([
        Step("answers", lambda ctx: [3, 8, 1, 9]),
        Step("grade", lambda ctx: ctx["answers"] * 10, ("answers",), map_over="answers",
             when=lambda ctx: ctx["answers"] > 2, context="dependencies"),
        Step("best", lambda ctx: max(ctx["grade"]), ("grade",), context="dependencies"),
    ])
    result = wf.run_sync()
    assert result.outputs["grade"] == [30, 80, 90]
    assert result.outputs["best"] == 90
    assert result.checkpoint is not None and set(result.checkpoint.skipped) == {"grade[2]"}
