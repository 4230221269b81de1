"""The queue under real process failures, on SQLite and PostgreSQL.

Worker processes (tests/support/queue_worker_child.py) drain the queue while the
test SIGKILLs one, SIGSTOPs another past its lease, or cancels a run one of
them is driving. Step starts and finishes are counted through side files
the children append to, and the fleet's live leases are sampled from the
database while they work.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from ekit_runtime.queue import Limits, open_queue
from tests.support.queue_backends import (
    audit_stale_writes,
    entry_epochs,
    live_leases,
    pause_outside_writes,
    queue_url,
    stale_writes,
    wait_for,
)
from tests.support.worker_fleet import Fleet

__all__ = ["queue_url"]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fleet(queue_url: str, tmp_path: Path) -> object:
    logs = tmp_path / "logs"
    logs.mkdir()
    f = Fleet(queue_url, logs)
    yield f
    f.close()


class Sampler(threading.Thread):
    """Samples the fleet's live leases every few milliseconds until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.samples, self.done = url, [], threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append(live_leases(self.url))
            self.done.wait(0.005)


@pytest.mark.timeout(150)
def test_three_workers_drain_forty_runs_through_a_sigkill(queue_url: str, fleet: Fleet) -> None:
    cap = 4
    q = open_queue(queue_url, limits=Limits(max_in_flight=cap))
    ids = [q.submit("crash", {"delay": 0.03}, run_id=f"run-{i:02d}") for i in range(40)]
    sampler = Sampler(queue_url)
    sampler.start()
    # The victim's attempts after its sixth wait forever: once one does (a
    # file says so), it is mid-run, however loaded the machine.
    victim = fleet.start(max_runs=2, hold_after=6)

    def victim_runs_in_flight() -> set[str]:
        mine = [ln for ln in fleet.lines("steps") if ln[-1] == str(victim.pid)]
        done = {ln[1] for ln in fleet.lines("finish") if ln[0] == "finishing" and ln[-1] == str(victim.pid)}
        return {ln[1] for ln in mine} - done

    wait_for(lambda: fleet.lines("held"), timeout=60, what="the victim to be mid-run")
    others = [fleet.start(max_runs=2) for _ in range(2)]
    # Killed while the others work. (Not each of them: with the victim's two
    # leases, the cap leaves room for two runs, which one worker may take.)
    pids = {str(p.pid) for p in others}
    wait_for(
        lambda: any(ln[-1] in pids for ln in fleet.lines("steps")),
        timeout=60,
        what="the other workers to start steps",
    )
    victim.kill()
    victim.wait()
    recorded = {(r, s) for r in ids for s in (q.checkpoint(r) or _empty()).outputs}
    in_flight_at_kill = victim_runs_in_flight()
    wait_for(lambda: len(q.runs("finished")) == 40, timeout=90, what="all 40 runs to finish")
    sampler.done.set()
    sampler.join()

    finished = Counter(ln[1] for ln in fleet.lines("finish") if ln[0] == "finished")
    finishing = Counter(ln[1] for ln in fleet.lines("finish") if ln[0] == "finishing")
    for r in ids:
        # Exactly one commit of "finished" per run; the only one that may lack
        # its after-commit line is the victim's, killed right after committing.
        assert finished[r] == 1 or (finished[r] == 0 and finishing[r] == 1), r
        assert finishing[r] == 1, f"{r} was finished {finishing[r]} times"
    starts = Counter((ln[1], ln[2]) for ln in fleet.lines("steps") if ln[0] == "start")
    assert recorded and all(starts[pair] == 1 for pair in recorded), "a recorded step ran again"
    for r in ids:
        assert set(q.result(r).outputs) == {"a", "b", "c"}  # type: ignore[union-attr]
    # The victim's unfinished runs were taken over: a later epoch finished them.
    assert in_flight_at_kill and all(q.status(r).epoch >= 2 for r in in_flight_at_kill)
    assert max(sampler.samples) <= cap, f"fleet cap exceeded: {max(sampler.samples)} live leases"
    assert max(sampler.samples) >= 2 and len(sampler.samples) > 50
    q.close()


def _empty():  # type: ignore[no-untyped-def]
    from ekit_runtime import WorkflowCheckpoint

    return WorkflowCheckpoint(0, {})  # type: ignore[arg-type]


