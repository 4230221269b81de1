"""A mapped step's recorded output stands only on its recorded items.

A mapped step's own output is the collection of its items; a checkpoint that
records it without them (or without the output it maps over) would let its
dependents run on it, then run every item again and never collect them. A
resume refuses such a checkpoint, naming the field and the step, before any
step runs; the run's own checkpoints (zero items, items skipped by a
condition) still resume.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from ekit_core import CheckpointError
from ekit_runtime import Step, Workflow

ran: list[str] = []


def _note(name: str, output: Any = None) -> Any:
    def body(ctx: Any) -> Any:
        ran.append(name)
        return name if output is None else output

    return body


def _workflow(upstream: Any = (1, 2, 3), when: Any = None) -> Workflow:
    return Workflow([
        Step("u", _note("u", list(upstream))),
        Step("m", _note("m"), ("u",), map_over="u", when=when),
        Step("n", _note("n"), ("m",), map_over="m"),
        Step("d", _note("d"), ("n",)),
    ])


def _recorded(workflow: Workflow) -> dict[str, Any]:
    result = workflow.run_sync()
    assert result.checkpoint is not None
    ran.clear()
    return result.checkpoint.to_dict()


def _refused(workflow: Workflow, data: dict[str, Any], match: str) -> None:
    with pytest.raises(CheckpointError, match=match) as caught:
        workflow.run_sync(resume_from=data)
    assert caught.value.field == "outputs"
    assert ran == []


@pytest.mark.parametrize("dropped", [
    ("m[0]", "m[1]", "m[2]", "n[0]", "n[1]", "n[2]", "n", "d"),  # every item, what follows too
    ("m[0]", "m[1]", "m[2]"),  # the items alone, the chain's kept
    ("m[1]",),  # one item
])
def test_a_mapped_output_without_its_items_is_refused_naming_the_step(dropped: tuple[str, ...]) -> None:
    workflow = _workflow()
    data = _recorded(workflow)
    for name in dropped:
        del data["outputs"][name]
    _refused(workflow, data, "'m'.*'m\\[")


def test_a_chained_mapped_output_without_its_items_is_refused() -> None:
    workflow = _workflow()
    data = _recorded(workflow)
    for name in ("n[0]", "n[1]", "n[2]", "d"):
        del data["outputs"][name]
    _refused(workflow, data, "'n'.*'n\\[0\\]'")


def test_a_mapped_output_without_what_it_maps_over_is_refused() -> None:
    workflow = _workflow()
    data = _recorded(workflow)
    for name in ("u", "m[0]", "m[1]", "m[2]", "n[0]", "n[1]", "n[2]"):
        del data["outputs"][name]
    _refused(workflow, data, "'m'.*'u'")


def test_a_mapped_output_over_an_output_with_no_items_is_refused() -> None:
    workflow = _workflow()
    data = _recorded(workflow)
    data["outputs"] = {"u": "not a list", "m": [], "n": [], "d": "d"}
    _refused(workflow, data, "'m'.*'u'")


@pytest.mark.parametrize("workflow", [
    _workflow(upstream=()),  # zero items: [] at once
    _workflow(when=lambda ctx: False),  # every item skipped by its condition
    _workflow(),
], ids=["no-items", "all-skipped", "plain"])
def test_the_runs_own_checkpoints_still_resume_running_nothing(workflow: Workflow) -> None:
    data = _recorded(workflow)
    result = workflow.run_sync(resume_from=copy.deepcopy(data))
    assert ran == []
    assert result.checkpoint is not None and result.checkpoint.to_dict()["outputs"] == data["outputs"]
