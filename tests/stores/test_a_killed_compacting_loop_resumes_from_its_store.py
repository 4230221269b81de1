"""A process running a compacting loop (``keep_last``), SIGKILLed mid-save, resumes from its store.

A compacting save of the SQLite and PostgreSQL stores deletes the rows of the
iteration it lets go of, writes the header (its counts) and inserts the new
iteration's rows: one transaction. The child (tests/support/
compacting_kill_child.py) is killed at random moments, and (SQLite) inside
such a save after all of its writes but before its commit. After every kill
the store loads; what it holds is one of the checkpoints the run saved (each kept
output the uninterrupted run's, the iterations it counts never fewer than
before); no iteration a loaded checkpoint counts as done starts again; and
the run ends as an uninterrupted one does.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support import compacting_kill_child as child
from tests.support.queue_backends import fresh_postgres

KILLS = 12
MAX_DELAY = 0.05

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")


@contextmanager
def _where(kind: str, tmp_path: Path) -> Iterator[str]:
    if kind == "sqlite":
        yield str(tmp_path / "cp.db")
    else:
        with fresh_postgres() as url:
            yield url


def _load(kind: str, where: str, run_id: str) -> Any:
    store = child.make_store(kind, where, run_id)
    try:
        return store.load()
    finally:
        store.close()


def _done(checkpoint: Any) -> int:
    """How many iterations ``checkpoint`` counts as recorded: compacted, then kept in order."""
    if checkpoint is None:
        return 0
    count = checkpoint.compacted.get("agent", 0)
    while f"agent#{count + 1}" in checkpoint.outputs:
        count += 1
    return count


def _check(checkpoint: Any, before: int, spawn: int) -> int:
    done = _done(checkpoint)
    assert done >= before, f"kill {spawn}: {before} iterations were recorded, now {done}"
    if checkpoint is None:
        return done
    kept = {k: v for k, v in checkpoint.outputs.items() if k.startswith("agent#")}
    compacted = checkpoint.compacted.get("agent", 0)
    assert kept == {f"agent#{k}": child.output_of(k) for k in range(compacted + 1, done + 1)}, spawn
    assert len(kept) <= child.KEEP, f"kill {spawn}: {sorted(kept)} kept, keep_last={child.KEEP}"
    return done


def _one_run(kind: str, where: str, log: Path, rng: random.Random) -> tuple[int, int]:
    """Kill and resume one run until it finishes, checking the store after every kill."""
    run_id = f"compacting-{uuid.uuid4().hex}"
    kills = tears = done = stalled = 0
    marks: list[tuple[int, int]] = []  # (start log's size, iterations recorded then)
    for spawn in range(300):
        tear = kind == "sqlite" and spawn % 2 == 1
        argv = [sys.executable, "-m", "tests.support.compacting_kill_child", kind, where, run_id,
                str(log), str(rng.randrange(2**32)), *(["tear"] if tear else [])]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        if ready == b"ready\n" and not tear:
            # The kill's moment is the point of the test, never a synchronisation;
            # kills that found nothing new widen the window (a loaded machine).
            time.sleep(rng.random() * MAX_DELAY * 2 ** min(stalled, 5))
            proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, err.decode(errors="replace")
        kills += not tear
        tears += tear
        loaded = _load(kind, where, run_id)  # must load, whatever the kill cut short
        if loaded is not None:
            saved = Path(f"{log}.saves").read_text(encoding="utf-8").splitlines()
            assert child.line_of(loaded) in saved, f"kill {spawn}: the store holds no saved checkpoint"
        now = _check(loaded, done, spawn)
        stalled = stalled + 1 if now == done else 0
        done = now
        marks.append((log.stat().st_size if log.exists() else 0, done))
    else:
        pytest.fail("the run never finished")
    final = _load(kind, where, run_id)
    assert final.outputs["agent"] == child.output_of(child.ITERATIONS)
    assert dict(final.compacted) == {"agent": child.ITERATIONS - child.KEEP}
    # No iteration counted as done by a checkpoint loaded after a kill started again.
    offset, mark, counted = 0, 0, 0
    for line in log.read_bytes().splitlines(keepends=True):
        while mark < len(marks) and marks[mark][0] <= offset:
            counted = marks[mark][1]
            mark += 1
        number = int(line.decode().strip().split("#")[1])
        assert number > counted, f"iteration {number} started again after {counted} were recorded"
        offset += len(line)
    return kills, tears


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_a_compacting_loop_killed_at_random_moments_resumes_where_it_was(
        kind: str, tmp_path: Path) -> None:
    rng = random.Random(f"ekit-compacting-kill-{kind}")
    kills = tears = runs = 0
    with _where(kind, tmp_path) as where:
        while kills < KILLS:
            k, t = _one_run(kind, where, tmp_path / f"starts-{runs}.log", rng)
            kills, tears, runs = kills + k, tears + t, runs + 1
    assert kind != "sqlite" or tears >= KILLS // 2, tears
    print(f"\n{kind}: {kills} SIGKILLs at random moments and {tears} inside a compacting save "
          f"before its commit, over {runs} runs")
