"""A SQLite save is one statement, and it keeps every promise the statements kept.

A save (what a worker writes after each step) is one insert into the view
``ekit_queue_writes_v2`` (or, for a step's output alone, ``ekit_queue_steps_v2``),
whose trigger runs the fenced update, the entries and the usage (and, for a
save in full, the header), so the write lock is taken and let go inside one
call into SQLite. These tests pin that it is one
statement, and try to break what the statements it replaced guaranteed: the
fence (a lost lease writes nothing), the cancel flag the save returns (the
row RETURNING gives back), the usage row, a save in full replacing what was
stored, text of any kind stored exactly (a NUL, which the JSON the trigger
reads cannot carry, is refused before any write), a lock held by another
process, and a file made before the view existed. (Several runs' saves in one
statement: tests/queue/test_queue_group_commit.py.)
"""

from __future__ import annotations

import json
import sqlite3
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ekit_runtime.queue.sqlite as sqlite_queue
from ekit_core import TokenUsage
from ekit_runtime import PatternResult, Step, Workflow, WorkflowCheckpoint
from ekit_runtime.queue import Lease, LeaseLostError, SqliteQueue
from ekit_runtime.queue.transient import is_transient
from tests.support.queue_backends import naps, wait_for

__all__ = ["naps"]  # (a fixture)

PATHS = ("one statement", "statements")


def _checkpoints(outputs: list[Any], *, llm_calls: int = 0) -> list[WorkflowCheckpoint]:
    """Every checkpoint of a chain whose step ``i`` returns ``outputs[i]`` (each with usage if asked)."""

    def step(value: Any) -> Any:
        async def run(ctx: dict[str, Any]) -> Any:
            if llm_calls:
                cost = TokenUsage(input_tokens=3, output_tokens=2, llm_calls=llm_calls)
                return PatternResult(value, cost=cost)
            return value

        return run

    steps = [Step(f"s{i}", step(v), (f"s{i - 1}",) if i else ()) for i, v in enumerate(outputs)]
    found: list[WorkflowCheckpoint] = []
    Workflow(steps).run_sync(checkpoint_fn=found.append)
    return found


def _statements(queue: SqliteQueue) -> list[str]:
    """The statements the queue's connection runs from now on, each once.

    (Python's trace hook reports each statement of a trigger with the text of
    the statement that fired it, so repeats of one text in a row are one.)
    """
    seen: list[str] = []

    def trace(sql: str) -> None:
        if not seen or seen[-1] != sql:
            seen.append(sql)

    queue.conn.set_trace_callback(trace)
    return seen


def _open(path: Path, how: str, **kwargs: Any) -> SqliteQueue:
    queue = SqliteQueue(path, **kwargs)
    if how == "statements":
        queue._one_statement = False  # as on an SQLite without its JSON functions
    return queue


def _claimed(queue: SqliteQueue, run_id: str = "r") -> Lease:
    queue.submit("w", run_id=run_id)
    lease = queue.claim("me", {"w": None}, 60)
    assert lease is not None
    return lease


def _run_row(queue: SqliteQueue, run_id: str = "r") -> tuple[Any, ...]:
    row = queue.conn.execute(
        "SELECT counted, step_index, steps_done, lease_until FROM ekit_queue_runs WHERE run_id = ?", (run_id,)
    ).fetchone()
    assert row is not None
    return tuple(row)


def test_a_save_of_one_new_step_is_one_statement_and_no_transaction(tmp_path: Path) -> None:
    queue = SqliteQueue(tmp_path / "q.db")
    lease = _claimed(queue)
    first, second, third = _checkpoints(["a", "b", "c"])
    seen = _statements(queue)
    queue.save(lease, first, 60)  # the first save writes the run in full, in one statement too
    assert len(seen) == 1 and seen[0].startswith("INSERT INTO ekit_queue_writes") and "graph_steps" in seen[0]
    seen.clear()
    assert queue.save(lease, second, 60) is False
    # A step's output alone: the narrow view (see test_queue_sqlite_one_page_save_reads_back_alike.py).
    assert len(seen) == 1 and seen[0].startswith("INSERT INTO ekit_queue_steps"), seen
    assert queue.save(lease, third, 60) is False
    assert len(seen) == 2 and not any(s.startswith(("BEGIN", "COMMIT")) for s in seen)
    loaded = queue.checkpoint("r")
    assert loaded is not None and dict(loaded.outputs) == dict(third.outputs)
    queue.close()


def test_an_sqlite_without_json_functions_saves_a_delta_in_statements(tmp_path: Path) -> None:
    queue = _open(tmp_path / "q.db", "statements")
    lease = _claimed(queue)
    first, second = _checkpoints(["a", "b"])
    queue.save(lease, first, 60)
    seen = _statements(queue)
    assert queue.save(lease, second, 60) is False
    assert seen[0] == "BEGIN IMMEDIATE" and seen[-1] == "COMMIT"
    loaded = queue.checkpoint("r")
    assert loaded is not None and dict(loaded.outputs) == {"s0": "a", "s1": "b"}
    queue.close()


