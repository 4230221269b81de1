"""audit(): what a resume skips and runs, why, and what looks wrong in a checkpoint."""

from __future__ import annotations

import asyncio
import copy
import importlib
import json
from dataclasses import replace
from typing import Any, NoReturn

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import (
    CheckpointError,
    Failed,
    GraphMismatchError,
    GraphSpec,
    RetryPolicy,
    Succeeded,
    TokenUsage,
    WorkflowCheckpoint,
    apply,
    audit,
    checkpoint_of,
    initial_state,
    plan,
)
from ekit_core.rewind import downstream
from ekit_runtime import Step, StepTimeoutError, Workflow
from tests.support.helpers import recorded_graph, with_recorded_graph
from tests.support.strategies import dags

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
    cp = with_recorded_graph(cp, {**recorded_graph(cp), "d": ["b"]})
    report = audit(None, cp)
    assert report.graph_source == "checkpoint"
    # A resume compares the recorded graph with its own (here the same one)
    # and goes ahead: only the audit says that the fingerprint does not fit.
    assert [a.kind for a in report.anomalies] == ["graph_fingerprint"]
    assert "not to the recorded fingerprint" in report.anomalies[0].message


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


# A recorded step with an old failure: the output wins. A step that failed,
# was retried and succeeded keeps its failure record; a resume skips it.


def _checkpoint_with_b_failed_then_recorded() -> WorkflowCheckpoint:
    policies = {"b": RetryPolicy(max_attempts=2, backoff_base=0)}
    state = initial_state(DIAMOND, policies=policies)
    state = apply(state, plan(state).starts)
    state = apply(state, [Succeeded("a", "A")])
    state = apply(state, plan(state).starts)  # b and c
    state = apply(state, [Failed("b", TimeoutError("slow model"))])
    state = apply(state, plan(state).starts)  # b again
    state = apply(state, [Succeeded("b", "B", TokenUsage(7, 3, 1))])
    return checkpoint_of(state)


def test_a_recorded_step_with_an_old_failure_is_skipped() -> None:
    cp = _checkpoint_with_b_failed_then_recorded()
    assert "b" in cp.outputs and cp.failures["b"].error_type == "TimeoutError"
    for given_cp in (cp, cp.to_dict(), json.loads(json.dumps(cp.to_dict()))):
        report = audit(DIAMOND, given_cp)
        assert report.clean
        assert report.skipped == ("a", "b") and report.to_run == ("c", "d")
        b = report.step("b")
        assert (b.action, b.reason, b.why) == ("skip", "recorded", "output recorded")
        assert b.usage == TokenUsage(7, 3, 1)
        assert report.step("d").waiting_on == ("c",)
    # And the core agrees: resuming starts c, never b again.
    assert plan(initial_state(DIAMOND, cp)).names == ("c",)


def test_an_old_failure_does_not_make_a_recorded_step_run_in_a_hand_made_checkpoint() -> None:
    cp = {
        "step_index": 2, "outputs": {"a": 1, "b": 2}, "cost": ZERO,
        "failures": {"b": {"error_type": "E", "message": "m", "attempts": 3}},
    }
    report = audit(DIAMOND, cp)
    assert report.step("b").action == "skip" and "b" not in report.to_run
    assert report.step("b").failure is None  # the row explains the skip, not the old failure
    assert report.to_dict()["steps"][1]["reason"] == "recorded"


# Everything a resume would refuse is an anomaly.


def _returns(value: str) -> Any:
    return lambda ctx: value


def test_a_context_key_that_is_a_step_name_is_an_anomaly_and_resume_refuses_it() -> None:
    cp = _checkpoint_after_a_and_failed_b()
    cp["context"] = {"topic": "owls", "c": "shadowed", "b": 1}
    report = audit(DIAMOND, cp)
    assert [(a.kind, a.step) for a in report.anomalies] == [
        ("context_collision", "c"), ("context_collision", "b"),
    ]
    assert not report.clean and "'c'" in report.anomalies[0].message
    with pytest.raises(CheckpointError, match="collide with step name"):
        initial_state(DIAMOND, cp)
    wf = Workflow([Step(n, _returns(n), DIAMOND.deps[n]) for n in DIAMOND.names])
    with pytest.raises(ValueError, match="collide with step name"):
        wf.run_sync(resume_from=cp)
    # The same checkpoint without the colliding keys is clean and resumes.
    cp["context"] = {"topic": "owls"}
    assert audit(DIAMOND, cp).clean
    initial_state(DIAMOND, cp)


