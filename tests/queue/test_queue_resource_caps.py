"""A cap on concurrent attempts per named resource holds across the fleet, and a dead holder's slots return.

``Step(..., resource="api")`` and ``Limits(resources={"api": N})``: at most N
attempts of the steps tagged ``api`` are inside their step at once, across
every worker process, on SQLite and on the real PostgreSQL server. A slot
counts only while its run's lease at the slot's epoch is live, so the slots
of a SIGKILLed worker come back once its lease expires, with no cleanup.

The worker processes (tests/support/resource_worker_child.py) keep a ledger of the
attempts inside a tagged step, under a file lock, which drops the entries of
processes that are gone; the database's own count of held slots is sampled
meanwhile. Waits are on conditions, never sleeps.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ekit_runtime import Step, Workflow
from ekit_runtime.queue import LeaseLostError, Limits, RunQueue, Worker, open_queue
from ekit_runtime.queue.lifecycle import fenced, slot_free, slot_held
from tests.support.queue_backends import queue, queue_url, wait_for

__all__ = ["queue", "queue_url"]

ROOT = Path(__file__).resolve().parents[2]

# -- the rule, as values --------------------------------------------------------


@given(
    slot_epoch=st.integers(0, 5),
    epoch=st.integers(0, 5),
    status=st.sampled_from(["queued", "running", "finished", "failed", "cancelled"]),
    lease_until=st.none() | st.floats(0, 100),
    now=st.floats(0, 100),
)
def test_a_slot_counts_exactly_while_the_lease_it_was_taken_under_is_live(
    slot_epoch: int, epoch: int, status: str, lease_until: float | None, now: float
) -> None:
    held = slot_held(slot_epoch, status, epoch, lease_until, now)
    assert held == fenced(status, epoch, lease_until, slot_epoch, now)
    # Spelled out: the run is running, at the slot's epoch, and the lease is unexpired.
    live = lease_until is not None and lease_until > now
    assert held == (status == "running" and epoch == slot_epoch and live)
    if held:
        # Once it stops counting it never counts again: a later clock, or a later epoch.
        assert not slot_held(slot_epoch, status, epoch + 1, lease_until, now)
        assert lease_until is not None and not slot_held(slot_epoch, status, epoch, lease_until, lease_until)


@given(cap=st.none() | st.integers(1, 20), held=st.integers(0, 30))
def test_a_slot_is_free_below_the_cap_and_always_without_one(cap: int | None, held: int) -> None:
    assert slot_free(cap, held) == (cap is None or held < cap)


def test_a_step_names_its_resource_with_a_value_error_naming_the_step() -> None:
    assert Step("a", lambda c: 1).resource is None
    assert Step("a", lambda c: 1, resource="openai").resource == "openai"
    for bad in ("", "x" * 201, "a\x00b", "\udc80", 3, b"openai"):
        with pytest.raises(ValueError, match=r"step 'call': resource (must|holds)"):
            Step("call", lambda c: 1, resource=bad)  # type: ignore[arg-type]


def test_a_resource_tag_changes_no_fingerprint() -> None:
    plain = Workflow([Step("a", lambda c: 1)])
    tagged = Workflow([Step("a", lambda c: 1, resource="openai")])
    assert plain.graph.fingerprint == tagged.graph.fingerprint


def test_a_plain_run_ignores_the_resource() -> None:
    result = Workflow([Step("a", lambda c: "x", resource="openai")]).run_sync()
    assert result.outputs == {"a": "x"}


def test_limits_check_each_resource_cap_naming_the_resource() -> None:
    limits = Limits(resources={"openai": 4, "anthropic": 2})
    assert dict(limits.resources) == {"anthropic": 2, "openai": 4}
    assert Limits.from_dict(limits.to_dict()) == limits
    assert Limits.from_dict({}) == Limits() and not Limits().resources
    with pytest.raises(ValueError, match=r"Limits.resources\['openai'\] must be a positive int, got 0"):
        Limits(resources={"openai": 0})
    with pytest.raises(ValueError, match=r"Limits.resources\['openai'\] must be a positive int, got True"):
        Limits(resources={"openai": True})
    with pytest.raises(ValueError, match=r"Limits\.resources: a resource name must not contain a NUL"):
        Limits(resources={"a\x00": 1})
    with pytest.raises(ValueError, match=r"Limits\.resources must be a mapping"):
        Limits(resources=[("openai", 1)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="frozen"):
        limits.resources["openai"] = 9  # type: ignore[index]
    hash(limits)  # still a hashable value


# -- the backends: a slot's take, its release and when it stops counting --------


def _leases(q: RunQueue, n: int, lease_seconds: float = 30.0) -> list[Any]:
    for i in range(n):
        q.submit("w", run_id=f"r{i}")
    leases = [q.claim("me", {"w": None}, lease_seconds) for _ in range(n)]
    assert all(lease is not None for lease in leases)
    return leases


def test_a_take_succeeds_only_below_the_cap_and_a_release_frees_the_slot(queue: RunQueue) -> None:
    queue.set_limits(Limits(resources={"api": 2}))
    a, b, c = _leases(queue, 3)
    assert queue.acquire_slot(a, "api", "r0/s/1") and queue.acquire_slot(b, "api", "r1/s/1")
    assert not queue.acquire_slot(c, "api", "r2/s/1")
    assert queue.slots_held() == {"api": 2}
    assert queue.acquire_slot(c, "other", "r2/t/1")  # a resource with no cap: always, but counted
    assert queue.slots_held() == {"api": 2, "other": 1}
    queue.release_slot(a, "api", "r0/s/1")
    assert queue.acquire_slot(c, "api", "r2/s/1")
    assert not queue.acquire_slot(a, "api", "r0/s/2")
    # An ended run's slots stop counting at once, with no release.
    queue.finish(b, "finished")
    assert queue.slots_held() == {"api": 1, "other": 1}
    assert queue.acquire_slot(a, "api", "r0/s/2")
    # A cap lowered below what is held: no new take until enough are given back.
    queue.set_limits(Limits(resources={"api": 1}))
    assert not queue.acquire_slot(c, "api", "r2/s/9")
    queue.release_slot(a, "api", "r0/s/2")
    assert not queue.acquire_slot(a, "api", "r0/s/3")
    queue.release_slot(c, "api", "r2/s/1")
    assert queue.acquire_slot(a, "api", "r0/s/3")


def test_a_take_is_fenced_and_a_lost_lease_takes_nothing(queue: RunQueue) -> None:
    queue.set_limits(Limits(resources={"api": 5}))
    (a,) = _leases(queue, 1)
    queue.release(a)
    with pytest.raises(LeaseLostError):
        queue.acquire_slot(a, "api", "r0/s/1")
    assert queue.slots_held() == {}


def test_a_slot_stops_counting_when_its_lease_expires_and_after_a_takeover(queue: RunQueue) -> None:
    queue.set_limits(Limits(resources={"api": 1}))
    (old,) = _leases(queue, 1, lease_seconds=0.3)
    assert queue.acquire_slot(old, "api", "r0/s/1")
    assert queue.slots_held() == {"api": 1}
    # The holder dies: nobody releases. The slot is free once its lease expired.
    wait_for(lambda: queue.slots_held() == {}, timeout=30, what="the dead holder's slot to stop counting")
    new = queue.claim("taker", {"w": None}, 30)
    assert new is not None and new.epoch == old.epoch + 1
    # The run is live again, at a later epoch: the old slot (same run, same
    # attempt key) does not count again.
    assert queue.slots_held() == {}
    assert queue.acquire_slot(new, "api", "r0/s/1")
    assert queue.slots_held() == {"api": 1}
    # The late holder's release names its own epoch: it cannot free the taker's slot.
    queue.release_slot(old, "api", "r0/s/1")
    assert queue.slots_held() == {"api": 1}
    queue.release_slot(new, "api", "r0/s/1")
    assert queue.slots_held() == {}


def test_a_slot_call_refuses_bad_arguments_before_the_database(queue: RunQueue) -> None:
    (a,) = _leases(queue, 1)
    with pytest.raises(ValueError, match="resource must be a non-empty string"):
        queue.acquire_slot(a, "", "r0/s/1")
    with pytest.raises(ValueError, match="resource must not contain a NUL"):
        queue.release_slot(a, "a\x00", "r0/s/1")
    with pytest.raises(ValueError, match="holder"):
        queue.acquire_slot(a, "api", "")
    with pytest.raises(ValueError, match="lease must be a Lease"):
        queue.acquire_slot("r0", "api", "r0/s/1")  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_concurrent_takers_never_share_the_last_slot(queue_url: str) -> None:
    """Eight connections race for a cap of 2, round after round: never more than 2 taken."""
    takers, rounds, cap = 8, 25, 2
    setup = open_queue(queue_url, limits=Limits(resources={"api": cap}))
    leases = _leases(setup, takers)
    queues = [open_queue(queue_url) for _ in range(takers)]
    barrier = threading.Barrier(takers + 1)
    taken: list[list[bool]] = [[] for _ in range(rounds)]
    errors: list[BaseException] = []

    def take(i: int) -> None:
        try:
            for r in range(rounds):
                barrier.wait(timeout=60)
                taken[r].append(queues[i].acquire_slot(leases[i], "api", f"r{i}/s/{r}"))
                barrier.wait(timeout=60)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=take, args=(i,)) for i in range(takers)]
    for t in threads:
        t.start()
    try:
        for r in range(rounds):
            barrier.wait(timeout=60)  # go
            barrier.wait(timeout=60)  # all took or were refused
            assert setup.slots_held() == {"api": cap}
            assert sum(taken[r]) == cap, f"round {r}: {sum(taken[r])} takers got a slot of a cap of {cap}"
            for i, lease in enumerate(leases):
                setup.release_slot(lease, "api", f"r{i}/s/{r}")
    finally:
        for t in threads:
            t.join(timeout=60)
        for q in (*queues, setup):
            q.close()
    assert not errors, errors


# -- one worker in this process: what ends an attempt gives its slot back ------------


def test_a_worker_gives_slots_back_when_attempts_end_and_when_a_waiting_run_is_cancelled(
    queue: RunQueue,
) -> None:
    """Cap 1: one run's tagged attempt holds the slot; the other run waits, then is cancelled."""
    queue.set_limits(Limits(resources={"api": 1}))
    inside, go = threading.Event(), threading.Event()
    seen: list[dict[str, int]] = []

    def call(ctx: Any) -> str:  # a sync step, in a thread: its release comes from the loop
        inside.set()
        go.wait(60)
        return "called"

    wf = Workflow([Step("call", call, resource="api"), Step("after", lambda ctx: "ok", ("call",))])
    worker = Worker(queue, {"w": wf}, max_runs=2, lease_seconds=5, heartbeat=0.1, poll=0.01)

    async def main() -> None:
        first = queue.submit("w", run_id="first")
        task = asyncio.ensure_future(worker.run_until_idle())
        await asyncio.to_thread(inside.wait, 60)
        second = queue.submit("w", run_id="second")
        await asyncio.to_thread(
            wait_for, lambda: queue.status(second).status == "running", timeout=30, what="a claim"
        )
        seen.append(queue.slots_held())
        queue.cancel(second)  # seen at the next heartbeat: the waiting attempt never starts
        await asyncio.to_thread(
            wait_for, lambda: queue.status(second).status == "cancelled", timeout=30, what="the cancel"
        )
        seen.append(queue.slots_held())
        go.set()
        await asyncio.wait_for(task, 60)
        assert queue.status(first).status == "finished"

    asyncio.run(main())
    assert seen == [{"api": 1}, {"api": 1}]
    assert queue.slots_held() == {} and _slot_rows(queue) == 0
    assert worker.outcomes == {"first": "finished", "second": "cancelled"}
    result = queue.result("first")
    assert result is not None and dict(result.outputs) == {"call": "called", "after": "ok"}


