"""A resume's starting point counts only the steps it keeps: ``step_index`` is "how many steps
have finished" (docs/checkpoint-format.md), so the items a changed mapped step lets go of leave
the count with their outputs. replay judges the resume's first save against that starting
point; a count left high read as ``step_index_decreased`` (found by the reference model)."""

from __future__ import annotations

from types import MappingProxyType

from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import GraphSpec, Shape, WorkflowCheckpoint
from ekit_core.rewind import outdated_steps
from ekit_core.transitions import kept_on_resume

GRAPH = GraphSpec.of({"a": [], "m": ["a"]}, shapes={"m": Shape(map_over="a")})


@settings(max_examples=30, deadline=None)
@given(items=st.integers(1, 4), data=st.data())
def test_the_items_of_a_bumped_mapped_step_leave_the_count(items: int, data: st.DataObject) -> None:
    done = data.draw(st.sets(st.integers(0, items - 1)))
    outputs: dict[str, object] = {"a": list(range(items)), **{f"m[{i}]": i for i in done}}
    checkpoint = WorkflowCheckpoint(step_index=len(outputs), outputs=MappingProxyType(outputs),
                                    versions=MappingProxyType({"m": "v0"}))
    bumped = {"m": "v1"}
    kept = kept_on_resume(GRAPH, checkpoint, outdated_steps(GRAPH, checkpoint, bumped), bumped)
    assert dict(kept.outputs) == {"a": list(range(items))}
    assert kept.step_index == 1
