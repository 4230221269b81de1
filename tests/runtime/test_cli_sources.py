"""``ekit audit`` and ``ekit replay`` read what every store and queue writes, told apart by content.

A real run (it fails once, then resumes) is saved by every store at once:
a JSON file, JSON lines, a journal, a SQLite store, a SQLite run queue (and,
in its own test, PostgreSQL). The command runs for real in a subprocess.
"""

from __future__ import annotations

import asyncio
import json
import runpy
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from ekit_core import WorkflowCheckpoint
from ekit_runtime import JournalStore, JsonFileStore, SqliteStore
from ekit_runtime.queue import Worker, open_queue
from ekit_runtime.sources import redacted
from tests.support.cli_runs import ekit, one_error_line
from tests.support.queue_backends import postgres_url

__all__ = ["postgres_url"]

FLOWS = '''
from ekit_runtime import PatternResult, Step, TokenUsage, Workflow

state = {"publisher_down": False}


def make(name):
    def run(ctx):
        if name == "publish" and state["publisher_down"]:
            raise RuntimeError("publisher down")
        return PatternResult(f"{name} done", cost=TokenUsage(12_000, 1_500, 1))
    return run


workflow = Workflow([
    Step("fetch", make("fetch")),
    Step("summarize", make("summarize"), ("fetch",)),
    Step("review", make("review"), ("fetch",)),
    Step("publish", make("publish"), ("summarize", "review")),
])
WORKFLOWS = {"pipeline": workflow}
'''
STEPS = ["fetch", "summarize", "review", "publish"]