def test_a_stopped_worker_gives_back_the_slots_its_attempts_held(queue: RunQueue) -> None:
    queue.set_limits(Limits(resources={"api": 5}))
    entered: list[str] = []
    all_in = asyncio.Event()

    async def call(ctx: Any) -> None:
        entered.append("x")
        if len(entered) == 3:
            all_in.set()
        await asyncio.Event().wait()

    wf = Workflow([Step(n, call, resource="api") for n in ("a", "b", "c")])
    worker = Worker(queue, {"w": wf}, max_runs=1, lease_seconds=30, poll=0.01)

    async def main() -> None:
        queue.submit("w", run_id="r")
        task = asyncio.ensure_future(worker.run())
        await asyncio.wait_for(all_in.wait(), 60)
        assert queue.slots_held() == {"api": 3}
        worker.stop()
        await asyncio.wait_for(task, 60)

    asyncio.run(main())
    assert queue.slots_held() == {}
    assert worker.outcomes == {"r": "released"} and queue.status("r").status == "queued"
    assert _slot_rows(queue) == 0  # given back, not only left to stop counting


def _slot_rows(queue: RunQueue) -> int:
    """How many slot rows the queue's table holds, counting or not."""
    sql = "SELECT count(*) FROM ekit_queue_slots"
    if queue.backend == "sqlite":
        return int(queue.conn.execute(sql).fetchone()[0])  # type: ignore[attr-defined]
    row = queue.db.run(lambda c: c.execute(sql).fetchone())  # type: ignore[attr-defined]
    return int(row[0])