def test_anything_else_resume_refuses_is_reported_by_the_backstop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A rule added to initial_state later is reported without audit knowing it.
    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise ValueError("checkpoint field 'x': a rule added later")

    # The module, not the function ekit_core re-exports under the same name.
    monkeypatch.setattr(importlib.import_module("ekit_core.audit"), "initial_state", refuse)
    report = audit(DIAMOND, _checkpoint_after_a_and_failed_b())
    assert [(a.kind, a.step) for a in report.anomalies] == [("resume_refused", None)]
    assert "a rule added later" in report.anomalies[0].message


def test_a_budget_the_recorded_usage_reaches_is_an_anomaly() -> None:
    cp = _checkpoint_after_a_and_failed_b()  # usage 10/5/1
    assert audit(DIAMOND, cp, budget=TokenUsage(11, 0, 0)).clean
    report = audit(DIAMOND, cp, budget=TokenUsage(10, 0, 0))
    [anomaly] = report.anomalies
    assert (anomaly.kind, anomaly.step) == ("budget_reached", None)
    assert "10/5/1" in anomaly.message and "10/0/0" in anomaly.message
    assert initial_state(DIAMOND, cp, budget=TokenUsage(10, 0, 0)).halt is not None
    # A finished run reaching its budget has nothing left to refuse.
    done = {**cp, "outputs": {n: n for n in DIAMOND.names}, "failures": {}}
    assert audit(DIAMOND, done, budget=TokenUsage(1, 1, 1)).clean
    negative = (TokenUsage(-1, 0, 0), r"input_tokens must be an int >= 0, got -1")
    for bad, fragment in [(5, "TokenUsage"), negative]:
        with pytest.raises(ValueError, match=fragment):
            audit(DIAMOND, cp, budget=bad)  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None)
@given(graph=dags(max_steps=8), data=st.data())
def test_audit_is_clean_exactly_when_a_resume_accepts_the_checkpoint(
    graph: GraphSpec, data: st.DataObject
) -> None:
    # A random legal prefix of a run, then a random context (keys that may be
    # step names), a graph and fingerprint that may be another graph's, and a budget.
    state = initial_state(graph)
    for _ in range(data.draw(st.integers(0, len(graph)), label="rounds")):
        batch = plan(state)
        if not batch:
            break
        state = apply(state, batch.starts)
        # One step finishes per round, so that most prefixes leave work to do.
        state = apply(state, [Succeeded(batch.starts[0].name, "out", TokenUsage(3, 1, 1))])
    cp = checkpoint_of(state).to_dict()
    # Each refusal drawn alone about as often as with the others.
    keys = st.sampled_from([*graph.names, "topic", "user"]) if data.draw(
        st.booleans(), label="colliding keys allowed"
    ) else st.sampled_from(["topic", "user"])
    cp["context"] = data.draw(st.dictionaries(keys, st.integers(), max_size=2), label="context")
    if data.draw(st.booleans(), label="other graph"):
        cp = with_recorded_graph(cp, {"other": []})
        cp["fingerprint"] = GraphSpec.of({"other": []}).fingerprint
    # Budgets near the recorded usage, so that both sides of "reached" occur.
    spent = state.cost.input_tokens
    budget = data.draw(
        st.none() | st.builds(TokenUsage, st.integers(max(0, spent - 1), spent + 1)), label="budget"
    )
    try:
        resumed = initial_state(graph, cp, budget=budget)
    except ValueError:
        refused = True
    else:
        refused = resumed.halt is not None  # starts nothing: the budget is spent
    report = audit(graph, cp, budget=budget)
    assert report.clean == (not refused), (report.format(), refused)


# Rules that one test alone guarded: a second, direct test for each.


