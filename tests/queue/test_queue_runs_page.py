"""``RunQueue.runs_page`` and ``workflow_names``: filtered, cut and counted in the database.

On SQLite and on the real PostgreSQL server alike: a page holds the runs
the filters match, in submission order (or newest first), ``offset`` of
them skipped and at most ``limit``; ``total`` counts every match; a page
past the end is empty with the total kept; bad arguments are a
``ValueError`` naming the argument before the database is read. Each
backend's SQL agrees with the base class's in-Python reading of
``runs()``, on every combination of filters, and with ``status()``.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from ekit_runtime.queue import STATUSES, RunInfo, RunQueue, RunsPage
from tests.support.queue_backends import queue, queue_url

__all__ = ["queue", "queue_url"]  # fixtures, used by name

WORKFLOWS = ("alpha", "beta", "gamma")


def fill(q: RunQueue) -> list[tuple[str, str, str]]:
    """Two runs of every (status, workflow), submitted in a shuffled order; ``[(run_id, status, workflow)]``
    in submission order.

    A run to leave the queued status is submitted at priority 1 and driven
    at once (the claim takes it before the queued ones, all at priority 0).
    """
    plan = [(status, wf) for status in STATUSES for wf in WORKFLOWS for _ in range(2)]
    random.Random(7).shuffle(plan)
    made = []
    for i, (status, wf) in enumerate(plan):
        run_id = f"run-{i:03d}"
        q.submit(wf, {"i": i}, run_id=run_id, priority=0 if status in ("queued", "cancelled") else 1)
        if status == "cancelled":
            assert q.cancel(run_id)
        elif status != "queued":
            lease = q.claim("w1", {wf: None}, 600)
            assert lease is not None and lease.run_id == run_id
            if status == "waiting":
                q.park(lease, "waits for a person")
            elif status in ("finished", "failed"):
                q.finish(lease, status, "boom" if status == "failed" else None)
        made.append((run_id, status, wf))
    assert [(r.run_id, r.status, r.workflow) for r in q.runs()] == made
    return made


def ids(page: RunsPage) -> list[str]:
    return [r.run_id for r in page.runs]


def test_a_page_is_a_slice_of_the_runs_in_submission_order(queue: RunQueue) -> None:
    made = [run_id for run_id, _, _ in fill(queue)]
    assert len(made) == 36
    for limit in (None, 0, 1, 5, 35, 36, 100):
        for offset in (0, 1, 7, 35, 36, 37, 10**6):
            end = None if limit is None else offset + limit
            page = queue.runs_page(limit=limit, offset=offset)
            assert ids(page) == made[offset:end], (limit, offset)
            assert page.total == 36
            newest = queue.runs_page(limit=limit, offset=offset, newest_first=True)
            assert ids(newest) == made[::-1][offset:end], (limit, offset)
            assert newest.total == 36
    assert ids(queue.runs_page()) == made  # every argument left out: runs() with its total
    runs, total = queue.runs_page(limit=2)  # a RunsPage unpacks as (runs, total)
    assert [r.run_id for r in runs] == made[:2] and total == 36


def test_filters_combine_and_the_total_counts_every_match(queue: RunQueue) -> None:
    made = fill(queue)
    for status in (None, *STATUSES):
        for workflow in (None, *WORKFLOWS, "nobody"):
            want = [r for r, s, w in made if status in (None, s) and workflow in (None, w)]
            page = queue.runs_page(status, workflow=workflow)
            assert ids(page) == want and page.total == len(want), (status, workflow)
            cut = queue.runs_page(status, workflow=workflow, limit=3, offset=1, newest_first=True)
            assert ids(cut) == want[::-1][1:4] and cut.total == len(want), (status, workflow)
    assert queue.runs_page("waiting", workflow="beta").total == 2
    assert queue.runs_page(workflow="beta").total == 12
    assert queue.runs_page("failed").total == 6


def _in_python(
    queue: RunQueue, status: Any, *, workflow: Any, limit: Any, offset: Any, newest_first: bool
) -> RunsPage:
    """The page, from every run read by ``runs`` and filtered, cut and counted in Python."""
    found = [r for r in queue.runs(status) if workflow is None or r.workflow == workflow]
    if newest_first:
        found.reverse()
    return RunsPage(found[offset:None if limit is None else offset + limit], len(found))


def test_the_sql_agrees_with_reading_every_run_and_with_status(queue: RunQueue) -> None:
    fill(queue)
    queue.announce("w2", {"alpha": None}, 60)  # a queued run's reason depends on who serves it
    for status in (None, "queued", "failed"):
        for workflow in (None, "alpha", "gamma"):
            for limit, offset in ((None, 0), (4, 2), (1, 30)):
                args: dict[str, Any] = {"workflow": workflow, "limit": limit, "offset": offset}
                for newest_first in (False, True):
                    sql = queue.runs_page(status, newest_first=newest_first, **args)
                    in_python = _in_python(queue, status, newest_first=newest_first, **args)
                    assert sql == in_python, (status, args, newest_first)
    page = queue.runs_page(limit=36)
    assert all(isinstance(r, RunInfo) and r == queue.status(r.run_id) for r in page.runs)
    reasons = {r.workflow: r.reason for r in queue.runs_page("queued").runs}
    assert reasons["alpha"] is None and reasons["beta"] == "no worker has workflow beta"


def test_pages_past_the_end_and_filters_matching_nothing_are_empty(queue: RunQueue) -> None:
    assert queue.runs_page() == RunsPage([], 0)  # an empty queue
    assert queue.runs_page("failed", workflow="alpha", limit=50, offset=50) == RunsPage([], 0)
    fill(queue)
    assert queue.runs_page(limit=50, offset=36) == RunsPage([], 36)
    assert queue.runs_page("running", limit=50, offset=6) == RunsPage([], 6)
    assert queue.runs_page(limit=50, offset=2**63 - 1) == RunsPage([], 36)
    assert queue.runs_page(limit=0) == RunsPage([], 36)  # a count alone
    assert queue.runs_page(workflow="nobody") == RunsPage([], 0)


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"status": "bogus"}, "status"),
        ({"status": "incomplete"}, "status"),
        ({"status": 3}, "status"),
        ({"limit": -1}, "limit"),
        ({"limit": 1.5}, "limit"),
        ({"limit": "10"}, "limit"),
        ({"limit": True}, "limit"),
        ({"limit": 2**63}, "limit"),
        ({"offset": -1}, "offset"),
        ({"offset": None}, "offset"),
        ({"offset": 0.0}, "offset"),
        ({"offset": 2**64}, "offset"),
        ({"workflow": ""}, "workflow"),
        ({"workflow": "w" * 201}, "workflow"),
        ({"workflow": "a\x00b"}, "workflow"),
        ({"workflow": 7}, "workflow"),
        ({"newest_first": "yes"}, "newest_first"),
    ],
)
def test_bad_arguments_are_a_value_error_naming_them_before_the_database_is_read(
    queue: RunQueue, arguments: dict[str, Any], named: str
) -> None:
    queue.submit("alpha", {}, run_id="r1")
    arguments = dict(arguments)  # (the parameter is shared by both backends' runs)
    status = arguments.pop("status", None)
    with pytest.raises(ValueError, match=rf"^{named} must "):
        queue.runs_page(status, **arguments)
    with pytest.raises(ValueError, match=rf"^{named} must "):
        RunQueue.runs_page(queue, status, **arguments)
    queue.close()  # refused before any statement: a closed queue refuses the same way
    with pytest.raises(ValueError, match=rf"^{named} must "):
        queue.runs_page(status, **arguments)


def test_workflow_names_are_each_workflow_once_in_code_point_order(queue: RunQueue) -> None:
    assert queue.workflow_names() == []
    names = ["beta", "Zeta", "alpha", "ähm", "émile", "straße", "éa", "z"]
    for i, name in enumerate(names * 3):
        queue.submit(name, {}, run_id=f"r{i}")
    queue.cancel("r0")  # an ended run's workflow is listed too
    got = queue.workflow_names()
    assert got == sorted(set(names)) == sorted({r.workflow for r in queue.runs()})
    assert got[:3] == ["Zeta", "alpha", "beta"]  # code points: upper case first, accents last


def test_workflow_names_keep_code_point_order_where_the_database_collates_by_language() -> None:
    """A PostgreSQL database whose collation is a language's (ICU en-US sorts ``alpha`` before
    ``Zeta``) lists workflows in code point order all the same, as SQLite and ``sorted`` do."""
    import uuid

    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    from ekit_runtime.queue import open_queue
    from tests.support.queue_backends import postgres_dsn

    dsn = postgres_dsn()
    name = f"ekit_test_icu_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE \"{name}\" LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C' "
                      "TEMPLATE template0")
    params = {**conninfo_to_dict(dsn), "dbname": name}
    try:
        with open_queue("postgresql://?" + "&".join(f"{k}={v}" for k, v in params.items())) as q:
            for i, workflow in enumerate(("beta", "Zeta", "alpha", "émile", "z")):
                q.submit(workflow, {}, run_id=f"r{i}")
            assert q.workflow_names() == ["Zeta", "alpha", "beta", "z", "émile"]
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
