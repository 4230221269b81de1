"""A loop that compacts its old iterations (``keep_last``) saves each iteration as a delta.

``keep_last`` exists so that a long-lived agent's storage stays bounded, and
with it every iteration's save changes the ``compacted`` count. The journal
writes such a save as a delta whose ``compacted`` says which iterations to let
go of (``WorkflowCheckpoint.delta_compacting``), so it grows by what each
iteration adds, and folds back to every checkpoint saved. The row stores
(SQLite, PostgreSQL) write it as a delta that deletes the rows of the
iterations let go of: a few rows and a constant number of bytes per
iteration, and as many rows stored after 80 iterations as after 40. (The
run queues' saves still rewrite the run: not tested here.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

import ekit_runtime.stores.postgres
import ekit_runtime.stores.sqlite
from ekit_runtime import (
    Done,
    JournalStore,
    PostgresStore,
    Repeat,
    RetryPolicy,
    SqliteStore,
    Step,
    Workflow,
    WorkflowCheckpoint,
)
from ekit_runtime.stores.rows import EncodedCheckpoint
from tests.support.queue_backends import fresh_postgres

ITERATIONS = 40


def _workflow(before: int, keep: int | None, iterations: int = ITERATIONS) -> Workflow:
    """``before`` steps, then a loop needing them all that ends at ``iterations``."""
    def agent(ctx: Any) -> Any:
        return Done("x" * 100) if ctx["agent"].number == iterations else "x" * 100

    names = tuple(f"p{i}" for i in range(before))
    return Workflow([*(Step(n, lambda ctx: "y" * 100) for n in names),
                     Step("agent", agent, names, repeat=Repeat(10 * iterations, keep_last=keep))])


def _journal_bytes(tmp_path: Path, before: int, keep: int | None) -> int:
    path = tmp_path / f"{before}-{keep}.jsonl"
    _workflow(before, keep).run_sync(checkpoint_fn=JournalStore(path))
    return path.stat().st_size


def test_a_compacting_loop_grows_the_journal_by_about_what_each_iteration_adds(
        tmp_path: Path) -> None:
    kept_all = _journal_bytes(tmp_path, 100, None)
    compacting = _journal_bytes(tmp_path, 100, 3)
    assert compacting <= kept_all * 1.5, (compacting, kept_all)


ROW_STORES = ("sqlite", "postgres")


@contextmanager
def _row_store(kind: str, tmp_path: Path, run_id: str) -> Iterator[Callable[[], Any]]:
    """A maker of stores of ``run_id`` in one database of ``kind`` (PostgreSQL: a fresh one)."""
    if kind == "sqlite":
        yield lambda: SqliteStore(tmp_path / "cp.db", run_id=run_id)
    else:
        with fresh_postgres() as url:
            yield lambda: PostgresStore(url, run_id=run_id)


def _stored_rows(store: Any) -> int:
    """How many entry rows the store's database holds for its run."""
    if isinstance(store, SqliteStore):
        found = store.conn.execute("SELECT count(*) FROM ekit_entries WHERE run_id=?",
                                   (store.run_id,)).fetchone()
    else:
        found = store.db.run(lambda c: c.execute(
            "SELECT count(*) FROM ekit_entries WHERE run_id = %s", (store.run_id,)).fetchone())
    return int(found[0])


def _written(encoded: EncodedCheckpoint) -> int:
    """The bytes a save writes: its rows' values and any header, failures and counts."""
    header = encoded.header if encoded.header is not None else encoded.recount
    return (sum(len(v) for _, _, v in encoded.rows) + len(header or "") + len(encoded.failures)
            + 4 * 8)


