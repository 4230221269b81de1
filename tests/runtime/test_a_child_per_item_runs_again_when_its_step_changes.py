"""A child per item of a map (``child=`` with ``map_over=``) runs again where its work changed.

What users rely on (docs/concepts.md: every step whose work changed, and what
is downstream of it, runs again with a new attempt number): a version bump of
one of the child's steps runs that step again for every item, and the child's
steps after it, with keys no earlier attempt had; the steps before it keep
their items; ``audit`` says so before anything runs. Before the fix the
child's steps (templates, with no shape of their own) kept their items: a
bump ran nothing again and the run handed back the old code's outputs.
"""

from __future__ import annotations

import json
from typing import Any

from ekit_core import WorkflowCheckpoint, audit
from ekit_runtime import Step, Workflow
from ekit_runtime.attempt import attempt_key


def _build(calls: list[str], fetch: str = "1", pick: str = "1") -> Workflow:
    def note(what: str, value: Any) -> Any:
        calls.append(f"{what} {attempt_key()}")
        return value

    child = Workflow([
        Step("fetch", lambda ctx: note("fetch", f"{ctx['topics']}@{fetch}"), version=fetch),
        Step("pick", lambda ctx: note("pick", f"{ctx['fetch']}/{pick}"), ("fetch",), version=pick),
    ])
    return Workflow([
        Step("topics", lambda ctx: ["a", "b"]),
        Step("research", depends_on=("topics",), child=child, map_over="topics"),
        Step("report", lambda ctx: note("report", ctx["research"]), ("research",)),
    ])


def _json(cp: WorkflowCheckpoint | None) -> dict[str, Any]:
    assert cp is not None
    loaded: dict[str, Any] = json.loads(json.dumps(cp.to_dict()))
    return loaded


def test_a_bumped_child_step_runs_again_per_item_with_what_follows_under_new_keys() -> None:
    first: list[str] = []
    done = _build(first).run_sync(run_id="r")
    assert done.outputs["report"] == ["a@1/1", "b@1/1"]
    again: list[str] = []
    bumped = _build(again, fetch="2")
    assert done.checkpoint is not None
    runs = {s.name for s in audit(bumped, done.checkpoint).steps if s.action == "run"}
    assert {"research/fetch", "research/pick", "research", "report"} <= runs, runs
    result = bumped.run_sync(run_id="r", resume_from=_json(done.checkpoint))
    assert result.outputs["report"] == ["a@2/1", "b@2/1"]
    assert sorted(c.split()[0] for c in again) == ["fetch", "fetch", "pick", "pick", "report"]
    assert not set(first) & set(again), "work that ran again reused an attempt key"


def test_a_bump_of_the_childs_last_step_keeps_the_items_before_it() -> None:
    first: list[str] = []
    done = _build(first).run_sync(run_id="r")
    again: list[str] = []
    result = _build(again, pick="2").run_sync(run_id="r", resume_from=_json(done.checkpoint))
    assert sorted(c.split()[0] for c in again) == ["pick", "pick", "report"]
    assert result.outputs["report"] == ["a@1/2", "b@1/2"]


def test_a_change_upstream_of_the_map_runs_the_child_on_the_new_items() -> None:
    def build(items: tuple[str, ...], version: str) -> Workflow:
        child = Workflow([Step("fetch", lambda ctx: f"{ctx['topics']}!")])
        return Workflow([
            Step("topics", lambda ctx: list(items), version=version),
            Step("research", depends_on=("topics",), child=child, map_over="topics"),
        ])

    done = build(("a", "b"), "1").run_sync()
    again = build(("a", "c"), "2").run_sync(resume_from=_json(done.checkpoint))
    assert again.outputs["research"] == ["a!", "c!"]  # (it was ["a!", "b!"]: the old items')
