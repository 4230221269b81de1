"""On PostgreSQL, a worker's batch of writes and its claim cost the same however many runs the queue held.

A queue's runs table churns: every claim leaves an entry in the claim index
for a row version that only a vacuum removes, and a burst of submits is not
in the planner's statistics until the next ANALYZE. Two plans once followed
that history: the fence of a batch of writes read every entry for status
running (one per run claimed since the last vacuum) instead of probing each
run by id, and a claim read every queued run and sorted them to take four.

These tests count the shared buffers each statement touches, as the server
reports them for the plan the queue's own session runs (auto_explain, sent
back to the session as a notice), with a short history and a long one, and
autovacuum and ANALYZE kept off the table so that nothing tidies up between.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from ekit_runtime.queue import Ending, Lease, RunQueue, open_queue
from tests.support.queue_backends import chain_checkpoints, fresh_postgres

pytest.importorskip("psycopg")


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh database whose runs table autovacuum leaves alone (nothing tidies up between measures)."""
    with fresh_postgres() as url:
        setup = open_queue(url)
        setup.db.conn.execute(  # type: ignore[attr-defined]
            "ALTER TABLE ekit_queue_runs SET (autovacuum_enabled = false)"
        )
        # (Commits stay synchronous: a commit not yet flushed lets no later scan mark its dead
        # index entries, so asynchronous commits would change the buffers measured.)
        setup.close()
        yield url


class _Plans:
    """The plans the queue's session runs from now on, with the buffers each touched."""

    def __init__(self, queue: RunQueue) -> None:
        conn = queue.db.conn  # type: ignore[attr-defined]
        conn.execute("LOAD 'auto_explain'")
        for name, value in (
            ("log_min_duration", "0"), ("log_analyze", "on"), ("log_buffers", "on"),
            ("log_timing", "off"), ("log_format", "json"), ("log_level", "notice"),
        ):
            conn.execute("SELECT set_config(%s, %s, false)", (f"auto_explain.{name}", value))
        self.seen: list[tuple[str, int]] = []
        conn.add_notice_handler(self._heard)

    def _heard(self, diag: Any) -> None:
        text = diag.message_primary or ""
        if "plan:" not in text:
            return
        plan = json.loads(text.split("plan:", 1)[1])
        top = plan["Plan"]
        touched = top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0)
        self.seen.append((plan["Query Text"], touched))

    def buffers(self, starting: str) -> list[int]:
        """The buffers of each statement seen whose text starts with ``starting``; then forget them."""
        found = [blocks for text, blocks in self.seen if text.startswith(starting)]
        self.seen.clear()
        return found


