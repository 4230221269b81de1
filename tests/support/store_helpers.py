"""Test helpers for the checkpoint stores: open each kind by name, make checkpoints and journal lines."""

from __future__ import annotations

import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from ekit_core import TokenUsage, WorkflowCheckpoint
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


def make_checkpoint(
    step_index: int,
    outputs: dict[str, Any],
    cost: TokenUsage | None = None,
    **fields: Any,
) -> WorkflowCheckpoint:
    """A checkpoint at ``step_index`` holding ``outputs``; mappings among ``fields`` made read-only."""
    wrapped = {k: MappingProxyType(v) if isinstance(v, dict) else v for k, v in fields.items()}
    return WorkflowCheckpoint(step_index, MappingProxyType(outputs), cost or TokenUsage(), **wrapped)


def framed_line(body: bytes) -> bytes:
    """One journal line holding ``body`` with a correct checksum (the journal's own framing)."""
    return b'{"c":"%08x","r":%s}\n' % (zlib.crc32(body), body)


def journal_lines(path: Path) -> list[bytes]:
    """The journal's lines, each with its newline."""
    return path.read_bytes().splitlines(keepends=True)


def journal_of(path: Path, *checkpoints: WorkflowCheckpoint) -> None:
    """A journal at ``path`` holding ``checkpoints``, saved in turn by one store."""
    with JournalStore(path) as store:
        for checkpoint in checkpoints:
            store(checkpoint)


def three_checkpoints(start: int = 1) -> list[WorkflowCheckpoint]:
    """Three checkpoints of one run, from ``step_index=start``, each adding one output."""
    return [make_checkpoint(i, {f"s{j}": j for j in range(i)}) for i in range(start, start + 3)]


def full_disk_on_call(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, n: int) -> None:
    """Make ``module.name``'s ``n``-th call from now fail as a full disk; the others run it."""
    real = getattr(module, name)
    calls: list[int] = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == n:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, failing)
