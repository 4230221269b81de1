"""How a store replaces its file: a temporary file beside the target, every byte written, a taken
temporary name skipped, a failed rename reported as such.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import JsonFileStore
from tests.support.store_helpers import journal_store, json_store, make_checkpoint, three_checkpoints


def test_the_temporary_file_of_a_save_is_created_beside_its_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rename is atomic only within one folder: the temporary file goes beside the target."""
    folder, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    real = os.replace
    renamed: list[tuple[str, str]] = []

    def spy(src: Any, dst: Any) -> None:
        renamed.append((os.fspath(src), os.fspath(dst)))
        real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    with JsonFileStore(folder / "cp.json") as store:
        store(make_checkpoint(1, {"a": 1}))
    [(src, dst)] = renamed
    assert dst == os.path.realpath(folder / "cp.json")
    assert os.path.dirname(src) == os.path.dirname(dst)
    assert os.path.basename(src).startswith(".cp.json.") and src.endswith(".tmp")
    assert os.listdir(elsewhere) == []


@pytest.mark.parametrize("make", [json_store, journal_store], ids=["json", "journal"])
def test_a_save_writes_every_byte_when_the_os_writes_a_few_at_a_time(
    tmp_path: Path, make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real(fd, bytes(data[:5])))
    first, second, third = three_checkpoints()
    with make(tmp_path) as store:
        store(first)
        store(second)
        store(third)
    monkeypatch.undo()
    assert make(tmp_path).load() == third


def _names_in_turn(monkeypatch: pytest.MonkeyPatch, names: list[str]) -> None:
    """Make the temporary file names ``.<file>.<name>.tmp``, the ``names`` in turn (the last one repeated)."""
    import secrets

    def token_hex(nbytes: int | None = None) -> str:
        return names.pop(0) if len(names) > 1 else names[0]

    monkeypatch.setattr(secrets, "token_hex", token_hex)


def test_a_taken_temporary_file_name_is_left_alone_and_another_one_tried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = tmp_path / ".cp.json.taken.tmp"
    taken.write_bytes(b"someone else's")
    _names_in_turn(monkeypatch, ["taken", "free"])
    with json_store(tmp_path) as store:
        store(make_checkpoint(1, {"a": 1}))
    assert taken.read_bytes() == b"someone else's"
    assert not (tmp_path / ".cp.json.free.tmp").exists()
    assert json_store(tmp_path).load() == make_checkpoint(1, {"a": 1})


def test_no_free_temporary_file_name_is_an_error_naming_the_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / ".cp.json.taken.tmp").write_bytes(b"")
    _names_in_turn(monkeypatch, ["taken"])
    target = os.path.realpath(tmp_path / "cp.json")
    with json_store(tmp_path) as store, pytest.raises(FileExistsError) as info:
        store(make_checkpoint(1, {"a": 1}))
    assert str(info.value) == f"{target}: no free temporary file name beside it"
    assert not (tmp_path / "cp.json").exists()


def test_a_failed_rename_whose_temporary_file_is_gone_raises_the_renames_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The clean-up of the temporary file never hides why the save failed."""

    def vanish(src: Any, dst: Any) -> None:
        os.unlink(src)  # removed meanwhile (by a cleaner, say): the rename finds nothing
        raise FileNotFoundError(2, "No such file or directory", os.fspath(src))

    monkeypatch.setattr(os, "replace", vanish)
    with json_store(tmp_path) as store, pytest.raises(FileNotFoundError, match="No such file"):
        store(make_checkpoint(1, {"a": 1}))
    assert os.listdir(tmp_path) == []