def test_why_counts_attempts_and_names_what_a_failed_step_waits_on() -> None:
    cp = {
        "step_index": 1, "outputs": {"a": "A"}, "cost": ZERO,
        "step_usage": {"a": {"input_tokens": 1, "output_tokens": 2, "llm_calls": 1},
                       "d": {"input_tokens": 9, "output_tokens": 9, "llm_calls": 9}},
        "failures": {
            "b": {"error_type": "TimeoutError", "message": "slow", "attempts": 3},
            "d": {"error_type": "ValueError", "message": "bad", "attempts": 1},
        },
    }
    report = audit(DIAMOND, cp)
    assert report.step("b").why == "recorded as failed 3 times: TimeoutError: slow"
    # d failed once (an earlier run) and now also waits on b and c.
    d = report.step("d")
    assert (d.action, d.reason, d.waiting_on) == ("run", "failed", ("b", "c"))
    assert d.why == "recorded as failed once: ValueError: bad; waiting on b, c"
    assert d.usage == TokenUsage(9, 9, 9)  # a run row still shows what was recorded
    assert report.to_dict()["steps"][3]["why"] == d.why


def test_every_missing_dependency_is_named_singular_or_plural() -> None:
    report = audit(DIAMOND, {"step_index": 2, "outputs": {"b": 1, "d": 2}, "cost": ZERO})
    assert [(a.kind, a.step, a.message) for a in report.anomalies] == [
        ("missing_dependency", "b", "output of 'b' is recorded but not that of its dependency 'a'"),
        ("missing_dependency", "d", "output of 'd' is recorded but not that of its dependency 'c'"),
    ]
    report = audit(DIAMOND, {"step_index": 1, "outputs": {"d": 2}, "cost": ZERO})
    [anomaly] = report.anomalies
    assert anomaly.message.endswith("its dependencies 'b', 'c'")


def test_outputs_and_failures_of_a_removed_step_and_a_context_key_are_told_apart() -> None:
    wf = Workflow([Step(n, _returns(n), DIAMOND.deps[n]) for n in DIAMOND.names])
    saved: list[WorkflowCheckpoint] = []
    wf.run_sync({"topic": "owls"}, checkpoint_fn=saved.append)
    cp = saved[-1].to_dict()
    cp["outputs"]["topic"] = "owls"  # as ExecutionKit kept context among outputs
    cp["failures"]["d"] = {"error_type": "E", "message": "m", "attempts": 1}
    smaller = Workflow([Step(n, _returns(n), DIAMOND.deps[n]) for n in ("a", "b", "c")])
    report = audit(smaller, cp)
    found = {(a.kind, a.step): a.message for a in report.anomalies}
    assert "removed" in found[("unknown_output", "d")]
    assert found[("unknown_output", "topic")] == "output recorded for 'topic': a context key"
    assert found[("unknown_failure", "d")] == "failure recorded for 'd', not a step"
    assert ("fingerprint_mismatch", None) in found


def test_a_recorded_graph_that_is_invalid_or_edited_is_a_graph_fingerprint_anomaly() -> None:
    cp = _checkpoint_after_a_and_failed_b()
    edited = with_recorded_graph(cp, {**recorded_graph(cp), "d": ["b"]})  # the fingerprint still says DIAMOND
    # Given the real graph, the fingerprint matches; only the recorded graph lies.
    assert [a.kind for a in audit(DIAMOND, edited).anomalies] == ["graph_fingerprint"]
    cyclic = with_recorded_graph(cp, {**recorded_graph(cp), "a": ["d"]})
    [anomaly] = audit(DIAMOND, cyclic).anomalies
    assert anomaly.kind == "graph_fingerprint"
    assert anomaly.message.startswith("the recorded graph is invalid: dependency cycle")
    assert audit(DIAMOND, cp).clean


# Changed steps (a bumped version tag, changed dependencies) run again, with
# everything downstream: audit says so, as the resume does.


def _tagged(graph: GraphSpec, versions: dict[str, str], ran: list[str] | None = None) -> Workflow:
    def make(name: str) -> Any:
        def run(ctx: Any) -> str:
            if ran is not None:
                ran.append(name)
            return name

        return run

    return Workflow([Step(n, make(n), graph.deps[n], version=versions.get(n)) for n in graph.names])


