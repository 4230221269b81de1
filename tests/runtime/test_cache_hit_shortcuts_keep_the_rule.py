"""What a hit skips to be cheap gives what the rule gives (issue 45: a hit's cost).

What users rely on: a cache hit is found for exactly the entries the rule
(docs/cache.md) says, however it is found. The shortcuts a hit takes must
not move a key: a head written directly is the head :func:`head_of` hashes
(an old cache's entries still hit), a stored text read by the scanner alone
is what ``default_loads`` reads (or refuses), an entry read back through its
slots is the entry, the read of a head with many entries is still bounded (and
reads the same through json_each as through a list of parameters),
and a value several cached steps read is hashed once as the run starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import TokenUsage
from ekit_core.code import CacheHit
from ekit_runtime import SqliteCache, Step, Workflow
from ekit_runtime.cache import CacheEntry, at_start, entry_key, head_of
from ekit_runtime.cache.base import CachedStep, _EntryTwin, _same_layout, hit_of, loads
from ekit_runtime.cache.sqlite import _CHUNK, FEW
from ekit_runtime.stores.codec import default_dumps, default_loads

# Any text, lone surrogates too (a step's name is checked elsewhere; the head must not care).
ANY_TEXT = st.text(st.characters(blacklist_categories=()), max_size=12)


@settings(max_examples=300, deadline=None)
@given(step=ANY_TEXT, fingerprint=ANY_TEXT, version=st.none() | ANY_TEXT, item=st.none() | ANY_TEXT,
       types=st.lists(ANY_TEXT, max_size=3).map(tuple))
def test_a_head_written_directly_is_the_head_of_its_parts(step: str, fingerprint: str, version: str | None,
                                                           item: str | None, types: tuple[str, ...]) -> None:
    one = CachedStep(None, step, fingerprint, version, types, None, None)  # type: ignore[arg-type]
    assert one.head(item) == head_of(step, fingerprint, version, item, types)


class Name(str):
    """A str subclass: not plain, so the head is made the long way (and is the same)."""


def test_a_head_of_values_that_are_not_plain_strings_is_made_the_long_way() -> None:
    one = CachedStep(None, Name("s"), "f", None, (), None, None)  # type: ignore[arg-type]
    assert one.head(Name("i")) == head_of("s", "f", None, "i", ())


def _key_the_long_way(head: str, reads: Mapping[str, str]) -> str:
    import hashlib

    return hashlib.sha256(default_dumps([head, sorted(reads.items())]).encode("utf-8", "surrogatepass")
                          ).hexdigest()


@settings(max_examples=300, deadline=None)
@given(head=ANY_TEXT, reads=st.dictionaries(ANY_TEXT, ANY_TEXT, max_size=5))
def test_an_entry_key_written_directly_is_the_key_of_its_parts(head: str, reads: dict[str, str]) -> None:
    # (every entry stored so far is filed under the long way's key: they must still be found)
    assert entry_key(head, reads) == _key_the_long_way(head, reads)


def test_an_entry_key_of_values_that_are_not_plain_strings_is_made_the_long_way() -> None:
    assert entry_key(Name("h"), {Name("k"): "x", "\x00keys": Name("y")}) == _key_the_long_way(
        "h", {"k": "x", "\x00keys": "y"})


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | ANY_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(value=JSON)
def test_a_stored_text_reads_as_default_loads_reads_it(value: Any) -> None:
    text = default_dumps(value)
    assert loads(text) == default_loads(text) == value or (
        isinstance(value, float) and math.isnan(value))


@pytest.mark.parametrize("text", ['{"a": NaN}', "Infinity", "[1, -Infinity]", " 1", "1 ", "", "[1,", "1 2",
                                  '"\x01"', b'"bytes"'])
def test_a_text_the_scanner_does_not_read_whole_goes_to_default_loads(text: Any) -> None:
    try:
        expected: Any = default_loads(text)
    except ValueError as exc:
        with pytest.raises(ValueError) as caught:
            loads(text)
        assert str(caught.value) == str(exc)
    else:
        assert loads(text) == expected


def test_an_entry_read_back_through_its_slots_is_the_entry() -> None:
    fields = [f.name for f in dataclasses.fields(CacheEntry)]
    assert fields == ["head", "reads", "output", "usage", "created", "step", "stored_key"], (
        "a new field: CacheEntry._read_back must set it too")
    usage = TokenUsage(3, 4, 1)
    fast = CacheEntry._read_back("h", {"a": "x"}, '"o"', usage, 12.5, "s", "k")
    ordinary = CacheEntry("h", {"a": "x"}, '"o"', usage, 12.5, "s", "k")
    assert fast == ordinary and repr(fast) == repr(ordinary)
    assert [getattr(fast, f) for f in fields] == [getattr(ordinary, f) for f in fields]
    assert type(fast) is CacheEntry and fast.key == "k"
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.output = "changed"  # type: ignore[misc]
    hit = hit_of(fast)
    assert type(hit) is CacheHit and hit == CacheHit("k", usage) and repr(hit) == repr(CacheHit("k", usage))
    with pytest.raises(dataclasses.FrozenInstanceError):
        hit.key = "other"  # type: ignore[misc]


def test_a_twin_whose_slots_drifted_from_its_class_is_refused_at_import() -> None:
    class Short:
        __slots__ = ("head", "reads")

    with pytest.raises(TypeError, match="slots of CacheEntry"):
        _same_layout(Short, CacheEntry)
    _same_layout(_EntryTwin, CacheEntry)


def test_few_tells_a_crowded_head_from_the_few_beside_it(tmp_path: Path) -> None:
    cache = SqliteCache(tmp_path / "c.db")
    # More under "crowded" than a bounded read of three heads takes: read at most FEW + 1, said so,
    # and the entries of the others still all read.
    for i in range(3 * (FEW + 1) + 5):
        cache.put(CacheEntry("crowded", {"x": str(i)}, json.dumps(i), created=1000.0 + i, step="c"))
    for i in range(3):
        cache.put(CacheEntry("few", {"x": str(i)}, json.dumps(i), created=2000.0 - i, step="f"))
    found = cache.few(["few", "crowded", "none"])
    assert found["crowded"] is None and found["none"] == []
    listed = found["few"]
    assert listed is not None and [e.output for e in listed] == ["0", "1", "2"]  # newest first
    assert found == cache.few(["none", "few", "crowded", "few"])
    cache.close()


@pytest.mark.parametrize("heads", [3, _CHUNK + 7])
def test_few_reads_the_same_entries_through_json_each_as_through_a_list_of_parameters(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, heads: int) -> None:
    # An SQLite without json_each reads the heads as IN (?, ...): both read exactly the fresh
    # entries under the heads asked, a crowded head said so, over any number of heads.
    monkeypatch.setattr(time, "time", lambda: 10_000.0)
    cache = SqliteCache(tmp_path / "c.db")  # (unbounded while filled: the stale entries stay)
    for n in range(heads):
        cache.put(CacheEntry(f"h{n}", {"x": "1"}, json.dumps(n), TokenUsage(n * 10**9, n % 3, n % 2),
                             created=9_950.0 + n % 40, step=f"s{n}"))
        cache.put(CacheEntry(f"h{n}", {"x": "2"}, "-1", created=9_800.0, step="s"))  # past max_age
    cache.put(CacheEntry("other", {}, "0", created=9_990.0, step="o"))
    for i in range(FEW + 2):
        cache.put(CacheEntry("crowded", {"x": str(i)}, json.dumps(i), created=9_960.0 + i, step="c"))
    cache.close()
    cache = SqliteCache(tmp_path / "c.db", max_age=100)
    asked = [f"h{n}" for n in range(heads)] + ["crowded", "none", "'); DROP TABLE ekit_cache; --"]
    assert cache._json is not None  # (this SQLite has it: both paths are compared)
    through_json = cache.few(asked)
    cache._json = None
    assert cache.few(asked) == through_json
    assert set(through_json) == set(asked) and through_json["crowded"] is None
    assert through_json["none"] == [] and through_json[asked[-1]] == []
    for n in range(heads):
        listed = through_json[f"h{n}"]
        assert listed is not None and [e.output for e in listed] == [json.dumps(n)]
        assert listed[0].usage == TokenUsage(n * 10**9, n % 3, n % 2) and listed[0].step == f"s{n}"
        assert listed[0].head == f"h{n}" and listed[0].reads == {"x": "1"}
        assert listed[0].created == 9_950.0 + n % 40
    cache.close()


def test_a_value_many_cached_steps_read_is_hashed_once_as_the_run_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def read_doc(ctx: Mapping[str, Any]) -> str:
        return f"{len(ctx['doc'])} characters"

    flow = Workflow([Step(f"s{i}", read_doc, cache=True) for i in range(5)])
    with SqliteCache(tmp_path / "c.db") as cache:
        asyncio.run(flow.run({"doc": "a long document"}, cache=cache))
        hashed: list[str] = []
        real = at_start.value_hash
        monkeypatch.setattr(at_start, "value_hash",
                            lambda context, key, encode: hashed.append(key) or real(context, key, encode))
        second = asyncio.run(flow.run({"doc": "a long document"}, cache=cache))
        assert second.checkpoint is not None
        assert set(second.checkpoint.cache_hits) == {f"s{i}" for i in range(5)}
        assert hashed == ["doc"]
        third = asyncio.run(flow.run({"doc": "another"}, cache=cache))  # and a new value misses, for all
        assert third.checkpoint is not None and not third.checkpoint.cache_hits


TONE = "gentle"


def review(ctx: Mapping[str, Any]) -> str:
    return f"a {TONE} review of {ctx['draft']}" + "".join(c for c in "ok" if c)  # (nested code too)


def test_a_fingerprint_replayed_for_known_code_is_the_one_computed_and_still_sees_its_globals(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ekit_runtime import fingerprints

    monkeypatch.setattr(fingerprints, "_CODE_BYTES", {})
    first = fingerprints.code_fingerprint(review)
    assert fingerprints._CODE_BYTES  # the code's bytes are kept...
    assert fingerprints.code_fingerprint(review) == first  # ...and replayed as the same fingerprint
    monkeypatch.setattr(fingerprints, "_CODE_BYTES", {})
    assert fingerprints.code_fingerprint(review) == first  # (computed afresh: the same)
    monkeypatch.setitem(globals(), "TONE", "blunt")  # a global the code reads: never kept with it
    assert fingerprints.code_fingerprint(review) != first
