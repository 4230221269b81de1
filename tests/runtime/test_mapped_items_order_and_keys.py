"""A mapped step's items follow its input: the input's order, its keys, and nothing invented.

What users rely on: a map over a mapping runs and collects its items in the
mapping's own order (insertion order, never sorted), in the run that made
them and in a resume read back from any store; a mapping with no items
collects ``{}`` (a list with none, ``[]``), which dependents see as such;
items whose ``item_key`` repeats (``"7"`` and ``7`` are one key) fail the
mapped step with ``MapError`` naming it, while the upstream's paid output
stays recorded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core.expansion import MapError
from ekit_runtime import JournalStore, JsonFileStore, SqliteStore, Step, Workflow, WorkflowCheckpoint


def _doubling(people: dict[str, int]) -> Workflow:
    return Workflow([
        Step("people", lambda ctx: dict(people)),
        Step("double", lambda ctx: ctx["people"] * 2, ("people",), map_over="people",
             context="dependencies"),
        Step("names", lambda ctx: list(ctx["double"]), ("double",), context="dependencies"),
        # An item-wise chain keeps the keys, and so the order, of the mapping.
        Step("plus", lambda ctx: ctx["double"] + 1, ("double",), map_over="double",
             context="dependencies"),
    ])


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.text("abcxyz", min_size=1, max_size=3), st.integers(0, 9), max_size=6))
def test_a_map_over_a_mapping_keeps_the_mappings_order(people: dict[str, int]) -> None:
    result = _doubling(people).run_sync()
    assert list(result.outputs["double"]) == list(people)  # not sorted: the input's order
    assert result.outputs["names"] == list(people)
    assert result.outputs["double"] == {k: 2 * v for k, v in people.items()}
    assert list(result.outputs["plus"]) == list(people) and isinstance(result.outputs["plus"], dict)


def test_the_mappings_order_survives_a_resume_from_every_store(tmp_path: Path) -> None:
    people = {"zoe": 1, "ann": 2, "mia": 3}
    saved: list[WorkflowCheckpoint] = []
    broken = [True]

    def double(ctx: Any) -> int:
        if ctx["people"] == 2 and broken and broken.pop():
            raise ConnectionError("the first run records 'people' and some items only")
        return int(ctx["people"]) * 2

    workflow = Workflow([
        Step("people", lambda ctx: dict(people)),
        Step("double", double, ("people",), map_over="people", context="dependencies"),
    ])
    with pytest.raises(ConnectionError):
        workflow.run_sync(checkpoint_fn=saved.append, max_concurrency=1)
    half = saved[-1]
    assert "double" not in half.outputs and "double[ann]" not in half.outputs
    for store in (JsonFileStore(tmp_path / "cp.json"), JournalStore(tmp_path / "cp.jsonl"),
                  SqliteStore(tmp_path / "cp.db", run_id="r")):
        store.save(half)
        loaded = store.load()
        assert loaded is not None
        for resume_from in (loaded, json.loads(json.dumps(half.to_dict()))):
            result = workflow.run_sync(resume_from=resume_from)
            assert list(result.outputs["double"]) == ["zoe", "ann", "mia"], store


def test_zero_items_of_a_mapping_collect_an_empty_mapping() -> None:
    seen: list[Any] = []
    workflow = Workflow([
        Step("people", lambda ctx: {}),
        Step("double", lambda ctx: 1 / 0, ("people",), map_over="people", context="dependencies"),
        Step("after", lambda ctx: seen.append(ctx["double"]), ("double",), context="dependencies"),
    ])
    result = workflow.run_sync()
    assert result.outputs["double"] == {} and isinstance(result.outputs["double"], dict)
    assert seen == [{}]
    assert result.checkpoint is not None
    again = workflow.run_sync(resume_from=json.loads(json.dumps(result.checkpoint.to_dict())))
    assert again.outputs["double"] == {} and seen == [{}]  # recorded: nothing runs again

    empty_list = Workflow([
        Step("people", lambda ctx: []),
        Step("double", lambda ctx: 1 / 0, ("people",), map_over="people"),
    ])
    assert empty_list.run_sync().outputs["double"] == []


@pytest.mark.parametrize("tickets", [
    [{"id": "T-1", "x": 1}, {"id": "T-2", "x": 2}, {"id": "T-1", "x": 3}],
    [{"id": 7, "x": 1}, {"id": "7", "x": 2}],  # one key once it names an item: "7"
    {"a": {"id": "k", "x": 1}, "b": {"id": "k", "x": 2}},
])
def test_repeated_item_keys_fail_the_mapped_step_with_map_error(tickets: Any) -> None:
    calls: list[Any] = []
    saved: list[WorkflowCheckpoint] = []
    workflow = Workflow([
        Step("tickets", lambda ctx: tickets),
        Step("answer", lambda ctx: calls.append(ctx["tickets"]), ("tickets",), map_over="tickets",
             item_key="id", context="dependencies"),
    ])
    with pytest.raises(MapError, match="step 'answer' maps over 'tickets', but items repeat the key id="):
        workflow.run_sync(checkpoint_fn=saved.append)
    assert calls == []  # no item of an ambiguous map is paid for
    assert saved[-1].outputs["tickets"] == tickets  # the upstream stays paid for
    assert not any(n.startswith("answer") for n in saved[-1].outputs)
    assert saved[-1].failures["answer"].error_type == "MapError"
    # A resume fails the same way before paying for anything.
    with pytest.raises(MapError, match="repeat the key"):
        workflow.run_sync(resume_from=saved[-1].to_dict())
    assert calls == []
