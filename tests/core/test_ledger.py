"""The ledger behind outputs: persistent, append-only, O(1) to extend the newest version."""

from __future__ import annotations

from types import MappingProxyType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ekit_core.ledger import Ledger


def test_extending_shares_storage_and_keeps_old_versions() -> None:
    empty: Ledger[str, int] = Ledger()
    one = empty.with_item("a", 1)
    two = one.with_item("b", 2)
    assert dict(empty) == {} and dict(one) == {"a": 1} and dict(two) == {"a": 1, "b": 2}
    assert "b" not in one and "b" in two and len(one) == 1
    assert one._b is two._b  # no copy on the linear path


def test_branching_from_an_old_version_copies_and_isolates() -> None:
    base = Ledger([("a", 1)])
    left = base.with_item("b", 2)
    right = base.with_item("c", 3)
    assert dict(left) == {"a": 1, "b": 2}
    assert dict(right) == {"a": 1, "c": 3}
    assert "c" not in left and "b" not in right
    assert right.extends(base) and left.extends(base) and not left.extends(right)


@given(st.lists(st.integers(0, 50), unique=True, max_size=30), st.data())
def test_a_ledger_grown_step_by_step_tells_what_it_added_since_any_earlier_one(
    keys: list[int], data: st.DataObject
) -> None:
    # A run's checkpoints: each one entry longer than the one before, on one
    # storage. What a save writes is what the newer adds to the older.
    versions: list[Ledger[int, int]] = [Ledger()]
    for key in keys:
        versions.append(versions[-1].with_item(key, -key))
    older = data.draw(st.integers(0, len(keys)))
    newer = data.draw(st.integers(older, len(keys)))
    assert versions[newer].added_since(versions[older]) == tuple((k, -k) for k in keys[older:newer])
    if older < newer:  # an earlier state is no extension of a later one
        assert versions[older].added_since(versions[newer]) is None
    # A branch from an older version (another storage) is not read off by identity.
    branch = versions[older].with_item(999, 0)
    assert versions[newer].added_since(branch) is None


def test_existing_keys_never_change() -> None:
    ledger = Ledger([("a", 1)])
    try:
        ledger.with_item("a", 2)
    except ValueError as exc:
        assert "'a'" in str(exc)
    else:
        raise AssertionError("overwriting a recorded key must fail")


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 30)), max_size=40))
def test_random_branching_matches_a_dict_model(ops: list[tuple[bool, int]]) -> None:
    versions: list[tuple[Ledger[int, int], dict[int, int]]] = [(Ledger(), {})]
    for from_oldest, key in ops:
        ledger, model = versions[0] if from_oldest else versions[-1]
        if key in model:
            continue
        versions.append((ledger.with_item(key, key * 2), {**model, key: key * 2}))
    for ledger, model in versions:
        assert dict(ledger) == model
        assert list(ledger) == list(model)  # insertion order
        assert all(k in ledger for k in model) and len(ledger) == len(model)
        assert ledger.items_from(len(model) // 2) == list(model.items())[len(model) // 2 :]


def _start(kind: str, entries: dict[int, int]) -> Ledger[int, int]:
    """A first ledger holding ``entries``, built the way ``kind`` names."""
    if kind == "dict":  # a resume's recorded outputs: the base path
        return Ledger(dict(entries))
    if kind == "proxy":
        return Ledger(MappingProxyType(dict(entries)))
    if kind == "pairs":
        return Ledger(list(entries.items()))
    ledger: Ledger[int, int] = Ledger()  # grown one entry at a time
    for k, v in entries.items():
        ledger = ledger.with_item(k, v)
    return ledger


@given(
    st.sampled_from(["dict", "proxy", "pairs", "grown"]),
    st.dictionaries(st.integers(100, 130), st.integers(), max_size=12),
    st.lists(st.tuples(st.integers(0, 50), st.integers(0, 30)), max_size=30),
    st.data(),
)
def test_every_way_of_building_a_ledger_reads_like_a_dict(
    kind: str, first: dict[int, int], ops: list[tuple[int, int]], data: st.DataObject
) -> None:
    # A ledger built over a dict keeps it as its base (looked up, not
    # indexed): every read, every branch and every prefix test must be the
    # same as for a ledger that holds the same entries in its columns.
    source = dict(first)
    versions: list[tuple[Ledger[int, int], dict[int, int]]] = [(_start(kind, source), dict(first))]
    source[999] = 0  # the ledger took its own copy: a later write to the source is not seen
    for pick, key in ops:
        ledger, model = versions[pick % len(versions)]
        if key in model:
            with pytest.raises(ValueError, match="already recorded"):
                ledger.with_item(key, 0)
            continue
        versions.append((ledger.with_item(key, key * 2), {**model, key: key * 2}))
    for (ledger, model), (other, other_model) in zip(
        versions, data.draw(st.permutations(versions)), strict=True
    ):
        assert dict(ledger) == model and ledger.as_dict() == model
        assert list(ledger) == list(model) and len(ledger) == len(model)
        assert all(ledger[k] == v and ledger.get(k) == v and k in ledger for k, v in model.items())
        assert 999 not in ledger and ledger.get(999, -1) == -1 and [] not in ledger
        with pytest.raises(KeyError):
            ledger[999]
        start = data.draw(st.integers(0, len(model) + 1))
        assert ledger.items_from(start) == list(model.items())[start:]
        prefix = list(other_model.items()) == list(model.items())[: len(other_model)]
        assert ledger.extends(other) == prefix
        # The fast delta: never entries of a ledger that is not a prefix, and
        # exactly the new ones of one that is (None: ask extends instead).
        added = ledger.added_since(other)
        if added is not None:
            assert prefix and list(added) == list(model.items())[len(other_model):]
        assert repr(ledger).startswith("Ledger({")


# -- comparing, slicing and printing ---------------------------------------------------


def test_a_ledger_extends_an_equal_prefix_of_another_store_but_not_a_changed_one() -> None:
    base = Ledger([("a", [1]), ("b", 2)])
    copy = Ledger([("a", [1]), ("b", 2), ("c", 3)])  # equal values, other objects
    assert copy.extends(base) and copy.extends(Ledger()) and base.extends(base)
    assert not base.extends(copy)  # longer
    assert not Ledger([("a", [1]), ("b", 3)]).extends(base)  # a value changed
    assert not Ledger([("x", [1]), ("b", 2)]).extends(base)  # a key changed
    shared = base.with_item("c", 3)
    assert shared.extends(base) and not base.extends(shared)


def test_a_ledger_slices_and_prints_a_bounded_view() -> None:
    ledger = Ledger([(f"k{i}", i) for i in range(10)])
    prefix = Ledger([("k0", 0), ("k1", 1)])
    assert ledger.items_from(8) == [("k8", 8), ("k9", 9)]
    assert ledger.items_from(-3) == ledger.items_from(0) and len(ledger.items_from(0)) == 10
    assert ledger.items_from(11) == []
    assert repr(prefix) == "Ledger({'k0': 0, 'k1': 1})"
    shown = ", ".join(f"'k{i}': {i}" for i in range(8))
    assert repr(ledger) == f"Ledger({{{shown}, ... (10 entries)}})"
    assert repr(Ledger()) == "Ledger({})"


def test_an_older_ledger_does_not_see_what_a_newer_one_added() -> None:
    older = Ledger([("a", 1)])
    newer = older.with_item("b", 2)
    assert newer.get("b") == 2
    assert older.get("b") is None
    assert older.get("b", 0) == 0
    assert "b" not in older and dict(older) == {"a": 1}