def _run_everywhere(d: Path) -> list[WorkflowCheckpoint]:
    """Fail a run, resume it, saving every checkpoint to every store; return the checkpoints."""
    flows = runpy.run_path(str(d / "flows.py"))
    workflow, state = flows["workflow"], flows["state"]
    saved: list[WorkflowCheckpoint] = []
    with JsonFileStore(d / "run.json") as single, JournalStore(d / "run-journal.jsonl") as journal, \
            SqliteStore(d / "runs.db", run_id="doc-1") as sqlite:

        def save(cp: WorkflowCheckpoint) -> None:
            saved.append(cp)
            for store in (single, journal, sqlite):
                store(cp)
            with open(d / "run-list.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(cp.to_dict()) + "\n")

        state["publisher_down"] = True
        with pytest.raises(RuntimeError, match="publisher down"):
            workflow.run_sync(checkpoint_fn=save)
        state["publisher_down"] = False
        workflow.run_sync(checkpoint_fn=save, resume_from=journal.load())
    with SqliteStore(d / "runs.db", run_id="doc-2") as other:
        workflow.run_sync(checkpoint_fn=other)
    return saved


def _drain_queue(d: Path, url: str, run_ids: list[str]) -> None:
    flows = runpy.run_path(str(d / "flows.py"))
    queue = open_queue(url)
    try:
        for run_id in run_ids:
            queue.submit("pipeline", {}, run_id=run_id)
        asyncio.run(Worker(queue, flows["WORKFLOWS"], lease_seconds=10).run_until_idle())
        assert all(queue.status(r).status == "finished" for r in run_ids)
    finally:
        queue.close()


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("stores")
    (d / "flows.py").write_text(FLOWS, encoding="utf-8")
    _run_everywhere(d)
    _drain_queue(d, str(d / "queue.db"), ["q-1", "q-2"])
    return d


def _json(proc: Any) -> Any:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize(
    ("source", "kind"),
    [
        (["run.json"], "json"),
        (["run-list.jsonl"], "jsonl"),
        (["run-journal.jsonl"], "journal"),
        (["runs.db", "--run-id", "doc-1"], "sqlite-store"),
        (["queue.db", "--run-id", "q-1"], "sqlite-queue"),
    ],
)
def test_audit_reads_every_store(stores: Path, source: list[str], kind: str) -> None:
    data = _json(ekit(stores, "audit", *source, "--workflow", "flows:workflow", "--json"))
    assert data["source"] == kind and data["clean"] is True
    assert data["skip"] == STEPS and data["run"] == []
    text = ekit(stores, "audit", *source)
    assert "resume skips 4 step(s), runs 0" in text.stdout
    assert "12,000/1,500/1" in text.stdout and "48,000/6,000/4" in text.stdout


def test_a_journal_replays_its_whole_history_as_the_list_of_checkpoints_does(stores: Path) -> None:
    journal = _json(ekit(stores, "replay", "run-journal.jsonl", "--json"))
    listed = _json(ekit(stores, "replay", "run-list.jsonl", "--json"))
    assert journal["ok"] is True and journal["source"] == "journal"
    assert journal["timeline"] == listed["timeline"]
    assert len(journal["timeline"]) >= 4
    finished = [n for e in journal["timeline"] for n in e["finished"]]
    assert sorted(finished) == sorted(STEPS)
    assert any(e["failed"] == ["publish"] for e in journal["timeline"])
    text = ekit(stores, "replay", "run-journal.jsonl").stdout
    assert "failed: publish" in text and "no violations" in text
    # Audit takes the latest checkpoint of a history, and says so.
    audit = ekit(stores, "audit", "run-journal.jsonl").stdout
    n = len(journal["timeline"])
    assert audit.startswith(
        f"audit of run-journal.jsonl, the latest of its {n} checkpoints (a JournalStore journal"
    )


def test_kinds_are_told_apart_by_content_not_by_name(stores: Path, tmp_path: Path) -> None:
    for src, disguise in [("runs.db", "runs.json"), ("run-journal.jsonl", "journal.db"),
                          ("run.json", "checkpoint.jsonl"), ("queue.db", "queue.txt")]:
        shutil.copy(stores / src, tmp_path / disguise)
    shutil.copy(stores / "flows.py", tmp_path / "flows.py")
    sqlite = _json(ekit(tmp_path, "audit", "runs.json", "--run-id", "doc-1", "--json"))
    assert sqlite["source"] == "sqlite-store"
    assert _json(ekit(tmp_path, "replay", "journal.db", "--json"))["source"] == "journal"
    assert _json(ekit(tmp_path, "audit", "checkpoint.jsonl", "--json"))["source"] == "json"
    queue = _json(ekit(tmp_path, "audit", "queue.txt", "--run-id", "q-2", "--json"))
    assert queue["source"] == "sqlite-queue"


def test_a_database_without_run_id_lists_its_runs(stores: Path) -> None:
    proc = ekit(stores, "audit", "runs.db")
    one_error_line(proc, "runs.db: a SqliteStore database holding 2 run(s); pass --run-id RUN")
    assert proc.stdout.split() == ["RUN_ID", "doc-1", "doc-2"]
    proc = ekit(stores, "replay", "queue.db", "--json")
    one_error_line(proc, "queue.db: a SqliteQueue run queue holding 2 run(s)")
    assert [(r["run_id"], r["status"], r["workflow"]) for r in json.loads(proc.stdout)] == [
        ("q-1", "finished", "pipeline"), ("q-2", "finished", "pipeline"),
    ]
    one_error_line(ekit(stores, "audit", "runs.db", "--run-id", "nope"), "runs.db: no run 'nope'")
    one_error_line(ekit(stores, "audit", "run.json", "--run-id", "doc-1"), "run.json: --run-id", "not one")


def test_a_database_holding_a_store_and_a_queue(stores: Path, tmp_path: Path) -> None:
    shutil.copy(stores / "flows.py", tmp_path / "flows.py")
    both = tmp_path / "both.db"
    cp = WorkflowCheckpoint.from_dict(json.loads((stores / "run.json").read_text()))
    with SqliteStore(both, run_id="x") as store:
        store(cp)
    _drain_queue(tmp_path, str(both), ["x"])
    proc = ekit(tmp_path, "audit", "both.db")
    one_error_line(proc, "a SqliteStore database and a SqliteQueue run queue holding 2 run(s)")
    assert "store" in proc.stdout and "queue" in proc.stdout
    one_error_line(
        ekit(tmp_path, "audit", "both.db", "--run-id", "x"), "pass --tables store or --tables queue"
    )
    assert _json(ekit(tmp_path, "audit", "both.db", "--run-id", "x", "--tables", "queue", "--json"))[
        "source"] == "sqlite-queue"
    assert _json(ekit(tmp_path, "audit", "both.db", "--run-id", "x", "--tables", "store", "--json"))[
        "source"] == "sqlite-store"


def test_unreadable_databases_and_inputs_are_one_line(stores: Path, tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "other.db")
    conn.execute("CREATE TABLE notes (x)")
    conn.commit()
    conn.close()
    one_error_line(ekit(tmp_path, "audit", "other.db"), "other.db: a database without ekit's tables")
    (tmp_path / "cut.db").write_bytes((stores / "runs.db").read_bytes()[:100])
    one_error_line(ekit(tmp_path, "audit", "cut.db", "--run-id", "doc-1"), "cut.db:")
    lines = (stores / "run-journal.jsonl").read_bytes().splitlines(keepends=True)
    (tmp_path / "damaged.jsonl").write_bytes(lines[0] + b"garbage\n" + b"".join(lines[1:]))
    one_error_line(ekit(tmp_path, "replay", "damaged.jsonl"), "damaged.jsonl", "line 2")
    (tmp_path / "binary.bin").write_bytes(b"\xff\xfe\x00")
    one_error_line(ekit(tmp_path, "audit", "binary.bin"), "binary.bin: not UTF-8 text")


def test_standard_input_takes_json_but_not_files_that_need_their_path(stores: Path) -> None:
    for name in ("run.json", "run-list.jsonl"):
        proc = _run_with_stdin(stores, (stores / name).read_bytes(), "audit", "-")
        assert proc.returncode == 0 and "resume skips 4 step(s)" in proc.stdout.decode()
    for name, fragment in [("runs.db", "SQLite database"), ("run-journal.jsonl", "JournalStore journal")]:
        proc = _run_with_stdin(stores, (stores / name).read_bytes(), "audit", "-")
        err = proc.stderr.decode()
        assert proc.returncode == 2 and err.count("\n") == 1 and fragment in err, err


def _run_with_stdin(cwd: Path, data: bytes, *args: str) -> Any:
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "ekit_runtime", *args], cwd=cwd, input=data,
                          capture_output=True, timeout=60)


