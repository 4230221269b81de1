"""A journal only ever grows by appends, so its history keeps every checkpoint a run saved.

What users rely on: a question, an answer, a version bump or a changed
context is saved by appending a record, never by rewriting the journal, so
the bytes saved before it stay as they were (a prefix of the file), and
``history()`` (what ``ekit replay`` reads) still holds every earlier
checkpoint, and replays as legal; a crash in such an append is a torn tail
like any other; only compaction (``compact()``, ``compact_after``) rewrites
the journal as one record.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from ekit_core import Answer, WorkflowCheckpoint, replay
from ekit_runtime import JournalStore, RunWaiting, Step, Workflow, ask


def _plain(cp: WorkflowCheckpoint) -> Any:
    return json.loads(json.dumps(cp.to_dict()))


def _distinct(saved: list[WorkflowCheckpoint]) -> list[Any]:
    """The saves as plain data, a save that changed nothing dropped (the journal writes no line for it)."""
    out: list[Any] = []
    for cp in saved:
        if not out or _plain(cp) != out[-1]:
            out.append(_plain(cp))
    return out


class _Recorder:
    """A journal's save that also keeps every checkpoint it was handed, and the file's bytes after each."""

    def __init__(self, store: JournalStore) -> None:
        self.store, self.saved, self.files = store, list[WorkflowCheckpoint](), list[bytes]()

    def __call__(self, cp: WorkflowCheckpoint) -> None:
        self.store(cp)
        self.saved.append(cp)
        self.files.append(Path(self.store.path).read_bytes())

    def prepare_run(self, cp: WorkflowCheckpoint) -> None:
        self.store.prepare_run(cp)


def _asking() -> Workflow:
    def title(ctx: Any) -> str:
        return f"{ask('What title?')}: {ctx['draft']}"

    return Workflow([
        Step("draft", lambda ctx: "text"),
        Step("title", title, ("draft",)),
        Step("publish", lambda ctx: f"published {ctx['title']}", ("title",)),
    ])


def _assert_append_only(files: list[bytes]) -> None:
    for before, after in pairwise(files):
        assert after.startswith(before), "a save rewrote what an earlier one had written"


def test_a_question_and_its_answer_are_appended_and_history_keeps_every_save(tmp_path: Path) -> None:
    path = tmp_path / "asked.jsonl"
    wf = _asking()
    with JournalStore(path, durable=False) as store:
        save = _Recorder(store)
        with pytest.raises(RunWaiting):
            wf.run_sync(checkpoint_fn=save)
    with JournalStore(path, durable=False) as store:
        save.store = store
        parked = store.load()
        wf.run_sync(checkpoint_fn=save, resume_from=parked, answers={"title": Answer("Tides", by="ann")})
    _assert_append_only(save.files)
    history = list(JournalStore(path).history())
    assert [_plain(cp) for cp in history] == _distinct(save.saved)
    assert history[-1].outputs["publish"] == "published Tides: text"
    report = replay(wf.graph, history)
    assert report.ok, report.format()


def test_a_version_bump_and_a_new_context_are_appended(tmp_path: Path) -> None:
    path = tmp_path / "bumped.jsonl"

    def flow(version: str) -> Workflow:
        return Workflow([
            Step("a", lambda ctx: ctx["x"]),
            Step("b", lambda ctx: ctx["a"] * 2, ("a",), version=version),
        ])

    with JournalStore(path, durable=False) as store:
        save = _Recorder(store)
        flow("1").run_sync({"x": 1}, checkpoint_fn=save)
        first = store.load()
        flow("2").run_sync({"x": 1, "y": 0}, checkpoint_fn=save, resume_from=first)
    _assert_append_only(save.files)
    history = list(JournalStore(path).history())
    assert [_plain(cp) for cp in history] == _distinct(save.saved)
    assert history[0].versions == {"b": "1"} and history[-1].versions == {"b": "2"}
    assert history[-1] == JournalStore(path).load()
    report = replay(flow("2").graph, history)
    assert report.ok, report.format()


def test_an_append_torn_by_a_crash_leaves_the_save_before_it(tmp_path: Path) -> None:
    path = tmp_path / "torn.jsonl"
    wf = _asking()
    answer = {"title": Answer("Tides", by="ann")}
    with JournalStore(path, durable=False) as store:
        with pytest.raises(RunWaiting):
            wf.run_sync(checkpoint_fn=store)
        parked = store.load()
        before = path.read_bytes()
        wf.run_sync(checkpoint_fn=store, resume_from=parked, answers=answer)
    after = path.read_bytes()
    assert after.startswith(before)
    # The answer's record, cut short by a crash: everything before it stands.
    cut = (len(after[len(before):].split(b"\n")[0]) + 1) // 2
    path.write_bytes(after[: len(before) + cut])
    reader = JournalStore(path, durable=False)
    assert reader.load() == parked
    assert reader.torn_tail == cut
    # The next save cuts the torn bytes off and appends after what stood.
    with reader:
        wf.run_sync(checkpoint_fn=reader, resume_from=parked, answers=answer)
    assert path.read_bytes() == after
    assert JournalStore(path).load().outputs["publish"] == "published Tides: text"  # type: ignore[union-attr]


def test_only_compaction_rewrites_the_journal(tmp_path: Path) -> None:
    path = tmp_path / "compacted.jsonl"
    wf = _asking()
    with JournalStore(path, durable=False) as store:
        with pytest.raises(RunWaiting):
            wf.run_sync(checkpoint_fn=store)
        wf.run_sync(checkpoint_fn=store, resume_from=store.load(), answers={"title": Answer("Tides")})
        assert len(path.read_bytes().splitlines()) > 1
        latest = store.compact()
    assert len(path.read_bytes().splitlines()) == 1
    assert JournalStore(path).load() == latest
    assert list(JournalStore(path).history()) == [latest]


def test_compact_after_counts_the_records_since_the_last_full_one(tmp_path: Path) -> None:
    path = tmp_path / "every.jsonl"
    wf = _asking()
    with JournalStore(path, durable=False, compact_after=100) as store:
        with pytest.raises(RunWaiting):
            wf.run_sync(checkpoint_fn=store)
        wf.run_sync(checkpoint_fn=store, resume_from=store.load(), answers={"title": Answer("Tides")})
    lines = path.read_bytes().splitlines()
    kinds = [json.loads(line[len(b'{"c":"00000000","r":'):-1])["kind"] for line in lines]
    assert kinds[0] == "full" and len(kinds) > 2
    assert JournalStore(path).load().outputs["publish"] == "published Tides: text"  # type: ignore[union-attr]


def test_ekit_rewind_into_a_journal_appends_and_keeps_its_history(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ekit_runtime.cli import main

    path = tmp_path / "run.jsonl"
    wf = Workflow([Step("a", lambda ctx: "A"), Step("b", lambda ctx: "B", ("a",))])
    with JournalStore(path, durable=False) as store:
        wf.run_sync(checkpoint_fn=store)
    before = path.read_bytes()
    history = list(JournalStore(path).history())
    code = main(["rewind", str(path), "--step", "b", "--graph-from-checkpoint", "-o", str(path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "history before the rewind stays" in out
    assert path.read_bytes().startswith(before)
    after = list(JournalStore(path).history())
    assert after[: len(history)] == history and sorted(after[-1].outputs) == ["a"]
