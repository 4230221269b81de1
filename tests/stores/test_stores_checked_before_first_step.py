"""What a store can know is wrong is refused before the first step runs, never after it was paid.

When the store is made: a path whose folder is missing, or that is a
directory or a FIFO; a PostgreSQL run id with a NUL or too long to be a
key. When the run starts (``Workflow.run`` calls the store's
``prepare_run`` before any step): the write lock, taken then, so a store
another process holds, a stale lock file of another user's, a folder this
user cannot write and a read-only database are refused; so are step
names, version tags and context values the store could never write, and
a store another writer saved since it loaded. Each case asserts that the
step, which records that it ran, did not run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from ekit_runtime import (
    JournalStore,
    JsonFileStore,
    SqliteStore,
    Step,
    StoreLockedError,
    UnencodableError,
    Workflow,
    WorkflowCheckpoint,
)
from tests.support.store_helpers import Holder

KINDS = ("json", "journal", "sqlite")
NAMES = {"json": "cp.json", "journal": "cp.jsonl", "sqlite": "cp.db"}
RUN_ID = "crash-run"  # the run crash_child.py holds
ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def _open(kind: str, path: Path, run_id: str = RUN_ID) -> Any:
    if kind == "json":
        return JsonFileStore(path)
    if kind == "journal":
        return JournalStore(path)
    return SqliteStore(path, run_id=run_id)


def _workflow(ran: list[str], name: str = "paid", version: str | None = None) -> Workflow:
    async def paid(ctx: dict[str, Any]) -> str:
        ran.append(name)  # an LLM call would be paid here
        return "output"

    return Workflow([Step(name, paid, version=version)])


def _run(store: Any, ran: list[str], **options: Any) -> Any:
    workflow = _workflow(ran, **options)
    return asyncio.run(workflow.run(checkpoint_fn=store))


# -- when the store is made ----------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_store_in_a_missing_folder_is_refused_when_made(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "runs" / NAMES[kind]
    argument = "database" if kind == "sqlite" else "path"
    expected = rf"^{argument} '.*runs/{NAMES[kind]}': its folder '.*runs' does not exist"
    with pytest.raises(ValueError, match=expected):
        _open(kind, path)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_a_store_path_that_is_a_directory_is_refused_when_made(kind: str, tmp_path: Path) -> None:
    (tmp_path / NAMES[kind]).mkdir()
    with pytest.raises(ValueError, match=r"is a directory, not a store file"):
        _open(kind, tmp_path / NAMES[kind])


@pytest.mark.parametrize("bad", [None, 3, b"cp.json"])
@pytest.mark.parametrize("store", [JsonFileStore, JournalStore])
def test_a_path_that_is_not_text_is_a_value_error_naming_it(store: Any, bad: Any) -> None:
    with pytest.raises(ValueError, match=r"^path must be a str or an os.PathLike of one, got "):
        store(bad)


@pytest.mark.parametrize("argument", ["dumps", "loads"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_codec_that_is_not_callable_is_refused_when_made(kind: str, argument: str, tmp_path: Path) -> None:
    path = tmp_path / NAMES[kind]
    make = {"json": JsonFileStore, "journal": JournalStore}.get(kind)
    with pytest.raises(ValueError, match=rf"^{argument} must be a callable or None, got int$"):
        if make is None:
            SqliteStore(path, run_id=RUN_ID, **{argument: 3})
        else:
            make(path, **{argument: 3})


# -- when the run starts -------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_store_another_process_holds_is_refused_before_the_first_step(kind: str, tmp_path: Path) -> None:
    path = tmp_path / NAMES[kind]
    ran: list[str] = []
    with Holder(kind, path) as holder:
        store = _open(kind, path)
        with pytest.raises(StoreLockedError, match=f"held by process {holder.proc.pid}"):
            _run(store, ran)
        assert ran == []
        store.close()
    with _open(kind, path) as store:  # the holder let go: the run goes ahead
        _run(store, ran)
    assert ran == ["paid"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_store_another_object_holds_is_refused_before_the_first_step(kind: str, tmp_path: Path) -> None:
    path = tmp_path / NAMES[kind]
    ran: list[str] = []
    with _open(kind, path) as first:
        first(WorkflowCheckpoint(0, MappingProxyType({})))
        with _open(kind, path) as second, pytest.raises(StoreLockedError, match="this process"):
            _run(second, ran)
    assert ran == []


@pytest.mark.parametrize("kind", KINDS)
def test_the_lock_is_taken_when_the_run_starts_and_kept_until_close(kind: str, tmp_path: Path) -> None:
    """So a second run that starts while the first is at its first step is refused at once."""
    path = tmp_path / NAMES[kind]
    ran: list[str] = []
    with _open(kind, path) as first:
        seen: list[BaseException] = []

        async def paid(ctx: dict[str, Any]) -> str:
            second = _open(kind, path)
            try:
                await _workflow(ran, "second").run(checkpoint_fn=second.save)  # a bound method too
            except StoreLockedError as exc:
                seen.append(exc)
            second.close()
            return "output"

        asyncio.run(Workflow([Step("first", paid)]).run(checkpoint_fn=first))
        assert len(seen) == 1 and "this process" in str(seen[0])
    assert ran == []


@pytest.mark.skipif(not ROOT, reason="chown needs root")
@pytest.mark.parametrize("kind", KINDS)
def test_a_stale_lock_file_of_another_user_is_refused_before_the_first_step(
    kind: str, tmp_path: Path
) -> None:
    path = tmp_path / NAMES[kind]
    store = _open(kind, path)
    store(WorkflowCheckpoint(0, MappingProxyType({})))
    lock = store._lock.lock_path if kind != "sqlite" else store._writer.lock_path
    store.close()
    Path(lock).write_text("4242\n")  # what a crashed run of that user leaves
    os.chown(lock, 65534, 65534)
    ran: list[str] = []
    with _open(kind, path) as store, pytest.raises(StoreLockedError) as info:
        _run(store, ran)
    assert ran == []
    assert f"the lock file {lock} belongs to another user (uid 65534)" in str(info.value)
    assert Path(lock).read_text() == "4242\n"


@contextlib.contextmanager
def _read_only(folder: Path) -> Iterator[None]:
    """``folder`` unwritable for this user, root included (immutable), for the block."""
    if ROOT:
        if subprocess.run(["chattr", "+i", str(folder)], capture_output=True, check=False).returncode:
            pytest.skip("chattr +i is not available here")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        return
    folder.chmod(0o555)
    try:
        yield
    finally:
        folder.chmod(0o755)


@pytest.mark.parametrize("stale_lock", [False, True], ids=["no-lock-file", "own-stale-lock-file"])
@pytest.mark.parametrize("kind", ["json", "journal"])
def test_a_folder_this_user_cannot_write_is_refused_before_the_first_step(
    kind: str, stale_lock: bool, tmp_path: Path
) -> None:
    folder = tmp_path / "runs"
    folder.mkdir()
    path = folder / NAMES[kind]
    if stale_lock:
        Path(str(path) + ".lock").write_text("4242\n")
    store = _open(kind, path)
    ran: list[str] = []
    with _read_only(folder), pytest.raises(StoreLockedError) as info:
        _run(store, ran)
    assert ran == []
    if stale_lock:
        assert f"this user cannot create files in the folder {folder}" in str(info.value)
    else:
        assert f"cannot create the lock file {path}.lock" in str(info.value)
    store.close()


def test_a_read_only_sqlite_database_is_refused_before_the_first_step(tmp_path: Path) -> None:
    db = tmp_path / "cp.db"
    SqliteStore(db, run_id=RUN_ID).close()
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, isolation_level=None)
    ran: list[str] = []
    with SqliteStore(conn, run_id=RUN_ID) as store, pytest.raises(StoreLockedError, match="read-only"):
        _run(store, ran)
    assert ran == []
    conn.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_store_another_writer_saved_since_it_loaded_is_refused_before_the_first_step(
    kind: str, tmp_path: Path
) -> None:
    path = tmp_path / NAMES[kind]
    stale = _open(kind, path)
    assert stale.load() is None
    with _open(kind, path) as other:
        other(WorkflowCheckpoint(1, MappingProxyType({"x": 1})))
    ran: list[str] = []
    with pytest.raises(StoreLockedError, match="since this store last read or wrote it"):
        _run(stale, ran)
    assert ran == []
    stale.close()


@pytest.mark.parametrize("options", [{"name": "lone \udc80"}, {"version": "\udc80"}], ids=["name", "version"])
@pytest.mark.parametrize("kind", KINDS)
def test_text_utf8_cannot_hold_is_refused_before_the_first_step(
    kind: str, options: dict[str, Any], tmp_path: Path
) -> None:
    """Whoever refuses it first (``Step`` itself, or the store's ``prepare_run``), no step runs."""
    ran: list[str] = []
    with _open(kind, tmp_path / NAMES[kind]) as store, pytest.raises(ValueError, match="'\\\\udc80'"):
        _run(store, ran, **options)
    assert ran == []


def _unstorable(where: str) -> WorkflowCheckpoint:
    """A checkpoint holding a lone surrogate in a step name, a version tag or a context key."""
    name = "lone \udc80" if where == "name" else "paid"
    return WorkflowCheckpoint(
        0, MappingProxyType({}), graph=MappingProxyType({name: ()}),
        versions=MappingProxyType({name: "\udc80"} if where == "version" else {}),
        context=MappingProxyType({"key \udc80": 1} if where == "context key" else {}),
    )


@pytest.mark.parametrize(
    ("where", "what", "step"),
    [
        ("name", "the name of step 'lone \\udc80'", "lone \udc80"),
        ("version", "the version tag of step 'paid'", "paid"),
        ("context key", "context key 'key \\udc80'", None),
    ],
    ids=["name", "version", "context-key"],
)
@pytest.mark.parametrize("kind", KINDS)
def test_prepare_run_refuses_text_utf8_cannot_hold_naming_it(
    kind: str, where: str, what: str, step: str | None, tmp_path: Path
) -> None:
    with _open(kind, tmp_path / NAMES[kind]) as store:
        with pytest.raises(UnencodableError) as info:
            store.prepare_run(_unstorable(where))
        assert str(info.value).startswith(f"cannot store {what}: it holds '\\udc80'")
        assert info.value.step == step
        assert store.load() is None


@pytest.mark.parametrize("kind", KINDS)
def test_a_context_value_the_store_cannot_encode_is_refused_before_the_first_step(
    kind: str, tmp_path: Path
) -> None:
    ran: list[str] = []
    with _open(kind, tmp_path / NAMES[kind]) as store, pytest.raises(UnencodableError, match="'bad'"):
        asyncio.run(_workflow(ran).run({"bad": object()}, checkpoint_fn=store))
    assert ran == []


def test_iterate_checks_the_store_before_the_first_step_too(tmp_path: Path) -> None:
    ran: list[str] = []

    async def drive(store: Any) -> None:
        async for _ in _workflow(ran).iterate(checkpoint_fn=store):
            pass

    path = tmp_path / "cp.json"
    with JsonFileStore(path) as first:
        first(WorkflowCheckpoint(0, MappingProxyType({})))
        with JsonFileStore(path) as second, pytest.raises(StoreLockedError, match="this process"):
            asyncio.run(drive(second))
    assert ran == []


def test_a_checkpoint_fn_with_no_prepare_run_is_called_as_before(tmp_path: Path) -> None:
    saved: list[int] = []
    ran: list[str] = []
    asyncio.run(_workflow(ran).run(checkpoint_fn=lambda cp: saved.append(cp.step_index)))
    assert (ran, saved) == (["paid"], [1])


# -- compact is a write ------------------------------------------------------------------


def test_compact_is_refused_while_another_process_holds_the_journal(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    with Holder("journal", path) as holder:
        before = path.read_bytes()
        with pytest.raises(StoreLockedError, match=f"held by process {holder.proc.pid}"):
            JournalStore(path).compact()
        assert path.read_bytes() == before
    with JournalStore(path) as store:
        assert store.compact() is not None


def test_a_refused_run_can_say_why_from_a_child_process(tmp_path: Path) -> None:
    """The error reaches a script as itself, not as a traceback of the driver."""
    path = tmp_path / "cp.json"
    script = (
        "import asyncio, sys\n"
        "from ekit_runtime import JsonFileStore, Step, Workflow\n"
        "ran = []\n"
        "async def paid(ctx):\n"
        "    ran.append(1)\n"
        "wf = Workflow([Step('paid', paid)])\n"
        "try:\n"
        "    asyncio.run(wf.run(checkpoint_fn=JsonFileStore(sys.argv[1])))\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, len(ran))\n"
    )
    with Holder("json", path):
        done = subprocess.run(
            [sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=60, check=True
        )
    assert done.stdout.split() == ["StoreLockedError", "0"]