@pytest.mark.timeout(120)
def test_postgres_store_and_queue_runs_are_audited_and_replayed(postgres_url: str, tmp_path: Path) -> None:
    from ekit_runtime.stores import PostgresStore

    (tmp_path / "flows.py").write_text(FLOWS, encoding="utf-8")
    workflow = runpy.run_path(str(tmp_path / "flows.py"))["workflow"]
    with PostgresStore(postgres_url, run_id="doc-1") as store:
        workflow.run_sync(checkpoint_fn=store)
    _drain_queue(tmp_path, postgres_url, ["q-1"])
    for run_id, kind in (("doc-1", "postgres-store"), ("q-1", "postgres-queue")):
        data = _json(ekit(tmp_path, "audit", postgres_url, "--run-id", run_id, "--workflow", "flows:workflow",
                          "--json"))
        assert data["source"] == kind and data["clean"] is True and data["skip"] == STEPS
        replayed = _json(ekit(tmp_path, "replay", postgres_url, "--run-id", run_id, "--json"))
        assert replayed["ok"] is True and len(replayed["timeline"]) == 1
    proc = ekit(tmp_path, "audit", postgres_url)
    one_error_line(proc, "a PostgresStore database and a PostgresQueue run queue holding 2 run(s)")
    assert proc.stdout.split()[4:] == ["doc-1", "store", "-", "-", "q-1", "queue", "finished", "pipeline"]
    one_error_line(ekit(tmp_path, "replay", postgres_url, "--run-id", "zz"), "no run 'zz'")
    refused = "postgresql://ekit:s3cret@127.0.0.1:1/nope"
    proc = ekit(tmp_path, "audit", refused, "--run-id", "x")
    one_error_line(proc, "postgresql://ekit:***@127.0.0.1:1/nope: OperationalError")
    assert "s3cret" not in proc.stderr


def test_urls_are_shown_without_their_password() -> None:
    assert redacted("postgresql://u:pw@h:5/db?sslmode=x") == "postgresql://u:***@h:5/db?sslmode=x"
    assert redacted("postgresql://?host=h&password=pw") == "postgresql://?host=h&password=***"
    assert redacted("postgresql://h/db") == "postgresql://h/db"


def test_a_libpq_key_value_string_is_read_as_a_postgresql_source(
    postgres_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from psycopg.conninfo import conninfo_to_dict

    from ekit_runtime import Step, Workflow
    from ekit_runtime.cli import main
    from ekit_runtime.stores import PostgresStore

    with PostgresStore(postgres_url, run_id="kv-1") as store:
        Workflow([Step("a", lambda ctx: "A")]).run_sync(checkpoint_fn=store)
    keywords = " ".join(f"{k}={v}" for k, v in conninfo_to_dict(postgres_url).items()) + " password=s3cret"
    assert main(["audit", keywords, "--run-id", "kv-1", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["source"] == "postgres-store" and "s3cret" not in out + err
    assert main(["audit", keywords]) == 2
    out, err = capsys.readouterr()
    assert "kv-1" in out and "password=***" in err and "s3cret" not in out + err
