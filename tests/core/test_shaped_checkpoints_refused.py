"""A hostile or damaged shaped checkpoint is refused, naming the field, before any step runs.

A checkpoint claims items, skips and shapes; each claim is checked against
what the recorded outputs make of the declared graph, so a file cannot make
a resume skip an item that does not exist or run a step its records forbid.
"""

from __future__ import annotations

from typing import Any

import pytest

from ekit_core import CheckpointError, GraphMismatchError, UnsupportedFormatError
from ekit_runtime import Step, Workflow

ran: list[str] = []


def _note(name: str) -> Any:
    def body(ctx: Any) -> Any:
        ran.append(name)
        return ["x", "y"] if name == "split" else name

    return body


WORKFLOW = Workflow([
    Step("split", _note("split")),
    Step("each", _note("each"), ("split",), map_over="split"),
    Step("gate", _note("gate"), when=lambda ctx: False),
    Step("after", _note("after"), ("gate",)),
])


def _good() -> dict[str, Any]:
    result = WORKFLOW.run_sync()
    assert result.checkpoint is not None
    ran.clear()
    return result.checkpoint.to_dict()


def _refused(data: dict[str, Any], field: str, match: str, error: type[Exception] = CheckpointError) -> None:
    with pytest.raises(error, match=match) as caught:
        WORKFLOW.run_sync(resume_from=data)
    if isinstance(caught.value, CheckpointError):
        assert caught.value.field == field
    assert ran == []


def test_a_good_checkpoint_resumes_running_nothing() -> None:
    assert WORKFLOW.run_sync(resume_from=_good()).outputs["each"] == ["each", "each"]
    assert ran == []


def test_an_item_the_upstream_output_does_not_have_is_refused() -> None:
    data = _good()
    data["outputs"]["each[7]"] = "forged"
    _refused(data, "outputs", "records item 'each\\[7\\]'")


def test_skips_the_outputs_contradict_are_refused() -> None:
    data = _good()
    data["outputs"]["gate"] = "ran after all"
    _refused(data, "skipped", "'gate' as skipped and its output too")
    data = _good()
    data["outputs"]["after"] = "ran"
    del data["skipped"]["after"]
    _refused(data, "skipped", "'gate' as skipped, yet the output of 'after'")
    data = _good()
    data["skipped"]["ghost"] = "never declared"
    _refused(data, "skipped", "'ghost', which is no step or item")


def test_malformed_fields_and_shapes_are_refused() -> None:
    data = _good()
    data["skipped"] = {"gate": 3}
    _refused(data, "skipped.gate", "must be a string")
    data = _good()
    data["shapes"]["each"] = {"map_over": "split", "colour": "red"}
    _refused(data, "shapes.each", "unknown field")
    # The same steps, shaped otherwise (each not mapped): another graph.
    unmapped = Workflow([Step(s.name, s.run, s.depends_on, when=s.when) for s in WORKFLOW.steps])
    other = unmapped.run_sync().checkpoint
    assert other is not None
    ran.clear()
    _refused(other.to_dict(), "", "different workflow graph", GraphMismatchError)
    data = _good()
    data["format_version"] = 4
    _refused(data, "format_version", "newer ekit", UnsupportedFormatError)
