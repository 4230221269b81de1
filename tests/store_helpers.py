"""Test helpers for the checkpoint stores: open each store kind in a folder, by name."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ekit_runtime import JournalStore, JsonFileStore, SqliteStore

Factory = Callable[..., Any]


def json_store(folder: Path, **kw: Any) -> JsonFileStore:
    return JsonFileStore(folder / "cp.json", **kw)


def journal_store(folder: Path, **kw: Any) -> JournalStore:
    return JournalStore(folder / "cp.jsonl", **kw)


def store_factories(run_id: str) -> dict[str, Factory]:
    """Each store kind by name, opening ``cp.*`` in a folder; the SQLite store holds ``run_id``."""

    def sqlite_store(folder: Path, **kw: Any) -> SqliteStore:
        return SqliteStore(folder / "cp.db", run_id=run_id, **kw)

    return {"json": json_store, "journal": journal_store, "sqlite": sqlite_store}


CRASH_CHILD = Path(__file__).resolve().parent / "crash_child.py"


class Holder:
    """A real second process holding a store's write lock (``crash_child.py hold``) until closed."""

    def __init__(self, kind: str, path: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(CRASH_CHILD), "hold", kind, str(path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the lock is held once it says so: no sleep
        if line != b"held\n":
            _, err = self.proc.communicate(timeout=30)
            raise AssertionError(f"the holder said {line!r}; stderr:\n{err.decode()}")

    def __enter__(self) -> Holder:
        return self

    def __exit__(self, *exc: object) -> None:
        _, err = self.proc.communicate(b"exit\n", timeout=30)
        assert self.proc.returncode == 0, err.decode()