def test_an_attempt_that_took_a_slot_but_never_starts_gives_it_back(queue: RunQueue) -> None:
    """The slot is taken before the lease check: an attempt cancelled in between gives it back."""
    from concurrent.futures import ThreadPoolExecutor

    from ekit_runtime.attempt import Attempt
    from ekit_runtime.queue.worker import _Drive

    queue.set_limits(Limits(resources={"api": 1}))
    step = Step("call", lambda ctx: "x", resource="api")
    worker = Worker(queue, {"w": Workflow([step])}, lease_seconds=30)
    (lease,) = _leases(queue, 1)

    async def main() -> None:
        worker._executor = ThreadPoolExecutor(1)
        drive = _Drive(lease, time.monotonic() + 30)
        drive.saves = 1  # a save handed over and not done: the attempt waits for it
        drive.saved.clear()
        admit = asyncio.ensure_future(worker._admit(drive, None, Attempt(step, {}, 1, lease.run_id)))
        await asyncio.to_thread(
            wait_for, lambda: queue.slots_held() == {"api": 1}, timeout=30, what="the slot to be taken"
        )
        assert not admit.done()
        admit.cancel()  # the run is cancelled before the attempt starts
        with pytest.raises(asyncio.CancelledError):
            await admit
        worker._executor.shutdown(wait=True)

    asyncio.run(main())
    assert queue.slots_held() == {} and _slot_rows(queue) == 0


