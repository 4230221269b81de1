"""The bit window's operations agree with the sets of indices they stand for.

:mod:`ekit_core.window` is the one module that knows how a state holds its
ready and running steps; these properties pin each operation to plain set
arithmetic over declaration indices, wide windows (past ``WIDTH``) included.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ekit_core import window

index_sets = st.sets(st.integers(min_value=0, max_value=700), max_size=40)


def bits_of(indices: set[int], offset: int = 0) -> int:
    return sum(1 << (i - offset) for i in indices)


@given(index_sets, st.one_of(st.none(), st.integers(min_value=0, max_value=50)))
def test_indices_are_the_set_bits_lowest_first(indices: set[int], limit: int | None) -> None:
    expected = sorted(indices)
    assert window.indices(bits_of(indices), limit) == (expected if limit is None else expected[:limit])
    assert window.size(bits_of(indices)) == len(indices)


@given(index_sets, st.integers(min_value=0, max_value=10))
def test_names_of_reads_the_window_at_its_offset(indices: set[int], offset: int) -> None:
    names = [f"s{i}" for i in range(720)]
    shifted = {i + offset for i in indices if i + offset < 720}
    bits = bits_of(shifted, offset)
    assert window.names_of(names, offset, bits) == tuple(f"s{i}" for i in sorted(shifted))


@given(index_sets)
def test_a_first_window_starts_at_the_lowest_ready_step(indices: set[int]) -> None:
    ready = sorted(indices)
    offset, bits = window.start(ready)
    assert (offset, bits) == ((ready[0], bits_of(indices, ready[0])) if ready else (0, 0))


@given(index_sets, index_sets, st.integers(min_value=0, max_value=700))
def test_mask_put_take_and_single_bits_are_set_arithmetic(
    held: set[int], some: set[int], offset: int
) -> None:
    held = {i + offset for i in held}
    some = {i + offset for i in some}
    bits = bits_of(held, offset)
    if some:
        assert window.mask(sorted(some), offset) == bits_of(some, offset)
        assert window.put(bits, list(some), offset) == bits_of(held | some, offset)
        taken = window.take(bits, list(some), offset)
        assert taken == (bits_of(held - some, offset) if some <= held else -1)
        assert window.take(bits, [offset - 1, *some], offset) == -1  # below the window
    for j in range(-2, 720):
        assert window.has(bits, j) == (j >= 0 and j + offset in held)
    for j in held:
        k = j - offset
        assert window.remove(bits, window.bit(k)) == bits_of(held - {j}, offset)
        assert window.add(bits, window.bit(k)) == bits
        assert window.through(bits, k) == bits_of({i for i in held if i <= j}, offset)
    assert window.only_one(bits) == (len(held) <= 1)
    if len(held) == 1:
        assert window.single(bits) + offset == next(iter(held))


@given(index_sets, index_sets, st.integers(min_value=0, max_value=700),
       st.integers(min_value=0, max_value=1400))
def test_fit_and_anchor_move_the_window_without_moving_a_step(
    ready: set[int], running: set[int], offset: int, i: int
) -> None:
    def steps(o: int, r: int, n: int) -> tuple[set[int], set[int]]:
        return ({o + j for j in window.indices(r)}, {o + j for j in window.indices(n)})

    ready = {j + offset for j in ready}
    running = {j + offset for j in running} - ready
    r, n = bits_of(ready, offset), bits_of(running, offset)
    o2, r2, n2 = window.anchor(offset, r, n)
    assert steps(o2, r2, n2) == (ready, running)
    assert not (r2 or n2) or (r2 | n2) & 1  # anchored at its lowest step
    o3, r3, n3 = window.fit(offset, r, n, i)
    assert steps(o3, r3, n3) == (ready, running) and (o3 <= i or not (ready or running))
    if not (ready or running):
        assert o3 == i
