"""A persistent, append-only mapping: the storage behind outputs and usage.

Outputs of a run only ever grow and never change (invariant 5), so every
state of a run can share one backing store and see a prefix of it. Adding an
entry to the newest state appends in place in O(1); adding to an older state
(a branch, which a plain run never makes) copies that prefix first. Readers
never mutate anything, so any number of states and checkpoints can be read
side by side, from any thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import suppress
from itertools import chain, islice
from types import MappingProxyType
from typing import Generic, TypeVar

__all__ = ["Ledger"]

_new = object.__new__

K = TypeVar("K")
V = TypeVar("V")


class _Backing(Generic[K, V]):
    __slots__ = ("base", "claims", "index", "keys", "values")

    def __init__(self, base: dict[K, V] | None = None) -> None:
        # The first entries, as a dict of their own (a resume's recorded
        # outputs): looked up there, never indexed or copied into the
        # columns, so that building a ledger over them costs one C copy.
        # Never changed once the backing exists.
        self.base: dict[K, V] = {} if base is None else base
        # The entries after the base: index maps each key to its place in
        # keys and values.
        self.index: dict[K, int] = {}
        self.keys: list[K] = []
        self.values: list[V] = []
        # Place -> the view that extended the store there. setdefault is
        # atomic in CPython, so two branches can never both append at one slot.
        self.claims: dict[int, object] = {}


class Ledger(Mapping[K, V]):
    """An immutable mapping whose ``with_item`` shares storage with its parent.

    Iteration follows insertion order. Equality is that of any ``Mapping``.
    """

    # _n counts the entries after the base that this view sees.
    __slots__ = ("_b", "_n")

    def __init__(self, items: Mapping[K, V] | Iterable[tuple[K, V]] = ()) -> None:
        # Built once per resume from every recorded output: a dict (or a
        # read-only view of one) becomes the base by one C copy; anything
        # else is made into columns by C loops (zip, dict), not one Python
        # step per entry.
        base = None
        if type(items) is dict or type(items) is MappingProxyType:
            with suppress(AttributeError):  # a view of a mapping without copy(): columns below
                base = items.copy()
            if type(base) is not dict:
                base = None
        backing: _Backing[K, V] = _Backing(base)
        if base is None:
            if isinstance(items, Mapping):
                keys, values = list(items.keys()), list(items.values())
            else:
                pairs = list(items)
                keys, values = (list(c) for c in zip(*pairs, strict=True)) if pairs else ([], [])
            if keys:
                backing.keys, backing.values = keys, values
                backing.index = dict(zip(keys, range(len(keys)), strict=True))
                if len(backing.index) != len(keys):
                    seen: set[K] = set()
                    for key in keys:
                        if key in seen:
                            raise ValueError(f"duplicate key {key!r}")
                        seen.add(key)
        self._b = backing
        self._n = len(backing.keys)

    def __getitem__(self, key: K) -> V:
        b = self._b
        i = b.index.get(key)
        if i is None:
            return b.base[key]
        if i >= self._n:
            raise KeyError(key)
        return b.values[i]

    def get(self, key: K, default: V | None = None) -> V | None:  # type: ignore[override]
        """``self[key]``, or ``default`` when absent, without raising inside (a hot path)."""
        b = self._b
        i = b.index.get(key)
        if i is None:
            return b.base.get(key, default)
        if i >= self._n:
            return default
        return b.values[i]

    def __contains__(self, key: object) -> bool:
        b = self._b
        try:
            i = b.index.get(key)  # type: ignore[arg-type]
        except TypeError:  # unhashable keys are simply absent
            return False
        if i is None:
            return key in b.base
        return i < self._n

    def __len__(self) -> int:
        return len(self._b.base) + self._n

    def __iter__(self) -> Iterator[K]:
        b = self._b
        if b.base:
            return chain(b.base, islice(b.keys, self._n))
        return islice(b.keys, self._n)

    def __repr__(self) -> str:
        # Bounded: asyncio and loggers repr results in passing, and a run may
        # hold many thousands of outputs.
        shown = ", ".join(f"{k!r}: {v!r}" for k, v in self._entries(0, 8))
        more = f", ... ({len(self)} entries)" if len(self) > 8 else ""
        return f"Ledger({{{shown}{more}}})"

    def as_dict(self) -> dict[K, V]:
        """A plain ``dict`` of the entries, in insertion order: one O(n) copy."""
        b = self._b
        entries = dict(b.base)
        # Bounded by n: the store may hold a longer branch's entries.
        entries.update(islice(zip(b.keys, b.values, strict=False), self._n))
        return entries

    def items_from(self, start: int) -> list[tuple[K, V]]:
        """The entries after the first ``start``, in insertion order: in
        O(len(result)) past the base, and a C walk to ``start`` inside it."""
        b = self._b
        first = start - len(b.base)
        if first >= 0:
            # Past the base (a save's delta, every step): two slices, no iterator
            # chain. This runs once per save, so its constant matters.
            return list(zip(b.keys[first:self._n], b.values[first:self._n], strict=True))
        return list(self._entries(start, len(self)))

    def _entries(self, start: int, stop: int) -> Iterator[tuple[K, V]]:
        """The entries from position ``start`` up to ``stop``, lazily."""
        b = self._b
        stop = min(stop, len(self))
        start = max(0, min(start, stop))
        m = len(b.base)
        rest: Iterator[tuple[K, V]] = iter(())
        if stop > m:
            first, last = max(start, m) - m, stop - m
            rest = zip(b.keys[first:last], b.values[first:last], strict=True)
        if start < m:
            return chain(islice(b.base.items(), start, min(stop, m)), rest)
        return rest

    def added_since(self, earlier: Ledger[K, V]) -> tuple[tuple[K, V], ...] | None:
        """The entries this ledger adds to ``earlier``, in insertion order, when both
        share storage and ``earlier`` is a prefix of it; else ``None`` (then ask
        :meth:`extends`). O(len(result)): a save's delta, once per step."""
        b = self._b
        start, stop = earlier._n, self._n
        if earlier._b is not b or start > stop:
            return None
        # (Views sharing a backing see prefixes of its columns: no base walk, no lengths.)
        return tuple(zip(b.keys[start:stop], b.values[start:stop], strict=True))

    def extends(self, other: Ledger[K, V]) -> bool:
        """Is ``other`` a prefix of this ledger? O(1) when they share storage."""
        if len(other) > len(self):
            return False
        if other._b is self._b:
            return True
        return all(
            k == ok and (v is ov or v == ov)
            for (k, v), (ok, ov) in zip(
                self._entries(0, len(other)), other._entries(0, len(other)), strict=True
            )
        )

    def with_item(self, key: K, value: V) -> Ledger[K, V]:
        """A new ledger holding every entry of this one plus ``key: value``.

        Raises ``ValueError`` if ``key`` is already present: entries never change.
        """
        backing, n = self._b, self._n
        i = backing.index.get(key)
        if (i is not None and i < n) or (backing.base and key in backing.base):
            raise ValueError(f"{key!r} is already recorded and cannot change")
        if len(backing.keys) != n or backing.claims.setdefault(n, self) is not self:
            backing = _Backing(self._b.base)  # the base is never changed: shared
            for k, v in zip(islice(self._b.keys, n), islice(self._b.values, n), strict=True):
                backing.index[k] = len(backing.keys)
                backing.keys.append(k)
                backing.values.append(v)
            backing.claims[n] = self
        backing.index[key] = n
        backing.keys.append(key)
        backing.values.append(value)
        view = _new(Ledger)  # (object.__new__: Ledger's own, one lookup less per step)
        view._b = backing
        view._n = n + 1
        return view

    def with_items(self, added: Mapping[K, V]) -> Ledger[K, V]:
        """:meth:`with_item` for each entry of ``added``, in order (a growing graph's
        tables, see :mod:`ekit_core.appending`): O(len(added))."""
        view: Ledger[K, V] = self
        for key, value in added.items():
            view = view.with_item(key, value)
        return view
