"""A directory cache serves an entry only from where its own head says it belongs, and writes
nothing outside its directory.

What users rely on: a hit is an output recorded for the same step, code and
inputs. An entry file found under another head's folder (copied or moved by
hand, restored from a backup into the wrong place) claims another step: it is
never served there. A head that is not a hash (a path: ``../elsewhere``) is
refused before anything is written.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ekit_runtime import DirectoryCache
from ekit_runtime.cache import CacheEntry, head_of


def test_an_entry_moved_under_another_head_is_not_served_there(tmp_path: Path) -> None:
    cache = DirectoryCache(tmp_path / "cache")
    draft, critique = (head_of(step, "f" * 32, None, None, ()) for step in ("draft", "critique"))
    stored = cache.put(CacheEntry(draft, {}, '"a draft"', step="draft"))
    (tmp_path / "cache" / critique).mkdir()
    shutil.copy(tmp_path / "cache" / draft / f"{stored.key}.json",
                tmp_path / "cache" / critique / f"{stored.key}.json")
    assert [e.output for e in cache.candidates(draft)] == ['"a draft"']
    assert cache.candidates(critique) == []


@pytest.mark.parametrize("head", ["../outside", "a/b", "", ".."])
def test_a_head_that_is_no_hash_is_refused(tmp_path: Path, head: str) -> None:
    cache = DirectoryCache(tmp_path / "cache")
    with pytest.raises(ValueError, match="head"):
        cache.put(CacheEntry(head, {}, '"x"', step="s"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
