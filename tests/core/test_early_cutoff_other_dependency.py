"""Early cutoff keeps an item only when nothing else it was made from ran again.

What users rely on: when the step a map runs over runs again (a bumped
``version``, a ``rewind``) and gives the same items, those items keep their
outputs; but when another dependency of the mapped step ran again too, the
items saw an input that is gone, so every one of them runs again (even if
that dependency's new output happens to equal its old one: it was paid to
run again, so it is new work). In an item-wise chain, the rule holds link
by link: a changed dependency of the second stage re-runs its items only.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from ekit_core import rewind
from ekit_runtime import Step, Workflow, WorkflowCheckpoint

PIECES = {"pieces": ["a", "b", "c"]}


def _pipeline(calls: list[str], versions: dict[str, str]) -> Workflow:
    def summarize(ctx: Any) -> str:
        calls.append(f"summarize {ctx['split']}")
        return f"{ctx['split']}-{ctx['tone']}"

    def critique(ctx: Any) -> str:
        calls.append(f"critique {ctx['summarize']}")
        return f"{ctx['summarize']}/{ctx['judge']}"

    return Workflow([
        Step("split", lambda ctx: ctx["pieces"], version=versions.get("split")),
        Step("tone", lambda ctx: ctx.get("style", "calm"), version=versions.get("tone")),
        Step("judge", lambda ctx: ctx.get("judge_style", "kind"), version=versions.get("judge")),
        Step("summarize", summarize, ("split", "tone"), map_over="split", context="dependencies"),
        Step("critique", critique, ("summarize", "judge"), map_over="summarize",
             context="dependencies"),
    ])


def _first(calls: list[str]) -> WorkflowCheckpoint:
    result = _pipeline(calls, {"split": "1", "tone": "1", "judge": "1"}).run_sync(PIECES)
    assert result.checkpoint is not None
    calls.clear()
    return WorkflowCheckpoint.from_dict(json.loads(json.dumps(result.checkpoint.to_dict())))


@pytest.mark.parametrize("style", ["calm", "terse"])  # the same output again, or a new one
def test_a_version_bump_of_another_dependency_runs_every_item_again(style: str) -> None:
    calls: list[str] = []
    cp = _first(calls)
    result = _pipeline(calls, {"split": "2", "tone": "2", "judge": "1"}).run_sync(
        {**PIECES, "style": style}, resume_from=cp)
    assert sorted(c for c in calls if c.startswith("summarize")) == [
        "summarize a", "summarize b", "summarize c"]
    assert result.outputs["summarize"] == [f"{p}-{style}" for p in "abc"]
    assert result.outputs["critique"] == [f"{p}-{style}/kind" for p in "abc"]


@pytest.mark.parametrize("style", ["calm", "terse"])
def test_a_rewind_of_another_dependency_runs_every_item_again(style: str) -> None:
    calls: list[str] = []
    cp = _first(calls)
    workflow = _pipeline(calls, {"split": "1", "tone": "1", "judge": "1"})
    rewound = rewind(workflow, cp, ["split", "tone"])
    result = workflow.run_sync({**PIECES, "style": style}, resume_from=rewound.to_dict())
    assert sorted(c for c in calls if c.startswith("summarize")) == [
        "summarize a", "summarize b", "summarize c"]
    assert result.outputs["critique"] == [f"{p}-{style}/kind" for p in "abc"]


def test_in_a_chain_only_the_link_whose_other_dependency_ran_again_runs() -> None:
    calls: list[str] = []
    cp = _first(calls)
    bumped = _pipeline(calls, {"split": "2", "tone": "1", "judge": "2"}).run_sync(
        {**PIECES, "judge_style": "harsh"}, resume_from=cp)
    assert sorted(calls) == ["critique a-calm", "critique b-calm", "critique c-calm"]
    assert bumped.outputs["critique"] == [f"{p}-calm/harsh" for p in "abc"]

    calls.clear()
    workflow = _pipeline(calls, {"split": "1", "tone": "1", "judge": "1"})
    again = workflow.run_sync({**PIECES, "judge_style": "harsh"},
                              resume_from=rewind(workflow, cp, ["split", "judge"]))
    assert sorted(calls) == ["critique a-calm", "critique b-calm", "critique c-calm"]
    assert again.outputs["critique"] == [f"{p}-calm/harsh" for p in "abc"]


def test_with_only_the_mapped_over_step_run_again_every_item_is_kept() -> None:
    # The yardstick for the tests above: the cutoff does keep items when it may.
    calls: list[str] = []
    cp = _first(calls)
    result = _pipeline(calls, {"split": "2", "tone": "1", "judge": "1"}).run_sync(PIECES, resume_from=cp)
    assert calls == [] and result.outputs["critique"] == [f"{p}-calm/kind" for p in "abc"]
    workflow = _pipeline(calls, {"split": "1", "tone": "1", "judge": "1"})
    workflow.run_sync(PIECES, resume_from=rewind(workflow, cp, "split"))
    assert calls == []
