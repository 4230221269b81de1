"""A step whose run-time shape changed is outdated, as a bumped version is.

What users rely on, resuming with ``allow_graph_change=True`` after turning
a plain step into a mapped one (or the reverse, or giving it a condition or
another key): its recorded output and its recorded items are not what it
makes now, so they run again, and so does everything that consumed them.
The resume ends as a fresh run of the current graph does, holding one
reading of the step (never the old plain output beside new items); the
audit says the same, with the reason; a resume without the option is
refused naming the step and its shape.
"""

from __future__ import annotations

from typing import Any

import pytest

from ekit_core import GraphMismatchError, audit, rewind
from ekit_runtime import Step, Workflow


def _build(calls: list[str], shape: str) -> Workflow:
    def m(ctx: Any) -> Any:
        calls.append(f"m {ctx['u']}")
        return ctx["u"] if shape == "plain" else ctx["u"] * 10

    def d(ctx: Any) -> Any:
        calls.append(f"d {ctx['m']}")
        return ctx["m"]

    options: dict[str, Any] = {
        "plain": {}, "mapped": {"map_over": "u"}, "conditional": {"when": _never},
    }[shape]
    return Workflow([
        Step("u", lambda ctx: [1, 2]),
        Step("m", m, ("u",), context="dependencies", **options),
        Step("d", d, ("m",), context="dependencies", join="any" if shape == "conditional" else "all"),
    ])


def _never(ctx: Any) -> bool:
    return False


SHAPES = [("plain", "mapped"), ("mapped", "plain"), ("plain", "conditional"), ("mapped", "conditional")]


@pytest.mark.parametrize(("before", "after"), SHAPES)
def test_a_reshaped_step_and_what_consumed_it_run_again_as_a_fresh_run(before: str, after: str) -> None:
    calls: list[str] = []
    first = _build(calls, before).run_sync()
    assert first.checkpoint is not None
    fresh = _build([], after).run_sync()
    calls.clear()
    resumed = _build(calls, after).run_sync(resume_from=first.checkpoint.to_dict(), allow_graph_change=True)
    assert resumed.outputs == fresh.outputs
    assert resumed.checkpoint is not None and fresh.checkpoint is not None
    assert dict(resumed.checkpoint.outputs) == dict(fresh.checkpoint.outputs)
    assert set(resumed.checkpoint.skipped) == set(fresh.checkpoint.skipped)
    assert not [c for c in calls if c.startswith("u")]  # what did not change is not paid again
    calls.clear()
    _build(calls, after).run_sync(resume_from=resumed.checkpoint.to_dict())
    assert calls == []


def test_the_audit_calls_a_reshaped_step_outdated_and_says_why() -> None:
    first = _build([], "plain").run_sync()
    assert first.checkpoint is not None
    report = audit(_build([], "mapped"), first.checkpoint.to_dict())
    rows = {row.name: row for row in report.steps}
    assert rows["m"].reason == "outdated" and "shape changed" in (rows["m"].outdated or "")
    assert rows["d"].reason == "outdated" and rows["u"].action == "skip"


def test_without_the_option_the_resume_is_refused_naming_the_reshaped_step() -> None:
    first = _build([], "plain").run_sync()
    assert first.checkpoint is not None
    with pytest.raises(GraphMismatchError, match="shape changed: 'm'"):
        _build([], "mapped").run_sync(resume_from=first.checkpoint.to_dict())


def test_a_rewind_into_the_reshaped_graph_resumes_as_a_fresh_run() -> None:
    first = _build([], "mapped").run_sync()
    assert first.checkpoint is not None
    workflow = _build([], "plain")
    rewound = rewind(workflow, first.checkpoint, "m")
    assert not [n for n in rewound.outputs if n.startswith("m")]  # the step and its items
    resumed = workflow.run_sync(resume_from=rewound.to_dict(), allow_graph_change=True)
    assert resumed.checkpoint is not None
    assert dict(resumed.checkpoint.outputs) == {"u": [1, 2], "m": [1, 2], "d": [1, 2]}


def _fresh_and_resumed(before: list[Step], after: list[Step]) -> tuple[Any, Any]:
    first = Workflow(before).run_sync()
    assert first.checkpoint is not None
    fresh = Workflow(after).run_sync()
    resumed = Workflow(after).run_sync(resume_from=first.checkpoint.to_dict(), allow_graph_change=True)
    assert resumed.checkpoint is not None and fresh.checkpoint is not None
    return fresh, resumed


def test_a_skipped_step_that_lost_its_condition_runs_and_what_joined_its_absence_runs_again() -> None:
    joined = Step("j", lambda ctx: sorted(ctx), ("a", "b"), join="any", context="dependencies")
    fresh, resumed = _fresh_and_resumed(
        [Step("a", lambda ctx: 1), Step("b", lambda ctx: 2, when=_never), joined],
        [Step("a", lambda ctx: 1), Step("b", lambda ctx: 2), joined])
    assert resumed.outputs == fresh.outputs and resumed.outputs["j"] == ["a", "b"]


def test_a_join_made_strict_beside_a_skipped_dependency_is_skipped_not_refused() -> None:
    def steps(join: Any) -> list[Step]:
        return [Step("a", lambda ctx: 1), Step("b", lambda ctx: 2, when=_never),
                Step("j", lambda ctx: 3, ("a", "b"), join=join), Step("after", lambda ctx: 4, ("j",))]

    fresh, resumed = _fresh_and_resumed(steps("any"), steps("all"))
    assert resumed.outputs == fresh.outputs
    assert set(resumed.checkpoint.skipped) == set(fresh.checkpoint.skipped) == {"b", "j", "after"}


def test_a_step_made_mapped_over_a_map_whose_items_were_skipped_finishes() -> None:
    def steps(chained: bool) -> list[Step]:
        return [Step("u", lambda ctx: [1, 2]), Step("m", lambda ctx: 0, ("u",), map_over="u", when=_never),
                Step("n", lambda ctx: 5, ("m",), map_over="m" if chained else None)]

    fresh, resumed = _fresh_and_resumed(steps(False), steps(True))
    assert resumed.outputs == fresh.outputs and resumed.outputs["n"] == []
