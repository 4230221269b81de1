"""A tuple or a list in a dataclass field, at any depth, comes back from a checkpoint as that type.

What users rely on (docs/outputs.md): a dataclass output is restored as it
was returned. JSON has one array for both, so a field annotated as a tuple
only (``tuple[int, ...]``, ``tuple[int, int] | None``) is stored as a list
and comes back a tuple, and a tuple in a field whose annotation also admits
a list (``tuple[int, ...] | list[int]``, ``Sequence[int]``, ``Any``) is
stored tagged, so that neither is taken for the other. Issue 42, item 12: a
list in a ``tuple[int, ...] | list[int]`` field came back a tuple.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ekit_core import CheckpointError
from ekit_runtime import Codec, JsonFileStore, Step, Workflow


@dataclasses.dataclass
class Shapes:
    either: tuple[int, ...] | list[int]
    either_or_none: list[int] | tuple[int, ...] | None
    labelled: Annotated[tuple[int, ...] | list[int], "ids"]
    sequence: Sequence[int]
    anything: Any
    only_tuple: tuple[int, ...]
    tuple_or_none: tuple[int, int] | None
    tuple_or_text: tuple[str, ...] | str
    pairs: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    table: dict[str, tuple[int, ...] | list[int]] = dataclasses.field(default_factory=dict)
    grid: tuple[tuple[int, ...] | list[int], ...] = ()


CODEC = Codec(Shapes)
ints = st.lists(st.integers(-5, 5), max_size=4)
array = st.one_of(ints, ints.map(tuple))  # a list or a tuple, either may be in each field


def round_trip(value: Any) -> Any:
    return CODEC.decode(json.loads(json.dumps(CODEC.encode(value))))


def same_types(a: Any, b: Any) -> bool:
    """Equal, and of the same type at every depth (a tuple is no list)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_types(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_types(a[k], b[k]) for k in a)
    return bool(a == b)


@given(either=array, either_or_none=st.one_of(st.none(), array), labelled=array, sequence=array,
       anything=st.one_of(array, st.integers()), only_tuple=ints.map(tuple),
       tuple_or_none=st.one_of(st.none(), st.tuples(st.integers(), st.integers())),
       tuple_or_text=st.one_of(st.text(max_size=3), st.lists(st.text(max_size=2)).map(tuple)),
       pairs=st.lists(st.tuples(st.integers(), st.integers()), max_size=3),
       table=st.dictionaries(st.sampled_from(["a", "$ekit", "b"]), array, max_size=3),
       grid=st.lists(array, max_size=3).map(tuple))
def test_each_field_comes_back_as_the_type_it_held(**fields: Any) -> None:
    value = Shapes(**fields)
    back = round_trip(value)
    assert type(back) is Shapes
    for name, held in fields.items():
        assert same_types(getattr(back, name), held), name


def test_a_field_annotated_as_a_tuple_only_is_stored_as_a_plain_list() -> None:
    # (what checkpoints written before the tag was needed hold, and still read back as tuples)
    value = Shapes([1], [2], [3], [4], [5], (6,), (7, 8), ("9",))
    stored = CODEC.encode(value)["value"]
    assert stored["only_tuple"] == [6] and stored["tuple_or_none"] == [7, 8]
    assert stored["tuple_or_text"] == ["9"]
    assert stored["either"] == [1] and stored["anything"] == [5]
    tagged = CODEC.encode(dataclasses.replace(value, either=(1,)))["value"]["either"]
    assert tagged == {"$ekit": "tuple", "value": [1]}


def test_a_tuple_in_a_field_that_admits_a_list_survives_a_store_and_a_resume(tmp_path: Path) -> None:
    seen: list[Any] = []

    def make(ctx: Any) -> Shapes:
        return Shapes((1, 2), [3], (4,), [5], (6,), (7,), None, "t")

    def use(ctx: Any) -> int:
        seen.append(ctx["make"])
        if len(seen) == 1:
            raise RuntimeError("the provider timed out")
        return 1

    flow = Workflow([Step("make", make), Step("use", use, ("make",))], codec=Codec())
    with JsonFileStore(tmp_path / "cp.json") as store, pytest.raises(RuntimeError):
        flow.run_sync(checkpoint_fn=store)
    flow.run_sync(resume_from=JsonFileStore(tmp_path / "cp.json").load())
    assert same_types(dataclasses.astuple(seen[1]), dataclasses.astuple(seen[0]))
    assert seen[1] == make(None)


@pytest.mark.parametrize("tag", [
    {"$ekit": "tuple", "value": {"a": 1}},
    {"$ekit": "tuple", "value": [1], "extra": 2},
    {"$ekit": "tuple"},
])
def test_a_malformed_tuple_tag_is_refused_naming_where(tag: dict[str, Any]) -> None:
    with pytest.raises(CheckpointError, match=r"outputs\.make.*malformed"):
        CODEC.decode_checkpoint({"step_index": 1, "outputs": {"make": tag},
                               "cost": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0}})
