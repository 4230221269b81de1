"""Crash tests: a child saving through a store after every step is SIGKILLed at random.

After every kill the store must load, hold only outputs equal to the
uninterrupted run's (and never fewer than before), and once the run finishes
no step recorded in any checkpoint loaded after a kill may have started
again. Kill delays come from a seeded generator; they are the point of the
test, never a synchronisation (the parent waits for the child's ``ready``
line before timing the kill).

Random kills only sometimes land inside a journal append, so for the journal
some children are also told to ``tear``: they SIGKILL themselves halfway
through an append (see crash_child.py). Each of those must leave a torn tail
that ``load()`` reports and ignores and that the next run's first append cuts
off, so the torn-tail path is exercised on every run of the test, not by luck.

Every child also takes the store's write lock at its first save and is
killed holding it, at any moment of a save: the next child's saves succeed
only because the OS dropped the dead child's lock, so each run is a test of
takeover after SIGKILL too (see test_stores_writers.py for the lock itself).
"""

from __future__ import annotations

import importlib.util
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

SUPPORT = Path(__file__).resolve().parents[1] / "support"
CHILD = SUPPORT / "crash_child.py"
_spec = importlib.util.spec_from_file_location("ekit_crash_child", CHILD)
assert _spec is not None and _spec.loader is not None
child = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(child)

KILLS_PER_STORE = 50
WORKERS = 2
MAX_DELAY = 0.03
# The share of journal children that tear an append instead of being killed.
TEAR_SHARE = 0.3
SUFFIX = {"json": "cp.json", "journal": "cp.jsonl", "sqlite": "cp.db"}

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")


def _load(kind: str, path: Path) -> tuple[Any, int]:
    store = child.make_store(kind, str(path))
    try:
        checkpoint = store.load()
        return checkpoint, getattr(store, "torn_tail", 0)
    finally:
        if hasattr(store, "close"):
            store.close()


def _one_run(kind: str, folder: Path, rng: random.Random, stats: dict[str, int]) -> None:
    """Kill and resume one run until it finishes; check the invariants after every kill."""
    path, log = folder / SUFFIX[kind], folder / "starts.log"
    expected = child.expected_outputs()
    recorded: dict[str, Any] = {}
    # (byte offset in the start log, steps recorded then): any start after the
    # offset must not be one of those steps.
    marks: list[tuple[int, frozenset[str]]] = []
    # Kills in a row that found nothing new recorded: each widens the window the
    # next kill falls in (doubling, up to 64 times), so that a loaded machine,
    # on which a child takes longer than MAX_DELAY to record its first step,
    # still gets through the run, its kills still at random moments.
    stalled = 0
    for spawn in range(400):
        tear = kind == "journal" and rng.random() < TEAR_SHARE
        argv = [sys.executable, str(CHILD), kind, str(path), str(log), str(rng.randrange(2**32))]
        proc = subprocess.Popen(
            [*argv, "tear"] if tear else argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        if ready == b"ready\n" and not tear:
            time.sleep(rng.random() * MAX_DELAY * 2 ** min(stalled, 6))
            proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, err.decode(errors="replace")
        stats["kills"] += 1
        checkpoint, torn = _load(kind, path)  # must not raise, whatever the kill cut short
        stats["torn"] += bool(torn)
        if tear:
            # The child died mid-append, by its own hand: the tail is torn for sure.
            assert torn > 0, f"kill {spawn}: a torn append was not reported"
            stats["tears"] += 1
        outputs = dict(checkpoint.outputs) if checkpoint is not None else {}
        for name, value in recorded.items():
            assert outputs.get(name) == value, f"kill {spawn}: recorded output of {name} lost"
        for name, value in outputs.items():
            assert value == expected[name], f"kill {spawn}: wrong output for {name}"
        assert checkpoint is None or checkpoint.step_index == len(outputs)
        stalled = stalled + 1 if len(outputs) == len(recorded) and not tear else 0
        recorded = outputs
        marks.append((log.stat().st_size if log.exists() else 0, frozenset(outputs)))
    else:
        pytest.fail("the run never finished")
    final, torn = _load(kind, path)
    # The finished run's saves cut off every torn tail that earlier kills left.
    assert torn == 0
    assert final is not None and dict(final.outputs) == expected
    assert final.step_index == len(child.GRAPH)
    starts = log.read_bytes()
    offset, mark, done = 0, 0, frozenset[str]()
    for line in starts.splitlines(keepends=True):
        while mark < len(marks) and marks[mark][0] <= offset:
            done = marks[mark][1]
            mark += 1
        name = line.decode().strip()
        assert name not in done, f"{name} started again after its output was recorded"
        offset += len(line)
    assert set(starts.decode().split()) == set(child.GRAPH)


def _worker(kind: str, folder: Path, worker: int, kills: int) -> dict[str, int]:
    """Independent runs, one after another, until ``kills`` kills have landed."""
    rng = random.Random(f"ekit-crash-{kind}-{worker}")
    stats = {"kills": 0, "torn": 0, "tears": 0, "runs": 0}
    while stats["kills"] < kills:
        run = folder / f"worker{worker}-run{stats['runs']}"
        run.mkdir(parents=True)
        _one_run(kind, run, rng, stats)
        stats["runs"] += 1
    return stats


# Fifty real processes killed per store: slower than the suite's 20 s default
# on a loaded 2-core machine, yet a hang still fails within minutes.
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", child.KINDS)
def test_sigkill_at_random_moments(kind: str, tmp_path: Path) -> None:
    # Independent runs side by side: a child spends most of its life starting
    # Python, so two at a time keep a 2-core machine busy.
    began = time.perf_counter()
    share = -(-KILLS_PER_STORE // WORKERS)
    with ThreadPoolExecutor(WORKERS) as pool:
        done = list(pool.map(lambda w: _worker(kind, tmp_path, w, share), range(WORKERS)))
    took = time.perf_counter() - began
    total = {key: sum(d[key] for d in done) for key in done[0]}
    print(
        f"\n{kind}: {total['kills']} SIGKILLs over {total['runs']} runs, "
        f"{total['torn']} torn tails seen ({total['tears']} from torn appends), {took:.1f}s"
    )
    assert total["kills"] >= KILLS_PER_STORE
    if kind == "journal":
        assert total["tears"] >= KILLS_PER_STORE * TEAR_SHARE / 2
        assert total["torn"] >= total["tears"]
