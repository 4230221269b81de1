"""audit(): what a resume skips and runs, why, and what looks wrong in a checkpoint."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import (
    CheckpointError,
    Failed,
    GraphSpec,
    Succeeded,
    TokenUsage,
    apply,
    audit,
    checkpoint_of,
    initial_state,
    plan,
)
from ekit_runtime import Step, Workflow
from tests.strategies import dags

DIAMOND = GraphSpec.of({"a": [], "b": ["a"], "c": ["a"], "d": ["b", "c"]})
ZERO = TokenUsage().to_dict()


def _checkpoint_after_a_and_failed_b() -> dict[str, Any]:
    state = initial_state(DIAMOND)
    state = apply(state, plan(state).starts)
    state = apply(state, [Succeeded("a", "A", TokenUsage(10, 5, 1))])
    state = apply(state, plan(state).starts)  # b and c
    state = apply(state, [Failed("b", ValueError("rate limited"))])
    return checkpoint_of(state).to_dict()


def test_each_step_is_skipped_or_run_with_its_reason() -> None:
    report = audit(DIAMOND, _checkpoint_after_a_and_failed_b())
    assert report.clean and report.graph_source == "given"
    assert report.skipped == ("a",) and report.to_run == ("b", "c", "d")
    a, b, c, d = report.steps
    assert (a.action, a.reason, a.usage) == ("skip", "recorded", TokenUsage(10, 5, 1))
    assert (b.action, b.reason) == ("run", "failed")
    assert b.failure is not None and b.failure.error_type == "ValueError"
    assert "recorded as failed once: ValueError: rate limited" in b.why
    assert (c.reason, c.why) == ("ready", "never recorded; ready to start")
    assert (d.reason, d.waiting_on) == ("waiting", ("b", "c"))
    assert d.why == "never recorded; waiting on b, c"
    assert report.step("d") is d
    with pytest.raises(KeyError):
        report.step("nope")


def test_the_skip_rule_is_invariant_1() -> None:
    # A step is skipped if and only if its output is recorded.
    cp = _checkpoint_after_a_and_failed_b()
    report = audit(DIAMOND, cp)
    for row in report.steps:
        assert (row.action == "skip") == (row.name in cp["outputs"])


@settings(max_examples=100, deadline=None)
@given(graph=dags(max_steps=10), data=st.data())
def test_audit_agrees_with_what_a_resume_would_start(graph: GraphSpec, data: st.DataObject) -> None:
    # Record a random legal prefix of a run, then compare the audit with the core.
    state = initial_state(graph)
    for _ in range(data.draw(st.integers(0, len(graph)))):
        batch = plan(state)
        if not batch:
            break
        state = apply(state, batch.starts)
        state = apply(state, [Succeeded(s.name, s.name) for s in batch.starts])
    cp = checkpoint_of(state)
    report = audit(graph, cp)
    resumed = initial_state(graph, cp.to_dict())
    assert report.clean
    assert set(report.skipped) == set(cp.outputs)
    ready = {r.name for r in report.steps if r.reason == "ready"}
    assert ready == set(plan(resumed).names)
    assert audit(None, cp.to_dict()) == replace(report, graph_source="checkpoint")


def test_anomalies_unknown_outputs_missing_dependencies_and_failures() -> None:
    cp = _checkpoint_after_a_and_failed_b()
    cp["outputs"]["d"] = "D"  # recorded without b and c
    cp["outputs"]["topic"] = "x"  # not a step
    cp["failures"]["ghost"] = {"error_type": "E", "message": "m", "attempts": 1}
    report = audit(DIAMOND, cp)
    kinds = [(a.kind, a.step) for a in report.anomalies]
    assert kinds == [
        ("unknown_output", "topic"),
        ("missing_dependency", "d"),
        ("unknown_failure", "ghost"),
    ]
    assert "'b', 'c'" in report.anomalies[1].message
    assert not report.clean


def test_executionkit_checkpoint_context_keys_are_reported_as_not_steps() -> None:
    legacy = {"step_index": 1, "outputs": {"topic": "cats", "a": "A"}, "cost": ZERO}
    report = audit(DIAMOND, legacy)
    assert report.skipped == ("a",)
    assert report.recorded_fingerprint is None
    [anomaly] = report.anomalies
    assert (anomaly.kind, anomaly.step) == ("unknown_output", "topic")
    assert "initial-context" in anomaly.message


def test_fingerprint_mismatch_names_added_removed_and_changed_steps() -> None:
    cp = _checkpoint_after_a_and_failed_b()
    changed = GraphSpec.of({"a": [], "b": [], "d": ["b"], "e": ["a"]})
    report = audit(changed, cp)
    mismatch = [a for a in report.anomalies if a.kind == "fingerprint_mismatch"]
    assert len(mismatch) == 1
    msg = mismatch[0].message
    assert "added: 'e'" in msg and "removed: 'c'" in msg and "dependencies changed: 'b', 'd'" in msg


def test_removed_step_output_is_named_as_such() -> None:
    cp = _checkpoint_after_a_and_failed_b()
    smaller = GraphSpec.of({"b": [], "c": [], "d": ["b", "c"]})
    report = audit(smaller, cp)
    unknown = [a for a in report.anomalies if a.kind == "unknown_output"]
    assert [a.step for a in unknown] == ["a"]
    assert "removed" in unknown[0].message


def test_a_recorded_graph_that_does_not_match_its_fingerprint_is_an_anomaly() -> None:
    cp = _checkpoint_after_a_and_failed_b()
    cp["graph"]["d"] = ["b"]
    report = audit(None, cp)
    assert report.graph_source == "checkpoint"
    assert [a.kind for a in report.anomalies] == ["fingerprint_mismatch", "graph_fingerprint"]


def test_workflow_is_accepted_and_no_graph_needs_a_recorded_one() -> None:
    wf = Workflow([Step("a", lambda c: 1), Step("b", lambda c: 2, ("a",))])
    report = audit(wf, {"step_index": 1, "outputs": {"a": 1}, "cost": ZERO})
    assert report.skipped == ("a",) and report.to_run == ("b",)
    with pytest.raises(ValueError, match="records no graph"):
        audit(None, {"step_index": 1, "outputs": {"a": 1}, "cost": ZERO})
    with pytest.raises(ValueError, match="GraphSpec"):
        audit("not a graph", {"step_index": 1, "outputs": {}, "cost": ZERO})
    with pytest.raises(CheckpointError, match="'outputs'"):
        audit(wf, {"step_index": 1, "outputs": [], "cost": ZERO})


def test_report_renders_as_table_and_json_and_never_mutates() -> None:
    cp = _checkpoint_after_a_and_failed_b()
    before = copy.deepcopy(cp)
    report = audit(DIAMOND, cp)
    assert cp == before
    assert report == audit(DIAMOND, cp)
    text = report.format()
    assert "resume skips 1 step(s), runs 3" in text
    assert "10/5/1" in text and "no anomalies" in text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["skip"] == ["a"] and data["clean"] is True
    assert data["steps"][1]["failure"]["message"] == "rate limited"
