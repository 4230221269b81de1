"""Writing a checkpoint into a file that may already be a store: ``ekit rewind -o``'s target.

:func:`write_checkpoint` tells what the file is by its content, as
:mod:`ekit_runtime.sources` does (never by its name), and writes through
the store that owns that kind of file, so that the store's rules hold: its
write lock (a live run holding the file is refused, naming the process, and
its next save still succeeds), its format, the file's permission bits.

- no file yet, or an empty one: a ``JsonFileStore`` file, created with the
  mode a store gives a new file;
- a checkpoint JSON (a ``JsonFileStore`` file): replaced through
  ``JsonFileStore``;
- a ``JournalStore`` journal: saved through ``JournalStore``. A rewound
  checkpoint does not extend the journal's last one (outputs went away), so
  it is appended as a full record: the journal loads, and ends with the
  rewound checkpoint, and its history before the rewind stays (``ekit
  replay`` reads it; ``compact()`` drops it);
- a ``SqliteStore`` database: saved as run ``run_id`` through
  ``SqliteStore``, under that run's lock.

Anything else is refused, before a byte is written, with a
:class:`TargetError` naming the file: a run queue's database (a queue run's
checkpoint is written by the worker holding its lease, or in place by the
queue's own fenced ``ekit queue rewind``, which the message points to), a
SQLite database of another application, JSON lines, a JSON array or any other
content, a directory, a URL.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote

from ekit_core import WorkflowCheckpoint
from ekit_runtime.redaction import is_keyword_dsn, redacted
from ekit_runtime.sources import SQLITE_MAGIC
from ekit_runtime.stores import JournalStore, JsonFileStore, SqliteStore, StoreLockedError

__all__ = ["TargetError", "write_checkpoint"]

_JOURNAL_START = b'{"c":"'
_NEW_FILE = "a new checkpoint JSON (JsonFileStore)"


class TargetError(ValueError):
    """A file a checkpoint cannot be written into safely; the message is one line naming it."""


@dataclass(frozen=True, slots=True)
class _Target:
    """What the file is, and how to write a checkpoint into it (returns what was done, in words)."""

    what: str
    write: Callable[[WorkflowCheckpoint], str]


def write_checkpoint(path: str, checkpoint: WorkflowCheckpoint, *, run_id: str | None = None) -> str:
    """Write ``checkpoint`` into ``path`` through the store that owns that kind of file.

    ``run_id`` is the run to write in a ``SqliteStore`` database. Returns
    what was written, in words (``"through JournalStore, ..."``). Raises
    :class:`TargetError` for a file it cannot write safely and for a store
    that refuses the save (another writer holds it), nothing written.
    """
    target = _target(path, run_id)
    try:
        return target.write(checkpoint)
    except TargetError:
        raise
    except StoreLockedError as exc:
        if exc.pid is None:
            # Not a live holder: the store's own message says why (a changed
            # file, a lock file that is a link or not ours, a folder not writable).
            raise TargetError(_one_line(str(exc))) from None  # it names the file itself
        lock = f" (lock file {exc.lock_path})" if exc.lock_path else ""
        raise TargetError(
            f"{path}: {target.what} that process {exc.pid} is writing{lock}: nothing was written. "
            "Let that run end (or stop it), then rewind again"
        ) from None
    except ValueError as exc:
        raise TargetError(f"{path}: {_one_line(str(exc))}") from None
    except OSError as exc:
        raise TargetError(f"{path}: cannot write: {exc.strerror or exc}") from None


def _target(path: str, run_id: str | None) -> _Target:
    if "://" in path or is_keyword_dsn(path):
        raise TargetError(
            f"{redacted(path)}: -o takes a file; a rewound checkpoint is not written into a database "
            "server (write it to a file and resume the run from that file)"
        )
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.lexists(path):
            raise TargetError(f"{path}: a symbolic link to nothing; refusing to write through it") from None
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise TargetError(f"{path}: cannot write: no folder {folder}") from None
        return _Target(_NEW_FILE, lambda cp: _json_file(path, cp, _NEW_FILE))
    except OSError as exc:
        raise TargetError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise TargetError(f"{path}: is a directory, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise TargetError(f"{path}: not a regular file; refusing to write to it")
    head = _head(path)
    if head.startswith(SQLITE_MAGIC):
        return _sqlite_target(path, run_id)
    if head.lstrip(b" \t\r\n").startswith(_JOURNAL_START):
        return _Target("a JournalStore journal", lambda cp: _journal(path, cp))
    if not head.strip():
        what = "an empty file, written as a checkpoint JSON (JsonFileStore)"
        return _Target("an empty file", lambda cp: _json_file(path, cp, what))
    _require_checkpoint_json(path)
    what = "a checkpoint JSON (JsonFileStore)"
    return _Target(what, lambda cp: _json_file(path, cp, f"{what}, replacing the checkpoint it held"))


def _head(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(4096)
    except OSError as exc:
        raise TargetError(f"{path}: cannot read: {exc.strerror or exc}") from None


_NOT_OURS = "refusing to overwrite it; give -o a new file, or a store's file"


def _require_checkpoint_json(path: str) -> None:
    """Refuse a file that is not one whole checkpoint JSON (JSON lines, an array, anything else)."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        raise TargetError(f"{path}: holds something other than an ekit checkpoint; {_NOT_OURS}") from None
    if not isinstance(data, dict):
        what = "a JSON array (a list of checkpoints?)" if isinstance(data, list) else "other JSON"
        raise TargetError(f"{path}: holds {what}; {_NOT_OURS}")
    try:
        WorkflowCheckpoint.from_dict(data)
    except ValueError:
        raise TargetError(f"{path}: holds JSON other than an ekit checkpoint; {_NOT_OURS}") from None


