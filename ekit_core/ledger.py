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
from itertools import islice
from typing import Generic, TypeVar

__all__ = ["Ledger"]

K = TypeVar("K")
V = TypeVar("V")


class _Backing(Generic[K, V]):
    __slots__ = ("claims", "index", "keys", "values")

    def __init__(self) -> None:
        self.index: dict[K, int] = {}
        self.keys: list[K] = []
        self.values: list[V] = []
        # Position -> the view that extended the store there. setdefault is
        # atomic in CPython, so two branches can never both append at one slot.
        self.claims: dict[int, object] = {}


class Ledger(Mapping[K, V]):
    """An immutable mapping whose ``with_item`` shares storage with its parent.

    Iteration follows insertion order. Equality is that of any ``Mapping``.
    """

    __slots__ = ("_b", "_n")

    def __init__(self, items: Mapping[K, V] | Iterable[tuple[K, V]] = ()) -> None:
        # Built once per resume from every recorded output: the columns are
        # made by C loops (zip, dict), not one Python step per entry.
        backing: _Backing[K, V] = _Backing()
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
        i = self._b.index.get(key)
        if i is None or i >= self._n:
            raise KeyError(key)
        return self._b.values[i]

    def get(self, key: K, default: V | None = None) -> V | None:  # type: ignore[override]
        """``self[key]``, or ``default`` when absent, without raising inside (a hot path)."""
        i = self._b.index.get(key)
        if i is None or i >= self._n:
            return default
        return self._b.values[i]

    def __contains__(self, key: object) -> bool:
        try:
            i = self._b.index.get(key)  # type: ignore[arg-type]
        except TypeError:  # unhashable keys are simply absent
            return False
        return i is not None and i < self._n

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[K]:
        return islice(self._b.keys, self._n)

    def __repr__(self) -> str:
        # Bounded: asyncio and loggers repr results in passing, and a run may
        # hold many thousands of outputs.
        shown = ", ".join(f"{k!r}: {v!r}" for k, v in self._slice(0, 8))
        more = f", ... ({self._n} entries)" if self._n > 8 else ""
        return f"Ledger({{{shown}{more}}})"

    def as_dict(self) -> dict[K, V]:
        """A plain ``dict`` of the entries, in insertion order: one O(n) copy."""
        b = self._b
        # Bounded by n: the store may hold a longer branch's entries.
        return dict(islice(zip(b.keys, b.values, strict=False), self._n))

    def items_from(self, start: int) -> list[tuple[K, V]]:
        """The entries after the first ``start``, in insertion order, in O(len(result))."""
        return self._slice(start, self._n)

    def _slice(self, start: int, stop: int) -> list[tuple[K, V]]:
        b = self._b
        stop = min(stop, self._n)
        start = max(0, min(start, stop))
        return list(zip(b.keys[start:stop], b.values[start:stop], strict=True))

    def extends(self, other: Ledger[K, V]) -> bool:
        """Is ``other`` a prefix of this ledger? O(1) when they share storage."""
        if other._n > self._n:
            return False
        if other._b is self._b:
            return True
        mine, theirs = self._b, other._b
        return all(
            mine.keys[i] == theirs.keys[i]
            and (mine.values[i] is theirs.values[i] or mine.values[i] == theirs.values[i])
            for i in range(other._n)
        )

    def with_item(self, key: K, value: V) -> Ledger[K, V]:
        """A new ledger holding every entry of this one plus ``key: value``.

        Raises ``ValueError`` if ``key`` is already present: entries never change.
        """
        backing, n = self._b, self._n
        i = backing.index.get(key)
        if i is not None and i < n:
            raise ValueError(f"{key!r} is already recorded and cannot change")
        if len(backing.keys) != n or backing.claims.setdefault(n, self) is not self:
            backing = _Backing()
            for k, v in zip(islice(self._b.keys, n), islice(self._b.values, n), strict=True):
                backing.index[k] = len(backing.keys)
                backing.keys.append(k)
                backing.values.append(v)
            backing.claims[n] = self
        backing.index[key] = n
        backing.keys.append(key)
        backing.values.append(value)
        view = Ledger.__new__(Ledger)
        view._b = backing
        view._n = n + 1
        return view
