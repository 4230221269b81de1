"""The JSON file store: a file changed by another writer is refused, a failed save does not refuse
the next one, an unreadable file names the decoder's error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ekit_runtime import CorruptStoreError, JsonFileStore, StoreLockedError
from tests.support.store_helpers import full_disk_on_call, json_store, make_checkpoint


def test_a_json_file_changed_by_another_writer_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cp.json"
    mine = JsonFileStore(path)
    mine(make_checkpoint(1, {"a": 1}))
    mine.close()
    with JsonFileStore(path) as other:
        other(make_checkpoint(2, {"a": 1, "b": 2}))
    with pytest.raises(StoreLockedError) as info:
        mine(make_checkpoint(2, {"a": 1, "c": 3}))
    mine.close()
    assert info.value.path == str(path)
    assert info.value.run_id is None
    assert str(info.value).startswith(f"{path}: the file changed since this store last read")
    assert JsonFileStore(path).load() == make_checkpoint(2, {"a": 1, "b": 2})


def test_a_failed_json_save_does_not_refuse_the_next_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a write that failed, what is on disk is unknown to the store, not "changed by another"."""
    import ekit_runtime.stores.jsonfile as jsonfile

    path = tmp_path / "cp.json"
    full_disk_on_call(monkeypatch, jsonfile, "atomic_write", 2)
    with JsonFileStore(path) as store:
        store(make_checkpoint(1, {"a": 1}))
        with pytest.raises(OSError, match="No space"):
            store(make_checkpoint(2, {"a": 1, "b": 2}))
        store(make_checkpoint(2, {"a": 1, "b": 2}))
    assert JsonFileStore(path).load() == make_checkpoint(2, {"a": 1, "b": 2})


def test_an_unreadable_json_file_names_the_decoder_error(tmp_path: Path) -> None:
    (tmp_path / "cp.json").write_text("{not json")
    with pytest.raises(CorruptStoreError, match=r"not a readable checkpoint \(JSONDecodeError: "):
        json_store(tmp_path).load()