@pytest.mark.timeout(150)
def test_a_paused_worker_is_fenced_out_after_a_takeover(queue_url: str, fleet: Fleet) -> None:
    q = open_queue(queue_url)
    audit_stale_writes(queue_url)  # (a zombie's write that a later one overwrites is caught too)
    # b takes long enough for the test to pause the first worker inside it,
    # after a's save and before b's, even on a loaded machine.
    run = q.submit("slow", {"b_delay": 3.0}, run_id="zombie")
    # max_runs=1: busy with its one run, it makes no claims; its only writes
    # are then saves and renewals.
    zombie = fleet.start(lease=1.0, heartbeat=0.2, max_runs=1)

    def started(step: str, pid: int) -> bool:
        return any(ln[:3] == ["start", run, step] and ln[-1] == str(pid) for ln in fleet.lines("steps"))

    # The runner starts b before it saves a, so "b started" alone does not mean
    # a is stored: the save may not have begun, or be half done in its transaction.
    wait_for(
        lambda: started("b", zombie.pid) and entry_epochs(queue_url, run) == {"a": 1},
        timeout=20,
        what="the first worker to save a and start b",
    )
    tries = pause_outside_writes(zombie.pid, queue_url)
    if queue_url.startswith("postgresql://"):
        # Every write a holder makes on PostgreSQL is one statement: a paused
        # holder never sits inside a transaction, so the first SIGSTOP is good.
        assert tries == 1
    assert entry_epochs(queue_url, run) == {"a": 1}, "b was saved before the pause"
    wait_for(lambda: live_leases(queue_url) == 0, timeout=10, what="the paused worker's lease to expire")
    taker = fleet.start(lease=1.0, heartbeat=0.2)
    wait_for(lambda: started("b", taker.pid), timeout=30, what="the taker to start b")
    os.kill(zombie.pid, signal.SIGCONT)
    wait_for(
        lambda: "was lost" in fleet.stderr(0), timeout=30, what="the paused worker to see its lease lost"
    )
    wait_for(lambda: q.status(run).status == "finished", timeout=30, what="the taker to finish the run")

    result = q.result(run)
    assert result is not None
    assert dict(result.outputs) == {"a": f"a@{zombie.pid}", "b": f"b@{taker.pid}", "c": f"c@{taker.pid}"}
    # Nothing the paused worker did after its lease was lost was saved: b and c bear the taker's
    # epoch; a, made and saved by the paused worker while its lease was live, as its value says,
    # keeps its epoch (the taker's first save appends its drive as a row, not the run again).
    assert entry_epochs(queue_url, run) == {"a": 1, "b": 2, "c": 2}
    assert q.status(run).epoch == 2
    finished = [ln for ln in fleet.lines("finish") if ln[0] == "finished"]
    assert finished == [["finished", run, str(taker.pid)]]
    starts = Counter((ln[2], ln[-1]) for ln in fleet.lines("steps") if ln[0] == "start")
    zombie_starts = {step for step, pid in starts if pid == str(zombie.pid)}
    # a was recorded before the pause: it never ran again. After SIGCONT the
    # zombie may have begun c (the runner starts the next step before it
    # saves), but its save was refused and nothing of it was stored.
    assert starts[("a", str(zombie.pid))] == 1 and starts[("a", str(taker.pid))] == 0
    assert {"a", "b"} <= zombie_starts <= {"a", "b", "c"}
    assert starts[("b", str(taker.pid))] == 1 and starts[("c", str(taker.pid))] == 1
    assert zombie.poll() is None  # it lives on, driving nothing
    assert stale_writes(queue_url) == []  # no write under epoch 1 once epoch 2 was granted
    q.close()


@pytest.mark.timeout(150)
def test_cancel_reaches_a_run_on_another_worker_within_one_heartbeat(queue_url: str, fleet: Fleet) -> None:
    heartbeat = 0.5
    q = open_queue(queue_url)
    run = q.submit("slow", {"b_delay": 60})
    worker = fleet.start(lease=3.0, heartbeat=heartbeat)
    wait_for(
        lambda: any(ln[:3] == ["start", run, "b"] for ln in fleet.lines("steps")),
        timeout=20,
        what="b to start",
    )
    asked = time.monotonic()
    assert q.cancel(run) is True
    wait_for(lambda: q.status(run).status == "cancelled", timeout=10, what="the cancel", interval=0.01)
    elapsed = time.monotonic() - asked
    assert elapsed < heartbeat + 0.4, f"cancel took {elapsed:.2f}s with a {heartbeat}s heartbeat"
    checkpoint = q.checkpoint(run)
    assert checkpoint is not None and dict(checkpoint.outputs) == {"a": f"a@{worker.pid}"}
    assert q.cancel(run) is False
    assert worker.poll() is None
    q.close()
