"""A queued run's live stream, on SQLite and PostgreSQL: what readers rely on (docs/streams.md).

Runs are driven by real ``ekit worker`` processes where the order of what
they publish is the point; the fence, the cap and pruning are pinned on the
queue's own calls.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import Step, Workflow, partial
from ekit_runtime.queue import LeaseLostError, RunQueue, UnknownRunError, Worker, open_queue
from ekit_runtime.queue.streams import Published, StreamEvent
from tests.support.queue_backends import queue, queue_url
from tests.support.stream_workflows import tokens

__all__ = ["queue", "queue_url"]

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]


def worker_process(url: str, *more: str, lease: str = "10") -> subprocess.Popen[str]:
    """``ekit worker`` draining the queue until idle, serving tests/support/stream_workflows.py."""
    argv = [sys.executable, "-m", "ekit_runtime", "worker", "--queue", url, "--workflows",
            "tests.support.stream_workflows:WORKFLOWS", "--until-idle", "--lease", lease, "-q", *more]
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT))})


def finished(proc: subprocess.Popen[str]) -> str:
    """Wait for the worker to exit 0; its stderr (what it logged), for a failing assertion to show."""
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, (out, err)
    return err[-2000:]


def text_of(events: list[StreamEvent]) -> str:
    return "".join(e.data for e in events if e.kind == "partial")


def published(n: int, start: int = 0) -> list[Published]:
    return [Published("partial", "s", json.dumps(f"p{i}"), time.time()) for i in range(start, start + n)]


def test_ten_thousand_tokens_are_read_live_in_order_with_none_lost(queue: RunQueue, queue_url: str) -> None:
    run_id = queue.submit("talk", {"n": 10_000})
    proc = worker_process(queue_url)
    try:
        # Read as the worker publishes: the iterator waits for more until the run ends.
        events = list(queue.stream(run_id, poll=0.01))
    finally:
        finished(proc)
    kinds = [e.kind for e in events]
    assert kinds[:2] == ["claimed", "started"] and kinds[-2:] == ["finished", "end"], kinds[:3] + kinds[-3:]
    assert [e.data for e in events if e.kind == "partial"] == [f"t{i} " for i in range(10_000)]
    assert [e.offset for e in events[:-1]] == list(range(1, len(events)))  # numbered 1, 2, 3 ... no hole
    assert events[-1].data == {"status": "finished", "error": None}
    assert not {"gap", "dropped"} & set(kinds)


def test_a_generator_steps_text_costs_the_stream_linear_bytes_and_rebuilds_whole(
    queue: RunQueue, queue_url: str
) -> None:
    n = 3000
    run_id = queue.submit("grow", {"n": n})
    proc = worker_process(queue_url)
    try:
        events = list(queue.stream(run_id, poll=0.01))
    finally:
        finished(proc)
    texts = [e for e in events if e.kind in ("partial", "rewritten")]
    # Each event holds what its yield added: the bytes are the text's, not n times it (O(n), not O(n^2)).
    assert sum(len(e.data) for e in texts) == len(tokens(n)) + len("revised!")
    assert [e.kind for e in texts[-2:]] == ["rewritten", "partial"]
    text = ""
    for e in texts:
        text = e.data if e.kind == "rewritten" else text + e.data
        if e is texts[n - 1]:
            assert text == tokens(n)
    assert text == "revised!" == queue.checkpoint(run_id).outputs["grow"]


def test_a_reader_that_disconnects_anywhere_resumes_without_gap_or_repeat(
    queue: RunQueue, queue_url: str
) -> None:
    n = 3000
    run_id = queue.submit("talk", {"n": n})
    proc = worker_process(queue_url)
    rng = random.Random(47)
    seen: list[StreamEvent] = []
    resumes = 0
    try:
        while not seen or seen[-1].kind != "end":
            after = seen[-1].offset if seen else 0
            stop_after = rng.randint(1, 400)  # this connection drops after so many events
            for count, event in enumerate(queue.stream(run_id, after, poll=0.01), 1):
                seen.append(event)
                if count == stop_after:
                    break
            resumes += 1
    finally:
        finished(proc)
    assert resumes > 5
    assert text_of(seen) == tokens(n)
    stored = [e.offset for e in seen if e.kind != "end"]
    assert stored == list(range(1, len(stored) + 1))


def test_an_async_reader_waits_for_more_and_resumes_from_an_offset(queue: RunQueue, queue_url: str) -> None:
    run_id = queue.submit("talk", {"n": 500})
    proc = worker_process(queue_url)

    async def read(after: int, most: int | None) -> list[StreamEvent]:
        got: list[StreamEvent] = []
        async for event in queue.astream(run_id, after, poll=0.01):
            got.append(event)
            if most is not None and len(got) == most:
                break
        return got

    logged = ""
    try:
        first = asyncio.run(read(0, 123))
        rest = asyncio.run(read(first[-1].offset, None))
    finally:
        logged = finished(proc)
    # (Seen once at load 11 with every partial missing: what was read, and what the worker logged.)
    assert text_of(first + rest) == tokens(500), ([(e.offset, e.kind) for e in first[:4] + rest[-4:]], logged)
    assert rest[-1].kind == "end"


def test_a_failed_step_is_told_after_its_tokens_and_the_end_says_failed(
    queue: RunQueue, queue_url: str
) -> None:
    run_id = queue.submit("fail", {})
    finished_proc = worker_process(queue_url)
    _out, logged = finished_proc.communicate(timeout=180)  # (exit 3 or 0 is not the point: the run failed)
    events = list(queue.stream(run_id))
    # (Seen once at load 11 as ["end"] alone: what the worker logged says why.)
    assert [e.kind for e in events] == ["claimed", "started", "partial", "failed", "end"], logged[-2000:]
    assert events[2].data == "before the failure"
    assert "ValueError: the step failed on purpose" in events[3].data["error"]
    assert events[-1].data["status"] == "failed"


def test_a_worker_killed_mid_step_loses_only_its_unflushed_events_and_the_next_says_so(
    queue: RunQueue, queue_url: str
) -> None:
    run_id = queue.submit("slow", {"n": 300})
    first = worker_process(queue_url, "--heartbeat", "0.2", lease="1")
    try:
        seen: list[StreamEvent] = []
        for event in queue.stream(run_id, poll=0.01):  # until the step has streamed a while
            seen.append(event)
            if event.kind == "partial" and event.data == "t50 ":
                break
        os.kill(first.pid, 9)
        first.wait(30)
        wait = threading.Event()
        while (queue.status(run_id).lease_until or 0) > time.time():  # claimable once it expires
            wait.wait(0.05)
        taker = worker_process(queue_url, "--heartbeat", "0.2", lease="1")
        events = seen + list(queue.stream(run_id, seen[-1].offset, poll=0.01))
        finished(taker)
    finally:
        if first.poll() is None:
            first.kill()
    kinds = [(e.kind, e.epoch) for e in events if e.kind != "partial"]
    # The killed worker's epoch: claimed, started, tokens, and no finish it never made.
    assert kinds[:2] == [("claimed", 1), ("started", 1)]
    assert ("finished", 1) not in kinds
    # The taker's: a new epoch, resuming, the step again from its start, to the end.
    assert kinds[2:] == [("claimed", 2), ("started", 2), ("finished", 2), ("end", 2)], kinds
    before = [e.data for e in events if e.kind == "partial" and e.epoch == 1]
    after = [e.data for e in events if e.kind == "partial" and e.epoch == 2]
    assert before == [f"t{i} " for i in range(len(before))] and len(before) > 50
    assert after == [f"t{i} " for i in range(300)]
    stored = [e.offset for e in events if e.kind != "end"]
    assert stored == list(range(1, len(stored) + 1))  # nothing published twice, no hole


def test_a_worker_that_lost_its_lease_publishes_nothing(queue: RunQueue) -> None:
    run_id = queue.submit("w", {})
    zombie = queue.claim("zombie", {"w": None}, 0.2)
    assert zombie is not None
    assert queue.publish_many([(zombie, published(3))], 100) == [3]
    wait = threading.Event()
    taker = None
    while taker is None:  # claimable once the zombie's lease has expired
        wait.wait(0.02)
        taker = queue.claim("taker", {"w": None}, 30)
    assert taker.epoch == zombie.epoch + 1
    refused = queue.publish_many([(zombie, published(5, 3))], 100)
    assert len(refused) == 1 and isinstance(refused[0], LeaseLostError)
    assert queue.publish_many([(taker, published(2, 100))], 100) == [5]
    events = list(queue.stream(run_id, follow=False))
    assert [e.data for e in events] == ["p0", "p1", "p2", "p100", "p101"]
    assert [e.epoch for e in events] == [1, 1, 1, 2, 2]


ZOMBIE_GATE = threading.Event()
ZOMBIE_EMITTED = threading.Event()


async def _zombie_step(ctx: Any) -> str:
    partial("before")
    ZOMBIE_EMITTED.set()
    await asyncio.to_thread(ZOMBIE_GATE.wait, 60)
    partial("after the lease was lost")
    await asyncio.sleep(0.2)  # (a flush would come now, if the fence let it)
    return "done"


def _steal(queue: RunQueue, run_id: str) -> None:
    """Another party takes the run: its epoch goes up, as a claim after an expiry makes it."""
    if queue.backend == "sqlite":
        conn = queue.conn  # type: ignore[attr-defined]
        conn.execute("UPDATE ekit_queue_runs SET epoch = epoch + 1 WHERE run_id = ?", (run_id,))
    else:
        queue.db.run(lambda c: c.execute(  # type: ignore[attr-defined]
            "UPDATE ekit_queue_runs SET epoch = epoch + 1 WHERE run_id = %s", (run_id,)))


def test_a_worker_driving_a_run_it_lost_publishes_nothing_more(queue: RunQueue) -> None:
    ZOMBIE_GATE.clear()
    ZOMBIE_EMITTED.clear()
    run_id = queue.submit("z", {})
    worker = Worker(queue, {"z": Workflow([Step("z", _zombie_step)])}, poll=0.01, stream_every=0.01)

    async def main() -> None:
        task = asyncio.create_task(worker.run_until_idle())
        await asyncio.to_thread(ZOMBIE_EMITTED.wait, 60)
        # Published (the worker flushes every 10 ms): read until it is there.
        async for event in queue.astream(run_id, poll=0.01):
            if event.data == "before":
                break
        _steal(queue, run_id)
        ZOMBIE_GATE.set()
        await task

    asyncio.run(main())
    assert worker.outcomes[run_id] == "lost"
    data = [e.data for e in queue.stream(run_id, follow=False)]
    assert "before" in data and "after the lease was lost" not in data
    assert not any(e.kind == "finished" for e in queue.stream(run_id, follow=False))


def test_the_cap_drops_the_oldest_and_a_reader_below_it_is_told(queue: RunQueue) -> None:
    run_id = queue.submit("w", {})
    lease = queue.claim("w1", {"w": None}, 30)
    assert lease is not None
    assert queue.publish_many([(lease, published(6))], 5) == [6]
    assert queue.publish_many([(lease, published(6, 6))], 5) == [12]
    events = list(queue.stream(run_id, follow=False))
    assert events[0].kind == "gap" and events[0].data == {"dropped_from": 1, "dropped_to": 7}
    assert events[0].offset == 7  # resuming after it reads on from the oldest kept
    assert [(e.offset, e.data) for e in events[1:]] == [(i, f"p{i - 1}") for i in range(8, 13)]
    # A reader past the dropped part is not told of it; one inside it is.
    assert [e.offset for e in queue.stream(run_id, 9, follow=False)] == [10, 11, 12]
    told = list(queue.stream(run_id, 3, follow=False))
    assert told[0].kind == "gap" and told[0].data == {"dropped_from": 4, "dropped_to": 7}


def test_a_workers_stream_cap_keeps_its_newest_events(queue: RunQueue, queue_url: str) -> None:
    run_id = queue.submit("talk", {"n": 300})
    finished(worker_process(queue_url, "--stream-cap", "50"))
    events = list(queue.stream(run_id))
    assert events[0].kind == "gap"
    assert [e.kind for e in events[1:]].count("partial") == 49  # 50 kept: the finished event is one
    assert text_of(events).endswith(tokens(300)[-len(text_of(events)):])
    assert events[-1].kind == "end"


def test_prune_removes_the_runs_stream(queue: RunQueue) -> None:
    run_id = queue.submit("w", {})
    lease = queue.claim("w1", {"w": None}, 30)
    assert lease is not None
    queue.publish_many([(lease, published(4))], 100)
    queue.finish(lease, "finished")
    assert queue.prune(0) == 1
    with pytest.raises(UnknownRunError):
        queue.read_stream(run_id)
    count = "SELECT count(*) FROM ekit_queue_stream"
    if queue.backend == "sqlite":
        rows = queue.conn.execute(count).fetchone()  # type: ignore[attr-defined]
    else:
        rows = queue.db.run(lambda c: c.execute(count).fetchone())  # type: ignore[attr-defined]
    assert rows[0] == 0


@pytest.mark.parametrize("after", [-1, True, "3", 1.5, 2**64, None])
def test_a_bad_offset_is_refused_naming_it(queue: RunQueue, after: object) -> None:
    run_id = queue.submit("w", {})
    with pytest.raises(ValueError, match="after must be a whole number from 0"):
        queue.read_stream(run_id, after)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="after must be a whole number from 0"):
        queue.stream(run_id, after)  # type: ignore[arg-type]


@pytest.mark.parametrize("run_id", ["", "x" * 300, "a\x00b", 5, None])
def test_a_bad_run_id_is_refused_before_the_database_is_read(queue: RunQueue, run_id: object) -> None:
    with pytest.raises(ValueError, match="run_id"):
        queue.read_stream(run_id)  # type: ignore[arg-type]


def test_an_unknown_run_and_an_offset_never_written_are_told_apart(queue: RunQueue) -> None:
    with pytest.raises(UnknownRunError):
        list(queue.stream("no-such-run"))
    run_id = queue.submit("w", {})
    assert list(queue.stream(run_id, follow=False)) == []
    with pytest.raises(ValueError, match="past the last event"):
        queue.read_stream(run_id, 1)
    lease = queue.claim("w1", {"w": None}, 30)
    assert lease is not None
    with pytest.raises(ValueError, match="known kind"):
        queue.publish_many([(lease, [Published("made-up", None, "1", 0.0)])], 100)
    with pytest.raises(ValueError, match="stream_cap"):
        queue.publish_many([(lease, published(1))], 0)


def test_a_queue_made_before_streams_gains_them_on_open(queue_url: str) -> None:
    first = open_queue(queue_url)
    run_id = first.submit("talk", {"n": 20})
    if first.backend == "sqlite":
        first.conn.execute("DROP TABLE ekit_queue_stream")  # type: ignore[attr-defined]
    else:
        first.db.run(lambda c: c.execute("DROP TABLE ekit_queue_stream"))  # type: ignore[attr-defined]
    first.close()
    finished(worker_process(queue_url))
    again = open_queue(queue_url)
    try:
        assert text_of(list(again.stream(run_id))) == tokens(20)
    finally:
        again.close()


def test_publishing_leaves_the_sqlite_saves_durable(tmp_path: Path) -> None:
    from ekit_runtime.queue import SqliteQueue

    queue = SqliteQueue(str(tmp_path / "durable.db"))
    queue.submit("w", {})
    lease = queue.claim("w1", {"w": None}, 30)
    assert lease is not None
    queue.publish_many([(lease, published(3))], 100)
    # (The stream's own transaction does not wait for the disk; the saves after it do.)
    assert queue.conn.execute("PRAGMA synchronous").fetchone() == (2,)  # FULL
    queue.close()