def test_a_bumped_version_makes_the_step_and_its_descendants_outdated() -> None:
    cp = _tagged(DIAMOND, {"a": "1", "b": "1"}).run_sync().checkpoint
    assert cp is not None and dict(cp.versions) == {"a": "1", "b": "1"}
    ran: list[str] = []
    bumped = _tagged(DIAMOND, {"a": "1", "b": "2"}, ran)
    report = audit(bumped, cp)
    assert report.clean and report.outdated == ("b", "d")
    assert report.skipped == ("a", "c") and report.to_run == ("b", "d")
    b, d = report.step("b"), report.step("d")
    assert (b.action, b.reason, b.outdated) == ("run", "outdated", "its version changed from '1' to '2'")
    assert b.why == "output recorded but outdated: its version changed from '1' to '2'"
    assert d.outdated == "it depends on 'b', which runs again" and d.waiting_on == ("b",)
    assert "resume skips 2 step(s), runs 2 (2 outdated)" in report.format()
    assert report.to_dict()["outdated"] == ["b", "d"]
    # The resume does what the audit says.
    bumped.run_sync(resume_from=cp)
    assert sorted(ran) == sorted(report.to_run)


def test_versions_for_a_bare_graph_and_their_checks() -> None:
    cp = _tagged(DIAMOND, {"a": "1", "b": "1"}).run_sync().checkpoint
    assert cp is not None
    # A GraphSpec says nothing of tags: the recorded ones stand.
    assert audit(DIAMOND, cp).outdated == ()
    assert audit(None, cp).outdated == ()
    assert audit(DIAMOND, cp, versions={"a": "2", "b": "1"}).outdated == ("a", "b", "c", "d")
    # No tags at all, where the checkpoint recorded some: both changed.
    assert audit(DIAMOND, cp, versions={}).outdated == ("a", "b", "c", "d")
    assert audit(_tagged(DIAMOND, {}), cp).outdated == ("a", "b", "c", "d")
    with pytest.raises(ValueError, match="version given for unknown step 'zz'"):
        audit(DIAMOND, cp, versions={"zz": "1"})
    with pytest.raises(ValueError, match="version of step 'a' must be a string"):
        audit(DIAMOND, cp, versions={"a": 3})  # type: ignore[dict-item]


def test_a_changed_dependency_is_outdated_and_the_mismatch_says_what_resume_says() -> None:
    old = GraphSpec.of({"fetch": [], "summary": ["fetch"], "email": ["summary"], "other": []})
    cp = _tagged(old, {}).run_sync().checkpoint
    assert cp is not None
    new = GraphSpec.of({"fetch": [], "style": [], "summary": ["fetch", "style"],
                        "email": ["summary"], "other": []})
    ran: list[str] = []
    report = audit(_tagged(new, {}, ran), cp)
    assert report.to_run == ("style", "summary", "email") and report.outdated == ("summary", "email")
    assert "dependencies changed from ['fetch'] to ['fetch', 'style']" in report.step("summary").why
    [anomaly] = report.anomalies
    assert anomaly.kind == "fingerprint_mismatch"
    # One loading path, one message: the anomaly is what the refused resume raises.
    with pytest.raises(GraphMismatchError) as refused:
        initial_state(new, cp)
    assert anomaly.message == str(refused.value)
    # With allow_graph_change the resume runs what the audit lists.
    _tagged(new, {}, ran).run_sync(resume_from=cp, allow_graph_change=True)
    assert ran == list(report.to_run)


@settings(max_examples=80, deadline=None)
@given(graph=dags(max_steps=9), data=st.data())
def test_audit_of_a_version_bump_agrees_with_what_the_resume_runs(
    graph: GraphSpec, data: st.DataObject
) -> None:
    bumped = data.draw(st.sets(st.sampled_from(graph.names)), label="bumped")
    cp = _tagged(graph, {n: "1" for n in graph.names}).run_sync().checkpoint
    assert cp is not None
    ran: list[str] = []
    flow = _tagged(graph, {n: "2" if n in bumped else "1" for n in graph.names}, ran)
    report = audit(flow, cp)
    assert set(report.outdated) == set(downstream(graph, bumped))
    flow.run_sync(resume_from=cp)
    assert sorted(ran) == sorted(report.to_run)


def test_a_step_timeout_is_shown_with_the_step_and_the_limit() -> None:
    async def never(ctx: Any) -> str:
        await asyncio.Event().wait()  # never set: only the timeout ends it
        return "unreachable"

    flow = Workflow([Step("quick", lambda ctx: "q"), Step("slow", never, ("quick",), timeout=0.05)])
    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(StepTimeoutError, match=r"^step 'slow' timed out after 0\.05s"):
        flow.run_sync(checkpoint_fn=saved.append)
    row = audit(flow, saved[-1]).step("slow")
    assert row.why == "recorded as failed once: StepTimeoutError: step 'slow' timed out after 0.05s"
