"""Round trips, failure modes and the journal format of ``ekit_runtime.stores``.

The crash tests (SIGKILL at random moments) live in test_stores_crash.py.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import json
import os
import re
import sqlite3
import stat
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ekit_core import CheckpointError
from ekit_core.checkpoint import FailureRecord
from ekit_runtime import (
    CorruptStoreError,
    JournalStore,
    JsonFileStore,
    PatternResult,
    SqliteStore,
    Step,
    StoreLockedError,
    TokenUsage,
    UnencodableError,
    Workflow,
    WorkflowCheckpoint,
)
from tests.support.store_helpers import Factory, store_factories

FACTORIES = store_factories("run-1")


@pytest.fixture(params=sorted(FACTORIES))
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., Any]:
    """A function opening the store under test in a fresh folder (same file every call)."""
    factory = FACTORIES[request.param]
    return lambda **kw: factory(tmp_path, **kw)


def _value(name: str) -> Any:
    return {
        "name": name,
        "text": f"héllo wörld ✓ 日本語 🚀 {name}",
        "nested": [1, 2.5, None, True, {"k": ["é", -3]}],
    }


def _diamond(values: Callable[[str], Any] = _value) -> Workflow:
    def body(name: str) -> Any:
        async def run(ctx: dict[str, Any]) -> Any:
            return PatternResult(values(name), cost=TokenUsage(10, 5, 1))

        return run

    deps = {"a": (), "b": ("a",), "c": ("a",), "d": ("b", "c"), "e": ("d",)}
    return Workflow([Step(n, body(n), d) for n, d in deps.items()])


def _run(workflow: Workflow, store: Any, **kw: Any) -> list[WorkflowCheckpoint]:
    seen: list[WorkflowCheckpoint] = []

    def save(cp: WorkflowCheckpoint) -> None:
        seen.append(cp)
        store(cp)

    workflow.run_sync(checkpoint_fn=save, **kw)
    return seen


# -- round trips --------------------------------------------------------------


def test_nothing_saved_loads_none(make: Factory) -> None:
    assert make().load() is None


def test_round_trip_every_save(make: Factory) -> None:
    store = make()
    seen: list[WorkflowCheckpoint] = []

    def save(cp: WorkflowCheckpoint) -> None:
        store(cp)
        seen.append(cp)
        # A fresh store object (as a new process would open) reads what was saved.
        assert make().load() == cp

    _diamond().run_sync({"user": "Zoë ☃"}, checkpoint_fn=save)
    final = make().load()
    assert final == seen[-1]
    assert final.cost == TokenUsage(50, 25, 5)
    assert dict(final.context) == {"user": "Zoë ☃"}
    assert final.outputs["e"]["text"].endswith("🚀 e")


def test_large_outputs(make: Factory) -> None:
    big = "ß" * 1_000_000 + "\n\t\"'\\ end"
    _run(_diamond(lambda n: big + n), make(durable=False))
    loaded = make().load()
    assert loaded.outputs["e"] == big + "e"
    assert len(loaded.outputs) == 5


def test_resume_from_loaded_checkpoint_skips_recorded_steps(make: Factory) -> None:
    started: list[str] = []

    def body(name: str) -> Any:
        def run(ctx: dict[str, Any]) -> str:
            started.append(name)
            if name == "c" and ctx.get("fail", False):
                raise RuntimeError("boom")
            return name.upper()

        return run

    deps = {"a": (), "b": ("a",), "c": ("a",), "d": ("b", "c")}
    workflow = Workflow([Step(n, body(n), d) for n, d in deps.items()])
    with pytest.raises(RuntimeError, match="boom"):
        workflow.run_sync({"fail": True}, checkpoint_fn=make(), max_concurrency=1)
    failed = make().load()
    assert set(failed.outputs) == {"a", "b"}
    assert failed.failures["c"].error_type == "RuntimeError"
    started.clear()
    store = make()
    result = workflow.run_sync(
        {"fail": False}, checkpoint_fn=store, resume_from=store.load()
    )
    assert started == ["c", "d"]
    assert make().load() == result.checkpoint
    assert dict(make().load().outputs) == {"a": "A", "b": "B", "c": "C", "d": "D"}


def test_executionkit_three_key_format(make: Factory) -> None:
    legacy = {
        "step_index": 2,
        "outputs": {"a": "A ✓", "b": {"n": [1, 2]}},
        "cost": {"input_tokens": 7, "output_tokens": 3, "llm_calls": 2},
    }
    checkpoint = WorkflowCheckpoint.from_dict(legacy)
    with make() as store:
        store(checkpoint)
    loaded = make().load()
    assert loaded == checkpoint
    assert {k: loaded.to_dict()[k] for k in legacy} == legacy
    workflow = Workflow(
        [
            Step("a", lambda ctx: "never"),
            Step("b", lambda ctx: "never", ("a",)),
            Step("c", lambda ctx: ctx["a"] + "!", ("b",)),
        ]
    )
    result = workflow.run_sync(resume_from=loaded, checkpoint_fn=make())
    assert dict(result.outputs) == {"a": "A ✓", "b": {"n": [1, 2]}, "c": "A ✓!"}
    assert make().load().cost == TokenUsage(7, 3, 2)


def test_json_file_holds_plain_checkpoint_dict(tmp_path: Path) -> None:
    store = JsonFileStore(tmp_path / "cp.json")
    seen = _run(_diamond(), store)
    raw = (tmp_path / "cp.json").read_text(encoding="utf-8")
    assert "日本語" in raw  # ensure_ascii=False: text stays readable
    assert json.loads(raw) == seen[-1].to_dict()
    legacy = {"step_index": 0, "outputs": {}, "cost": {"input_tokens": 0, "output_tokens": 0,
                                                        "llm_calls": 0}}
    (tmp_path / "legacy.json").write_text(json.dumps(legacy))
    assert JsonFileStore(tmp_path / "legacy.json").load() == WorkflowCheckpoint.from_dict(legacy)


# -- what cannot be encoded -------------------------------------------------------


class Opaque:
    def __repr__(self) -> str:  # a stable test id: pytest-xdist workers must collect alike
        return "Opaque()"


@pytest.mark.parametrize(
    "bad", [Opaque(), "lone \ud800 surrogate", float("nan"), {"k": {1, 2}}], ids=repr
)
def test_unencodable_output_names_step_and_leaves_store_untouched(make: Factory, bad: Any) -> None:
    workflow = _diamond(lambda n: bad if n == "d" else n)
    store = make()
    with pytest.raises(ValueError, match="'d'") as info:
        workflow.run_sync(checkpoint_fn=store, max_concurrency=1)
    assert isinstance(info.value, UnencodableError)
    assert info.value.step == "d"
    before = make().load()
    assert set(before.outputs) == {"a", "b", "c"}
    # The store still works after the refusal, and the file is intact.
    resumed = _diamond().run_sync(checkpoint_fn=store, resume_from=before)
    assert make().load() == resumed.checkpoint


def test_unencodable_context_is_named(make: Factory) -> None:
    with pytest.raises(UnencodableError, match=r"context key 'when'"):
        _diamond().run_sync({"when": Opaque()}, checkpoint_fn=make())
    assert make().load() is None


def test_custom_dumps_and_loads_for_rich_types(make: Factory) -> None:
    def default(obj: object) -> Any:
        if isinstance(obj, dt.date):
            return {"$date": obj.isoformat()}
        raise TypeError(f"{type(obj).__name__} is not JSON")

    def hook(obj: dict[str, Any]) -> Any:
        return dt.date.fromisoformat(obj["$date"]) if set(obj) == {"$date"} else obj

    def dumps(data: Any) -> str:
        return json.dumps(data, default=default, ensure_ascii=False)

    def loads(text: str) -> Any:
        return json.loads(text, object_hook=hook)

    day = dt.date(2024, 2, 29)
    seen = _run(_diamond(lambda n: {"n": n, "day": day}), make(dumps=dumps, loads=loads))
    loaded = make(dumps=dumps, loads=loads).load()
    assert loaded == seen[-1]
    assert loaded.outputs["e"]["day"] == day


def test_save_rejects_non_checkpoint(make: Factory) -> None:
    with pytest.raises(ValueError, match="WorkflowCheckpoint"):
        make().save({"step_index": 0})


# -- JSON file -------------------------------------------------------------------


def test_json_file_failed_replace_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = JsonFileStore(tmp_path / "cp.json")
    seen = _run(_diamond(), store)
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk gone")))
    bigger = WorkflowCheckpoint(6, MappingProxyType({**seen[-1].outputs, "f": 1}))
    with pytest.raises(OSError, match="disk gone"):
        store(bigger)
    monkeypatch.undo()
    assert JsonFileStore(tmp_path / "cp.json").load() == seen[-1]
    # No temp file left; the lock file goes with the store's lock.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cp.json", "cp.json.lock"]
    store.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cp.json"]


def test_json_file_fsyncs_file_and_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The new file is fsynced before the rename makes it visible, the folder after."""
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        events.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    for _ in range(2):  # creating the file, then replacing it
        events.clear()
        JsonFileStore(tmp_path / "cp.json")(WorkflowCheckpoint(0, MappingProxyType({})))
        assert events == ["fsync file", "replace", "fsync folder"]
    events.clear()
    JsonFileStore(tmp_path / "cp.json", durable=False)(WorkflowCheckpoint(0, MappingProxyType({})))
    assert events == ["replace"]


