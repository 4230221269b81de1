"""Typed outputs at the edges of the codec: kept by an early cutoff, of a reloaded type, or refused.

What users rely on (docs/outputs.md): typed items that an early cutoff keeps
reach the steps downstream as their types after a resume from a store; a
type defined again (a reloaded module, a notebook cell run twice) registers
again under its name and is what a resume builds; stored data naming a field
the dataclass does not have is refused, naming the step and the field, and
sets nothing; and a dataclass the codec was not told is refused, both when
stored and when read, even though its module is imported (nothing a
checkpoint names is looked up outside the codec).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from ekit_core import CheckpointError, rewind
from ekit_runtime import Codec, JsonFileStore, Step, UnencodableError, Workflow
from ekit_runtime.typed import type_name


@dataclasses.dataclass(frozen=True)
class Note:
    text: str


# -- typed items an early cutoff keeps ------------------------------------------------------


def notes_pipeline(calls: list[str], version: str, *, split_fails: bool = False) -> Workflow:
    def split(ctx: Any) -> list[str]:
        if split_fails:
            raise ConnectionError("the provider is overloaded")
        return list(ctx["pieces"])

    def summarize(ctx: Any) -> Note:
        calls.append(f"summarize {ctx['split']}")
        return Note(ctx["split"].upper())

    def merge(ctx: Any) -> str:
        notes = ctx["summarize"]
        assert all(type(n) is Note for n in notes), notes  # every item as its type, kept or new
        return " ".join(n.text for n in notes)

    return Workflow([
        Step("split", split, version=version),
        Step("summarize", summarize, ("split",), map_over="split", context="dependencies"),
        Step("merge", merge, ("summarize",), context="dependencies"),
    ], codec=Codec())


def test_typed_items_kept_by_an_early_cutoff_are_decoded_on_resume(tmp_path: Path) -> None:
    path = tmp_path / "cp.json"
    calls: list[str] = []
    with JsonFileStore(path) as store:
        notes_pipeline(calls, "1").run_sync({"pieces": ["a", "b"]}, checkpoint_fn=store)
    # Version 2 of split fails before it runs again: the items are set aside, stored tagged.
    with JsonFileStore(path) as store, pytest.raises(ConnectionError):
        notes_pipeline(calls, "2", split_fails=True).run_sync(
            {"pieces": ["a", "c"]}, checkpoint_fn=store, resume_from=store.load())
    stored = JsonFileStore(path).load()
    assert stored is not None and stored.superseded["summarize[0]"]["$ekit"] == "type"
    calls.clear()
    result = notes_pipeline(calls, "2").run_sync({"pieces": ["a", "c"]}, resume_from=stored)
    assert calls == ["summarize c"]  # "a" is kept, and handed on as a Note
    assert result.outputs["merge"] == "A C" and result.outputs["summarize"] == [Note("A"), Note("C")]


# -- a type defined again -----------------------------------------------------------------


def define_note() -> type:
    """A fresh class ``Note`` of this module, as reloading the module would make it."""

    @dataclasses.dataclass(frozen=True)
    class Note:  # the same name on purpose: a reload defines it again
        text: str

    Note.__qualname__ = "Note"
    return Note


def test_a_type_defined_again_registers_again_and_is_what_a_resume_builds() -> None:
    old, new = define_note(), define_note()
    assert old is not new and type_name(old) == type_name(new)
    codec = Codec(old)
    stored = codec.encode(old("kept"))
    codec.register(new)  # not "name taken": it is the same type, defined again
    assert new in codec and old not in codec
    back = codec.decode(json.loads(json.dumps(stored)))
    assert type(back) is new and back == new("kept")
    assert codec.encode(new("x")) == {"$ekit": "type", "type": type_name(new), "value": {"text": "x"}}


def test_a_workflow_built_with_a_type_defined_again_resumes_what_the_old_one_stored() -> None:
    old, new = define_note(), define_note()

    def flow(cls: type, seen: list[Any]) -> Workflow:
        def make(ctx: Any) -> Any:
            return cls("made")

        def use(ctx: Any) -> int:
            seen.append(ctx["make"])
            return 1

        return Workflow([Step("make", make), Step("use", use, ("make",))], codec=Codec(cls))

    first = flow(old, []).run_sync()
    assert first.checkpoint is not None
    seen: list[Any] = []
    again = flow(new, seen)
    stored = json.loads(json.dumps(rewind(again, first.checkpoint, "use").to_dict()))
    again.run_sync(resume_from=stored)
    assert [type(v) for v in seen] == [new] and seen[0] == new("made")


# -- stored data the dataclass does not have ------------------------------------------------


def test_stored_fields_a_dataclass_lacks_are_refused_naming_the_step_and_the_field() -> None:
    codec = Codec(Note)
    tagged = {"$ekit": "type", "type": type_name(Note), "value": {"text": "t", "admin": True}}
    cp = {"step_index": 1, "outputs": {"make": tagged},
          "cost": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0}}
    with pytest.raises(CheckpointError, match=r"outputs\.make.*'admin'"):
        codec.decode_checkpoint(cp)
    with pytest.raises(CheckpointError, match="'admin'"):
        codec.decode(tagged)


# -- a dataclass the codec was not told --------------------------------------------------------


def test_a_dataclass_the_codec_was_not_told_is_refused_though_its_module_is_imported() -> None:
    assert sys.modules[__name__].Note is Note  # importable by the name a checkpoint would give
    told, untold = Codec(Note), Codec()
    with pytest.raises(UnencodableError, match="has not registered"):
        untold.encode(Note("x"))
    stored = told.encode_checkpoint(
        told.decode_checkpoint({"step_index": 1, "outputs": {"make": told.encode(Note("x"))},
                                "cost": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0}}))
    with pytest.raises(CheckpointError, match=r"outputs\.make.*has not registered"):
        untold.decode_checkpoint(stored)
    assert Note not in untold
