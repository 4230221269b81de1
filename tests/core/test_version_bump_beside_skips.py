"""A version bump beside a skip: the resume keeps every skip that a skip still standing forces.

What users rely on: bumping one step's ``version`` re-runs that step and
what depends on it, and decides again the conditions below it; a step that
also needs a step skipped elsewhere (not below the bump) is still skipped,
so the run resumes its own checkpoint, finishes, pays the bumped step once,
and a further resume pays nothing. A hand-made checkpoint that records a
skipped dependency without skipping the (mapped) step that needs it is
refused naming the field, not run into a wedge.
"""

from __future__ import annotations

from typing import Any

import pytest

from ekit_core import CheckpointError, audit
from ekit_runtime import Step, Workflow


def never(ctx: Any) -> bool:
    return False


def _recording(calls: list[str], name: str, value: Any) -> Any:
    def run(ctx: Any) -> Any:
        calls.append(name)
        return value

    return run


def _plain(calls: list[str], version: str) -> Workflow:
    return Workflow([
        Step("a", _recording(calls, "a", 1), version=version),
        Step("b", _recording(calls, "b", 2), when=never),
        Step("c", _recording(calls, "c", 3), ("a", "b")),
        Step("d", _recording(calls, "d", 4), ("c",)),
    ])


def _mapped(calls: list[str], version: str) -> Workflow:
    return Workflow([
        Step("u", _recording(calls, "u", [1, 2]), version=version),
        Step("b", _recording(calls, "b", 2), when=never),
        Step("m", _recording(calls, "m", 0), ("u", "b"), map_over="u"),
        Step("n", _recording(calls, "n", 0), ("m",), map_over="m"),
        Step("after", _recording(calls, "after", 5), ("n",)),
    ])


@pytest.mark.parametrize("build", [_plain, _mapped], ids=["skipped dependency", "skipped map"])
def test_a_bump_beside_a_skip_resumes_finishes_and_pays_the_bumped_step_once(build: Any) -> None:
    calls: list[str] = []
    first = build(calls, "1").run_sync()
    assert first.checkpoint is not None
    fresh = build([], "2").run_sync()
    calls.clear()
    second = build(calls, "2").run_sync(resume_from=first.checkpoint.to_dict())
    assert calls == [calls[0]] and calls[0] in ("a", "u")  # the bumped step, once
    assert second.outputs == fresh.outputs
    assert second.checkpoint is not None and fresh.checkpoint is not None
    assert set(second.checkpoint.skipped) == set(fresh.checkpoint.skipped)
    calls.clear()
    build(calls, "2").run_sync(resume_from=second.checkpoint.to_dict())
    assert calls == []


def test_the_audit_reads_the_bump_beside_a_skip_as_the_resume_does() -> None:
    first = _plain([], "1").run_sync()
    assert first.checkpoint is not None
    report = audit(_plain([], "2"), first.checkpoint.to_dict())
    assert not report.anomalies
    assert report.to_run == ("a",)


def test_a_skip_below_the_bump_that_nothing_else_forces_is_decided_again() -> None:
    asked: list[str] = []

    def gate(ctx: Any) -> bool:
        asked.append("c")
        return False

    def build(version: str) -> Workflow:
        return Workflow([
            Step("a", lambda ctx: 1, version=version),
            Step("b", lambda ctx: 2, when=never),
            Step("c", lambda ctx: 3, ("a",), when=gate),
            Step("d", lambda ctx: 4, ("b", "c")),
        ])

    first = build("1").run_sync()
    assert first.checkpoint is not None and set(first.checkpoint.skipped) == {"b", "c", "d"}
    asked.clear()
    second = build("2").run_sync(resume_from=first.checkpoint.to_dict())
    assert asked == ["c"]  # c's condition is asked again; d stays skipped through b either way
    assert second.checkpoint is not None and set(second.checkpoint.skipped) == {"b", "c", "d"}


def test_a_mapped_step_not_skipped_beside_its_skipped_dependency_is_refused() -> None:
    calls: list[str] = []
    first = _mapped(calls, "1").run_sync()
    assert first.checkpoint is not None
    forged = first.checkpoint.to_dict()
    forged["outputs"] = {"u": [1, 2]}
    forged["skipped"] = {"b": "condition never was false"}
    calls.clear()
    with pytest.raises(CheckpointError, match="'b' as skipped, yet not 'm'"):
        _mapped(calls, "1").run_sync(resume_from=forged)
    assert calls == []
