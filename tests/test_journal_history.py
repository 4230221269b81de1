"""``JournalStore.history()``: every checkpoint a journal holds, one per line, from real saves."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from ekit_core import GraphSpec, WorkflowCheckpoint, replay
from ekit_runtime import CorruptStoreError, JournalStore, PatternResult, Step, TokenUsage, Workflow
from tests.strategies import dags


def _workflow(graph: GraphSpec, fail: set[str] | None = None) -> Workflow:
    def make(name: str) -> object:
        def run(ctx: object) -> PatternResult[str]:
            if fail is not None and name in fail:
                raise RuntimeError(f"{name} broke")
            return PatternResult(f"out {name}", cost=TokenUsage(3, 1, 1))

        return run

    return Workflow([Step(n, make(n), graph.deps[n]) for n in graph.names])  # type: ignore[arg-type]


def _saved_distinct(saved: list[WorkflowCheckpoint]) -> list[dict[str, object]]:
    """The saves as dicts, a save that changed nothing dropped (the journal writes no line for it)."""
    out: list[dict[str, object]] = []
    for cp in saved:
        data = json.loads(json.dumps(cp.to_dict()))
        if not out or data != out[-1]:
            out.append(data)
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(graph=dags(min_steps=1, max_steps=8))
def test_history_is_every_save_in_order_and_ends_with_load(graph: GraphSpec, tmp_path: Path) -> None:
    path = tmp_path / f"h-{graph.fingerprint[7:19]}.jsonl"
    path.unlink(missing_ok=True)
    saved: list[WorkflowCheckpoint] = []
    with JournalStore(path, durable=False) as store:

        def save(cp: WorkflowCheckpoint) -> None:
            saved.append(cp)
            store(cp)

        _workflow(graph).run_sync(checkpoint_fn=save)
    history = list(JournalStore(path).history())
    assert [json.loads(json.dumps(cp.to_dict())) for cp in history] == _saved_distinct(saved)
    assert history[-1] == JournalStore(path).load()
    assert replay(graph, history).ok
    # Consecutive checkpoints share their outputs: a delta costs what changed.
    for before, after in pairwise(history):
        assert after.delta_since(before).extends


def test_history_of_a_failed_and_resumed_run_spans_both(tmp_path: Path) -> None:
    graph = GraphSpec.of({"a": [], "b": ["a"], "c": ["b"]})
    path = tmp_path / "resumed.jsonl"
    with JournalStore(path) as store, pytest.raises(RuntimeError, match="b broke"):
        _workflow(graph, fail={"b"}).run_sync(checkpoint_fn=store)
    with JournalStore(path) as store:
        _workflow(graph).run_sync(checkpoint_fn=store, resume_from=store.load())
    history = list(JournalStore(path).history())
    assert [sorted(cp.outputs) for cp in history] == [["a"], ["a"], ["a", "b"], ["a", "b", "c"]]
    assert "b" in history[1].failures
    report = replay(graph, history)
    assert report.ok, report.format()


def test_a_torn_last_line_is_skipped_and_damage_raises(tmp_path: Path) -> None:
    graph = GraphSpec.of({"a": [], "b": ["a"]})
    path = tmp_path / "torn.jsonl"
    with JournalStore(path) as store:
        _workflow(graph).run_sync(checkpoint_fn=store)
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"c":"0000')  # an append cut short by a crash
    assert len(list(JournalStore(path).history())) == 2
    lines = whole.splitlines(keepends=True)
    path.write_bytes(lines[0] + b"garbage\n" + lines[1])
    with pytest.raises(CorruptStoreError, match="line 2"):
        list(JournalStore(path).history())
    path.write_bytes(b'{"step_index": 0}\n')
    with pytest.raises(CorruptStoreError, match="not a JournalStore journal"):
        list(JournalStore(path).history())


def test_a_compacted_or_missing_journal(tmp_path: Path) -> None:
    graph = GraphSpec.of({"a": [], "b": ["a"]})
    path = tmp_path / "compact.jsonl"
    assert list(JournalStore(path).history()) == []
    with JournalStore(path) as store:
        _workflow(graph).run_sync(checkpoint_fn=store)
        assert len(list(store.history())) == 2
        store.compact()  # the history starts again at the full record
        assert list(store.history()) == [store.load()]
