"""Tables a run grows by a few entries at a time: what a loop's iteration adds, in O(that).

A shaped run's running graph and its tables (step -> index, step -> dependencies,
the names in order, step -> dependents, item -> what it is an item of) grow
whenever a map expands or a loop grows an iteration. Copying a table to add
to it costs O(table): per iteration of a loop, O(every iteration so far).
This module owns the rule that keeps growth O(what is added), amortized:

- a small table (at most ``SMALL`` entries) is copied: one C copy is cheaper
  than the appends below, and its lookups stay the C lookups of a dict;
- a larger table grown by few entries (fewer than a quarter of its size)
  becomes an append-only :class:`~ekit_core.ledger.Ledger` (a mapping) or an
  :class:`Appended` (a sequence) and is appended to: O(1) an entry, shared
  with the table before, which still sees its own entries only;
- a larger one grown by many (a map's items) is copied whole: the copy costs
  at most four times what is added.

Readers see the same keys, values and order either way; only a reader that
needs a ``dict`` or ``tuple`` itself would tell them apart, and none does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from itertools import islice
from types import MappingProxyType
from typing import Any, TypeVar, overload

from ekit_core.ledger import Ledger

__all__ = ["SMALL", "Appended", "grown_names", "grown_table", "with_one"]

SMALL = 128
"""Tables up to this size are copied to grow (measured: a one-step loop's iteration in a
graph of 40 to 80 steps costs less by copies than by appends)."""

K = TypeVar("K")
V = TypeVar("V")

_new = object.__new__


def grown_table(table: Mapping[K, V], added: Mapping[K, V]) -> Mapping[K, V]:
    """``table`` and ``added`` (keys new to it), in that order, as a new read-only mapping
    (``table`` unchanged): appended to when ``table`` is large and ``added`` small (see the
    module), else copied."""
    if not added:
        return table
    size = len(table)
    if size > SMALL and len(added) * 4 < size:
        ledger = table if type(table) is Ledger else Ledger(table)  # (one C copy, once)
        return ledger.with_items(added)
    if type(table) is Ledger:
        merged = table.as_dict()
    elif type(table) is MappingProxyType or type(table) is dict:
        merged = table.copy()  # (the C copy of the dict behind it)
    else:
        merged = dict(table)
    merged.update(added)
    return MappingProxyType(merged)


def with_one(table: Mapping[K, V], key: K, value: V) -> Mapping[K, V]:
    """:func:`grown_table` for one entry (a loop's iteration grows each table by one)."""
    if len(table) <= SMALL and type(table) is MappingProxyType:  # (a loop in a small graph)
        merged = table.copy()
    elif len(table) > SMALL:
        ledger = table if type(table) is Ledger else Ledger(table)
        return ledger.with_item(key, value)
    else:
        merged = table.copy() if type(table) is dict else dict(table)
    merged[key] = value
    return MappingProxyType(merged)


def grown_names(names: Sequence[str], added: Sequence[str]) -> Sequence[str]:
    """``names`` and then ``added``, as :func:`grown_table` grows a mapping: a tuple while
    small or grown by many, else an :class:`Appended` appended to."""
    if not added:
        return names
    size = len(names)
    if size > SMALL and len(added) * 4 < size:
        appended = names if type(names) is Appended else Appended(names)
        return appended.plus(added)
    return (*names, *added)


class Appended(Sequence[str]):
    """An immutable sequence of names whose :meth:`plus` shares storage with it (as a
    :class:`~ekit_core.ledger.Ledger` does for a mapping): appending to the newest costs
    O(what is appended); appending to an older one copies its prefix first. Equal to the
    tuple of its names, and to any sequence of the same names."""

    __slots__ = ("_b", "_claims", "_n")

    def __init__(self, names: Sequence[str] = ()) -> None:
        self._b: list[str] = list(names)
        self._claims: dict[int, Appended] = {}
        self._n = len(self._b)

    def plus(self, added: Sequence[str]) -> Appended:
        """A new sequence: these names, then ``added``."""
        backing, n, claims = self._b, self._n, self._claims
        if len(backing) != n or claims.setdefault(n, self) is not self:
            backing, claims = backing[:n], {}  # a branch: its own copy of the prefix
        backing.extend(added)
        view = _new(Appended)
        view._b, view._claims, view._n = backing, claims, len(backing)
        return view

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[str, ...]: ...

    def __getitem__(self, i: int | slice) -> str | tuple[str, ...]:
        if type(i) is int and 0 <= i < self._n:
            return self._b[i]
        if isinstance(i, slice):
            return tuple(self._b[:self._n][i])
        if isinstance(i, int) and -self._n <= i < 0:
            return self._b[self._n + i]
        raise IndexError("name index out of range")

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[str]:
        return islice(self._b, self._n)

    def __contains__(self, name: object) -> bool:
        return any(n == name for n in islice(self._b, self._n))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(other) == self._n and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__: Any = None

    def __repr__(self) -> str:
        return f"Appended({tuple(self)!r})"
