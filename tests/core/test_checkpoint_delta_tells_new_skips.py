"""``delta_since`` tells the skips a checkpoint adds, and stops extending when one is gone.

Within one run skips only grow, and checkpoints between two skips share one
mapping: the delta finds the new ones from the end, without walking the
others. A skip that disappeared or changed its reason, or other shapes, is
no extension: a store writes such a checkpoint whole. An SQLite database made
before skips had a table of their own still opens, and loads as it did.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ekit_core import WorkflowCheckpoint
from ekit_core.shapes import Shape
from ekit_runtime import SqliteStore, Step, Workflow


def odd(context: dict[str, Any]) -> bool:
    return bool(context["split"] % 2 == 1)


def _checkpoints(n: int = 6) -> list[WorkflowCheckpoint]:
    flow = Workflow([
        Step("split", lambda c: list(range(c["n"]))),
        Step("score", lambda c: c["split"], ("split",), map_over="split", when=odd,
             context="dependencies"),
    ])
    saved: list[WorkflowCheckpoint] = []
    flow.run_sync({"n": n}, checkpoint_fn=saved.append, max_concurrency=1)
    return saved


def test_consecutive_checkpoints_of_a_run_add_their_new_skips_and_nothing_else() -> None:
    saved = _checkpoints()
    seen: dict[str, str] = {}
    for previous, checkpoint in zip([None, *saved], saved, strict=False):
        delta = checkpoint.delta_since(previous)
        assert delta.extends
        assert not set(delta.skipped) & set(seen)
        seen.update(delta.skipped)
    assert seen == dict(saved[-1].skipped) and len(seen) == 3


def test_a_delta_across_many_checkpoints_adds_every_skip_between() -> None:
    saved = _checkpoints()
    first, last = saved[0], saved[-1]
    delta = last.delta_since(first)
    assert delta.extends
    assert dict(delta.skipped) == {k: v for k, v in last.skipped.items() if k not in first.skipped}


def test_checkpoints_read_back_compare_their_skips_in_full() -> None:
    saved = _checkpoints()
    read = [WorkflowCheckpoint.from_dict(cp.to_dict()) for cp in saved]  # no shared ledgers
    delta = read[-1].delta_since(read[0])
    assert delta.extends
    assert dict(delta.skipped) == {k: v for k, v in read[-1].skipped.items() if k not in read[0].skipped}


def test_a_skip_gone_or_changed_or_other_shapes_is_no_extension() -> None:
    # Read back, as a store gives them: a run's own checkpoints never lose or
    # change a skip, and their deltas trust that, as they trust the ledgers.
    saved = [WorkflowCheckpoint.from_dict(cp.to_dict()) for cp in _checkpoints()]
    previous, last = saved[-2], saved[-1]
    assert previous.skipped
    name = next(iter(previous.skipped))
    gone = dataclasses.replace(
        last, skipped=MappingProxyType({k: v for k, v in last.skipped.items() if k != name}))
    changed = dataclasses.replace(
        last, skipped=MappingProxyType({**last.skipped, name: "another reason"}))
    reshaped = dataclasses.replace(
        last, shapes=MappingProxyType({**last.shapes, "score": Shape("split", None, "even")}))
    for checkpoint in (gone, changed, reshaped):
        delta = checkpoint.delta_since(previous)
        assert not delta.extends
        assert delta.skipped == checkpoint.skipped  # the delta holds everything


def test_a_hand_made_checkpoint_with_the_runs_ledgers_but_other_skips_is_compared_in_full() -> None:
    saved = _checkpoints()
    previous, last = saved[-2], saved[-1]
    # Same ledgers (so, to the fast path, one run), skips reordered: the last
    # of previous' is no longer where the new ones begin.
    reordered = dataclasses.replace(
        last, skipped=MappingProxyType(dict(reversed(list(last.skipped.items())))))
    assert reordered._outputs_ledger is last._outputs_ledger  # (replace keeps them)
    delta = reordered.delta_since(previous)
    assert delta.extends
    assert dict(delta.skipped) == {k: v for k, v in last.skipped.items() if k not in previous.skipped}


def _made_before_skips(path: Path, checkpoint: WorkflowCheckpoint) -> None:
    """A database as a store that kept no skips table left it, holding ``checkpoint``."""
    with SqliteStore(path, run_id="old") as store:
        store.save(checkpoint)
    conn = sqlite3.connect(path)
    conn.execute("DROP TABLE ekit_skips")
    conn.commit()
    conn.close()


def test_a_database_made_before_the_skips_table_opens_and_gains_it(tmp_path: Path) -> None:
    plain = Workflow([Step("a", lambda c: 1)]).run_sync().checkpoint
    _made_before_skips(tmp_path / "old.db", plain)
    with SqliteStore(tmp_path / "old.db", run_id="old") as store:
        assert store.load() == plain
        shaped = _checkpoints()[-1]
        store.save(shaped)
    with SqliteStore(tmp_path / "old.db", run_id="old") as store:
        assert store.load() == shaped


def test_a_read_only_database_made_before_the_skips_table_opens_and_loads(tmp_path: Path) -> None:
    plain = Workflow([Step("a", lambda c: 1)]).run_sync().checkpoint
    _made_before_skips(tmp_path / "old.db", plain)
    conn = sqlite3.connect(f"file:{tmp_path / 'old.db'}?mode=ro", uri=True, isolation_level=None)
    with SqliteStore(conn, run_id="old") as store:
        assert store.load() == plain
    conn.close()
