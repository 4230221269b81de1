"""ProgressPrinter on shaped runs: items counted as they appear, skips counted as done."""

from __future__ import annotations

import io
from typing import Any

import pytest

from ekit_core import (
    GraphSpec,
    RunSettled,
    RunStarted,
    StepExpanded,
    StepFinished,
    StepSkipped,
    StepStarted,
    TokenUsage,
)
from ekit_core.shapes import Shape
from ekit_runtime import ProgressPrinter, Step, Workflow
from tests.support.shaped_runs import pipeline

NO_USAGE = TokenUsage()


def test_an_expansion_grows_the_total_by_its_items_and_a_collection_says_so() -> None:
    out = io.StringIO()
    pipeline([]).run_sync({"doc": "a|b"}, trace=ProgressPrinter(out, tty=False))
    lines = out.getvalue().splitlines()
    assert lines[0] == "run started: 4 steps"
    # The split's output then expands summarize and, item by item, critique: 4 + 2 + 2.
    assert lines[1].startswith("[1/4 ") and "done split" in lines[1]
    assert any(line.startswith("[2/8 ") and "done summarize[" in line for line in lines)
    assert any("collected summarize from 2 item(s)" in line for line in lines)
    assert lines[-1].startswith("run finished: 8/8 steps, 0 tokens this run")


def test_a_resume_counts_its_recorded_items_as_done() -> None:
    saved: list[Any] = []
    wf = pipeline([])
    wf.run_sync({"doc": "a|b"}, checkpoint_fn=saved.append)
    mid = next(cp for cp in saved if "summarize" in cp.outputs and "merge" not in cp.outputs)
    printer = ProgressPrinter(io.StringIO(), tty=False)
    events: list[Any] = []
    wf.run_sync(resume_from=mid, trace=[events.append, printer])
    expanded = [e for e in events if isinstance(e, StepExpanded)]
    assert {(e.name, e.items) for e in expanded} == {("summarize", 2), ("critique", 2)}
    assert sum(e.recorded for e in expanded) == sum(1 for n in mid.outputs if "[" in n)
    assert (printer.done, printer.total) == (8, 8)


def urgent(ctx: dict[str, Any]) -> bool:
    return bool(ctx["route"] == "urgent")


def test_a_skip_by_a_condition_is_done_and_marked() -> None:
    wf = Workflow([
        Step("route", lambda c: "calm"),
        Step("escalate", lambda c: "E", ("route",), when=urgent),
        Step("after", lambda c: "x", ("escalate",)),
    ])
    out = io.StringIO()
    printer = ProgressPrinter(out, tty=False)
    wf.run_sync(trace=printer)
    lines = out.getvalue().splitlines()
    assert "skipped escalate: condition urgent was false" in lines[2]
    assert "skipped after: it needs 'escalate', which was skipped" in lines[3]
    assert lines[-1].startswith("run finished: 3/3 steps (2 skipped by a condition)")
    assert (printer.done, printer.total, printer.skipped_by_condition) == (3, 3, 2)


def test_the_status_line_counts_items_done_of_total() -> None:
    p = ProgressPrinter(io.StringIO(), tty=True)
    p(RunStarted(total=2, recorded=1))
    for k in range(3):
        p(StepStarted(f"each[{k}]", 1, 0.0))
    assert " 1/5 steps | 3 running (each[0] " in p.status()
    p(StepFinished("each[0]", 1, NO_USAGE, 0.1))
    assert " 2/5 steps" in p.status()
    assert p.items == 3


def test_a_plain_graph_named_like_items_counts_as_today_when_its_graph_is_given() -> None:
    graph = GraphSpec.of({"a[1]": ()})
    out = io.StringIO()
    p = ProgressPrinter(out, tty=False, graph=graph)
    p(RunStarted(total=1, recorded=0))
    p(StepStarted("a[1]", 1, 0.0))
    p(StepFinished("a[1]", 1, NO_USAGE, 0.5))
    p(RunSettled("finished", 1, 1, NO_USAGE))
    assert out.getvalue().splitlines()[1].startswith("[1/1 ")
    assert p.items == 0


def test_the_graph_tells_items_exactly() -> None:
    graph = GraphSpec.of({"u": (), "m": ("u",), "n[x]": ()}, {"m": Shape(map_over="u")})
    p = ProgressPrinter(io.StringIO(), tty=False, graph=graph)
    p(RunStarted(total=3, recorded=0))
    p(StepStarted("m[0]", 1, 0.0))
    p(StepSkipped("m[1]", "condition c was false"))
    p(StepStarted("n[x]", 1, 0.0))
    assert (p.total, p.done, p.items) == (5, 1, 2)
    with pytest.raises(ValueError, match="graph must be"):
        ProgressPrinter(graph=42)