@pytest.mark.parametrize("how", PATHS)
def test_a_delta_save_tells_whether_a_cancel_was_asked(tmp_path: Path, how: str) -> None:
    queue = _open(tmp_path / "q.db", how)
    lease = _claimed(queue)
    checkpoints = _checkpoints(["a", "b", "c", "d"], llm_calls=1)
    assert queue.save(lease, checkpoints[0], 60) is False
    assert queue.save(lease, checkpoints[1], 60) is False  # with a usage row: still no cancel
    assert queue.cancel("r") is True  # a running run: flagged
    assert queue.save(lease, checkpoints[2], 60) is True
    assert queue.save(lease, checkpoints[3], 60) is True  # and it stays asked
    # The flag was reported, not changed, and the saves were all stored.
    assert queue.status("r").cancel_requested
    loaded = queue.checkpoint("r")
    assert loaded is not None and len(loaded.outputs) == 4
    queue.close()


@pytest.mark.parametrize("how", PATHS)
def test_a_delta_save_adds_the_usage_row_the_rate_limits_count(tmp_path: Path, how: str) -> None:
    queue = _open(tmp_path / "q.db", how)
    lease = _claimed(queue)
    checkpoints = _checkpoints(["a", "b", "c"], llm_calls=2)
    for cp in checkpoints:
        queue.save(lease, cp, 60)
    rows = queue.conn.execute("SELECT llm_calls, tokens FROM ekit_queue_usage").fetchall()
    # One row per step that used calls, each counting only what that save added.
    assert [tuple(r) for r in rows] == [(2, 5)] * len(checkpoints)
    queue.close()


@pytest.mark.parametrize("how", PATHS)
@pytest.mark.parametrize("lost", ["expired", "taken over", "finished"])
# With usage the save goes through ekit_queue_writes; without, through the narrow ekit_queue_steps.
@pytest.mark.parametrize("llm_calls", [1, 0])
def test_a_delta_save_under_a_lost_lease_writes_nothing(
    tmp_path: Path, how: str, lost: str, llm_calls: int
) -> None:
    queue = _open(tmp_path / "q.db", how)
    lease = _claimed(queue)
    checkpoints = _checkpoints(["a", "b"], llm_calls=llm_calls)
    queue.save(lease, checkpoints[0], 60)
    if lost == "expired":
        queue.conn.execute("UPDATE ekit_queue_runs SET lease_until = 0 WHERE run_id = 'r'")
    elif lost == "taken over":
        queue.conn.execute("UPDATE ekit_queue_runs SET lease_until = 0 WHERE run_id = 'r'")
        other = SqliteQueue(tmp_path / "q.db")
        assert other.claim("them", {"w": checkpoints[0].fingerprint}, 60) is not None
        other.close()
    else:
        queue.finish(Lease(lease.run_id, lease.epoch, "w", lease.context, None, lease.expires), "finished")
    row = _run_row(queue)
    entries = queue.conn.execute("SELECT count(*) FROM ekit_queue_entries").fetchone()[0]
    usage = queue.conn.execute("SELECT count(*) FROM ekit_queue_usage").fetchone()[0]
    with pytest.raises(LeaseLostError):
        queue.save(lease, checkpoints[1], 60)
    assert _run_row(queue) == row
    assert queue.conn.execute("SELECT count(*) FROM ekit_queue_entries").fetchone()[0] == entries
    assert queue.conn.execute("SELECT count(*) FROM ekit_queue_usage").fetchone()[0] == usage
    assert not queue.conn.in_transaction
    queue.close()


def _prefixed_dumps(value: Any) -> str:
    # Strings stored as they are (control characters and NUL included), the rest as JSON.
    return "s" + value if isinstance(value, str) else "j" + json.dumps(value)


def _prefixed_loads(text: str) -> Any:
    return text[1:] if text[:1] == "s" else json.loads(text[1:])


# Any text but a NUL, which the queue refuses before it writes (tests/queue/test_queue_hostile_input.py).
_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.lists(_TEXT, min_size=2, max_size=5))
def test_any_text_a_dumps_writes_is_stored_exactly(tmp_path: Path, values: list[str]) -> None:
    path = Path(tempfile.mkdtemp(dir=tmp_path)) / "q.db"  # (a file of its own for each example)
    queue = SqliteQueue(path, dumps=_prefixed_dumps, loads=_prefixed_loads)
    lease = _claimed(queue)
    checkpoints = _checkpoints(values)
    queue.save(lease, checkpoints[0], 60)
    seen = _statements(queue)
    for cp in checkpoints[1:]:
        queue.save(lease, cp, 60)
    queue.conn.set_trace_callback(None)
    stored = dict(queue.conn.execute("SELECT name, value FROM ekit_queue_entries WHERE kind = 'output'"))
    assert stored == {f"s{i}": "s" + v for i, v in enumerate(values)}
    loaded = queue.checkpoint("r")
    assert loaded is not None and dict(loaded.outputs) == {f"s{i}": v for i, v in enumerate(values)}
    # One statement per save, whatever the text: quotes, backslashes, control and astral characters.
    assert len(seen) == len(checkpoints) - 1
    assert all(sql.startswith("INSERT INTO ekit_queue_steps") for sql in seen)
    queue.close()


