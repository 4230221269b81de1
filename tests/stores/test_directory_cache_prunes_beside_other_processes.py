"""A directory cache's bounds hold while other processes prune the same directory.

What users rely on: every ``put`` of a bounded ``DirectoryCache`` prunes, and
so does ``ekit cache prune``; an entry that another process removes while this
one prunes is simply gone, never an error (which would fail the put, or the
command). Shown with real processes, and pinned at the exact moment: an entry
vanishing between its read and the look at its size.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import DirectoryCache
from ekit_runtime.cache import CacheEntry, directory

_SPAWN = multiprocessing.get_context("spawn")
_DEADLINE = 300.0  # a deadlock detector only


def _fill(root: str, me: int, rounds: int, out: Any) -> None:
    cache = DirectoryCache(root, max_entries=5)
    try:
        for i in range(rounds):
            cache.put(CacheEntry(f"h{i % 7}", {"x": f"{me}-{i}"}, '"o"', step="s"))
            if i % 3 == 0:
                cache.prune()
        out.put("ok")
    except Exception as exc:
        out.put(f"{type(exc).__name__}: {exc}")


def test_processes_putting_and_pruning_one_directory_never_fail(tmp_path: Path) -> None:
    out = _SPAWN.Queue()
    workers = [_SPAWN.Process(target=_fill, args=(str(tmp_path), me, 300, out)) for me in range(3)]
    for worker in workers:
        worker.start()
    try:
        assert [out.get(timeout=_DEADLINE) for _ in workers] == ["ok"] * 3
    finally:
        for worker in workers:
            worker.join(_DEADLINE)
    assert len(list(DirectoryCache(tmp_path).entries())) <= 5 * 3  # each bound by its last prune


def test_an_entry_removed_by_another_prune_mid_prune_is_not_an_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = DirectoryCache(tmp_path)
    for i in range(4):
        cache.put(CacheEntry("head", {"x": str(i)}, '"o"', step="s"))
    read = directory._read

    def read_then_vanish(path: Path) -> CacheEntry | None:
        entry = read(path)
        path.unlink()  # another process's prune, between this one's read and its stat
        return entry

    monkeypatch.setattr(directory, "_read", read_then_vanish)
    cache.prune(max_entries=1)
    monkeypatch.undo()
    assert list(cache.entries()) == []
