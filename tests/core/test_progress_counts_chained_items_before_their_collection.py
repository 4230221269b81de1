"""A run's progress counts the items of a chained mapped step as soon as they are known.

What users rely on (ekit_core.progress, issue 42 item 19): one definition
of progress, "N of M steps done", where M counts every mapped step's items
once its input is known. A step mapped over another mapped step's items
(an item-wise chain, ``Step("n", ..., map_over="m")``) has one item per
item of ``m``, known as soon as ``m``'s input is; its items run before
``m`` is collected. ``run_progress`` counted them only once ``m``'s
collection was recorded, so a run whose ``m[2]`` was still running (or had
failed) read "7 of 7 steps done" while four units remained, and
``ekit queue list`` showed 7/7, where the dashboard's item counts (from
``items_progress``) already said ``n`` had 4 items.
"""

from __future__ import annotations

from typing import Any

from ekit_core import WorkflowCheckpoint
from ekit_core.progress import items_progress, run_progress
from ekit_runtime import Step, Workflow


def _m(ctx: Any) -> int:
    if ctx["split"] == 3:
        raise RuntimeError("item 2 fails")
    return int(ctx["split"]) * 10


def _flow(*, when: bool = False) -> Workflow:
    skip = {"when": lambda ctx: ctx["split"] != 2} if when else {}
    return Workflow([
        Step("split", lambda ctx: [1, 2, 3, 4]),
        Step("m", _m, ("split",), map_over="split", context="dependencies", **skip),
        Step("n", lambda ctx: ctx["m"] + 1, ("m",), map_over="m", context="dependencies"),
    ])


def _check(wf: Workflow, saved: list[WorkflowCheckpoint]) -> None:
    assert saved
    for cp in saved:
        progress = run_progress(cp)
        items = items_progress(wf.graph, cp)
        known = sum(p.total for p in items.values() if p.total is not None)
        assert progress.total == len(wf.graph) + known, (sorted(cp.outputs), progress, items)


def test_a_chained_steps_items_count_before_what_it_chains_to_is_collected() -> None:
    saved: list[WorkflowCheckpoint] = []
    wf = _flow()
    wf.run_sync(checkpoint_fn=saved.append, isolate_failures=True)
    last = saved[-1]
    assert "m" not in last.outputs and {"n[0]", "n[1]", "n[3]"} <= set(last.outputs)
    progress = run_progress(last)
    assert (progress.done, progress.failed, progress.total) == (7, 1, 11)
    assert progress.text() == "7 of 11 steps done"
    _check(wf, saved)


def test_a_chain_over_items_a_condition_skipped_counts_them_too() -> None:
    saved: list[WorkflowCheckpoint] = []
    wf = _flow(when=True)
    wf.run_sync(checkpoint_fn=saved.append, isolate_failures=True)
    _check(wf, saved)
