"""Queued child runs with real ``ekit worker`` processes, on SQLite and PostgreSQL.

What users rely on: a parent waiting for its children holds no worker (two
workers of one run each drive its two children at once, while the parent's
row holds no lease); a worker SIGKILLed right after it submitted a child and
before it saved leaves no duplicate child, and the parent finishes; a worker
SIGKILLed right after its last child's end was written leaves the parent queued
(woken in that same transaction), not waiting for ever; a cancel of the
parent stops its children on their workers, and so does the parent's failure
(another step failed while its child ran). Each step start is appended and
fsynced to a side file, so the counts survive the kills.
"""

from __future__ import annotations

import signal
from collections import Counter
from contextlib import AbstractContextManager
from pathlib import Path
from subprocess import Popen

import pytest

from ekit_runtime.queue import RunQueue, open_queue
from tests.support.queue_backends import live_leases, queue_url, wait_for
from tests.support.queued_children import STARTED, child_workers, starts

__all__ = ["queue_url"]

FLOWS = '''
import asyncio, os, signal
from ekit_core import TokenUsage
from ekit_runtime import PatternResult, Step, Workflow, attempt_key
from ekit_runtime.children import Child
from ekit_runtime.queue import RunQueue
from ekit_runtime.queue.group_commit import GroupCommit

LOG, GATE, MARK, MODE = (os.environ[k] for k in ("CHILD_LOG", "CHILD_GATE", "CHILD_MARK", "CHILD_MODE"))

''' + STARTED + '''

def killed_once():
    """SIGKILL this worker the first time a fault point is reached (the mark tells it happened)."""
    if not os.path.exists(MARK):
        open(MARK, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)


if MODE == "after_spawn":  # committed the child's submit; the parent's checkpoint is not saved
    _spawn = RunQueue.spawn

    def spawn(self, lease, *args, **kwargs):
        made = _spawn(self, lease, *args, **kwargs)
        killed_once()
        return made

    RunQueue.spawn = spawn

if MODE == "after_child_end":  # the last child's end committed; nothing else written
    _finish = GroupCommit.finish

    async def finish(self, lease, status, error=None):
        await _finish(self, lease, status, error)
        if "/" in lease.run_id:
            started("ended")
            if open(LOG, encoding="utf-8").read().split().count("ended") == 2:
                killed_once()

    GroupCommit.finish = finish


async def draft(ctx):
    which = attempt_key().run_id.rsplit("/", 1)[-1]
    started(f"draft:{which}")
    while not os.path.exists(GATE):  # (held until the test opens the gate)
        await asyncio.sleep(0.02)
    started(f"drafted:{which}")
    return PatternResult(f"draft on {which}", cost=TokenUsage(10, 5, 1))


def polish(ctx):
    return ctx["draft"].upper()


WRITER = Workflow([Step("draft", draft), Step("polish", polish, ("draft",))])


def brief(ctx):
    started("brief")
    return "owls"


def report(ctx):
    started("report")
    return [ctx["left"], ctx["right"]]


async def doomed(ctx):
    while "draft:left" not in open(LOG, encoding="utf-8").read().split():  # (once the child runs)
        await asyncio.sleep(0.02)
    started("doomed")
    raise RuntimeError("doomed")


WORKFLOWS = {
    "failing": Workflow([
        Step("brief", brief),
        Step("left", depends_on=("brief",), child=Child(WRITER, queued=True)),
        Step("doomed", doomed, ("brief",)),
    ]),
    "main": Workflow([
        Step("brief", brief),
        Step("left", depends_on=("brief",), child=Child(WRITER, queued=True)),
        Step("right", depends_on=("brief",), child=Child(WRITER, queued=True)),
        Step("report", report, ("left", "right")),
    ]),
    "writer": WRITER,
}
'''

EXPECTED = ["DRAFT ON LEFT", "DRAFT ON RIGHT"]


def _workers(tmp_path: Path, url: str, count: int, mode: str = "", *flags: str
             ) -> AbstractContextManager[list[Popen[str]]]:
    """``count`` worker processes of one run each, stopped (SIGKILL) when the block ends."""
    return child_workers(tmp_path, url, count, FLOWS, {"CHILD_MODE": mode}, *flags, tag=mode)


def _starts(tmp_path: Path) -> Counter[str]:
    return starts(tmp_path)


def _finished_once(q: RunQueue, tmp_path: Path) -> None:
    """The parent finished with both children's outputs, each child paid for once."""
    info = q.status("m")
    assert info.status == "finished", info.error
    result = q.result("m")
    assert result is not None and result.outputs["report"] == EXPECTED
    assert result.cost.llm_calls == 2  # each child's usage, rolled up into the parent's
    assert len(q.runs()) == 3, [r.run_id for r in q.runs()]  # no child twice
    assert [r.run_id for r in q.runs()] == ["m", "m/left", "m/right"]
    starts = _starts(tmp_path)
    assert starts["drafted:left"] == 1 and starts["drafted:right"] == 1 and starts["report"] == 1, starts