def test_json_file_garbage_is_a_value_error(tmp_path: Path) -> None:
    (tmp_path / "cp.json").write_bytes(b'{"step_index": 1, "outp')
    with pytest.raises(CorruptStoreError, match=r"cp\.json"):
        JsonFileStore(tmp_path / "cp.json").load()
    (tmp_path / "cp.json").write_text('{"step_index": 1, "outputs": {}}')
    with pytest.raises(CheckpointError, match="cost"):
        JsonFileStore(tmp_path / "cp.json").load()


# -- journal ---------------------------------------------------------------------


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line)["r"] for line in path.read_bytes().splitlines()]


def test_journal_appends_only_deltas(tmp_path: Path) -> None:
    store = JournalStore(tmp_path / "cp.jsonl")
    seen = _run(_diamond(), store, max_concurrency=1)
    records = _lines(tmp_path / "cp.jsonl")
    assert [r["kind"] for r in records] == ["full"] + ["delta"] * (len(seen) - 1)
    assert list(records[0]["outputs"]) == ["a"]
    assert [list(r["outputs"]) for r in records[1:]] == [["b"], ["c"], ["d"], ["e"]]
    assert all(r["cost"] == {"input_tokens": 10, "output_tokens": 5, "llm_calls": 1}
               for r in records[1:])


