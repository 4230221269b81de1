"""Run-queue throughput: ``python -m benchmarks.queue [--quick] [--backends sqlite,postgres]``.

For each backend and 1, 2 and 4 worker processes, drains N runs of a K-step
chain of no-op steps and reports runs/s and step saves/s (each step of a
chain is one fenced save). The workers are started first and released
together, so process start-up is not timed. Then, in one process, times a
fenced ``queue.save`` of one new step next to a bare ``INSERT`` of the same
row on the same connection (SQLite: in its own ``BEGIN IMMEDIATE``
transaction, same durability). PostgreSQL uses ``--dsn`` or
``EKIT_TEST_POSTGRES_DSN``; without either it is left out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ekit_runtime import Step, Workflow, WorkflowCheckpoint
from ekit_runtime.queue import RunQueue, Worker, open_queue


def chain(steps: int) -> Workflow:
    """A chain of ``steps`` no-op async steps."""

    async def noop(ctx: dict[str, Any]) -> str:
        return "ok"

    return Workflow([Step(f"s{i}", noop, (f"s{i - 1}",) if i else ()) for i in range(steps)])


def _child(url: str, go: str, steps: int) -> None:
    queue = open_queue(url)
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.001)
    done = asyncio.run(Worker(queue, {"chain": chain(steps)}, max_runs=4, poll=0.01).run_until_idle())
    print(done, flush=True)
    queue.close()


def drain(url: str, workers: int, runs: int, steps: int) -> float:
    """Seconds for ``workers`` processes to drain ``runs`` runs of a ``steps``-step chain."""
    queue = open_queue(url)
    for _ in range(runs):
        queue.submit("chain")
    queue.close()
    go = os.path.join(tempfile.mkdtemp(), "go")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.queue", "--child", url, go, str(steps)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(workers)
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    began = time.perf_counter()
    open(go, "w").close()
    done = 0
    for p in procs:
        out, _ = p.communicate()
        done += int(out.strip())
    elapsed = time.perf_counter() - began
    assert done == runs, f"drained {done} of {runs} runs"
    return elapsed


@contextmanager
def fresh(backend: str, dsn: str | None) -> Iterator[str]:
    """A URL for an empty queue on ``backend``."""
    if backend == "sqlite":
        yield os.path.join(tempfile.mkdtemp(), "bench.db")
        return
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    assert dsn is not None
    name = f"ekit_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    params = {**conninfo_to_dict(dsn), "dbname": name}
    try:
        yield "postgresql://?" + "&".join(f"{k}={v}" for k, v in params.items())
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def save_cost(url: str, steps: int) -> dict[str, float]:
    """Median microseconds of a fenced save of one new step, and of a bare insert of that row."""
    checkpoints: list[WorkflowCheckpoint] = []
    chain(steps).run_sync(checkpoint_fn=checkpoints.append)
    queue = open_queue(url)
    queue.submit("chain", run_id="bench")
    lease = queue.claim("bench", {"chain": None}, 600)
    assert lease is not None
    saves = []
    for cp in checkpoints:
        t = time.perf_counter()
        queue.save(lease, cp, 600)
        saves.append(time.perf_counter() - t)
    inserts = _bare_inserts(queue, len(checkpoints))
    queue.close()
    return {"save_us": statistics.median(saves[1:]) * 1e6, "insert_us": statistics.median(inserts) * 1e6}


def _bare_inserts(queue: RunQueue, n: int) -> list[float]:
    row = ("bench", "output", "s", json.dumps("ok"), 1)
    times = []
    if queue.backend == "sqlite":
        conn = queue.conn  # type: ignore[attr-defined]
        conn.execute("CREATE TABLE bare (run_id TEXT, kind TEXT, name TEXT, value TEXT, epoch INTEGER)")
        for i in range(n):
            t = time.perf_counter()
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO bare VALUES (?, ?, ?, ?, ?)", (*row[:2], f"s{i}", *row[3:]))
            conn.execute("COMMIT")
            times.append(time.perf_counter() - t)
        return times
    pg = queue.db.conn  # type: ignore[attr-defined]
    pg.execute("CREATE TABLE bare (run_id text, kind text, name text, value text, epoch bigint)")
    for i in range(n):
        t = time.perf_counter()
        pg.execute("INSERT INTO bare VALUES (%s, %s, %s, %s, %s)", (*row[:2], f"s{i}", *row[3:]))
        times.append(time.perf_counter() - t)
    return times


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print one JSON line per measurement, then a table."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.queue")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="a smoke run: few runs, 1 and 2 workers")
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--dsn", default=os.environ.get("EKIT_TEST_POSTGRES_DSN"))
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child[0], args.child[1], int(args.child[2]))
        return 0
    runs, counts = (20, (1, 2)) if args.quick else (args.runs, (1, 2, 4))
    rows = []
    for backend in args.backends.split(","):
        if backend == "postgres" and not args.dsn:
            print("postgres: no --dsn nor EKIT_TEST_POSTGRES_DSN; left out", file=sys.stderr)
            continue
        for workers in counts:
            with fresh(backend, args.dsn) as url:
                elapsed = drain(url, workers, runs, args.steps)
            rows.append(
                {
                    "backend": backend,
                    "workers": workers,
                    "runs_per_s": runs / elapsed,
                    "saves_per_s": runs * args.steps / elapsed,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        with fresh(backend, args.dsn) as url:
            cost = save_cost(url, 50 if args.quick else 300)
        rows.append({"backend": backend, **cost})
        print(json.dumps(rows[-1]), flush=True)
    for r in rows:
        if "workers" in r:
            print(
                f"{r['backend']:9} {r['workers']} worker(s): {r['runs_per_s']:8.1f} runs/s "
                f"{r['saves_per_s']:9.1f} step saves/s"
            )
        else:
            print(
                f"{r['backend']:9} fenced save of one step {r['save_us']:7.0f} us, "
                f"bare insert of that row {r['insert_us']:7.0f} us"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
