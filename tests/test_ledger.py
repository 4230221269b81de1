"""The ledger behind outputs: persistent, append-only, O(1) to extend the newest version."""

from __future__ import annotations

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
