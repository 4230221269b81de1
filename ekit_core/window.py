"""The bit window: how a state holds its ready and running steps, and every operation on it.

Why it exists: a run's ready and running steps could be sets of names, but
a transition then pays per step for hashing and copying sets. Instead each
is an ``int`` used as a bit set over a *window* of declaration indices:
bit ``j`` stands for step ``graph.names[offset + j]``, and the window starts
at (or below) the lowest unfinished step. The integers are then as wide as
the run's frontier, not its graph, so a transition costs what the frontier
costs, even in a graph of a hundred thousand steps.

A window is three values kept side by side by :class:`~ekit_core.State`
(``_offset``, ``_ready``, ``_running``) and by the transitions' working
copy: ``offset`` (the declaration index of bit 0) and the two bit sets.
Indices here are of two kinds: a step's declaration index ``i`` (its place
in ``graph.names``) and its window index ``j = i - offset`` (its bit).

This module is the only one that knows that representation. One exception,
for speed, is stated here so that it lives in one place: on the path every
step of every run takes, :mod:`ekit_core.transitions` writes a few of the
operations below inline, each with a comment naming the one it inlines:
testing and clearing a finished step's bit in ``_succeeded`` (:func:`has`,
:func:`remove`), setting a child's ready bit in ``_count_down``
(:func:`add`, :func:`bit`), the one-ready-step test of ``_choose`` and
``_launch`` (:func:`only_one`, :func:`single`), and moving the chosen bits
from ready to running in ``_begin_attempts`` (:func:`remove`, :func:`add`).
There a Python call costs more than the operation itself (on a window
narrower than :data:`NARROW` an int operation costs about as much as a
call), once or more per step: calling them by name there cost a chain 2%
more instructions per step (153.3k to 156.6k, ``python -m
benchmarks.instructions``; fan-out, fan-in and resume did not move).
Everything else, the rare rules and the wide-window paths, calls them.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "NARROW",
    "WIDTH",
    "add",
    "anchor",
    "bit",
    "fit",
    "has",
    "indices",
    "mask",
    "names_of",
    "only_one",
    "put",
    "remove",
    "single",
    "size",
    "start",
    "take",
    "through",
]

WIDTH = 256
"""Window indices below this are set in place; beyond it, bits wait for one :func:`mask`."""

NARROW = 1 << WIDTH
"""Bit sets below it are narrow: an operation on them costs about as much as a call."""


def indices(bits: int, limit: int | None = None) -> list[int]:
    """Indices of the set bits of ``bits``, lowest first, at most ``limit`` of them."""
    if not bits & (bits - 1):  # zero or one bit: the common case of a chain
        return [bits.bit_length() - 1] if bits and limit != 0 else []
    out: list[int] = []
    if limit is None:
        limit = bits.bit_count()
    if limit <= 8:
        while bits and len(out) < limit:
            low = bits & -bits
            out.append(low.bit_length() - 1)
            bits ^= low
        return out
    digits = bin(bits)[:1:-1]
    i = digits.find("1")
    while i != -1 and len(out) < limit:
        out.append(i)
        i = digits.find("1", i + 1)
    return out


def names_of(names: Sequence[str], offset: int, bits: int) -> tuple[str, ...]:
    """The steps whose bits are set in ``bits`` (a window at ``offset``), in declaration order."""
    return tuple(names[offset + j] for j in indices(bits))


def size(bits: int) -> int:
    """How many steps ``bits`` holds."""
    return bits.bit_count()


def only_one(bits: int) -> bool:
    """Does ``bits`` hold at most one step? (Inlined in ``transitions._choose``.)"""
    return not bits & (bits - 1)


def single(bits: int) -> int:
    """The window index of the one step ``bits`` holds."""
    return bits.bit_length() - 1


def has(bits: int, j: int) -> bool:
    """Is window index ``j`` (negative: below the window) set in ``bits``?"""
    return j >= 0 and bool((bits >> j) & 1)


def bit(j: int) -> int:
    """The bit set holding window index ``j`` (>= 0) alone."""
    return 1 << j


def add(bits: int, more: int) -> int:
    """``bits`` with the bits of ``more`` set too."""
    return bits | more


def remove(bits: int, some: int) -> int:
    """``bits`` without ``some``, which it covers. (Inlined in ``transitions._succeeded``.)"""
    return bits ^ some


def take(bits: int, indices: list[int], offset: int) -> int:
    """``bits`` without the steps at declaration ``indices`` (one :func:`mask`), or
    ``-1`` if one of them is not set in ``bits`` or lies below the window."""
    if min(indices) < offset:
        return -1
    some = mask(indices, offset)
    return bits ^ some if bits & some == some else -1


def put(bits: int, indices: list[int], offset: int) -> int:
    """``bits`` with the steps at declaration ``indices`` (all >= ``offset``) set: one :func:`mask`."""
    return bits | mask(indices, offset)


def through(bits: int, j: int) -> int:
    """The bits of ``bits`` at window indices up to ``j``, included."""
    return bits & ((2 << j) - 1)


def start(ready: list[int]) -> tuple[int, int]:
    """The window of a first state: its offset at the lowest of ``ready`` (declaration
    indices, ascending), and their bits."""
    if not ready:
        return 0, 0
    bits = 0
    for i in ready:  # fewer bytecodes per step than mask(): a first state may set thousands
        bits |= 1 << i
    offset = ready[0]
    return offset, bits >> offset


def mask(indices: list[int], offset: int) -> int:
    """The int with bit ``i - offset`` set for each ``i`` in ``indices`` (all >= ``offset``).

    One mask for many steps, not one operation per step: an operation on an
    int costs its width, and a fan-out's window is as wide as the fan-out.
    """
    if len(indices) <= 4:
        bits = 0
        for i in indices:
            bits |= 1 << (i - offset)
        return bits
    raw = bytearray(((max(indices) - offset) >> 3) + 1)
    for i in indices:
        j = i - offset
        raw[j >> 3] |= 1 << (j & 7)
    return int.from_bytes(raw, "little")


def fit(offset: int, ready: int, running: int, i: int) -> tuple[int, int, int]:
    """Move the window so that declaration index ``i`` falls inside it.

    An empty window simply moves to ``i``; an index below it widens the
    window downwards.
    """
    if not (ready or running):
        return i, 0, 0
    if i < offset:
        shift = offset - i
        return i, ready << shift, running << shift
    return offset, ready, running


def anchor(offset: int, ready: int, running: int) -> tuple[int, int, int]:
    """Re-anchor the window at its lowest set bit, keeping the integers narrow."""
    both = ready | running
    if both and not both & 1:
        low = (both & -both).bit_length() - 1
        return offset + low, ready >> low, running >> low
    return offset, ready, running
