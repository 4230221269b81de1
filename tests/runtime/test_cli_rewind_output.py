"""``ekit rewind -o FILE`` writes through the store that owns FILE, or refuses; it never clobbers one.

The kind of an existing file is read from its content: a checkpoint JSON
is replaced through ``JsonFileStore``, a journal saved through
``JournalStore``, a ``SqliteStore`` run through ``SqliteStore``, each under
its write lock and keeping the file's mode; a run queue's database, JSON
lines, a foreign SQLite database or any other file is refused with nothing
written. A live run holding the file (a real child process) keeps it: the
rewind is refused naming that process, and the run's next save succeeds.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ekit_core import WorkflowCheckpoint
from ekit_runtime import JournalStore, JsonFileStore, SqliteStore, Step, Workflow
from ekit_runtime.cli import main
from ekit_runtime.queue import SqliteQueue

ROOT = Path(__file__).resolve().parents[2]
FLOW = Workflow([Step("a", lambda ctx: "A"), Step("b", lambda ctx: "B", ("a",)),
                 Step("c", lambda ctx: "C")])


def _run(cli: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(cli)
    out, err = capsys.readouterr()
    return code, out, err


def _finished() -> WorkflowCheckpoint:
    saved: list[WorkflowCheckpoint] = []
    FLOW.run_sync(checkpoint_fn=saved.append)
    return saved[-1]


def _source(tmp_path: Path) -> str:
    path = tmp_path / "source.json"
    path.write_text(json.dumps(_finished().to_dict()))
    return str(path)


def _rewind(source: str, out: Path, *extra: str) -> list[str]:
    return ["rewind", source, "--step", "a", "--graph-from-checkpoint", "-o", str(out), *extra]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_queue_database_is_refused_untouched_and_still_listable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "runs.db"
    with SqliteQueue(str(db)) as q:
        q.submit("flow", {"n": 1}, run_id="r1")
    before = _digest(db)
    code, _, err = _run(_rewind(_source(tmp_path), db), capsys)
    assert code == 2
    assert "run queue" in err and "nothing was written" in err and err.count("\n") == 1
    # It points at the fenced way in: the queue's own rewind.
    assert f"ekit queue --queue {db} rewind RUN STEP" in err
    assert _digest(db) == before
    code, out, err = _run(["queue", "--queue", str(db), "list", "--json"], capsys)
    assert code == 0, err
    assert [r["run_id"] for r in json.loads(out)] == ["r1"]


def test_a_journal_is_saved_through_its_store_keeping_its_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    journal = tmp_path / "run.journal"
    with JournalStore(journal) as store:
        FLOW.run_sync(checkpoint_fn=store)
    journal.chmod(0o640)
    code, out, err = _run(_rewind(str(journal), journal), capsys)
    assert code == 0, err
    assert "through JournalStore" in out
    loaded = JournalStore(journal).load()
    assert loaded is not None and sorted(loaded.outputs) == ["c"]
    assert sorted(list(JournalStore(journal).history())[-1].outputs) == ["c"]
    assert stat.S_IMODE(journal.stat().st_mode) == 0o640
    assert not (tmp_path / "run.journal.lock").exists()


def test_a_checkpoint_json_is_replaced_through_its_store_keeping_its_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.json"
    with JsonFileStore(path) as store:
        FLOW.run_sync(checkpoint_fn=store)
    path.chmod(0o644)
    code, _, err = _run(_rewind(str(path), path), capsys)
    assert code == 0, err
    loaded = JsonFileStore(path).load()
    assert loaded is not None and sorted(loaded.outputs) == ["c"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_a_new_file_gets_the_mode_a_store_gives_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_path = tmp_path / "rewound.json"
    source = _source(tmp_path)  # one run: its durations are what both files get
    code, _, err = _run(_rewind(source, out_path), capsys)
    assert code == 0, err
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out_path.stat().st_mode) == 0o666 & ~umask
    loaded = JsonFileStore(out_path).load()
    assert loaded is not None and sorted(loaded.outputs) == ["c"]
    # An empty file (made by touch, say) holds nothing to lose: written the same way.
    empty = tmp_path / "empty.json"
    empty.touch()
    code, _, err = _run(_rewind(source, empty), capsys)
    assert code == 0, err
    assert JsonFileStore(empty).load() == loaded


def test_a_sqlite_store_run_is_saved_through_the_store_the_other_runs_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "store.db"
    for run in ("r1", "r2"):
        with SqliteStore(db, run_id=run) as store:
            FLOW.run_sync(checkpoint_fn=store)
    db.chmod(0o640)
    code, _, err = _run(_rewind(str(db), db, "--run-id", "r1"), capsys)
    assert code == 0, err
    reader = SqliteStore(db, run_id="r1")
    r1, r2 = reader.load("r1"), reader.load("r2")
    reader.close()
    assert r1 is not None and sorted(r1.outputs) == ["c"]
    assert r2 is not None and sorted(r2.outputs) == ["a", "b", "c"]
    assert stat.S_IMODE(db.stat().st_mode) == 0o640
    # From a file, the run to write is named with --output-run-id; without it, refused.
    code, _, err = _run(_rewind(_source(tmp_path), db), capsys)
    assert code == 2 and "--output-run-id" in err
    code, _, err = _run(_rewind(_source(tmp_path), db, "--output-run-id", "r3"), capsys)
    assert code == 0, err


@pytest.mark.parametrize(
    "content",
    [
        b'{"step_index": 0}\n{"step_index": 1}\n',  # JSON lines
        b"[]",
        b"notes, not JSON\n",
        b'{"name": "settings"}',
    ],
    ids=["json-lines", "json-array", "text", "other-json"],
)
def test_a_file_of_another_kind_is_refused_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes
) -> None:
    path = tmp_path / "target.json"
    path.write_bytes(content)
    code, _, err = _run(_rewind(_source(tmp_path), path), capsys)
    assert code == 2 and "refusing to overwrite it" in err and err.count("\n") == 1
    assert path.read_bytes() == content


def test_a_foreign_sqlite_database_and_a_directory_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import sqlite3

    db = tmp_path / "app.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE t (x)")
    before = _digest(db)
    code, _, err = _run(_rewind(_source(tmp_path), db), capsys)
    assert code == 2 and "without a SqliteStore's tables" in err
    assert _digest(db) == before
    code, _, err = _run(_rewind(_source(tmp_path), tmp_path), capsys)
    assert code == 2 and "is a directory" in err


def _wait_for(path: Path, child: subprocess.Popen[str], deadline: float) -> None:
    while not path.exists():
        if child.poll() is not None:
            raise AssertionError(f"the live run ended early: {child.communicate()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {path} within the deadline")
        time.sleep(0.01)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["json", "journal", "sqlite"])
def test_a_store_a_live_run_holds_is_refused_and_the_run_saves_its_next_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    path = tmp_path / {"json": "live.json", "journal": "live.journal", "sqlite": "live.db"}[kind]
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.support.rewind_live_child", kind, str(path), str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        _wait_for(tmp_path / "ready", child, time.monotonic() + 40)
        run_id = ["--run-id", "live"] if kind == "sqlite" else []
        code, _, err = _run(_rewind(str(path), path, *run_id), capsys)
        assert code == 2
        assert f"process {child.pid} is writing" in err and "nothing was written" in err
        (tmp_path / "go").write_text("")
        out, _ = child.communicate(timeout=40)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, out
    if kind == "json":
        saved = JsonFileStore(path).load()
    elif kind == "journal":
        saved = JournalStore(path).load()
    else:
        saved = SqliteStore(path, run_id="live").load()
    assert saved is not None and saved.outputs == {"a": "a done", "b": "b done"}
