"""A PostgreSQL cache whose session the server dropped reconnects: the run still gets its hit.

What users rely on: a fleet's cache outlives its connections. A session the
server ends (a restart, a failover, an administrator, a proxy closing an idle
connection during a long step) is found broken at the next statement; the
cache opens a new session and asks again, so the lookup is a hit, not a paid
miss, and the store after a miss is kept.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Mapping
from typing import Any

from ekit_runtime import Step, Workflow
from tests.support.queue_backends import fresh_postgres, postgres_dsn


def _drop_sessions(url: str) -> int:
    import psycopg

    dbname = url.split("dbname=")[1].split("&")[0]
    with psycopg.connect(postgres_dsn(), autocommit=True) as admin:
        row = admin.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                            "WHERE datname = %s AND pid <> pg_backend_pid()", (dbname,)).fetchone()
    assert row is not None
    return int(row[0])


def test_a_dropped_session_costs_no_call_and_no_entry() -> None:
    from ekit_runtime.cache.postgres import PostgresCache

    calls: list[int] = []

    def paid(ctx: Mapping[str, Any]) -> Any:
        calls.append(ctx["a"])
        return ctx["a"] * 10

    wf = Workflow([Step("paid", paid, cache=True)])
    with fresh_postgres() as url:
        cache = PostgresCache(url)
        try:
            asyncio.run(wf.run({"a": 1}, cache=cache))
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a failed lookup or store warns: none may
                assert _drop_sessions(url) == 1
                assert asyncio.run(wf.run({"a": 1}, cache=cache)).outputs["paid"] == 10  # a hit
                asyncio.run(wf.run({"a": 2}, cache=cache))  # a miss, stored...
                assert _drop_sessions(url) == 1
                assert asyncio.run(wf.run({"a": 2}, cache=cache)).outputs["paid"] == 20  # ...and hit
        finally:
            cache.close()
    assert calls == [1, 2]
