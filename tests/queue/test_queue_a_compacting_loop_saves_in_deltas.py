"""A queued run's loop that compacts its old iterations (``keep_last``) is saved in deltas.

What users rely on: ``keep_last`` keeps a long-lived agent's storage bounded,
and through the run queue (both backends) each iteration's save writes the
new iteration's rows, deletes the rows of the one let go of and writes the
header again, rather than rewriting the run: a few rows and a constant
number of bytes per save, as many rows stored after 80 iterations as after
40, and every checkpoint saved loads back as it was, alone or in a worker's
batch of writes (``write_many``), fenced like any save. A worker SIGKILLed
in the middle of such a save leaves the checkpoint before it: the deletes
and the header commit with the save or not at all.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ekit_runtime.queue.base
from ekit_runtime import Done, Repeat, RetryPolicy, Step, Workflow, WorkflowCheckpoint
from ekit_runtime.queue import Ending, Lease, LeaseLostError, RunQueue, open_queue
from ekit_runtime.stores.rows import EncodedCheckpoint
from tests.support.queue_backends import expire_lease, queue, queue_url, wait_for

__all__ = ["queue", "queue_url"]

ROOT = Path(__file__).resolve().parents[2]
ITERATIONS = 40


def _workflow(iterations: int, keep: int | None = 3, before: int = 30) -> Workflow:
    """``before`` steps, then a loop needing them all that ends at ``iterations``."""
    def agent(ctx: Any) -> Any:
        return Done("x" * 100) if ctx["agent"].number == iterations else "x" * 100

    names = tuple(f"p{i}" for i in range(before))
    return Workflow([*(Step(n, lambda ctx: "y" * 100) for n in names),
                     Step("agent", agent, names, repeat=Repeat(10 * iterations, keep_last=keep))])


def _claimed(q: RunQueue, run_id: str) -> Lease:
    q.submit("w", run_id=run_id)
    lease = q.claim("me", {"w": None}, 60)
    assert lease is not None and lease.run_id == run_id
    return lease


def _stored_rows(q: RunQueue, run_id: str) -> int:
    """How many entry rows the queue's database holds for the run."""
    sql = "SELECT count(*) FROM ekit_queue_entries WHERE run_id = {p}"
    if q.backend == "sqlite":
        return int(q.conn.execute(sql.format(p="?"), (run_id,)).fetchone()[0])  # type: ignore[attr-defined]
    return int(q.db.run(lambda c: c.execute(sql.format(p="%s"), (run_id,)).fetchone()[0]))  # type: ignore[attr-defined]


def _written(encoded: EncodedCheckpoint) -> int:
    """The bytes a save writes: its rows' values and any header, failures and counts."""
    header = encoded.header if encoded.header is not None else encoded.recount
    return (sum(len(v) for _, _, v in encoded.rows) + len(header or "") + len(encoded.failures)
            + 4 * 8)


@pytest.fixture
def encoded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[EncodedCheckpoint]]:
    """What each save of the queue encodes, in order."""
    written: list[EncodedCheckpoint] = []
    real = ekit_runtime.queue.base.encode_checkpoint

    def spy(*args: Any, **kw: Any) -> EncodedCheckpoint:
        written.append(real(*args, **kw))
        return written[-1]

    monkeypatch.setattr(ekit_runtime.queue.base, "encode_checkpoint", spy)
    yield written


def test_a_queued_compacting_loop_saves_each_iteration_in_a_few_rows(
        queue: RunQueue, encoded: list[EncodedCheckpoint]) -> None:
    stored: dict[int, int] = {}
    for iterations in (ITERATIONS, 2 * ITERATIONS):
        run_id = f"loop-{iterations}"
        lease = _claimed(queue, run_id)
        encoded.clear()
        _workflow(iterations).run_sync(checkpoint_fn=lambda cp, lease=lease: queue.save(lease, cp, 60))
        stored[iterations] = _stored_rows(queue, run_id)
        saves = encoded[-iterations + 5:-1]  # (the last save adds the loop's own output too)
        assert all(not e.full and e.gone for e in saves), [(e.full, e.gone) for e in saves]
        rows = [len(e.rows) for e in saves]
        sizes = [_written(e) for e in saves]
        assert max(rows) <= 4, rows  # the new iteration's output and usage rows
        # What a save writes does not grow with the iterations before it.
        assert max(sizes) - min(sizes) <= 16, sizes
        assert max(sizes) < 1_500, sizes  # (the header: under 1 KB for a 31-step graph)
        print(f"\n{queue.backend}, {iterations} iterations: rows per save {max(rows)}, bytes per save "
              f"{min(sizes)}-{max(sizes)}, rows stored {stored[iterations]}")
    # Twice the iterations, the same rows kept: the queue's storage stays bounded.
    assert stored[2 * ITERATIONS] == stored[ITERATIONS], stored


