"""What a store encodes and what it names when it cannot: each output keeps its first encoding,
another version's output is encoded afresh, and an encoding error names the real cause.
"""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from ekit_core import WorkflowCheckpoint
from ekit_runtime import CorruptStoreError, JournalStore, JsonFileStore, SqliteStore
from ekit_runtime.stores import UnencodableError
from tests.support.store_helpers import journal_store, json_store, make_checkpoint


def test_a_nan_at_the_top_level_is_located_as_such(tmp_path: Path) -> None:
    (tmp_path / "cp.json").write_text("NaN")
    with pytest.raises(CorruptStoreError, match="NaN at the top level: "):
        json_store(tmp_path).load()


def _save_loaded(store: JsonFileStore, loaded: WorkflowCheckpoint) -> None:
    store(loaded)


def _compact(store: JournalStore, loaded: WorkflowCheckpoint) -> None:
    store.compact()


@pytest.mark.parametrize(
    ("make", "rewrite"), [(json_store, _save_loaded), (journal_store, _compact)], ids=["json", "journal"]
)
def test_a_loaded_output_its_dumps_cannot_write_loads_and_fails_at_the_rewrite(
    tmp_path: Path, make: Any, rewrite: Any
) -> None:
    """A ``loads`` may build what ``dumps`` refuses: load() still works; rewriting it names the step."""
    with make(tmp_path) as store:
        store(make_checkpoint(1, {"price": 1.5}))
    with make(tmp_path, loads=lambda text: json.loads(text, parse_float=Decimal)) as reader:
        loaded = reader.load()
        assert loaded is not None and loaded.outputs["price"] == Decimal("1.5")
        with pytest.raises(UnencodableError) as info:
            rewrite(reader, loaded)
    assert info.value.step == "price"


def test_an_unencodable_checkpoint_field_names_the_real_cause(tmp_path: Path) -> None:
    """Neither an output nor a context key is at fault: the message gives the encoder's error."""
    with SqliteStore(tmp_path / "cp.db", run_id="r") as store, pytest.raises(UnencodableError) as info:
        store(make_checkpoint(1, {"a": 1}, versions={"a": "\ud800"}))
    assert str(info.value).startswith("cannot encode the checkpoint: UnicodeEncodeError: ")
    assert isinstance(info.value.__cause__, UnicodeEncodeError)
    assert SqliteStore(tmp_path / "cp.db", run_id="r").load() is None


def _changed_fingerprint(checkpoint: WorkflowCheckpoint) -> dict[str, Any]:
    return {"fingerprint": "other"}


def _changed_graph(checkpoint: WorkflowCheckpoint) -> dict[str, Any]:
    return {"graph": {"a": (), "b": ("a",)}}


@pytest.mark.parametrize("make", [json_store, journal_store], ids=["json", "journal"])
@pytest.mark.parametrize("change", [_changed_fingerprint, _changed_graph], ids=["fingerprint", "graph"])
def test_an_output_of_another_version_of_the_workflow_is_encoded_afresh(
    tmp_path: Path, make: Any, change: Any
) -> None:
    """Another fingerprint or graph is another run: an equal-looking new object is not the saved one."""
    shared = [1]
    first = make_checkpoint(1, {"a": shared}, fingerprint="f", graph={"a": ()})
    with make(tmp_path) as store:
        store(first)
        shared.append(2)  # mutated after it was saved: the stored text stays [1]
        second = make_checkpoint(
            2, {"a": [1, 2], "b": 1}, **{"fingerprint": "f", "graph": {"a": ()}, **change(first)}
        )
        store(second)
    loaded = make(tmp_path).load()
    assert loaded is not None and loaded.outputs["a"] == [1, 2]
    assert loaded == second


@pytest.mark.parametrize("make", [json_store, journal_store], ids=["json", "journal"])
def test_a_full_rewrite_keeps_the_first_encoding_of_an_output_mutated_since(
    tmp_path: Path, make: Any
) -> None:
    """Another output changed, so the save is written whole; the mutated one keeps its first text."""
    shared = [1]
    with make(tmp_path) as store:
        store(make_checkpoint(1, {"a": shared}))
        store(make_checkpoint(2, {"a": shared, "b": 1}))  # only "b" is new: "a" is not looked at again
        shared.append(2)
        store(make_checkpoint(3, {"a": shared, "b": 2}))
        store(make_checkpoint(4, {"a": shared, "b": 3}))
    loaded = make(tmp_path).load()
    assert loaded is not None and loaded.outputs == {"a": [1], "b": 3}


@pytest.mark.parametrize("make", [json_store, journal_store], ids=["json", "journal"])
def test_an_output_that_left_the_checkpoint_is_encoded_afresh_when_it_comes_back(
    tmp_path: Path, make: Any
) -> None:
    """Its stored text went with it: what comes back under that name is written as it is now."""
    shared = [1]
    with make(tmp_path) as store:
        store(make_checkpoint(1, {"a": shared}))
        store(make_checkpoint(0, {}))  # rewound: nothing of "a" is stored any more
        shared.append(2)
        store(make_checkpoint(1, {"a": shared}))
    loaded = make(tmp_path).load()
    assert loaded is not None and loaded.outputs == {"a": [1, 2]}


def _plain_dumps(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"))


def test_another_codec_names_the_context_key_it_cannot_encode(tmp_path: Path) -> None:
    store = JsonFileStore(tmp_path / "cp.json", dumps=_plain_dumps, loads=json.loads)
    with pytest.raises(UnencodableError) as info:
        store(make_checkpoint(1, {"a": 1}, context={"fine": 1, "bad": object()}))
    assert info.value.step is None
    assert str(info.value).startswith("cannot encode context key 'bad': TypeError: ")
    store.close()
    assert not (tmp_path / "cp.json").exists()
