"""Replaying a shaped run: items are steps of the timeline, with the dependencies they grew with.

Every checkpoint of a run with mapped and conditional steps, across crashes
and resumes, replays without a violation; the real violations (an item
recorded before its input, an output that disappears, an item the input
does not have) are still found.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ekit_core import (
    GraphSpec,
    Skipped,
    WorkflowCheckpoint,
    advance,
    checkpoint_of,
    initial_state,
    replay,
)
from ekit_runtime import Step, Workflow
from tests.support.shaped_runs import all_skipped_chain, pipeline, shaped_graphs, shaped_result


def recorded() -> tuple[Workflow, list[dict[str, Any]]]:
    saved: list[WorkflowCheckpoint] = []
    wf = pipeline([])
    wf.run_sync({"doc": "aaa|b|cc"}, checkpoint_fn=saved.append)
    return wf, [json.loads(json.dumps(cp.to_dict())) for cp in saved]


def _kinds(report: Any) -> set[tuple[int, str | None, str]]:
    return {(v.index, v.step, v.kind) for v in report.violations}


def test_a_mapped_run_replays_clean_with_one_timeline_entry_per_item() -> None:
    wf, cps = recorded()
    report = replay(wf, cps)
    assert report.ok, report.format()
    # Which checkpoint holds what depends on which steps finished together;
    # what holds in every order: each item once, a collection with or after its items.
    finished = [n for entry in report.timeline for n in entry.finished]
    items = [f"{m}[{k}]" for m in ("summarize", "critique") for k in range(3)]
    assert sorted(n for n in finished if "[" in n) == sorted(items)
    for mapped in ("summarize", "critique"):
        at = report.finished_at(mapped)
        assert at is not None and all(report.finished_at(f"{mapped}[{k}]") <= at for k in range(3))
    assert report.finished_at("critique[2]") >= report.finished_at("summarize[2]")
    assert replay(None, cps).ok


def test_an_item_recorded_before_its_input_is_a_violation() -> None:
    wf, cps = recorded()
    forged = [json.loads(json.dumps(cp)) for cp in cps]
    # critique[1] starts only once summarize[1] is recorded: a later checkpoint.
    at = next(i for i, cp in enumerate(cps) if "critique[1]" in cp["outputs"])
    del forged[at]["outputs"]["summarize[1]"]
    forged[at]["step_index"] -= 1
    kinds = _kinds(replay(wf, forged))
    assert (at, "critique[1]", "dependency_not_recorded") in kinds
    assert (at, "summarize[1]", "output_removed") in kinds


def test_a_collection_recorded_before_its_items_is_a_violation() -> None:
    wf, cps = recorded()
    first = next(i for i, cp in enumerate(cps) if "summarize" in cp["outputs"])
    forged = [json.loads(json.dumps(cp)) for cp in cps[first:]]
    del forged[0]["outputs"]["summarize[2]"]
    assert (0, "summarize", "dependency_not_recorded") in _kinds(replay(wf, forged))


def test_an_item_the_input_does_not_have_is_an_unknown_step() -> None:
    wf, cps = recorded()
    cps[2]["outputs"]["summarize[7]"] = "X"
    assert (2, "summarize[7]", "unknown_step") in _kinds(replay(wf, cps))


def test_new_skips_are_on_the_timeline_with_their_reason() -> None:
    wf = Workflow([
        Step("route", lambda c: "calm"),
        Step("escalate", lambda c: "ESC", ("route",), when=lambda c: c["route"] == "urgent"),
        Step("join", lambda c: "j", ("escalate", "route"), join="any"),
    ])
    saved: list[WorkflowCheckpoint] = []
    wf.run_sync(checkpoint_fn=saved.append)
    report = replay(wf, saved)
    assert report.ok, report.format()
    skips = {n: why for e in report.timeline for n, why in e.skipped.items()}
    assert list(skips) == ["escalate"] and skips["escalate"].startswith("condition")
    assert "skipped: escalate" in report.format()


def test_a_resume_between_an_all_skipped_chain_and_its_other_dependency_replays_clean() -> None:
    # d runs item by item after b, whose only item is skipped; d also needs c,
    # skipped only after a resume: d is skipped, never recorded before c.
    graph, state = all_skipped_chain()
    saved = [checkpoint_of(state)]
    state, _ = advance(initial_state(graph, saved[-1]))
    state, _ = advance(state, [Skipped("c", "condition cond was false")])
    saved.append(checkpoint_of(state))
    report = replay(graph, saved)
    assert report.ok, report.format()
    assert "d" in report.timeline[-1].skipped and report.finished_at("d") is None


def _record(graph: GraphSpec, data: st.DataObject) -> list[dict[str, Any]]:
    """Every checkpoint of a run of ``graph``, crashed and resumed at random points."""
    state, batch = advance(initial_state(graph))
    pending, saved = list(batch.names), []
    while pending:
        name = pending.pop(data.draw(st.integers(0, len(pending) - 1), label="which"))
        state, batch = advance(state, [shaped_result(state, name)])
        pending += batch.names
        saved.append(json.loads(json.dumps(checkpoint_of(state).to_dict())))
        if pending and data.draw(st.booleans(), label="crash"):
            state, batch = advance(initial_state(graph, saved[-1]))
            pending = list(batch.names)
    return saved


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=shaped_graphs(), data=st.data())
def test_any_shaped_run_crashed_and_resumed_replays_clean(graph: GraphSpec, data: st.DataObject) -> None:
    saved = _record(graph, data)
    report = replay(graph, saved)
    assert report.ok, report.format()
    finished = {n for e in report.timeline for n in e.finished}
    last = saved[-1] if saved else {"outputs": {}}
    compacted = {f"{loop}#{k}" for loop, n in last.get("compacted", {}).items() for k in range(1, n + 1)}
    assert finished == set(last["outputs"]) | compacted  # (a compacted iteration finished too)