def _work_off(queue: RunQueue, runs: int) -> None:
    """Drive ``runs`` queued runs of five steps as a worker does: claimed, saved and ended four at a time."""
    cps = chain_checkpoints(5)
    for _ in range(runs // 4):
        leases = queue.claim_many("me", {"w": None}, 60, 4)
        assert len(leases) == 4
        for cp in cps:
            queue.write_many([(lease, cp) for lease in leases], (), 60)
        queue.write_many((), [Ending(lease, "finished") for lease in leases], 60)


def _batch_buffers(queue: RunQueue, plans: _Plans, tag: str) -> int:
    """Buffers of the fenced writes of four runs' second saves and their endings (median of three).

    The four are submitted ahead of the backlog (a higher priority), so that
    the claim takes them.
    """
    cps = chain_checkpoints(2)
    touched = []
    for round_ in range(3):
        for i in range(4):
            queue.submit("w", run_id=f"{tag}{round_}-{i}", priority=1)
        leases: list[Lease] = queue.claim_many("me", {"w": None}, 60, 4)
        assert sorted(lease.run_id for lease in leases) == [f"{tag}{round_}-{i}" for i in range(4)]
        queue.write_many([(lease, cps[0]) for lease in leases], (), 60)
        plans.buffers("")
        assert queue.write_many([(lease, cps[1]) for lease in leases], (), 60) == ([False] * 4, [])
        assert queue.write_many((), [Ending(lease, "finished") for lease in leases], 60) == ([], [None] * 4)
        writes = plans.buffers("WITH i AS")
        assert len(writes) == 2, writes
        touched.append(sum(writes))
    return sorted(touched)[1]


# (Thousands of runs claimed, saved and ended: the timeout is a deadlock detector, sized for a
# loaded machine.)
@pytest.mark.timeout(600)
def test_a_batch_of_writes_does_not_read_the_runs_claimed_before(pg_url: str) -> None:
    # A worker starting on a full queue: its session plans its statements
    # while thousands of runs are queued and none has run yet.
    setup = open_queue(pg_url)
    for i in range(2400):
        setup.submit("w", run_id=f"old{i}")
    setup.close()
    queue = open_queue(pg_url)
    try:
        plans = _Plans(queue)
        _work_off(queue, 200)
        short = _batch_buffers(queue, plans, "a")
        _work_off(queue, 2000)
        long = _batch_buffers(queue, plans, "b")
    finally:
        queue.close()
    # By id, each run costs a few buffers whatever came before (an index one
    # level deeper at most). Reading the claim index's entries for status
    # running, and the rows they point to, cost about one buffer more per 20
    # runs claimed since the last vacuum.
    assert long <= short + 16, (short, long)


@pytest.mark.timeout(600)
def test_a_claim_does_not_read_the_whole_backlog(pg_url: str) -> None:
    pg_queue = open_queue(pg_url)
    # The first claim is one in full (it reads the fleet's limits); the quick
    # ones, what a worker makes from then on, are measured.
    pg_queue.submit("w", run_id="first")
    first = pg_queue.claim_many("me", {"w": None}, 60, 4)
    pg_queue.write_many((), [Ending(lease, "finished") for lease in first], 60)
    plans = _Plans(pg_queue)

    def claim_buffers(backlog: int, tag: str) -> int:
        for i in range(backlog):
            pg_queue.submit("w", run_id=f"{tag}{i}")
        plans.buffers("")
        touched = []
        for _ in range(3):
            assert len(pg_queue.claim_many("me", {"w": None}, 60, 4)) == 4
            claims = plans.buffers("WITH swept AS")
            assert len(claims) == 1, claims
            touched.append(claims[0])
        # (the rest of the backlog finished, so that the next measure starts from none queued)
        while leases := pg_queue.claim_many("me", {"w": None}, 60, 64):
            pg_queue.write_many((), [Ending(lease, "finished") for lease in leases], 60)
        plans.buffers("")
        return sorted(touched)[1]

    try:
        short = claim_buffers(400, "a")
        long = claim_buffers(3000, "b")
    finally:
        pg_queue.close()
    # Read off its index in order, a claim stops after the runs it takes (a
    # larger backlog costs a level more in each index the leases write to:
    # four runs, four indexes). Reading every queued run cost about one
    # buffer per twenty, 164 more here. The margin sits between the two: with
    # other suites using the same server, a claim sometimes still visits the
    # dead entries of the runs just finished before a scan marks them (63
    # became 109), which is not the backlog.
    assert long <= short + 80, (short, long)


def test_the_queues_statements_are_planned_once_per_session(pg_url: str) -> None:
    # A custom plan of a batch of writes took longer to make than to run
    # (about 0.4 ms against 0.1), and the plan cache chose one for every call
    # once the generic plan priced its array of runs above the runs it held.
    queue = open_queue(pg_url)
    try:
        for i in range(40):
            queue.submit("w", run_id=f"r{i}")
        _work_off(queue, 40)
        rows = queue.db.conn.execute(  # type: ignore[attr-defined]
            "SELECT left(statement, 30), generic_plans, custom_plans FROM pg_prepared_statements"
        ).fetchall()
    finally:
        queue.close()
    prepared = {text: (generic, custom) for text, generic, custom in rows}
    assert any(text.startswith("WITH i AS") for text in prepared), prepared  # (the writes, prepared)
    assert any(text.startswith("WITH swept AS") for text in prepared), prepared  # (the claims)
    assert all(custom == 0 for _generic, custom in prepared.values()), prepared


def test_every_session_of_the_queue_gets_the_planner_settings(pg_url: str) -> None:
    import psycopg

    from ekit_runtime.queue import PostgresQueue

    def settings(queue: RunQueue) -> tuple[str, ...]:
        row = queue.db.conn.execute(  # type: ignore[attr-defined]
            "SELECT current_setting('plan_cache_mode'), current_setting('random_page_cost'), "
            "current_setting('enable_bitmapscan')"
        ).fetchone()
        return tuple(row)

    wanted = ("force_generic_plan", "1.1", "off")
    own = open_queue(pg_url)
    adopted = PostgresQueue(psycopg.connect(pg_url))
    try:
        assert settings(own) == wanted
        assert settings(adopted) == wanted
        # A session the server ended is replaced by one with the same settings.
        with pytest.raises(psycopg.OperationalError):
            own.db.conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")  # type: ignore[attr-defined]
        own.submit("w", run_id="after")  # (reconnects)
        assert settings(own) == wanted
    finally:
        own.close()
        adopted.close()
