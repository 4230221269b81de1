"""A store writes only into regular files of its own: never through a link planted beside it.

A store's lock file (``<file>.lock``, or ``<database>-ekit-<run>-<hash>.lock``)
has a name anyone can predict, so whoever can write the folder can put
something there first: a symlink to a file the user cares about, a hard
link to it, a FIFO, a directory, a device, or a file of another user's.
Each is refused, with a :class:`StoreLockedError` naming the lock file, and
the victim keeps its bytes and its mode. The other files a save touches
get the same treatment: the temporary file of an atomic write (created
with ``O_EXCL``, so a planted name is skipped), the store file itself
(a symlink there is the user's and is followed, but one swapped in after
a save is refused), the journal's appends, a FIFO where the store file
was (refused, never waited on), and SQLite's ``-wal``/``-shm`` files.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from ekit_runtime import JournalStore, JsonFileStore, SqliteStore, StoreLockedError, WorkflowCheckpoint
from ekit_runtime.stores import CorruptStoreError
from ekit_runtime.stores.sqlite import _lock_file

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX file kinds")

KINDS = ("json", "journal", "sqlite")
NAMES = {"json": "cp.json", "journal": "cp.jsonl", "sqlite": "cp.db"}
RUN_ID = "r"
ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
VICTIM_BYTES = b"precious: not a lock file\n" * 3
VICTIM_MODE = 0o640


def _open(kind: str, folder: Path) -> Any:
    path = folder / NAMES[kind]
    if kind == "json":
        return JsonFileStore(path)
    if kind == "journal":
        return JournalStore(path)
    return SqliteStore(path, run_id=RUN_ID)


def _lock_path(kind: str, folder: Path) -> Path:
    target = os.path.realpath(folder / NAMES[kind])
    return Path(_lock_file(target, RUN_ID) if kind == "sqlite" else target + ".lock")


def _cp(count: int) -> WorkflowCheckpoint:
    return WorkflowCheckpoint(count, MappingProxyType({f"s{i}": i for i in range(count)}))


def _victim(folder: Path) -> Path:
    victim = folder / "victim"
    victim.write_bytes(VICTIM_BYTES)
    victim.chmod(VICTIM_MODE)
    return victim


def _plant(hostile: str, where: Path, victim: Path) -> str:
    """Put a ``hostile`` file at ``where``; the words the refusal uses for it."""
    if hostile == "symlink":
        where.symlink_to(victim)
        return "is a symbolic link"
    if hostile == "dangling symlink":
        where.symlink_to(victim.parent / "nowhere")
        return "is a symbolic link"
    if hostile == "hard link":
        os.link(victim, where)
        return "has 2 hard links"
    if hostile == "fifo":
        os.mkfifo(where)
        return "is a FIFO"
    if hostile == "directory":
        where.mkdir()
        return "is a directory"
    if hostile == "device":
        os.mknod(where, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # /dev/null's numbers
        return "is a character device"
    assert hostile == "another user's file"
    where.write_bytes(b"12345\n")
    os.chown(where, 65534, 65534)
    return "belongs to another user (uid 65534)"


HOSTILE = [
    "symlink",
    "dangling symlink",
    "hard link",
    "fifo",
    "directory",
    pytest.param("device", marks=pytest.mark.skipif(not ROOT, reason="mknod needs root")),
    pytest.param("another user's file", marks=pytest.mark.skipif(not ROOT, reason="chown needs root")),
]


def _assert_untouched(victim: Path) -> None:
    assert victim.read_bytes() == VICTIM_BYTES
    assert stat.S_IMODE(victim.stat().st_mode) == VICTIM_MODE


@pytest.mark.parametrize("hostile", HOSTILE)
@pytest.mark.parametrize("kind", KINDS)
def test_a_hostile_lock_path_is_refused_and_its_victim_untouched(
    kind: str, hostile: str, tmp_path: Path
) -> None:
    victim = _victim(tmp_path)
    lock = _lock_path(kind, tmp_path)
    words = _plant(hostile, lock, victim)
    store = _open(kind, tmp_path)
    with pytest.raises(StoreLockedError) as info:
        store(_cp(1))
    assert info.value.lock_path == str(lock)
    assert f"the lock file {lock} {words}" in str(info.value)
    assert "remove that file" in str(info.value)
    _assert_untouched(victim)
    assert os.path.lexists(lock)  # left as it was: not ours to remove
    assert not (tmp_path / "nowhere").exists()
    assert store.load() is None  # nothing saved
    # Refused again, the same way, until someone removes it; then the store works.
    with pytest.raises(StoreLockedError, match="remove that file"):
        store(_cp(1))
    store.close()
    if lock.is_dir() and not lock.is_symlink():
        lock.rmdir()
    else:
        lock.unlink()
    with _open(kind, tmp_path) as again:
        again(_cp(1))
        assert again.load() == _cp(1)
    _assert_untouched(victim)


@pytest.mark.parametrize("kind", KINDS)
def test_a_lock_file_swapped_for_a_symlink_while_held_is_never_written_through(
    kind: str, tmp_path: Path
) -> None:
    victim = _victim(tmp_path)
    lock = _lock_path(kind, tmp_path)
    store = _open(kind, tmp_path)
    store(_cp(1))
    lock.unlink()
    lock.symlink_to(victim)
    with pytest.raises(StoreLockedError, match="lost its write lock"):
        store(_cp(2))
    store.close()  # letting go removes only the file it locked, never what replaced it
    assert lock.is_symlink()
    _assert_untouched(victim)
    fresh = _open(kind, tmp_path)
    with pytest.raises(StoreLockedError, match="is a symbolic link"):
        fresh(_cp(2))
    fresh.close()
    _assert_untouched(victim)


@pytest.mark.parametrize("hostile", ["symlink", "dangling symlink", "hard link", "fifo", "directory"])
@pytest.mark.parametrize("kind", ["json", "journal"])
def test_a_hostile_file_at_the_temporary_name_is_skipped(
    kind: str, hostile: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The temporary name is random; made predictable here, what sits there is never opened."""
    import secrets as real_secrets

    import ekit_runtime.stores.files as files

    names = iter(["0" * 16])

    class Predictable:
        @staticmethod
        def token_hex(n: int) -> str:
            return next(names, None) or real_secrets.token_hex(n)

    victim = _victim(tmp_path)
    planted = tmp_path / f".{NAMES[kind]}.{'0' * 16}.tmp"
    _plant(hostile, planted, victim)
    monkeypatch.setattr(files, "secrets", Predictable)
    with _open(kind, tmp_path) as store:
        store(_cp(1))
    assert _open(kind, tmp_path).load() == _cp(1)
    _assert_untouched(victim)
    assert os.path.lexists(planted)