def test_journal_resumed_in_new_process_writes_full_then_deltas(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    workflow = _diamond()
    first = JournalStore(path)

    def stop(cp: WorkflowCheckpoint) -> None:
        first(cp)
        if cp.step_index == 2:
            raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        workflow.run_sync(checkpoint_fn=stop, max_concurrency=1)
    first.close()  # as its process would on exit
    # A new process, no load(): its first save has no in-memory previous.
    fresh = JournalStore(path)
    done = workflow.run_sync(checkpoint_fn=fresh, resume_from=JournalStore(path).load(),
                             max_concurrency=1)
    # c, d and e ran: the first save rewrote the journal in full.
    assert [r["kind"] for r in _lines(path)] == ["full", "delta", "delta"]
    assert list(_lines(path)[0]["outputs"]) == ["a", "b", "c"]
    assert JournalStore(path).load() == done.checkpoint
    fresh.close()
    # After load(), the same object appends deltas against what it read.
    again = JournalStore(path)
    cp = again.load()
    assert cp is not None
    again(WorkflowCheckpoint(6, MappingProxyType({**cp.outputs, "x": 1}), cp.cost,
                             cp.context, cp.step_usage, cp.failures, cp.fingerprint, cp.graph,
                             durations=cp.durations))
    assert [r["kind"] for r in _lines(path)][-1] == "delta"
    assert JournalStore(path).load().outputs["x"] == 1


def test_journal_torn_tail_at_every_offset(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    seen = _run(_diamond(), JournalStore(path), max_concurrency=1)
    raw = path.read_bytes()
    ends = [i + 1 for i, b in enumerate(raw) if b == ord("\n")]
    assert len(ends) == len(seen)
    for cut in range(ends[0], len(raw) + 1):
        path.write_bytes(raw[:cut])
        store = JournalStore(path)
        complete = sum(1 for e in ends if e <= cut)
        assert store.load() == seen[complete - 1]
        assert store.torn_tail == cut - ends[complete - 1]
        # The next append cuts the torn bytes off first.
        store(seen[-1])
        again = JournalStore(path)
        assert again.load() == seen[-1]
        assert again.torn_tail == 0


def test_journal_damaged_middle_line_is_corruption(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    _run(_diamond(), JournalStore(path), max_concurrency=1)
    lines = path.read_bytes().splitlines(keepends=True)
    # One flipped bit inside a line that is followed by others: not a crash.
    line = bytearray(lines[2])
    line[line.index(b"kind") + 1] ^= 1
    lines[2] = bytes(line)
    path.write_bytes(b"".join(lines))
    with pytest.raises(CorruptStoreError, match="line 3") as info:
        JournalStore(path).load()
    assert info.value.line == 3


def test_journal_delta_before_full_is_corruption(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    _run(_diamond(), JournalStore(path), max_concurrency=1)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[1:]))
    with pytest.raises(CorruptStoreError, match="line 1"):
        JournalStore(path).load()


def _journal_of_diamond(path: Path) -> list[WorkflowCheckpoint]:
    return _run(_diamond(), JournalStore(path), max_concurrency=1)


def _not_journals(tmp_path: Path) -> dict[str, bytes]:
    """Files whose first line is not a whole journal record, by what made them."""
    json_file = tmp_path / "cp.json"
    _run(_diamond(), JsonFileStore(json_file))
    one_line = tmp_path / "one.jsonl"
    JournalStore(one_line)(WorkflowCheckpoint(1, MappingProxyType({"a": "A"})))
    journal = one_line.read_bytes()
    return {
        "JsonFileStore file": json_file.read_bytes(),
        "JsonFileStore file with newline": json_file.read_bytes() + b"\n",
        "junk": b"hello world",
        "junk line then journal": b"hello\n" + journal,
        "frame prefix only": b'{"c":"0000',
        "bad checksum": journal[:6] + b"%08x" % (int(journal[6:14], 16) ^ 1) + journal[14:],
        "UTF-8 BOM": b"\xef\xbb\xbf" + journal,
        "CR only": journal.replace(b"\n", b"\r"),
    }


@pytest.mark.parametrize(
    "kind",
    ["JsonFileStore file", "JsonFileStore file with newline", "junk", "junk line then journal",
     "frame prefix only", "bad checksum", "UTF-8 BOM", "CR only"],
)
def test_journal_damaged_first_line_is_corruption_not_a_torn_tail(tmp_path: Path, kind: str) -> None:
    """Line 1 is only ever written atomically: damage there means "not a journal", never "torn"."""
    path = tmp_path / "cp.jsonl"
    content = _not_journals(tmp_path)[kind]
    path.write_bytes(content)
    store = JournalStore(path)
    with pytest.raises(CorruptStoreError, match=r"cp\.jsonl, line 1: not a JournalStore journal") as info:
        store.load()
    assert info.value.line == 1
    assert info.value.path == str(path)
    assert store.torn_tail == 0
    assert path.read_bytes() == content  # loading never touches the file
    if kind.startswith("JsonFileStore"):
        assert "JsonFileStore file?" in str(info.value)
    # The file stays readable by what wrote it.
    if kind == "JsonFileStore file":
        assert JsonFileStore(path).load() is not None


@pytest.mark.parametrize(
    "tail",
    [b"garbage", b"garbage\n", b"\x00x\x00", b'{"c":"0000zz', b'{"c":"00000000","x', b'{"r":{}}\n',
     b"\n"],
    ids=repr,
)
def test_journal_last_line_not_a_record_prefix_is_corruption(tmp_path: Path, tail: bytes) -> None:
    path = tmp_path / "cp.jsonl"
    _journal_of_diamond(path)
    lines = len(path.read_bytes().splitlines())
    path.write_bytes(path.read_bytes() + tail)
    with pytest.raises(CorruptStoreError, match=f"line {lines + 1}: the last line does not start") as info:
        JournalStore(path).load()
    assert info.value.line == lines + 1


@pytest.mark.parametrize(
    "tail",
    [b"{", b'{"c":"', b'{"c":"0a1b', b'{"c":"0a1b2c3d","r', b'{"c":"0a1b2c3d","r":{"kind":"del',
     b'{"c":"0a1b2c3d","r":{"kind":"delta"}}\n', b"\x00" * 4096],
    ids=repr,
)
def test_journal_torn_append_is_forgiven(tmp_path: Path, tail: bytes) -> None:
    """What a kill mid-append leaves (a prefix of a line, or a whole one with a bad checksum),
    or a power cut on a file system that shows the unwritten block as zeros."""
    path = tmp_path / "cp.jsonl"
    seen = _journal_of_diamond(path)
    path.write_bytes(path.read_bytes() + tail)
    store = JournalStore(path)
    assert store.load() == seen[-1]
    assert store.torn_tail == len(tail)


def test_journal_with_windows_line_endings_loads_and_appends(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    seen = _journal_of_diamond(path)
    lf_lines = path.read_bytes().splitlines()
    for keep in (1, len(seen)):  # a one-line journal, and a whole one
        path.write_bytes(b"".join(line + b"\r\n" for line in lf_lines[:keep]))
        store = JournalStore(path)
        assert store.load() == seen[keep - 1]
        assert store.torn_tail == 0
        # Appending after CRLF lines works; the new lines end in LF.
        expected = _extended(seen[-1])
        store(expected)
        assert [r["kind"] for r in _lines(path)][-1] == "delta"
        again = JournalStore(path)
        assert again.load() == expected
        assert again.torn_tail == 0
        assert path.read_bytes().endswith(b"}\n")
        assert not path.read_bytes().endswith(b"\r\n")
    # A CRLF journal torn mid-append still forgives the torn bytes.
    path.write_bytes(path.read_bytes() + b'{"c":"12')
    assert JournalStore(path).load() == _extended(seen[-1])


def _extended(cp: WorkflowCheckpoint) -> WorkflowCheckpoint:
    return WorkflowCheckpoint(
        cp.step_index + 1, MappingProxyType({**cp.outputs, "x": "X ✓"}), cp.cost, cp.context,
        cp.step_usage, cp.failures, cp.fingerprint, cp.graph, durations=cp.durations,
    )


def _rewrite_line(path: Path, index: int, change: Callable[[dict[str, Any]], None]) -> None:
    """Change the record on line ``index`` (0-based) and frame it again with a valid checksum."""
    from ekit_runtime.stores.journal import _frame

    lines = path.read_bytes().splitlines(keepends=True)
    record = json.loads(lines[index])["r"]
    change(record)
    lines[index] = _frame(json.dumps(record, separators=(",", ":")).encode())
    path.write_bytes(b"".join(lines))


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(record: dict[str, Any]) -> None:
        target = record
        *parents, last = key.split(".")
        for parent in parents:
            target = target[parent]
        target[last] = value

    return change


BAD_DELTAS = {
    "step_usage.c": _set("step_usage.c", "lots"),
    "step_usage.c.llm_calls": _set("step_usage.c.llm_calls", -1),
    "step_usage.c.input_tokens": _set("step_usage.c.input_tokens", True),
    "step_usage.c.output_tokens": _set("step_usage.c", {"input_tokens": 1, "llm_calls": 1}),
    "failures.z.message": _set("failures", {"z": {"error_type": "E"}}),
    "failures.z.attempts": _set("failures", {"z": {"error_type": "E", "message": "m", "attempts": 0}}),
    "failures.z": _set("failures", {"z": None}),
    "cost.llm_calls": _set("cost.llm_calls", -1),
    "cost.output_tokens": _set("cost.output_tokens", 1.5),
    "cost": _set("cost", None),
    "step_index": _set("step_index", -3),
    "outputs": _set("outputs", ["c"]),
}


@pytest.mark.parametrize("field", list(BAD_DELTAS))
def test_journal_bad_delta_values_are_corruption_naming_line_and_field(
    tmp_path: Path, field: str
) -> None:
    path = tmp_path / "cp.jsonl"
    _journal_of_diamond(path)
    _rewrite_line(path, 2, BAD_DELTAS[field])
    with pytest.raises(CorruptStoreError, match=rf"cp\.jsonl, line 3: delta record: .*'{field}'") as info:
        JournalStore(path).load()
    assert info.value.line == 3


def test_journal_usage_that_goes_down_is_written_in_full(tmp_path: Path) -> None:
    """A delta only ever adds usage; a checkpoint whose cost fell is recorded whole, appended."""
    path = tmp_path / "cp.jsonl"
    store = JournalStore(path)
    first = WorkflowCheckpoint(1, MappingProxyType({"a": 1}), TokenUsage(10, 10, 2))
    second = WorkflowCheckpoint(2, MappingProxyType({"a": 1, "b": 2}), TokenUsage(5, 20, 2))
    store(first)
    store(second)
    assert [r["kind"] for r in _lines(path)] == ["full", "full"]
    assert list(JournalStore(path).history()) == [first, second]
    assert JournalStore(path).load() == second


def test_journal_compact(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    store = JournalStore(path)
    seen = _run(_diamond(), store, max_concurrency=1)
    store.close()
    assert JournalStore(path).compact() == seen[-1]
    assert [r["kind"] for r in _lines(path)] == ["full"]
    assert JournalStore(path).load() == seen[-1]
    assert JournalStore(tmp_path / "none.jsonl").compact() is None


def test_journal_compact_after(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    seen = _run(_diamond(), JournalStore(path, compact_after=2), max_concurrency=1)
    assert [r["kind"] for r in _lines(path)] == ["full", "delta"]
    assert JournalStore(path).load() == seen[-1]
    with pytest.raises(ValueError, match="compact_after"):
        JournalStore(path, compact_after=0)


def test_journal_dumps_must_be_one_line(tmp_path: Path) -> None:
    store = JournalStore(tmp_path / "cp.jsonl", dumps=lambda d: json.dumps(d, indent=1))
    with pytest.raises(ValueError, match="single line"):
        store(WorkflowCheckpoint(0, MappingProxyType({})))


def _failures(names: list[str], attempts: int) -> MappingProxyType[str, FailureRecord]:
    return MappingProxyType({n: FailureRecord("E", f"msg {n} ✗", attempts) for n in names})


checkpoint_sequences = st.lists(
    st.tuples(
        st.lists(
            st.one_of(st.integers(), st.text(), st.lists(st.integers(), max_size=3)), max_size=3
        ),
        st.integers(0, 50),
        st.lists(st.sampled_from("xyz"), max_size=3, unique=True),
        st.integers(1, 3),
        st.lists(st.one_of(st.none(), st.floats(0, 1e6)), max_size=3),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=checkpoint_sequences, cut=st.floats(0, 1))
def test_journal_folds_random_sequences(
    tmp_path_factory: pytest.TempPathFactory,
    steps: list[tuple[list[Any], int, list[str], int, list[float | None]]],
    cut: float,
) -> None:
    """Any growing sequence of checkpoints folds back to each one; any truncation to a prefix.
    Durations too: some outputs timed (the seconds drawn beside them), some not."""
    path = tmp_path_factory.mktemp("j") / "cp.jsonl"
    store = JournalStore(path, durable=False)
    outputs: dict[str, Any] = {}
    usage: dict[str, TokenUsage] = {}
    cost = TokenUsage()
    durations: dict[str, float] = {}
    saved: list[WorkflowCheckpoint] = []
    sizes: list[int] = []
    for values, tokens, failing, attempts, seconds in steps:
        for value, took in itertools.zip_longest(values, seconds[: len(values)]):
            name = f"s{len(outputs)}"
            outputs[name] = value
            usage[name] = TokenUsage(tokens, 1, 1)
            cost = cost + usage[name]
            if took is not None:
                durations[name] = took
        checkpoint = WorkflowCheckpoint(
            len(outputs), MappingProxyType(dict(outputs)), cost,
            step_usage=MappingProxyType(dict(usage)), failures=_failures(failing, attempts),
            durations=MappingProxyType(dict(durations)),
        )
        store(checkpoint)
        saved.append(checkpoint)
        sizes.append(path.stat().st_size)
        assert JournalStore(path).load() == checkpoint
    raw = path.read_bytes()
    at = sizes[0] + int(cut * (len(raw) - sizes[0]))
    path.write_bytes(raw[:at])
    store = JournalStore(path)
    # The latest checkpoint whose save had completed by byte ``at``.
    expected = [cp for cp, size in zip(saved, sizes, strict=True) if size <= at][-1]
    assert store.load() == expected
    assert store.torn_tail == at - max(size for size in sizes if size <= at)


def test_journal_bytes_per_step_stay_flat(tmp_path: Path) -> None:
    """Bytes appended per save do not grow with the run: 1k-step vs 16k-step chains."""

    def per_step(n: int) -> float:
        store = JournalStore(tmp_path / f"chain{n}.jsonl", durable=False)
        sizes: list[int] = []

        def save(cp: WorkflowCheckpoint) -> None:
            store(cp)
            sizes.append(os.path.getsize(store.path))

        workflow = Workflow(
            [
                Step(f"s{i:05d}", lambda ctx: "o" * 100, (f"s{i - 1:05d}",) if i else (),
                     context="dependencies")
                for i in range(n)
            ]
        )
        workflow.run_sync(checkpoint_fn=save)
        assert len(sizes) == n
        deltas = [b - a for a, b in pairwise(sizes)]
        # The last 1k appends of the long run cost what the first 1k did.
        assert max(deltas[-1000:]) <= max(deltas[:1000]) + 2
        return (sizes[-1] - sizes[0]) / (n - 1)

    short, long = per_step(1_000), per_step(16_000)
    print(f"\njournal bytes/step: 1k chain {short:.1f}, 16k chain {long:.1f}")
    # Only the digits of step_index may grow (4 -> 5 digits).
    assert long <= short * 1.02


# -- SQLite ----------------------------------------------------------------------


def test_sqlite_many_runs_in_one_database(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    results = {}
    for run in ("nightly", "adhoc ✓"):
        with SqliteStore(db, run_id=run) as store:
            results[run] = _run(_diamond(lambda n, r=run: f"{r}:{n}"), store)[-1]
    with SqliteStore(db, run_id="other") as store:
        assert store.runs() == ["adhoc ✓", "nightly"]
        assert store.load() is None
        assert store.load("nightly") == results["nightly"]
        assert store.load("adhoc ✓").outputs["e"] == "adhoc ✓:e"
        assert store.delete("nightly") is True
        assert store.delete("nightly") is False
        assert store.runs() == ["adhoc ✓"]
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()


def test_sqlite_each_save_one_transaction_of_new_rows(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "runs.db", isolation_level=None)
    statements: list[str] = []
    conn.set_trace_callback(statements.append)
    store = SqliteStore(conn, run_id="r")
    seen = _run(_diamond(), store, max_concurrency=1)
    begins = [s for s in statements if s.startswith("BEGIN")]
    commits = [s for s in statements if s == "COMMIT"]
    assert len(begins) == len(commits) == len(seen)
    inserts = [s for s in statements if s.startswith("INSERT INTO ekit_entries")]
    # One output row and one usage row per step: deltas only.
    assert len(inserts) == 2 * len(seen)
    assert store.load() == seen[-1]
    conn.execute("BEGIN")
    with pytest.raises(ValueError, match="transaction"):
        store(seen[-1])
    conn.execute("ROLLBACK")
    conn.close()


def test_sqlite_a_writer_that_bypassed_the_lock_is_not_written_over(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    one = SqliteStore(db, run_id="r")
    seen = _run(_diamond(), one, max_concurrency=1)
    # Something that ignores the lock (an old ekit, a script) saves the run.
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("UPDATE ekit_runs SET saves = saves + 1, step_index = 99 WHERE run_id = 'r'")
    other.close()
    for save in (_extended(seen[-1]), dataclasses.replace(seen[-1], context=MappingProxyType({"x": 1}))):
        # Neither a delta nor a full rewrite may write over what it saved.
        with pytest.raises(StoreLockedError, match=r"runs\.db, run 'r': the run was saved by another"):
            one(save)
        assert SqliteStore(db, run_id="r").load().step_index == 99
    assert one.load().step_index == 99  # load() again, and the store goes on from there
    one(_extended(seen[-1]))
    assert SqliteStore(db, run_id="r").load() == _extended(seen[-1])
    one.close()


def test_sqlite_bad_run_id(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="run_id"):
        SqliteStore(tmp_path / "x.db", run_id="")


def _interrupt_inserts(conn: sqlite3.Connection) -> Callable[[bool], None]:
    """Make SQLite interrupt the next row insert: it then rolls the whole transaction back itself."""
    armed = {"on": False, "now": False}

    def trace(statement: str) -> None:
        armed["now"] = armed["on"] and statement.startswith("INSERT INTO ekit_entries")

    conn.set_trace_callback(trace)
    conn.set_progress_handler(lambda: int(armed["now"]), 1)
    return lambda on: armed.update(on=on, now=False)


def test_sqlite_error_sqlite_rolled_back_itself_is_not_masked(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "runs.db", isolation_level=None)
    store = SqliteStore(conn, run_id="r")
    seen = _run(_diamond(), store, max_concurrency=1)
    arm = _interrupt_inserts(conn)
    arm(True)
    with pytest.raises(sqlite3.OperationalError, match="interrupted"):
        store(_extended(seen[-1]))
    assert not conn.in_transaction
    arm(False)
    assert SqliteStore(conn, run_id="r").load() == seen[-1]
    store(_extended(seen[-1]))
    assert SqliteStore(conn, run_id="r").load() == _extended(seen[-1])
    conn.close()


def test_sqlite_failed_commit_is_rolled_back_and_later_saves_work(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "runs.db", isolation_level=None)
    store = SqliteStore(conn, run_id="r")
    seen = _run(_diamond(), store, max_concurrency=1)
    # A deferred foreign key is checked at COMMIT, which then fails and leaves
    # the transaction open: a real way for COMMIT to fail.
    conn.executescript(
        """
        PRAGMA foreign_keys=ON;
        CREATE TABLE parent (id INTEGER PRIMARY KEY);
        CREATE TABLE child (parent INTEGER REFERENCES parent(id) DEFERRABLE INITIALLY DEFERRED);
        CREATE TRIGGER orphan AFTER INSERT ON ekit_entries BEGIN INSERT INTO child VALUES (-1); END;
        """
    )
    with pytest.raises(sqlite3.IntegrityError, match="FOREIGN KEY"):
        store(_extended(seen[-1]))
    assert not conn.in_transaction
    assert SqliteStore(conn, run_id="r").load() == seen[-1]
    conn.execute("DROP TRIGGER orphan")
    store(_extended(seen[-1]))
    assert SqliteStore(conn, run_id="r").load() == _extended(seen[-1])
    conn.close()


def test_sqlite_load_reads_without_the_write_lock(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    with SqliteStore(db, run_id="r") as writer:
        seen = _run(_diamond(), writer)
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process is in the middle of a save
    conn = sqlite3.connect(db, isolation_level=None, timeout=0)
    statements: list[str] = []
    conn.set_trace_callback(statements.append)
    reader = SqliteStore(conn, run_id="r")
    assert reader.load() == seen[-1]  # WAL: a reader never waits for the writer
    assert reader.load("nobody") is None
    assert [s for s in statements if s.startswith("BEGIN")] == ["BEGIN", "BEGIN"]
    other.execute("ROLLBACK")
    other.close()
    conn.close()


def test_sqlite_garbage_file_is_corrupt_store_error_and_closes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "runs.db"
    path.write_bytes(b"this is not a database, just text " * 100)
    opened: list[sqlite3.Connection] = []
    real = sqlite3.connect

    def connect(*args: Any, **kw: Any) -> sqlite3.Connection:
        opened.append(real(*args, **kw))
        return opened[-1]

    monkeypatch.setattr(sqlite3, "connect", connect)
    with pytest.raises(CorruptStoreError, match=r"runs\.db: not a usable SQLite database") as info:
        SqliteStore(path, run_id="r")
    assert isinstance(info.value, ValueError)
    assert info.value.path == str(path)
    assert len(opened) == 1
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):
        opened[0].execute("SELECT 1")


def test_sqlite_damaged_pages_are_corrupt_store_error(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    with SqliteStore(db, run_id="r") as store:
        _run(_diamond(), store)
    data = bytearray(db.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    data[page:] = b"Z" * (len(data) - page)  # every page after the schema page
    db.write_bytes(bytes(data))
    with SqliteStore(db, run_id="r") as store, pytest.raises(
        CorruptStoreError, match=r"runs\.db: damaged database"
    ):
        store.load()


@pytest.mark.parametrize(
    ("field", "make_bad"),
    [
        ("cost.input_tokens", lambda cp: dataclasses.replace(cp, cost=TokenUsage(2**63, 0, 0))),
        ("cost.llm_calls", lambda cp: dataclasses.replace(cp, cost=TokenUsage(0, 0, 2**70))),
        ("step_index", lambda cp: dataclasses.replace(cp, step_index=2**63)),
    ],
)
def test_sqlite_count_beyond_64_bits_is_refused_before_writing(
    tmp_path: Path, field: str, make_bad: Callable[[WorkflowCheckpoint], WorkflowCheckpoint]
) -> None:
    db = tmp_path / "runs.db"
    store = SqliteStore(db, run_id="r")
    seen = _run(_diamond(), store, max_concurrency=1)
    for bad in (make_bad(seen[-1]), make_bad(_extended(seen[-1]))):  # in full, and as a delta
        with pytest.raises(UnencodableError, match=rf"{re.escape(field)} = \d+: SQLite integers"):
            store(bad)
        assert not store.conn.in_transaction
        assert SqliteStore(db, run_id="r").load() == seen[-1]
    store(_extended(seen[-1]))
    assert SqliteStore(db, run_id="r").load() == _extended(seen[-1])
    store.close()


@pytest.mark.parametrize(
    "make",
    [JsonFileStore, JournalStore, lambda path: SqliteStore(path, run_id="r")],
    ids=["json", "journal", "sqlite"],
)
def test_saving_something_that_is_not_a_checkpoint_is_a_value_error(
    tmp_path: Path, make: Callable[[Path], Any]
) -> None:
    store = make(tmp_path / "store")
    with pytest.raises(ValueError, match="must be a WorkflowCheckpoint, got dict"):
        store.save({"step_index": 0, "outputs": {}, "cost": {}})
    assert store.load() is None  # nothing was written
