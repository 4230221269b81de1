"""Queued children per item and per iteration with real ``ekit worker`` processes, on SQLite and PostgreSQL.

What users rely on: the items' children run on other workers while their
parent holds none, and the parent is woken once, when the last one ended; a
worker SIGKILLed in the middle of a family (right after it submitted the
second item's child, or the second iteration's, and before it saved) leaves
no child submitted twice and no step paid twice, and the next worker
finishes the family; a cancel of the parent stops every item's child, those
running on workers and those still queued. Each step start is appended and
fsynced to a side file, so the counts survive the kills.
"""

from __future__ import annotations

import signal
from collections import Counter
from contextlib import AbstractContextManager
from pathlib import Path
from subprocess import Popen

import pytest

from ekit_runtime.queue import open_queue
from tests.support.queue_backends import live_leases, queue_url, wait_for
from tests.support.queued_children import STARTED, child_workers, starts

__all__ = ["queue_url"]

FLOWS = '''
import asyncio, os, signal
from ekit_core import TokenUsage
from ekit_runtime import PatternResult, Repeat, Step, Workflow, attempt_key
from ekit_runtime.children import Child
from ekit_runtime.queue import RunQueue

LOG, GATE, MARK, KILL_AT = (os.environ[k] for k in ("CHILD_LOG", "CHILD_GATE", "CHILD_MARK", "CHILD_KILL_AT"))

''' + STARTED + '''

if KILL_AT:  # SIGKILL this worker once, right after the submit of that child committed
    _spawn = RunQueue.spawn

    def spawn(self, lease, *args, **kwargs):
        made = _spawn(self, lease, *args, **kwargs)
        if kwargs.get("run_id") == KILL_AT and not os.path.exists(MARK):
            open(MARK, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return made

    RunQueue.spawn = spawn


async def draft(ctx):
    which = attempt_key().run_id.rsplit("/", 1)[-1]
    started(f"draft:{which}")
    while not os.path.exists(GATE):  # (held until the test opens the gate)
        await asyncio.sleep(0.02)
    started(f"drafted:{which}")
    return PatternResult(f"draft on {ctx['topics']}", cost=TokenUsage(10, 5, 1))


WRITER = Workflow([Step("draft", draft), Step("polish", lambda ctx: ctx["draft"].upper(), ("draft",))])


def turn(ctx):
    it = ctx["agent"]
    started(f"turn:{it['number']}")
    return [*(it["previous"] or []), it["number"]]


TURNER = Workflow([Step("turn", turn)])


def report(ctx):
    started("report")
    return list(ctx["write"])


WORKFLOWS = {
    "mapped": Workflow([
        Step("topics", lambda ctx: ["owls", "bats", "cats"]),
        Step("write", depends_on=("topics",), map_over="topics", child=Child(WRITER, queued=True)),
        Step("report", report, ("write",)),
    ]),
    "looping": Workflow([
        Step("agent", child=Child(TURNER, queued=True),
             repeat=Repeat(max_iterations=5, until=lambda out: len(out) == 3)),
    ]),
    "writer": WRITER,
    "turner": TURNER,
}
'''

ITEMS = ["m/write[0]", "m/write[1]", "m/write[2]"]
EXPECTED = ["DRAFT ON OWLS", "DRAFT ON BATS", "DRAFT ON CATS"]


def _workers(tmp_path: Path, url: str, count: int, kill_at: str = "", *flags: str
             ) -> AbstractContextManager[list[Popen[str]]]:
    """``count`` worker processes of one run each, stopped (SIGKILL) when the block ends."""
    return child_workers(tmp_path, url, count, FLOWS, {"CHILD_KILL_AT": kill_at}, *flags)


def _starts(tmp_path: Path) -> Counter[str]:
    return starts(tmp_path)


def _resumed_after_the_kill(url: str, tmp_path: Path, victim_ran: str) -> None:
    """Run the killed worker's family to its end with a fresh worker."""
    q = open_queue(url)
    try:
        wait_for(lambda: live_leases(url) == 0, timeout=30, what="the killed worker's lease to expire")
        with _workers(tmp_path, url, 1, "", "--until-idle") as (taker,):
            assert taker.wait(timeout=120) == 0, (tmp_path / "stderr-0").read_text()
        assert q.status("m").status == "finished", (victim_ran, q.status("m").error)
    finally:
        q.close()


