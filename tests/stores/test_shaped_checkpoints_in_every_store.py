"""A run with run-time shapes survives every store and both run queues, at O(delta) per save.

The run maps a step over a list (``score``, skipped by a condition for the
even items), maps a second one item-wise over it (``check``, skipped by
another condition once its item's score is known, so skips keep arriving
after the first save), collects the items (``total``), and ends in a join
over alternatives (``answer``, one of whose dependencies is skipped). Saved
through each store, every checkpoint loads back as it was saved; the last
equals the in-memory one (item outputs, ``skipped``, ``shapes``, format 2);
a resume from what the store holds runs nothing again; the journal's
history gives back every checkpoint; and what a save writes per item stays
flat as the run grows tenfold.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

import ekit_runtime.queue.base
import ekit_runtime.stores.postgres
import ekit_runtime.stores.sqlite
from ekit_core import WorkflowCheckpoint
from ekit_core.checkpoint import SHAPED_FORMAT_VERSION
from ekit_core.shapes import Shape
from ekit_runtime import JournalStore, JsonFileStore, PostgresStore, SqliteStore, Step, Workflow
from ekit_runtime.queue import Worker, open_queue
from ekit_runtime.stores import CorruptStoreError
from ekit_runtime.stores.rows import EncodedCheckpoint
from tests.support.helpers import timed_alike
from tests.support.queue_backends import fresh_postgres, queue_url
from tests.support.store_helpers import framed_line

__all__ = ["queue_url"]

N = 12
STORES = ("json", "journal", "sqlite", "postgres")


def odd(context: dict[str, Any]) -> bool:
    return bool(context["split"] % 2 == 1)


def not_round(context: dict[str, Any]) -> bool:
    return bool(context["score"] % 30 != 0)


def urgent(context: dict[str, Any]) -> bool:
    return bool(context["route"] == "urgent")


def shaped(ran: list[str], *, stagger: bool = True) -> Workflow:
    """The shaped workflow; ``ran`` gets each step (and item) that runs. ``stagger``: items
    finish one by one (a queue worker sets no concurrency limit), so saves interleave skips."""

    def step(name: str, body: Callable[[dict[str, Any]], Any]) -> Any:
        async def run(context: dict[str, Any]) -> Any:
            ran.append(name)
            value = body(context)
            if stagger and isinstance(value, int) and name in ("score", "check"):
                await asyncio.sleep(0.002 * (value % 97))
            return value

        return run

    return Workflow([
        Step("split", step("split", lambda c: list(range(c["n"])))),
        Step("score", step("score", lambda c: c["split"] * 10), ("split",),
             map_over="split", when=odd, context="dependencies"),
        Step("check", step("check", lambda c: c["score"] + 1), ("score",),
             map_over="score", when=not_round, context="dependencies"),
        Step("total", step("total", lambda c: sum(c["check"])), ("check",), context="dependencies"),
        Step("route", step("route", lambda c: "calm")),
        Step("escalate", step("escalate", lambda c: "ESC"), ("route",), when=urgent),
        Step("reply", step("reply", lambda c: "re"), ("route",)),
        Step("answer", step("answer", lambda c: sorted(c)), ("escalate", "reply"),
             join="any", context="dependencies"),
    ])


def expected_skips(n: int) -> set[str]:
    evens = {f"score[{k}]" for k in range(0, n, 2)} | {f"check[{k}]" for k in range(0, n, 2)}
    return evens | {f"check[{k}]" for k in range(3, n, 6)} | {"escalate"}


def check_final(final: WorkflowCheckpoint, loaded: WorkflowCheckpoint | None, n: int, *,
                other_run: bool = False) -> None:
    assert loaded is not None
    # Two runs (a reference, and the one stored) agree on all but their durations' values.
    assert timed_alike(loaded, final) if other_run else loaded == final
    assert loaded.format_version == SHAPED_FORMAT_VERSION == 2
    assert set(loaded.skipped) == expected_skips(n)
    assert loaded.shapes == shaped([]).graph.shapes and set(loaded.shapes) == {
        "score", "check", "escalate", "answer"}
    items = {f"score[{k}]" for k in range(1, n, 2)} | {
        f"check[{k}]" for k in range(1, n, 2) if k % 6 != 3}
    assert items <= set(loaded.outputs)
    assert loaded.outputs["score"] == [k * 10 for k in range(1, n, 2)]
    assert loaded.outputs["answer"] == ["n", "reply"]  # (the run's context, and what ran)


def resumes_running_nothing(loaded: WorkflowCheckpoint, final: WorkflowCheckpoint) -> None:
    ran: list[str] = []
    result = shaped(ran).run_sync(resume_from=loaded)
    assert ran == []
    # Not step_index: see test_a_resume_of_a_finished_run_keeps_its_step_index.
    assert timed_alike(result.checkpoint, dataclasses.replace(final, step_index=result.checkpoint.step_index))
    assert result.checkpoint.durations == loaded.durations  # nothing ran: the recorded ones kept


# -- the stores ------------------------------------------------------------------


@pytest.fixture
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], Any]]:
    """A function opening a fresh store object on one place, for the store kind ``request.param``."""
    kind = request.param
    if kind == "postgres":
        with fresh_postgres() as url:
            yield lambda: PostgresStore(url, run_id="shaped")
        return
    opens: dict[str, Callable[[], Any]] = {
        "json": lambda: JsonFileStore(tmp_path / "cp.json"),
        "journal": lambda: JournalStore(tmp_path / "cp.jsonl"),
        "sqlite": lambda: SqliteStore(tmp_path / "cp.db", run_id="shaped"),
    }
    yield opens[kind]


def _spied(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[EncodedCheckpoint]:
    """Every EncodedCheckpoint ``module`` writes, recorded."""
    written: list[EncodedCheckpoint] = []
    real = module.encode_checkpoint

    def spy(*args: Any, **kw: Any) -> EncodedCheckpoint:
        encoded: EncodedCheckpoint = real(*args, **kw)
        written.append(encoded)
        return encoded

    monkeypatch.setattr(module, "encode_checkpoint", spy)
    return written


def _close(store: Any) -> None:
    close = getattr(store, "close", None)
    if close is not None:
        close()


@pytest.mark.parametrize("opener", STORES, indirect=True)
def test_every_checkpoint_of_a_shaped_run_loads_back_and_the_last_resumes_running_nothing(
    opener: Callable[[], Any],
) -> None:
    store = opener()
    saved: list[WorkflowCheckpoint] = []

    def save(cp: WorkflowCheckpoint) -> None:
        store.save(cp)
        saved.append(cp)
        reader = opener()
        try:
            assert reader.load() == cp, f"save {len(saved)} did not load back"
        finally:
            _close(reader)

    result = shaped([]).run_sync({"n": N}, checkpoint_fn=save)
    _close(store)
    # Skips were added by saves after the first, not only by it.
    assert len(saved) > 3 and len(saved[0].skipped) < len(result.checkpoint.skipped)
    reader = opener()
    loaded = reader.load()
    _close(reader)
    assert loaded is not None
    check_final(result.checkpoint, loaded, N)
    resumes_running_nothing(loaded, result.checkpoint)


@pytest.mark.parametrize(
    ("opener", "module"),
    [("sqlite", ekit_runtime.stores.sqlite), ("postgres", ekit_runtime.stores.postgres)],
    indirect=["opener"],
)
def test_a_row_store_writes_each_skip_once_and_never_rewrites_the_run(
    opener: Callable[[], Any], module: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = _spied(monkeypatch, module)
    store = opener()
    result = shaped([]).run_sync({"n": N}, checkpoint_fn=store)
    _close(store)
    final = result.checkpoint
    # prepare_run encodes the checkpoint the run starts from (to check it), writing nothing.
    checked, *written = written
    assert checked.rows == []
    assert written[0].full and not any(e.full for e in written[1:])
    rows = [row for e in written for row in e.rows]
    # (A step's duration rides in its usage row: one for each step with usage or a duration.)
    usage_rows = len(final.step_usage.keys() | final.durations.keys())
    assert len(rows) == len(final.outputs) + usage_rows + len(final.skipped)
    assert {name for kind, name, _ in rows if kind == "skip"} == set(final.skipped)
    assert any(kind == "skip" for e in written[1:] for kind, _, _ in e.rows)


def _journal_bytes(folder: Path, n: int) -> tuple[int, JournalStore]:
    store = JournalStore(folder / f"run{n}.jsonl", durable=False)
    shaped([], stagger=False).run_sync({"n": n}, checkpoint_fn=store, max_concurrency=1)
    store.close()
    return os.path.getsize(store.path), store


def test_the_journal_appends_flat_bytes_per_item_and_its_history_is_every_checkpoint(
    tmp_path: Path,
) -> None:
    sizes = {}
    for n in (100, 1000):
        size, store = _journal_bytes(tmp_path, n)
        sizes[n] = size / n
        lines = Path(store.path).read_bytes().splitlines()
        assert sum(1 for line in lines if b'"kind":"full"' in line) == 1
    # Measured: about 280 bytes per item at 100 items, 275 at 1000 (the full record is shared).
    assert sizes[1000] <= sizes[100] * 1.05, sizes

    saved: list[WorkflowCheckpoint] = []
    store = JournalStore(tmp_path / "history.jsonl")

    def save(cp: WorkflowCheckpoint) -> None:
        store.save(cp)
        if not saved or cp != saved[-1]:  # a save that changes nothing appends nothing
            saved.append(cp)

    result = shaped([]).run_sync({"n": N}, checkpoint_fn=save)
    store.close()
    history = list(JournalStore(tmp_path / "history.jsonl").history())
    assert history == saved
    assert [len(cp.skipped) for cp in history] == [len(cp.skipped) for cp in saved]
    assert all(b.delta_since(a).extends for a, b in itertools.pairwise(history))
    check_final(result.checkpoint, history[-1], N)


def _rows_per_item(folder: Path, n: int) -> tuple[float, float]:
    written: list[EncodedCheckpoint] = []
    real = ekit_runtime.stores.sqlite.encode_checkpoint

    def spy(*args: Any, **kw: Any) -> EncodedCheckpoint:
        written.append(real(*args, **kw))
        return written[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ekit_runtime.stores.sqlite, "encode_checkpoint", spy)
        with SqliteStore(folder / f"run{n}.db", run_id="r", durable=False) as store:
            shaped([], stagger=False).run_sync({"n": n}, checkpoint_fn=store, max_concurrency=1)
    _, first, *deltas = written  # prepare_run's check, the first save, the rest
    assert first.full and not any(e.full for e in deltas)
    rows = [row for e in deltas for row in e.rows]
    return len(rows) / n, sum(len(k) + len(v) for _, k, v in rows) / n


def test_a_row_store_writes_flat_bytes_per_item(tmp_path: Path) -> None:
    (rows, size), (rows_10x, size_10x) = (_rows_per_item(tmp_path, n) for n in (100, 1000))
    assert rows_10x <= rows * 1.01, (rows, rows_10x)
    # Measured: 2.07 rows and 63 bytes per item at 100 items, 2.01 and 66 at 1000
    # (names and numbers gain a digit).
    assert size_10x <= size * 1.1, (size, size_10x)


# -- the queues ------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_worker_saves_a_shaped_run_on_each_queue_backend_in_deltas(
    queue_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = _spied(monkeypatch, ekit_runtime.queue.base)
    reference = shaped([]).run_sync({"n": N}, durations=True).checkpoint  # (as a queued run records)
    q = open_queue(queue_url)
    try:
        run_id = q.submit("shaped", {"n": N})
        asyncio.run(Worker(q, {"shaped": shaped([])}, poll=0.01).run_until_idle())
        loaded = q.checkpoint(run_id)
    finally:
        q.close()
    check_final(reference, loaded, N, other_run=True)
    assert loaded is not None
    resumes_running_nothing(loaded, reference)
    assert len(written) > 3 and written[0].full and not any(e.full for e in written[1:])
    assert any(kind == "skip" for e in written[1:] for kind, _, _ in e.rows)


def test_a_resume_of_a_finished_run_keeps_its_step_index() -> None:
    flow = Workflow([Step("route", lambda c: "calm"),
                     Step("escalate", lambda c: "ESC", ("route",), when=urgent)])
    final = flow.run_sync().checkpoint
    assert final.step_index == 1
    assert flow.run_sync(resume_from=final).checkpoint.step_index == 1


# -- hostile checkpoints ---------------------------------------------------------


def _hostile() -> dict[str, tuple[WorkflowCheckpoint, str]]:
    """Each hostile checkpoint, with the field its refusal names."""
    saved: list[WorkflowCheckpoint] = []
    shaped([], stagger=False).run_sync({"n": 8}, checkpoint_fn=saved.append, max_concurrency=1)
    mid, final = saved[len(saved) // 2], saved[-1]
    assert "score[1]" in mid.outputs
    return {
        # An item of score that split's recorded output has no item for.
        "item": (dataclasses.replace(mid, outputs=MappingProxyType({**mid.outputs, "score[99]": 990})),
                 "outputs"),
        # score skipped, though its output (and its items') is recorded.
        "skip": (dataclasses.replace(final, skipped=MappingProxyType(
            {**final.skipped, "score": "condition odd was false"})), "skipped"),
        # A join that is neither "all" nor "any".
        "shape": (dataclasses.replace(mid, shapes=MappingProxyType(
            {**mid.shapes, "score": Shape("split", None, "odd", "some")})), "shapes.score"),
    }


HOSTILE = ("item", "skip", "shape")


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_checkpoint_given_to_run_is_refused_naming_the_field_before_any_step(
    case: str,
) -> None:
    checkpoint, field = _hostile()[case]
    ran: list[str] = []
    with pytest.raises(ValueError, match=f"checkpoint field '{field}'"):
        asyncio.run(shaped(ran).run(resume_from=checkpoint.to_dict()))
    assert ran == []


@pytest.mark.parametrize("case", HOSTILE)
@pytest.mark.parametrize("opener", STORES, indirect=True)
def test_a_hostile_checkpoint_in_a_store_is_refused_naming_the_field_before_any_step(
    opener: Callable[[], Any], case: str
) -> None:
    checkpoint, field = _hostile()[case]
    store = opener()
    store.save(checkpoint)
    _close(store)
    ran: list[str] = []
    reader = opener()
    try:
        with pytest.raises(ValueError, match=f"checkpoint field '{field}'"):
            # The parser refuses a bad shape at load; the core what contradicts
            # the graph, when the run begins.
            shaped(ran).run_sync(resume_from=reader.load())
    finally:
        _close(reader)
    assert ran == []


def test_journal_deltas_carry_the_new_skips_and_one_recorded_twice_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    with JournalStore(path) as store:
        final = shaped([]).run_sync({"n": N}, checkpoint_fn=store).checkpoint
    records = [json.loads(line)["r"] for line in path.read_bytes().splitlines()]
    deltas = [r for r in records[1:] if "skipped" in r]
    assert deltas, "no delta carried a skip"
    folded = {**records[0].get("skipped", {})}
    for record in records[1:]:
        folded.update(record.get("skipped", {}))
    assert folded == dict(final.skipped)
    again = dict(deltas[-1], outputs={}, step_usage={}, cost={
        "input_tokens": 0, "output_tokens": 0, "llm_calls": 0})
    with path.open("ab") as journal:
        journal.write(framed_line(json.dumps(again, separators=(",", ":")).encode()))
    with pytest.raises(CorruptStoreError, match="'skipped' records step"):
        JournalStore(path).load()
