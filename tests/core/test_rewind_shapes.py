"""Rewinding a shaped run: one item, every item of a mapped step, or what it maps over.

A rewound item drops itself, its mapped step's collected output, the items
chained to it and everything downstream; a rewound mapped step drops every
item; skips downstream are dropped too (decided again). A resume of the
rewound checkpoint runs exactly what was dropped and ends as the full run.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ekit_core import (
    GraphSpec,
    WorkflowCheckpoint,
    advance,
    audit,
    initial_state,
    rewind,
)
from ekit_core.rewind import grown
from ekit_runtime import Step, Workflow
from tests.support.shaped_runs import pipeline, run_to_end, shaped_graphs


def full_run() -> tuple[Workflow, list[str], WorkflowCheckpoint]:
    ran: list[str] = []
    wf = pipeline(ran)
    checkpoint = wf.run_sync({"doc": "aaa|b|cc"}).checkpoint
    assert checkpoint is not None
    ran.clear()
    return wf, ran, checkpoint


def test_rewinding_one_item_drops_it_its_chain_the_collections_and_downstream() -> None:
    wf, ran, full = full_run()
    trimmed = rewind(wf, full, "summarize[2]")
    assert set(full.outputs) - set(trimmed.outputs) == {
        "summarize[2]", "summarize", "critique[2]", "critique", "merge"}
    assert trimmed.step_index == len(trimmed.outputs)
    result = wf.run_sync(resume_from=trimmed)
    assert ran == ["summarize cc", "critique CC", "merge"]
    assert result.outputs["merge"] == "AAA! B! CC!"


def test_rewinding_a_mapped_step_drops_every_item_and_the_chained_ones() -> None:
    wf, ran, full = full_run()
    trimmed = rewind(wf, full, "summarize")
    assert set(trimmed.outputs) == {"split"}
    wf.run_sync(resume_from=trimmed)
    assert sorted(ran) == sorted(["summarize aaa", "summarize b", "summarize cc",
                                  "critique AAA", "critique B", "critique CC", "merge"])


def test_rewinding_the_last_stage_keeps_the_first_stage_items() -> None:
    wf, ran, full = full_run()
    trimmed = rewind(wf, full, "critique")
    assert set(trimmed.outputs) == {"split", "summarize", "summarize[0]", "summarize[1]",
                                    "summarize[2]"}
    wf.run_sync(resume_from=trimmed)
    assert sorted(ran) == ["critique AAA", "critique B", "critique CC", "merge"]


def test_rewinding_the_upstream_drops_the_items_and_collections_downstream() -> None:
    wf, ran, full = full_run()
    trimmed = rewind(wf, full, "split")
    assert trimmed.outputs == {}
    assert trimmed.step_index == 0
    assert set(trimmed.superseded) >= {"split", "summarize[0]", "critique[2]"}  # set aside
    assert wf.run_sync(resume_from=trimmed).outputs["merge"] == "AAA! B! CC!"
    # The split ran again and gave the same pieces: the early cutoff keeps
    # every item, and only the split and the merge ran.
    assert len(ran) == 2


def test_rewind_drops_the_skips_downstream_so_conditions_are_decided_again() -> None:
    def urgent(ctx: dict[str, Any]) -> bool:
        return bool(ctx["route"] == "urgent")

    wf = Workflow([
        Step("route", lambda c: c["kind"]),
        Step("escalate", lambda c: "ESC", ("route",), when=urgent),
        Step("after", lambda c: "x", ("escalate",)),
        Step("other", lambda c: "o"),
    ])
    full = wf.run_sync({"kind": "calm"}).checkpoint
    assert full is not None and set(full.skipped) == {"escalate", "after"}
    trimmed = rewind(wf, full, "route")
    assert dict(trimmed.skipped) == {} and set(trimmed.outputs) == {"other"}
    assert rewind(wf, full, "other").skipped == full.skipped
    again = wf.run_sync({"kind": "urgent"}, resume_from=trimmed)
    assert again.outputs["after"] == "x"


def test_rewind_names_unknown_items() -> None:
    wf, _ran, full = full_run()
    with pytest.raises(ValueError, match=r"summarize\[7\]"):
        rewind(wf, full, "summarize[7]")


def test_grown_lists_the_items_the_recorded_outputs_expand_into() -> None:
    wf, _ran, full = full_run()
    items = grown(wf.graph, full.outputs)
    assert items.members["summarize"] == ("summarize[0]", "summarize[1]", "summarize[2]")
    assert items.steps["critique[1]"] == ("summarize[1]",)
    assert grown(wf.graph, {}).steps == {}


def _compacted(cp: WorkflowCheckpoint) -> set[str]:
    """The iterations ``cp`` compacted: done, their outputs let go of (``keep_last``)."""
    return {f"{loop}#{k}" for loop, n in cp.compacted.items() for k in range(1, n + 1)}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=shaped_graphs(), data=st.data())
def test_a_rewound_shaped_run_resumes_to_the_same_outputs_running_only_what_was_dropped(
    graph: GraphSpec, data: st.DataObject
) -> None:
    outputs, _ran, full = run_to_end(graph)
    names = sorted({*graph.names, *full.outputs, *full.skipped})
    chosen = data.draw(st.sampled_from(names), label="rewound")
    trimmed = rewind(graph, full, chosen)
    dropped = ({*full.outputs, *full.skipped, *_compacted(full)}
               - {*trimmed.outputs, *trimmed.skipped, *_compacted(trimmed)})
    report = audit(graph, trimmed)
    assert report.clean, report.format()
    assert {s.name for s in report.steps if s.reason == "ready"} == set(
        advance(initial_state(graph, trimmed))[1].names)
    again, ran, _ = run_to_end(graph, WorkflowCheckpoint.from_dict(trimmed.to_dict()))
    assert again == outputs
    # Only what was dropped starts again (a condition decided again may skip
    # it), and everything dropped that is recorded again, not collected, ran,
    # but the items the early cutoff keeps (set aside, their input unchanged).
    collections = {n for n, s in graph.shapes.items() if s.map_over is not None or s.repeat}
    kept = set(trimmed.superseded)
    assert {n for n in dropped if n in again and n not in collections | kept} <= ran <= dropped