def _flaky_agent(keep: int) -> Workflow:
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
def test_every_checkpoint_a_queued_compacting_loop_saved_loads_back(
        queue: RunQueue, keep: int, encoded: list[EncodedCheckpoint]) -> None:
    lease = _claimed(queue, "flaky")
    seen: list[WorkflowCheckpoint] = []

    def save(cp: WorkflowCheckpoint) -> None:
        queue.save(lease, cp, 60)
        seen.append(cp)
        assert queue.checkpoint("flaky") == cp, len(seen)

    _flaky_agent(keep).run_sync(checkpoint_fn=save)
    assert dict(seen[-1].compacted) == {"agent": 12 - keep}
    assert any(e.gone for e in encoded) and not any(e.full for e in encoded if e.gone)
    assert _stored_rows(queue, "flaky") == len(seen[-1].outputs) + len(seen[-1].step_usage) + sum(
        1 for n in seen[-1].durations if n not in seen[-1].step_usage)


def _checkpoints(iterations: int, keep: int = 2) -> list[WorkflowCheckpoint]:
    seen: list[WorkflowCheckpoint] = []
    _workflow(iterations, keep, before=2).run_sync(checkpoint_fn=seen.append)
    return seen


def test_a_batch_of_writes_holding_compacting_saves_writes_each_alike(
        queue: RunQueue, queue_url: str, encoded: list[EncodedCheckpoint]) -> None:
    one, two, ended, lost = (_claimed(queue, r) for r in ("one", "two", "ended", "lost"))
    first, second = _checkpoints(8), _checkpoints(9)
    start = _first_compacting(first)
    # The runs save in step up to a checkpoint before the first's loop compacts, then in batches.
    for cp_one, cp_two in zip(first[:start], second[:start], strict=True):
        saved, _ = queue.write_many([(one, cp_one), (two, cp_two), (lost, cp_one)], (), 60)
        assert saved == [False, False, False]
    _take_over(queue_url, lost)
    compacting = 0
    for k in range(start, start + 5):
        encoded.clear()
        endings = [Ending(ended, "finished")] if k == start + 2 else []
        saved, done = queue.write_many([(one, first[k]), (two, second[k]), (lost, first[k])], endings, 60)
        assert saved[:2] == [False, False] and isinstance(saved[2], LeaseLostError), saved
        assert done == [None] * len(endings)
        compacts = [cps[k].compacted != cps[k - 1].compacted for cps in (first, second)]
        assert [e.recount is not None for e in encoded[:2]] == compacts, k
        if k == start:
            assert encoded[2].recount is not None  # (the refused one too: a compacting delta)
        compacting += all(compacts)
        assert queue.checkpoint("one") == first[k]
        assert queue.checkpoint("two") == second[k]
        assert queue.checkpoint("lost") == first[start - 1]  # refused: nothing written for it
    assert queue.status("ended").status == "finished"
    assert compacting >= 2


def _take_over(url: str, lease: Lease) -> None:
    """Let ``lease`` run out and another worker's claim take its run (its epoch goes up); its
    holder is not told, as a holder paused past its lease is not."""
    expire_lease(url, lease.run_id)
    with open_queue(url) as thief:
        again = thief.claim("thief", {"w": thief.status(lease.run_id).fingerprint}, 60)
    assert again is not None and again.run_id == lease.run_id


def _first_compacting(cps: list[WorkflowCheckpoint]) -> int:
    return next(k for k in range(1, len(cps)) if cps[k].compacted != cps[k - 1].compacted)