def test_a_delta_save_waits_out_another_process_lock_then_commits(tmp_path: Path, naps: list[float]) -> None:
    queue = SqliteQueue(tmp_path / "q.db")
    lease = _claimed(queue)
    first, second = _checkpoints(["a", "b"])
    queue.save(lease, first, 60)
    holder = sqlite3.connect(tmp_path / "q.db", isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    done = threading.Event()
    results: list[object] = []

    def save() -> None:
        try:
            results.append(queue.save(lease, second, 60))
        except BaseException as exc:  # reported below
            results.append(exc)
        done.set()

    thread = threading.Thread(target=save)
    thread.start()
    wait_for(lambda: len(naps) >= 3, timeout=30, what="the save to nap while the lock is held")
    assert not done.is_set()
    holder.execute("ROLLBACK")
    assert done.wait(30)
    thread.join()
    holder.close()
    assert results == [False]
    loaded = queue.checkpoint("r")
    assert loaded is not None and dict(loaded.outputs) == {"s0": "a", "s1": "b"}
    queue.close()


def test_a_delta_save_locked_past_the_timeout_fails_transiently_and_writes_nothing(
    tmp_path: Path, naps: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = SqliteQueue(tmp_path / "q.db")
    lease = _claimed(queue)
    first, second = _checkpoints(["a", "b"])
    queue.save(lease, first, 60)
    before = _run_row(queue)
    monkeypatch.setattr(sqlite_queue, "_BUSY_TIMEOUT", 0.2)
    holder = sqlite3.connect(tmp_path / "q.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    with pytest.raises(sqlite3.OperationalError) as locked:
        queue.save(lease, second, 60)
    holder.execute("ROLLBACK")
    holder.close()
    assert "locked" in str(locked.value) and is_transient(locked.value) and naps
    assert _run_row(queue) == before
    # What was stored is now unknown to the queue, so the next save is written in full
    # (its header in the statement).
    seen = _statements(queue)
    assert queue.save(lease, second, 60) is False
    assert len(seen) == 1 and seen[0].startswith("INSERT INTO ekit_queue_writes") and "graph_steps" in seen[0]
    loaded = queue.checkpoint("r")
    assert loaded is not None and dict(loaded.outputs) == {"s0": "a", "s1": "b"}
    queue.close()


def test_a_file_made_before_the_view_gains_it_on_open(tmp_path: Path) -> None:
    path = tmp_path / "q.db"
    SqliteQueue(path).close()
    raw = sqlite3.connect(path, isolation_level=None)
    for kind in ("delta", "full", "end"):
        raw.execute(f"DROP TRIGGER ekit_queue_writes_v2_{kind}")
    raw.execute("DROP VIEW ekit_queue_writes_v2")
    raw.execute("DROP TRIGGER ekit_queue_steps_v2_entry")
    raw.execute("DROP VIEW ekit_queue_steps_v2")
    raw.close()
    queue = SqliteQueue(path)
    made = queue.conn.execute("SELECT name FROM sqlite_master WHERE type IN ('view', 'trigger')")
    names = {r[0] for r in made}
    assert {"ekit_queue_writes_v2", *(f"ekit_queue_writes_v2_{k}" for k in ("delta", "full", "end"))} <= names
    assert {"ekit_queue_steps_v2", "ekit_queue_steps_v2_entry"} <= names
    lease = _claimed(queue)
    first, second = _checkpoints(["a", "b"])
    seen = _statements(queue)
    queue.save(lease, first, 60)
    queue.save(lease, second, 60)
    assert [s[:28] for s in seen] == ["INSERT INTO ekit_queue_write", "INSERT INTO ekit_queue_steps"]
    loaded = queue.checkpoint("r")
    assert loaded is not None and dict(loaded.outputs) == {"s0": "a", "s1": "b"}
    queue.close()


@pytest.mark.parametrize("how", PATHS)
def test_a_save_in_full_replaces_what_was_stored(tmp_path: Path, how: str) -> None:
    queue = _open(tmp_path / "q.db", how)
    lease = _claimed(queue)
    checkpoints = _checkpoints(["a", "b", "c"])
    for cp in checkpoints:
        queue.save(lease, cp, 60)
    # An entry no checkpoint of this run holds (as a save that failed midway might have left):
    queue.conn.execute(
        "INSERT INTO ekit_queue_entries (run_id, kind, name, value, epoch, ord) "
        "VALUES ('r', 'output', 'stale', '1', ?, 0)",
        (lease.epoch,),
    )
    queue._forget("r")  # what is stored is unknown: the next save is in full
    assert queue.cancel("r") is True
    assert queue.save(lease, checkpoints[1], 60) is True  # an earlier one: only a save in full can say so
    loaded = queue.checkpoint("r")
    assert loaded is not None and dict(loaded.outputs) == {"s0": "a", "s1": "b"}
    names = [r[0] for r in queue.conn.execute("SELECT name FROM ekit_queue_entries ORDER BY ord")]
    assert names == ["s0", "s1"]
    queue.close()