@pytest.mark.parametrize("kind", ["json", "journal"])
def test_a_symlinked_store_file_is_followed_and_locked_beside_its_target(kind: str, tmp_path: Path) -> None:
    """The user's own symlink: the file it points to is replaced, the link stays a link."""
    real = tmp_path / "real" / NAMES[kind]
    real.parent.mkdir()
    link = tmp_path / NAMES[kind]
    link.symlink_to(real)
    with _open(kind, tmp_path) as store:
        store(_cp(1))
        assert Path(str(real) + ".lock").is_file()
        store(_cp(2))
    assert link.is_symlink()
    assert _open(kind, tmp_path).load() == _cp(2)


@pytest.mark.parametrize("kind", ["json", "journal"])
def test_a_store_file_swapped_for_a_symlink_after_a_save_is_not_written_through(
    kind: str, tmp_path: Path
) -> None:
    victim = _victim(tmp_path)
    path = tmp_path / NAMES[kind]
    with _open(kind, tmp_path) as store:
        store(_cp(1))
        path.unlink()
        path.symlink_to(victim)
        with pytest.raises(StoreLockedError, match="changed since this store last read or wrote it"):
            store(_cp(2))
    _assert_untouched(victim)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind", ["json", "journal"])
def test_a_fifo_in_place_of_the_store_file_is_refused_not_waited_on(kind: str, tmp_path: Path) -> None:
    path = tmp_path / NAMES[kind]
    os.mkfifo(path)
    with pytest.raises(ValueError, match=r"is a FIFO, not a store file"):
        _open(kind, tmp_path)
    path.unlink()
    store = _open(kind, tmp_path)
    os.mkfifo(path)  # put there after the store was made
    with pytest.raises(CorruptStoreError, match=r"is a FIFO, not a store file"):
        store.load()
    if kind == "journal":
        with pytest.raises(CorruptStoreError, match=r"is a FIFO, not a store file"):
            list(store.history())


@pytest.mark.parametrize("suffix", ["-wal", "-shm", "-journal"])
def test_a_link_in_place_of_sqlites_own_files_is_refused_naming_it(suffix: str, tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    db = tmp_path / "cp.db"
    with SqliteStore(db, run_id=RUN_ID) as store:
        store(_cp(1))
    companion = Path(str(db) + suffix)
    if os.path.lexists(companion):
        companion.unlink()
    companion.symlink_to(victim)
    with pytest.raises(ValueError, match=rf"its file {companion} is a symbolic link, where SQLite"):
        SqliteStore(db, run_id=RUN_ID)
    _assert_untouched(victim)


@pytest.mark.parametrize("kind", KINDS)
def test_a_link_to_the_held_lock_file_in_its_place_counts_as_losing_it(kind: str, tmp_path: Path) -> None:
    """Its lock file renamed and a link to it put in its place: another name now, so the lock is lost."""
    lock = _lock_path(kind, tmp_path)
    store = _open(kind, tmp_path)
    store(_cp(1))
    moved = tmp_path / "moved.lock"
    lock.rename(moved)
    lock.symlink_to(moved)
    with pytest.raises(StoreLockedError, match="lost its write lock"):
        store(_cp(2))
    store.close()
    assert lock.is_symlink() and moved.is_file()
