"""Auditing a shaped run: items, skips and expansions explained one by one.

A consistent checkpoint of a run with mapped and conditional steps audits
clean: its items are rows of their own (recorded, or to run), never outputs
that are not steps; a skip is explained with its reason; a mapped step not
collected says how many items it expands into. Inconsistent records are
still anomalies.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from ekit_core import (
    GraphSpec,
    WorkflowCheckpoint,
    advance,
    audit,
    checkpoint_of,
    initial_state,
)
from ekit_core.transitions import context_outputs
from ekit_runtime import Step, Workflow
from tests.support.shaped_runs import all_skipped_chain, pipeline, run_to_end, shaped_graphs, shaped_result


def checkpoints() -> tuple[Workflow, list[WorkflowCheckpoint]]:
    saved: list[WorkflowCheckpoint] = []
    wf = pipeline([])
    wf.run_sync({"doc": "aaa|b|cc"}, checkpoint_fn=saved.append)
    return wf, saved


def test_every_checkpoint_of_a_mapped_run_audits_clean() -> None:
    wf, saved = checkpoints()
    for cp in saved:
        assert audit(wf, cp).clean, audit(wf, cp).format()
        assert audit(None, cp.to_dict()).clean


def test_items_are_rows_of_their_own_right_before_their_mapped_step() -> None:
    wf, saved = checkpoints()
    report = audit(wf, saved[0])  # split recorded, nothing else
    assert [s.name for s in report.steps] == [
        "split", "summarize[0]", "summarize[1]", "summarize[2]", "summarize",
        "critique[0]", "critique[1]", "critique[2]", "critique", "merge"]
    item = report.step("summarize[1]")
    assert (item.action, item.reason, item.item_of, item.depends_on) == (
        "run", "ready", "summarize", ("split",))
    assert report.step("critique[1]").waiting_on == ("summarize[1]",)
    mapped = report.step("summarize")
    assert (mapped.action, mapped.reason, mapped.items) == ("run", "mapped", 3)
    assert mapped.why == "would expand into 3 item(s)"


def test_a_half_done_map_counts_its_recorded_items() -> None:
    wf, saved = checkpoints()
    half = json.loads(json.dumps(saved[-1].to_dict()))
    for name in ("summarize[2]", "summarize", "critique[2]", "critique", "merge"):
        del half["outputs"][name]
    half["step_index"] = len(half["outputs"])
    report = audit(wf, half)
    assert report.clean, report.format()
    assert report.to_run == ("summarize[2]", "summarize", "critique[2]", "critique", "merge")
    assert report.step("summarize").why == (
        "2 of 3 item(s) recorded or skipped, 1 to run; collected once all are")
    assert report.step("critique[0]").action == "skip"


def test_a_mapped_step_whose_input_is_not_recorded_waits_then_expands() -> None:
    wf = pipeline([])
    report = audit(wf, None)
    row = report.step("summarize")
    assert (row.reason, row.items, row.waiting_on) == ("mapped", None, ("split",))
    assert row.why.startswith("waiting on split; then expands")


def urgent(ctx: dict[str, Any]) -> bool:
    return bool(ctx["route"] == "urgent")


def test_a_chained_map_whose_items_were_all_skipped_still_waits_for_its_other_dependency() -> None:
    # d runs item by item after b, whose only item was skipped; d also needs
    # c, not yet run: a resume does not collect d yet (c may still be skipped).
    graph, state = all_skipped_chain()
    report = audit(graph, checkpoint_of(state))
    assert report.clean, report.format()
    d = report.step("d")
    assert (d.action, d.reason, d.waiting_on) == ("run", "mapped", ("c",))
    assert d.why == "1 item(s) recorded or skipped; waiting on c, then collected"
    resumed, batch = advance(initial_state(graph, checkpoint_of(state)))
    assert "d" not in resumed.outputs and batch.names == ("c",)


def test_skips_are_explained_with_their_reason_and_not_run() -> None:
    wf = Workflow([
        Step("route", lambda c: c["kind"]),
        Step("escalate", lambda c: "ESC", ("route",), when=urgent),
        Step("reply", lambda c: "re", ("route",)),
        Step("join", lambda c: sorted(c), ("escalate", "reply"), join="any",
             context="dependencies"),
        Step("after", lambda c: "x", ("escalate",)),
    ])
    cp = wf.run_sync({"kind": "calm"}).checkpoint
    assert cp is not None
    report = audit(wf, cp)
    assert report.clean, report.format()
    assert report.to_run == ()
    assert report.step("escalate").why == "skipped: condition urgent was false"
    assert report.step("after").skipped == "it needs 'escalate', which was skipped"
    assert "(2 skipped by a condition)" in report.format()


def test_items_are_not_context_but_a_step_that_is_gone_still_is() -> None:
    graph = pipeline([]).graph
    assert context_outputs(graph, {"summarize[0]": 1, "topic": 2, "merge[0]": 3}) == {
        "topic": 2, "merge[0]": 3}


def test_a_collection_recorded_before_its_items_is_an_anomaly() -> None:
    wf, saved = checkpoints()
    forged = json.loads(json.dumps(saved[-1].to_dict()))
    del forged["outputs"]["summarize[1]"]
    kinds = {(a.kind, a.step) for a in audit(wf, forged).anomalies}
    assert ("missing_dependency", "summarize") in kinds
    assert ("missing_dependency", "critique[1]") in kinds


def test_an_item_the_input_does_not_have_is_refused_as_a_resume_refuses_it() -> None:
    wf, saved = checkpoints()
    forged = json.loads(json.dumps(saved[-1].to_dict()))
    forged["outputs"]["summarize[9]"] = "X"
    kinds = [a.kind for a in audit(wf, forged).anomalies]
    assert kinds == ["resume_refused"]
    assert "summarize[9]" in audit(wf, forged).anomalies[0].message


def test_an_item_failure_is_no_unknown_failure() -> None:
    calls: list[str] = []

    def flaky(ctx: dict[str, Any]) -> str:
        calls.append(ctx["split"])
        if ctx["split"] == "b":
            raise RuntimeError("b is bad")
        return str(ctx["split"])

    wf = Workflow([
        Step("split", lambda c: ["a", "b"]),
        Step("each", flaky, ("split",), map_over="split", context="dependencies"),
    ])
    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(RuntimeError, match="b is bad"):
        wf.run_sync(checkpoint_fn=saved.append)
    report = audit(wf, saved[-1])
    assert report.clean, report.format()
    assert report.step("each[1]").reason == "failed"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=shaped_graphs())
def test_any_finished_shaped_run_audits_clean_and_resumes_nothing(graph: GraphSpec) -> None:
    _outputs, _ran, full = run_to_end(graph)
    report = audit(graph, WorkflowCheckpoint.from_dict(full.to_dict()))
    assert report.clean, report.format()
    assert [s.name for s in report.steps if s.action == "run"] == []


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=shaped_graphs())
def test_every_checkpoint_of_a_shaped_run_audits_clean_and_a_resume_runs_no_skipped_row(
    graph: GraphSpec,
) -> None:
    state, batch = advance(initial_state(graph))
    pending = list(batch.names)
    while pending:
        name = pending.pop(0)
        state, batch = advance(state, [shaped_result(state, name)])
        pending += batch.names
        cp = WorkflowCheckpoint.from_dict(checkpoint_of(state).to_dict())
        report = audit(graph, cp)
        assert report.clean, report.format()
        _outputs, ran, _ = run_to_end(graph, cp)
        assert not ran & set(report.skipped)
        # What is ready now is what a resume starts first.
        ready = {s.name for s in report.steps if s.reason == "ready"}
        first = set(advance(initial_state(graph, cp))[1].names)
        assert first == ready