def _json_file(path: str, checkpoint: WorkflowCheckpoint, what: str) -> str:
    store = JsonFileStore(path)
    try:
        # load() first, also of a file that is not there yet: it checks the
        # content again and pins the file, so that the save is refused if the
        # file appears, changes or is replaced in between, not only if
        # another writer holds the lock. (An empty file does not load.)
        if not _is_empty(path):
            store.load()
        store.save(checkpoint)
    finally:
        store.close()
    return f"as {what}"


def _is_empty(path: str) -> bool:
    try:
        return os.path.getsize(path) == 0
    except FileNotFoundError:
        return False


def _journal(path: str, checkpoint: WorkflowCheckpoint) -> str:
    with JournalStore(path) as store:
        if store.load() is None:
            raise TargetError(f"{path}: a JournalStore journal holding no checkpoint; {_NOT_OURS}")
        store.save(checkpoint)
    return (
        "through JournalStore: the journal now ends with it (appended as one full record; "
        "its history before the rewind stays)"
    )


def _sqlite_target(path: str, run_id: str | None) -> _Target:
    has_store, has_queue, store_runs = _sqlite_tables(path)
    if has_store and (not has_queue or run_id in store_runs):
        if run_id is None:
            raise TargetError(
                f"{path}: a SqliteStore database holding {len(store_runs):,} run(s); pass "
                "--output-run-id RUN (or --run-id) to say which run to write"
            )
        what = f"a SqliteStore database, run {run_id!r},"
        return _Target(what, lambda cp: _sqlite_store(path, run_id, cp))
    if has_queue:
        raise TargetError(
            f"{path}: a run queue's database (SqliteQueue): nothing was written. Rewind a queued run "
            f"in place, fenced against its workers, with: ekit queue --queue {path} rewind RUN STEP... "
            "(or fork it under a new id: ekit queue ... fork RUN STEP... --run-id NEW)"
        )
    raise TargetError(f"{path}: a SQLite database without a SqliteStore's tables; {_NOT_OURS}")


def _sqlite_tables(path: str) -> tuple[bool, bool, frozenset[str]]:
    """Whether the database holds a store's and a queue's tables, and the store's run ids; read-only."""
    uri = "file:" + quote(os.path.abspath(path)) + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=30.0)
        try:
            names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            runs: frozenset[str] = frozenset()
            if "ekit_runs" in names:
                runs = frozenset(r[0] for r in conn.execute("SELECT run_id FROM ekit_runs"))
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise TargetError(f"{path}: a SQLite file that cannot be read ({exc}); {_NOT_OURS}") from None
    return "ekit_runs" in names, "ekit_queue_runs" in names, runs


def _sqlite_store(path: str, run_id: str, checkpoint: WorkflowCheckpoint) -> str:
    with SqliteStore(path, run_id=run_id) as store:
        store.load()
        store.save(checkpoint)
    return f"through SqliteStore, as run {run_id!r}"


def _one_line(text: str) -> str:
    return " ".join(text.split())