@pytest.mark.timeout(240)
def test_two_workers_drive_both_children_at_once_while_the_parent_holds_no_worker(
        queue_url: str, tmp_path: Path) -> None:
    q = open_queue(queue_url)
    q.submit("main", run_id="m")
    with _workers(tmp_path, queue_url, 2):
        # Each worker drives one run at a time: both children run at once only if the parent holds none.
        wait_for(lambda: {"draft:left", "draft:right"} <= set(_starts(tmp_path)), timeout=120,
                 what="both children to start")
        parent, left, right = (q.status(r) for r in ("m", "m/left", "m/right"))
        assert (parent.status, parent.lease_until, parent.owner) == ("waiting", None, None)
        assert parent.reason is not None and parent.reason.startswith("waiting for child run")
        assert left.status == right.status == "running" and left.owner != right.owner
        assert live_leases(queue_url) == 2  # the children's; none for the parent
        assert q.family("m") == (None, [("m/left", "left"), ("m/right", "right")])
        (tmp_path / "gate").touch()
        wait_for(lambda: q.status("m").status == "finished", timeout=120, what="the parent to finish")
    _finished_once(q, tmp_path)
    q.close()


@pytest.mark.timeout(240)
def test_a_worker_killed_after_submitting_a_child_and_before_saving_leaves_no_duplicate(
        queue_url: str, tmp_path: Path) -> None:
    q = open_queue(queue_url)
    q.submit("main", run_id="m")
    (tmp_path / "gate").touch()
    with _workers(tmp_path, queue_url, 1, "after_spawn") as (victim,):
        assert victim.wait(timeout=120) == -signal.SIGKILL
    checkpoint = q.checkpoint("m")
    assert checkpoint is None or not checkpoint.asked  # the wait was never saved
    assert len(q.family("m")[1]) == 1  # the child was submitted
    wait_for(lambda: live_leases(queue_url) == 0, timeout=30, what="the killed worker's lease to expire")
    with _workers(tmp_path, queue_url, 1, "", "--until-idle") as (taker,):
        assert taker.wait(timeout=120) == 0, (tmp_path / "stderr-0").read_text()
    _finished_once(q, tmp_path)
    q.close()


@pytest.mark.timeout(240)
def test_a_worker_killed_right_after_a_childs_end_leaves_the_parent_queued(
        queue_url: str, tmp_path: Path) -> None:
    q = open_queue(queue_url)
    q.submit("main", run_id="m")
    (tmp_path / "gate").touch()
    with _workers(tmp_path, queue_url, 1, "after_child_end") as (victim,):
        assert victim.wait(timeout=120) == -signal.SIGKILL
    ended = [r for r in q.runs() if "/" in r.run_id and r.status == "finished"]
    assert len(ended) == 2  # the last child's end was written, and then the worker died
    assert q.status("m").status == "queued"  # woken in that transaction: not waiting for ever
    wait_for(lambda: live_leases(queue_url) == 0, timeout=30, what="the killed worker's leases to expire")
    with _workers(tmp_path, queue_url, 1, "", "--until-idle") as (taker,):
        assert taker.wait(timeout=120) == 0, (tmp_path / "stderr-0").read_text()
    _finished_once(q, tmp_path)
    q.close()


@pytest.mark.timeout(240)
def test_a_cancel_of_the_parent_stops_its_children_on_their_workers(queue_url: str, tmp_path: Path) -> None:
    q = open_queue(queue_url)
    q.submit("main", run_id="m")
    with _workers(tmp_path, queue_url, 2):
        wait_for(lambda: {"draft:left", "draft:right"} <= set(_starts(tmp_path)), timeout=120,
                 what="both children to start")
        assert q.cancel("m") is True
        assert q.status("m").status == "cancelled"  # parked: at once; its children flagged
        wait_for(lambda: all(q.status(r).status == "cancelled" for r in ("m/left", "m/right")),
                 timeout=60, what="the children's workers to stop them")
        assert live_leases(queue_url) == 0
    starts = _starts(tmp_path)
    assert starts["drafted:left"] == 0 and starts["drafted:right"] == 0 and starts["report"] == 0
    q.close()


@pytest.mark.timeout(240)
def test_a_parent_that_fails_stops_its_child_on_its_worker(queue_url: str, tmp_path: Path) -> None:
    q = open_queue(queue_url)
    q.submit("failing", run_id="m")
    with _workers(tmp_path, queue_url, 2):
        wait_for(lambda: q.status("m").status == "failed", timeout=120, what="the parent to fail")
        assert "doomed" in str(q.status("m").error)
        # Flagged in the transaction of the parent's end; its worker stops it at its next heartbeat.
        wait_for(lambda: q.status("m/left").status == "cancelled", timeout=60,
                 what="the child's worker to stop it")
        assert live_leases(queue_url) == 0
    starts = _starts(tmp_path)
    assert starts["draft:left"] == 1 and starts["drafted:left"] == 0 and starts["doomed"] == 1, starts
    q.close()
