"""``JournalStore.history()``: every checkpoint a journal holds, one per line, from real saves."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from ekit_core import FailureRecord, GraphSpec, TokenUsage, WorkflowCheckpoint, replay
from ekit_runtime import CorruptStoreError, JournalStore, PatternResult, Step, Workflow
from tests.support.store_helpers import (
    framed_line,
    journal_lines,
    journal_of,
    make_checkpoint,
    three_checkpoints,
)
from tests.support.strategies import dags


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


# -- every field, torn tails, deltas before any full record --------------------------------------


def _history_run() -> list[WorkflowCheckpoint]:
    """Saves that exercise every part of a delta: outputs (two at once), usage, failures, context."""
    context = {"user": "u"}
    common: dict[str, Any] = {
        "context": context, "fingerprint": "f" * 8, "versions": {"a": "1"},
        "graph": {"a": (), "b": ("a",), "c": ("a",), "d": ("b", "c")},
    }
    return [
        make_checkpoint(1, {"a": 1}, TokenUsage(1, 2, 1), step_usage={"a": TokenUsage(1, 2, 1)}, **common),
        make_checkpoint(
            3, {"a": 1, "c": [3], "b": "two"}, TokenUsage(4, 6, 3),
            step_usage={"a": TokenUsage(1, 2, 1), "c": TokenUsage(1, 1, 1), "b": TokenUsage(2, 3, 1)},
            failures={"d": FailureRecord("ValueError", "boom")}, **common,
        ),
        make_checkpoint(
            4, {"a": 1, "c": [3], "b": "two", "d": None}, TokenUsage(5, 6, 4),
            step_usage={"a": TokenUsage(1, 2, 1), "c": TokenUsage(1, 1, 1), "b": TokenUsage(2, 3, 1),
                        "d": TokenUsage(1, 0, 1)},
            **common,
        ),
    ]


def _same(got: WorkflowCheckpoint, want: WorkflowCheckpoint) -> None:
    assert got == want
    assert list(got.outputs.items()) == list(want.outputs.items())
    assert list(got.step_usage.items()) == list(want.step_usage.items())


def test_history_is_each_save_in_order_with_every_field(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    saved = _history_run()
    journal_of(path, *saved)
    history = list(JournalStore(path).history())
    assert len(history) == len(saved)
    for got, want in zip(history, saved, strict=True):
        _same(got, want)
    delta = history[2].delta_since(history[1])
    assert delta.extends
    assert [name for name, _ in delta.outputs] == ["d"]


def test_history_skips_a_torn_tail_and_restarts_at_a_full_record(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    saved = _history_run()
    journal_of(path, *saved)
    with open(path, "ab") as f:
        f.write(b'{"c":"0')
    assert len(list(JournalStore(path).history())) == 3
    JournalStore(path).compact()
    history = list(JournalStore(path).history())
    assert len(history) == 1
    _same(history[0], saved[-1])
    assert list(JournalStore(tmp_path / "missing.jsonl").history()) == []


def test_history_of_a_delta_before_any_full_record_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    journal_of(path, *three_checkpoints())
    lines = journal_lines(path)
    path.write_bytes(lines[1] + lines[2])
    with pytest.raises(CorruptStoreError) as info:
        list(JournalStore(path).history())
    assert (info.value.path, info.value.line) == (str(path), 1)
    assert str(info.value) == f"{path}, line 1: a delta record before any full one"


def test_load_of_a_delta_before_any_full_record_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    journal_of(path, *three_checkpoints())
    lines = journal_lines(path)
    path.write_bytes(lines[1] + lines[2])
    with pytest.raises(CorruptStoreError) as info:
        JournalStore(path).load()
    assert (info.value.path, info.value.line) == (str(path), 1)
    assert str(info.value) == f"{path}, line 1: a delta record before any full one"


def _read_history(store: JournalStore) -> None:
    list(store.history())


def _read_load(store: JournalStore) -> None:
    store.load()


@pytest.mark.parametrize("read", [_read_history, _read_load], ids=["history", "load"])
@pytest.mark.parametrize("bad_line", [1, 2])
def test_a_record_with_a_bad_field_names_its_line(tmp_path: Path, read: Any, bad_line: int) -> None:
    path = tmp_path / "cp.jsonl"
    journal_of(path, *three_checkpoints())
    lines = journal_lines(path)
    record = json.loads(lines[bad_line - 1][len(b'{"c":"00000000","r":') : -2])
    record["step_index"] = "one"
    lines[bad_line - 1] = framed_line(json.dumps(record).encode())
    path.write_bytes(b"".join(lines))
    with pytest.raises(CorruptStoreError) as info:
        read(JournalStore(path))
    assert (info.value.path, info.value.line) == (str(path), bad_line)
    assert str(info.value).startswith(f"{path}, line {bad_line}: ")
    assert "step_index" in str(info.value)