@pytest.mark.timeout(240)
def test_items_children_run_on_other_workers_and_the_parent_is_woken_once(
        queue_url: str, tmp_path: Path) -> None:
    q = open_queue(queue_url)
    q.submit("mapped", run_id="m")
    with _workers(tmp_path, queue_url, 2):
        # Each worker drives one run at a time: two children run at once only if the parent holds none.
        wait_for(lambda: sum(k.startswith("draft:") for k in _starts(tmp_path)) == 2, timeout=120,
                 what="two items' children to start")
        parent = q.status("m")
        assert (parent.status, parent.lease_until, parent.owner) == ("waiting", None, None)
        assert live_leases(queue_url) == 2  # the children's; none for the parent
        assert q.family("m") == (None, [(r, r.split("/")[1]) for r in ITEMS])
        (tmp_path / "gate").touch()
        wait_for(lambda: q.status("m").status == "finished", timeout=120, what="the parent to finish")
    result = q.result("m")
    assert result is not None and result.outputs["report"] == EXPECTED and result.cost.llm_calls == 3
    assert q.status("m").epoch == 3  # claimed, parked, woken once for three children, claimed
    starts = _starts(tmp_path)
    assert [starts[f"drafted:write[{i}]"] for i in range(3)] == [1, 1, 1] and starts["report"] == 1, starts
    q.close()


@pytest.mark.timeout(240)
def test_a_worker_killed_between_two_items_submits_leaves_no_child_twice(
        queue_url: str, tmp_path: Path) -> None:
    q = open_queue(queue_url)
    q.submit("mapped", run_id="m")
    (tmp_path / "gate").touch()
    with _workers(tmp_path, queue_url, 1, "m/write[1]") as (victim,):
        assert victim.wait(timeout=120) == -signal.SIGKILL
    assert [c for c, _ in q.family("m")[1]] == ITEMS[:2]  # two submitted, then the kill
    _resumed_after_the_kill(queue_url, tmp_path, "m/write[1]")
    assert q.result("m") is not None and q.result("m").outputs["report"] == EXPECTED  # type: ignore[union-attr]
    assert [r.run_id for r in q.runs()] == ["m", *ITEMS]  # no child twice
    starts = _starts(tmp_path)
    assert [starts[f"drafted:write[{i}]"] for i in range(3)] == [1, 1, 1] and starts["report"] == 1, starts
    q.close()


@pytest.mark.timeout(240)
def test_a_worker_killed_after_an_iterations_submit_leaves_no_iteration_twice(
        queue_url: str, tmp_path: Path) -> None:
    q = open_queue(queue_url)
    q.submit("looping", run_id="m")
    with _workers(tmp_path, queue_url, 1, "m/agent#2") as (victim,):
        assert victim.wait(timeout=120) == -signal.SIGKILL
    assert [c for c, _ in q.family("m")[1]] == ["m/agent#1", "m/agent#2"]
    _resumed_after_the_kill(queue_url, tmp_path, "m/agent#2")
    result = q.result("m")
    assert result is not None and result.outputs["agent"] == [1, 2, 3]
    assert [r.run_id for r in q.runs()] == ["m", "m/agent#1", "m/agent#2", "m/agent#3"]
    assert _starts(tmp_path) == Counter({"turn:1": 1, "turn:2": 1, "turn:3": 1})
    q.close()


@pytest.mark.timeout(240)
def test_a_cancel_of_the_parent_stops_every_items_child(queue_url: str, tmp_path: Path) -> None:
    q = open_queue(queue_url)
    q.submit("mapped", run_id="m")
    with _workers(tmp_path, queue_url, 2):
        wait_for(lambda: sum(k.startswith("draft:") for k in _starts(tmp_path)) == 2, timeout=120,
                 what="two items' children to start")
        assert q.cancel("m") is True
        wait_for(lambda: all(q.status(r).status == "cancelled" for r in ITEMS), timeout=60,
                 what="every item's child to be cancelled")
        assert q.status("m").status == "cancelled" and live_leases(queue_url) == 0
    starts = _starts(tmp_path)
    assert not any(k.startswith("drafted:") for k in starts) and starts["report"] == 0, starts
    q.close()