def test_a_compacting_save_under_a_lost_lease_writes_nothing(
        queue_url: str, encoded: list[EncodedCheckpoint]) -> None:
    with open_queue(queue_url) as holder:
        lease = _claimed(holder, "r")
        cps = _checkpoints(6)
        k = _first_compacting(cps)
        for cp in cps[:k]:
            holder.save(lease, cp, 60)
        rows = _stored_rows(holder, "r")
        _take_over(queue_url, lease)
        with pytest.raises(LeaseLostError):
            holder.save(lease, cps[k], 60)
        assert encoded[-1].recount is not None and encoded[-1].gone  # (refused: a compacting delta)
        assert holder.checkpoint("r") == cps[k - 1]
        assert _stored_rows(holder, "r") == rows


# -- a worker SIGKILLed in the middle of a compacting save -------------------------

CHILD = '''
import json, os, sys, time
from pathlib import Path
from ekit_runtime.queue import open_queue
from ekit_runtime.queue.sqlite import SqliteQueue
from tests.queue.test_queue_a_compacting_loop_saves_in_deltas import _workflow

url, folder, stop_at = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
queue = open_queue(url)
lease = queue.claim("victim", {"w": None}, 600)
compacting = [0]
real_header = SqliteQueue._write_header


def held(conn, run_id, header):
    real_header(conn, run_id, header)  # (inside the save's transaction: not committed)
    if compacting[0] == stop_at:
        (folder / "mid").write_text("x")
        time.sleep(600)


SqliteQueue._write_header = staticmethod(held)
previous = [None]


def save(cp):
    if previous[0] is not None and cp.compacted != previous[0].compacted:
        compacting[0] += 1
        if compacting[0] == stop_at and queue.backend == "postgres":
            (folder / "ready").write_text("x")
            while not (folder / "go").exists():
                time.sleep(0.01)
    with open(folder / "saving.jsonl", "a") as f:
        f.write(json.dumps(cp.to_dict()) + "\\n")
    queue.save(lease, cp, 600)
    previous[0] = cp


_workflow(12, 2, before=3).run_sync(checkpoint_fn=save)
'''


def _child(tmp_path: Path, url: str, stop_at: int) -> subprocess.Popen[str]:
    (tmp_path / "child.py").write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, str(tmp_path / "child.py"), url, str(tmp_path), str(stop_at)],
                            cwd=ROOT, env=env, stderr=open(tmp_path / "stderr", "w"), text=True)


@pytest.mark.timeout(120)
def test_a_worker_killed_mid_compacting_save_leaves_the_checkpoint_before(
        queue_url: str, tmp_path: Path) -> None:
    q = open_queue(queue_url)
    q.submit("w", run_id="r")
    child = _child(tmp_path, queue_url, stop_at=4)
    try:
        if q.backend == "sqlite":
            # The child stops inside its save's transaction, after the header and deletes.
            wait_for(lambda: (tmp_path / "mid").exists(), timeout=60, what="the save to be half made")
            child.send_signal(signal.SIGKILL)
        else:
            _kill_mid_statement(queue_url, child, tmp_path)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    sent = [WorkflowCheckpoint.from_dict(json.loads(line))
            for line in (tmp_path / "saving.jsonl").read_text().splitlines()]
    assert sent[-1].compacted != sent[-2].compacted  # (the save killed was a compacting one)
    assert q.checkpoint("r") == sent[-2]
    assert _stored_rows(q, "r") == len(sent[-2].outputs) + len(sent[-2].step_usage) + sum(
        1 for n in sent[-2].durations if n not in sent[-2].step_usage)
    q.close()


def _kill_mid_statement(url: str, child: subprocess.Popen[str], tmp_path: Path) -> None:
    """PostgreSQL: hold the rows the child's save deletes, so that its one statement stops
    inside; kill the child and end its session, as a server does with a client gone."""
    import psycopg

    wait_for(lambda: (tmp_path / "ready").exists(), timeout=60, what="the compacting save")
    with psycopg.connect(url) as holder, psycopg.connect(url, autocommit=True) as admin:
        holder.execute("SELECT 1 FROM ekit_queue_entries WHERE run_id = 'r' FOR UPDATE").fetchall()
        (tmp_path / "go").write_text("x")

        def blocked() -> int | None:
            row = admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE '%%ekit_queue_entries%%' AND pid <> pg_backend_pid()").fetchone()
            return None if row is None else int(row[0])

        wait_for(lambda: blocked() is not None, timeout=60, what="the save to wait inside its statement")
        pid = blocked()
        child.send_signal(signal.SIGKILL)
        child.wait()
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and admin.execute(
                "SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone() is not None:
            time.sleep(0.05)
        holder.rollback()