# -- real worker processes --------------------------------------------------------


class Fleet:
    """Worker processes of one test (tests/support/resource_worker_child.py), SIGKILLed at teardown."""

    def __init__(self, url: str, folder: Path) -> None:
        self.url, self.folder = url, folder
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, *, max_runs: int = 2, hold: bool = False, lease: float = 1.0) -> subprocess.Popen[str]:
        argv = [sys.executable, "-m", "tests.support.resource_worker_child", self.url, str(self.folder)]
        argv += ["--max-runs", str(max_runs), "--lease", str(lease), "--heartbeat", str(lease / 5)]
        if hold:
            argv.append("--hold")
        with open(self.folder / f"stderr-{len(self.procs)}", "w") as stderr:
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        self.procs.append(proc)
        return proc

    def ledger(self) -> dict[str, Any]:
        try:
            return dict(json.loads((self.folder / "ledger.json").read_text()))
        except FileNotFoundError:
            return {"inside": [], "max": 0, "entries": [], "exits": []}

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture
def fleet(queue_url: str, tmp_path: Path) -> Any:
    folder = tmp_path / "fleet"
    folder.mkdir()
    f = Fleet(queue_url, folder)
    yield f
    f.close()


class HeldSampler(threading.Thread):
    """Samples the database's count of held slots of ``api`` every few milliseconds."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.queue = open_queue(url)
        self.samples: list[int] = []
        self.done = threading.Event()

    def run(self) -> None:
        try:
            while not self.done.is_set():
                self.samples.append(self.queue.slots_held().get("api", 0))
                self.done.wait(0.005)
        finally:
            self.queue.close()

    def stop(self) -> list[int]:
        self.done.set()
        if self.is_alive():
            self.join(timeout=30)
        return self.samples


@pytest.fixture
def sampler(queue_url: str) -> Any:
    """A started :class:`HeldSampler`, stopped at teardown (before the database goes)."""
    s = HeldSampler(queue_url)
    s.start()
    yield s
    s.stop()


def _submit(url: str, n: int, cap: int, delay: float, meet: int = 0) -> RunQueue:
    """``n`` runs of ``fan``; none ends before ``meet`` worker processes drive runs (see the child)."""
    q = open_queue(url, limits=Limits(resources={"api": cap}))
    for i in range(n):
        q.submit("fan", {"delay": delay, "meet": meet}, run_id=f"run-{i:02d}")
    return q


@pytest.mark.timeout(180)
def test_three_workers_never_exceed_the_cap_and_reach_it(
    queue_url: str, fleet: Fleet, sampler: HeldSampler
) -> None:
    cap, runs = 3, 12
    # The first worker to start would drive every run alone on a loaded machine, before the
    # others are up: no run ends until two processes drive runs, so the work is shared.
    q = _submit(queue_url, runs, cap, delay=0.1, meet=2)
    for _ in range(3):
        fleet.start(max_runs=2)  # up to 3 x 2 x 3 = 18 tagged attempts wanting a slot at once
    wait_for(lambda: len(q.runs("finished")) == runs, timeout=150, what=f"all {runs} runs to finish")
    held = sampler.stop()
    ledger = fleet.ledger()
    assert len(ledger["entries"]) == 3 * runs and not ledger["inside"]
    assert ledger["max"] == cap, f"{ledger['max']} tagged attempts were inside at once (cap {cap})"
    assert max(held) <= cap and cap in held, max(held)
    assert q.slots_held() == {}  # every slot given back
    assert len({e[2] for e in ledger["entries"]}) >= 2  # the work was shared
    q.close()


@pytest.mark.timeout(180)
def test_a_cap_of_one_serialises_the_tagged_attempts(queue_url: str, fleet: Fleet) -> None:
    runs = 5
    q = _submit(queue_url, runs, 1, delay=0.02)
    for _ in range(2):
        fleet.start(max_runs=2)
    wait_for(lambda: len(q.runs("finished")) == runs, timeout=150, what=f"all {runs} runs to finish")
    ledger = fleet.ledger()
    assert ledger["max"] == 1 and len(ledger["entries"]) == 3 * runs
    # The same seen on the clock: each attempt left before the next one entered.
    spans = sorted(
        (enter[0], next(x[0] for x in ledger["exits"] if x[1:] == enter[2:])) for enter in ledger["entries"]
    )
    assert all(left <= entered for (_, left), (entered, _) in itertools.pairwise(spans)), spans
    q.close()


@pytest.mark.timeout(240)
def test_a_sigkilled_holders_slots_come_back_once_its_lease_expires(
    queue_url: str, fleet: Fleet, sampler: HeldSampler
) -> None:
    cap, runs = 3, 10
    q = _submit(queue_url, runs, cap, delay=0.1)
    # The victim's tagged attempts stay inside forever: it takes every slot.
    victim = fleet.start(max_runs=2, hold=True)
    wait_for(lambda: len(fleet.ledger()["inside"]) == cap, timeout=60, what="the victim to hold every slot")
    assert q.slots_held() == {"api": cap}
    survivors = [fleet.start(max_runs=2) for _ in range(2)]
    wait_for(
        lambda: any(r.owner and r.owner.endswith(f":{survivors[1].pid}") for r in q.runs("running")),
        timeout=60,
        what="the survivors to drive runs (waiting for slots)",
    )
    victim.kill()
    victim.wait()
    killed_at = time.time()
    # When the victim's leases run out, on the database's clock (no renewal comes now).
    expiries = [r.lease_until for r in q.runs("running") if r.owner and r.owner.endswith(f":{victim.pid}")]
    assert expiries and all(e is not None for e in expiries)
    wait_for(lambda: len(q.runs("finished")) == runs, timeout=180, what=f"all {runs} runs to finish")
    held = sampler.stop()
    ledger = fleet.ledger()
    assert ledger["max"] == cap, f"{ledger['max']} tagged attempts were inside at once (cap {cap})"
    assert max(held) <= cap, f"the database counted {max(held)} held slots (cap {cap})"
    survivor_pids = {p.pid for p in survivors}
    theirs = [e for e in ledger["entries"] if e[2] in survivor_pids]
    # No survivor got in while the victim lived, nor before its first lease expired.
    first = min(e[0] for e in theirs)
    assert first > killed_at and first >= min(e for e in expiries if e is not None), (first, expiries)
    # The slots came back: the survivors alone filled the cap again.
    assert max(e[1] for e in theirs) == cap
    # The victim's runs were taken over at a later epoch and finished by the survivors.
    for info in q.runs("finished"):
        result = q.result(info.run_id)
        assert result is not None and set(result.outputs) == {"a", "b", "c", "free", "end"}
    assert any(info.epoch >= 2 for info in q.runs("finished"))
    assert q.slots_held() == {}
    q.close()
