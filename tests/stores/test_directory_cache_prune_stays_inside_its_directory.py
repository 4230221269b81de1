"""``DirectoryCache.prune`` (and so every bounded put, and ``ekit cache prune``) deletes only its own files.

What users rely on: pruning a cache directory removes cache entries and
nothing else. A folder of the cache that is a symbolic link to somewhere
else (made by hand, by a tool, by someone hostile) is not the cache's: the
files it leads to are never deleted, whatever their names.
"""

from __future__ import annotations

import os
from pathlib import Path

from ekit_runtime import DirectoryCache
from ekit_runtime.cache import CacheEntry


def test_prune_never_deletes_through_a_symlinked_folder(tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.json").write_text('{"mine": 1}')
    cache = DirectoryCache(tmp_path / "cache", max_entries=1)
    cache.put(CacheEntry("head", {"x": "1"}, '"o"', step="s"))
    os.symlink(precious, tmp_path / "cache" / ("a" * 64))
    cache.prune(max_age=1e-9)
    cache.put(CacheEntry("head", {"x": "2"}, '"o"', step="s"))
    assert (precious / "notes.json").read_text() == '{"mine": 1}'