@pytest.mark.parametrize("kind", ROW_STORES)
def test_a_row_store_writes_a_compacting_loops_iteration_in_a_few_rows(
        kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = ekit_runtime.stores.sqlite if kind == "sqlite" else ekit_runtime.stores.postgres
    written: list[EncodedCheckpoint] = []
    real = module.encode_checkpoint

    def spy(*args: Any, **kw: Any) -> EncodedCheckpoint:
        encoded: EncodedCheckpoint = real(*args, **kw)
        written.append(encoded)
        return encoded

    monkeypatch.setattr(module, "encode_checkpoint", spy)
    stored: dict[int, int] = {}
    for iterations in (ITERATIONS, 2 * ITERATIONS):
        with _row_store(kind, tmp_path, f"loop-{iterations}") as make:
            store = make()
            written.clear()
            _workflow(100, 3, iterations).run_sync(checkpoint_fn=store)
            stored[iterations] = _stored_rows(store)
            store.close()
        saves = written[-iterations + 5:-1]  # (the last save adds the loop's own output too)
        assert all(not e.full and e.gone for e in saves), [(e.full, e.gone) for e in saves]
        rows = [len(e.rows) for e in saves]
        sizes = [_written(e) for e in saves]
        assert max(rows) <= 4, rows  # the new iteration's output and usage rows
        # What a save writes does not grow with the iterations before it.
        assert max(sizes) - min(sizes) <= 16, sizes
        assert max(sizes) < 2_000, sizes  # (the header: ~1.1 KB of a 101-step graph)
        print(f"\n{kind}, {iterations} iterations: rows per save {max(rows)}, bytes per save "
              f"{min(sizes)}-{max(sizes)}, rows stored {stored[iterations]}")
    # Twice the iterations, the same rows kept: the store stays bounded.
    assert stored[2 * ITERATIONS] == stored[ITERATIONS], stored


@pytest.mark.parametrize("kind", ROW_STORES)
@pytest.mark.parametrize("keep", [1, 3])
def test_a_row_store_loads_back_every_checkpoint_a_compacting_loop_saved(
        kind: str, keep: int, tmp_path: Path) -> None:
    with _row_store(kind, tmp_path, f"flaky-{keep}") as make:
        store, reader = make(), make()
        seen: list[WorkflowCheckpoint] = []

        def save(cp: WorkflowCheckpoint) -> None:
            store.save(cp)
            seen.append(cp)
            assert reader.load() == cp, len(seen)

        ran = _flaky_agent(keep).run_sync(checkpoint_fn=save)
        assert dict(seen[-1].compacted) == {"agent": 12 - keep}
        # A resume from what is stored ends as the run did, and saves what it loaded.
        resumed = _flaky_agent(keep).run_sync(resume_from=reader.load(), checkpoint_fn=store)
        assert resumed.outputs == ran.outputs
        assert reader.load() == seen[-1]
        store.close()
        reader.close()


def _flaky_agent(keep: int | None) -> Workflow:
    """A loop whose even iterations fail once first (failure records, retries, durations)."""
    tried: set[int] = set()

    def agent(ctx: Any) -> Any:
        number = ctx["agent"].number
        if number % 2 == 0 and number not in tried:
            tried.add(number)
            raise ConnectionError(f"iteration {number} is overloaded")
        return Done({"n": number}) if number == 12 else {"n": number}

    return Workflow([Step("a", lambda ctx: "y" * 10),
                     Step("agent", agent, ("a",), retry=RetryPolicy(max_attempts=2, backoff_base=0),
                          repeat=Repeat(20, keep_last=keep))])


@pytest.mark.parametrize("keep", [1, 3])
def test_the_journal_folds_back_to_every_checkpoint_a_compacting_loop_saved(
        tmp_path: Path, keep: int) -> None:
    store = JournalStore(tmp_path / "cp.jsonl")
    saved: list[WorkflowCheckpoint] = []

    def save(cp: WorkflowCheckpoint) -> None:
        store.save(cp)
        saved.append(cp)

    _flaky_agent(keep).run_sync(checkpoint_fn=save)
    store.close()
    assert dict(saved[-1].compacted) == {"agent": 12 - keep}
    lines = (tmp_path / "cp.jsonl").read_text().splitlines()
    # Every save after the first is a delta, but the one whose compacted_retries grew (from
    # none to one failed attempt: at most a retry policy's attempts, however long the loop).
    assert [dict(cp.compacted_retries) for cp in saved[-1:]] == [{"agent": 1}]
    grew = sum(a.compacted_retries != b.compacted_retries for b, a in pairwise(saved))
    assert grew == 1
    assert sum('"kind":"full"' in line for line in lines) == 1 + grew, lines[:3]
    reader = JournalStore(tmp_path / "cp.jsonl")
    assert reader.load() == saved[-1]
    history = list(reader.history())
    assert history == saved
    assert reader.compact() == saved[-1]


def test_a_delta_compacting_is_a_plain_delta_without_keep_last() -> None:
    saved: list[WorkflowCheckpoint] = []
    _flaky_agent(None).run_sync(checkpoint_fn=saved.append)
    for before, after in pairwise(saved):
        assert after.delta_compacting(before) == after.delta_since(before)
        assert not after.delta_compacting(before).compacted


def test_a_delta_compacting_names_the_new_count_and_adds_only_the_new_iteration() -> None:
    saved: list[WorkflowCheckpoint] = []
    _flaky_agent(2).run_sync(checkpoint_fn=saved.append)
    grew = [(b, a) for b, a in pairwise(saved)
            if a.compacted != b.compacted and a.compacted_retries == b.compacted_retries]
    assert grew
    for before, after in grew:
        delta = after.delta_compacting(before)
        assert delta.extends and dict(delta.compacted) == dict(after.compacted)
        assert [name for name, _ in delta.outputs] == [n for n in after.outputs if n not in before.outputs]
        assert not after.delta_since(before).extends  # (what every other writer reads: in full)


def _body_agent() -> Workflow:
    """A loop whose body (a model call, tools mapped over what it asked, a fold) compacts."""
    def model(ctx: Any) -> list[str]:
        return [f"q{ctx['agent'].number}.{i}" for i in range(ctx["agent"].number % 3)]

    def fold(ctx: Any) -> Any:
        seen = [*(ctx["agent"].previous or []), *ctx["tool"]]
        return Done(seen) if ctx["agent"].number == 6 else seen

    body = Workflow([Step("model", model),
                     Step("tool", lambda ctx: str(ctx["model"]).upper(), ("model",), map_over="model"),
                     Step("fold", fold, ("tool", "model"))])
    return Workflow([Step("agent", child=body, repeat=Repeat(9, keep_last=2))])


@pytest.mark.parametrize("kind", ROW_STORES)
def test_a_row_store_deletes_a_compacting_loop_bodys_steps_and_items(
        kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = ekit_runtime.stores.sqlite if kind == "sqlite" else ekit_runtime.stores.postgres
    written: list[EncodedCheckpoint] = []
    real = module.encode_checkpoint
    monkeypatch.setattr(module, "encode_checkpoint",
                        lambda *a, **kw: written.append(real(*a, **kw)) or written[-1])
    with _row_store(kind, tmp_path, "body") as make:
        store, reader = make(), make()
        seen: list[WorkflowCheckpoint] = []

        def save(cp: WorkflowCheckpoint) -> None:
            store.save(cp)
            seen.append(cp)
            assert reader.load() == cp, len(seen)

        _body_agent().run_sync(checkpoint_fn=save)
        assert dict(seen[-1].compacted) == {"agent": 4, "agent/tool[]": 4}
        assert _stored_rows(store) == len(seen[-1].outputs) + len(seen[-1].step_usage) + sum(
            1 for n in seen[-1].durations if n not in seen[-1].step_usage)
        store.close()
        reader.close()
    compacting = [e for e in written if e.gone]
    assert compacting and not any(e.full for e in compacting)
    assert any("[" in name for e in compacting for name in e.gone)  # (a body map's items too)
