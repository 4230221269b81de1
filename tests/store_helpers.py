"""Test helpers for the checkpoint stores: open each store kind in a folder, by name."""

from __future__ import annotations

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
