"""Run-queue throughput: ``python -m benchmarks.queue [--quick] [--backends sqlite,postgres]``.

For each backend and 1, 2 and 4 worker processes, drains N runs of a K-step
chain of no-op steps and reports runs/s and step saves/s (each step of a
chain is one fenced save). The workers are started first and released
together, so process start-up is not timed. Each round drains once with
each number of workers, on a fresh database; the figures are the medians of
the rounds, and the 2-worker ratio is the median of each round's own ratio
(1 and 2 workers measured seconds apart, on the same machine load). A
drain is 1,000 runs by default, so that a worker's start (its first claim,
its sessions' first statements) and its last runs, which no other run
overlaps, are a small part of the time: at 200 runs two PostgreSQL workers
drained in under half a second, and one round's 2-worker ratio ranged from
1.1 to 2.2 for the same code.

After each round, in this process, a fenced ``queue.save`` of one new step
is timed next to a bare ``INSERT`` of the same row in its own committed
transaction on the same connection (SQLite: ``BEGIN IMMEDIATE``, same
durability), the two alternating so that both meet the same disk and the
same write-ahead log. One such reading scatters by about 0.04x from the
next on this machine, so the ratio judged is the median of the rounds'
readings, each printed.

A durable commit waits for the disk, so every figure is printed next to the
disk's fsync rate, measured beside the database (``os.fsync`` of a small
write, the median of 50) before and after: a save cannot be faster than one
fsync, and SQLite, which holds its write lock through the commit, cannot
save more often than the disk syncs. The durability settings the run used
are printed too (SQLite ``synchronous``, PostgreSQL ``fsync`` and
``synchronous_commit``).

PostgreSQL uses ``--dsn`` or ``EKIT_TEST_POSTGRES_DSN``; without either it
is left out. ``--json PATH`` writes every figure and each target's verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from benchmarks.queue_cost import chain, cost_child, measure_cost, report_cost
from ekit_runtime import WorkflowCheckpoint
from ekit_runtime.queue import RunQueue, Worker, open_queue

# The targets: (backend, figure, comparison, threshold, what it says).
TARGETS = (
    ("sqlite", "workers_2_over_1", ">=", 1.0, "SQLite: 2 workers drain at least as many runs/s as 1"),
    ("sqlite", "save_over_insert", "<=", 1.3, "SQLite: a fenced save within 1.3x a bare insert"),
    ("postgres", "workers_2_over_1", ">=", 1.7, "PostgreSQL: 2 workers drain at least 1.7x the runs/s of 1"),
)


def _child(url: str, go: str, steps: int) -> None:
    queue = open_queue(url)
    claims = 0
    claim_some = Worker._claim_some

    async def counted(self: Worker) -> bool:
        # Each claim that leased runs is a commit of its own (the claims that
        # found none write nothing). Counted where the worker claims, since on
        # PostgreSQL its claims are awaited on its loop, not made through
        # queue.claim_many (ekit_runtime.queue.postgres_loop).
        nonlocal claims
        leased = await claim_some(self)
        claims += leased
        return leased

    Worker._claim_some = counted  # type: ignore[method-assign]  # (its claims, counted)
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.001)
    worker = Worker(queue, {"chain": chain(steps)}, max_runs=4, poll=0.01)
    done = asyncio.run(worker.run_until_idle())
    group = worker._group  # its saves and endings, committed together (ekit_runtime.queue.group_commit)
    print(done, group.batches if group else 0, group.saves if group else 0, claims, flush=True)
    queue.close()


def drain(url: str, workers: int, runs: int, steps: int) -> tuple[float, float, float]:
    """Seconds for ``workers`` processes to drain ``runs`` runs of a ``steps``-step chain; saves per
    write; commits per run.

    The second figure is how many saves each of the workers' group commits
    held on average (``GroupCommit``: one statement, one commit each, its
    runs' endings in it too); the third, the workers' group commits and
    claims (each claim may lease several runs) per run drained.
    """
    queue = open_queue(url)
    for _ in range(runs):
        queue.submit("chain")
    queue.close()
    gate = tempfile.mkdtemp()
    go = os.path.join(gate, "go")
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
    done = batches = saves = claims = 0
    for p in procs:
        out, _ = p.communicate()
        ran, wrote, held, claimed = (int(x) for x in out.split())
        done, batches, saves, claims = done + ran, batches + wrote, saves + held, claims + claimed
    elapsed = time.perf_counter() - began
    shutil.rmtree(gate, ignore_errors=True)
    assert done == runs, f"drained {done} of {runs} runs"
    return elapsed, saves / batches if batches else 0.0, (batches + claims) / runs


def fsync_us(directory: str, n: int = 50) -> float:
    """Median microseconds of ``os.fsync`` after a small write, in a file in ``directory``."""
    fd, path = tempfile.mkstemp(dir=directory, prefix="fsync-probe-")
    try:
        times = []
        for i in range(n):
            os.pwrite(fd, b"x" * 100, (i % 8) * 4096)
            t = time.perf_counter()
            os.fsync(fd)
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e6
    finally:
        os.close(fd)
        os.unlink(path)


@contextmanager
def fresh(backend: str, dsn: str | None) -> Iterator[str]:
    """A URL for an empty queue on ``backend``."""
    if backend == "sqlite":
        directory = tempfile.mkdtemp()
        try:
            yield os.path.join(directory, "bench.db")
        finally:
            shutil.rmtree(directory, ignore_errors=True)
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


def durability(queue: RunQueue) -> str:
    """The settings that make a commit durable, as the queue's connection sees them."""
    if queue.backend == "sqlite":
        conn = queue.conn  # type: ignore[attr-defined]
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        level = conn.execute("PRAGMA synchronous").fetchone()[0]
        named = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}.get(level, str(level))
        return f"journal_mode={mode} synchronous={named}"
    pg = queue.db.conn  # type: ignore[attr-defined]
    said = [f"{k}={pg.execute(f'SHOW {k}').fetchone()[0]}" for k in ("fsync", "synchronous_commit")]
    return " ".join(said)


def save_cost(url: str, steps: int) -> dict[str, Any]:
    """Median microseconds of a fenced save of one new step, and of a bare insert of that row.

    The two alternate, so that both meet the same disk and the same log.
    """
    checkpoints: list[WorkflowCheckpoint] = []
    chain(steps).run_sync(checkpoint_fn=checkpoints.append)
    queue = open_queue(url)
    queue.submit("chain", run_id="bench")
    lease = queue.claim("bench", {"chain": None}, 600)
    assert lease is not None
    insert = _bare_insert(queue)
    queue.save(lease, checkpoints[0], 600)  # the first save writes the run in full: not timed
    saves, inserts = [], []
    for i, cp in enumerate(checkpoints[1:]):
        t = time.perf_counter()
        queue.save(lease, cp, 600)
        saves.append(time.perf_counter() - t)
        t = time.perf_counter()
        insert(i)
        inserts.append(time.perf_counter() - t)
    settings = durability(queue)
    queue.close()
    save = statistics.median(saves) * 1e6
    bare = statistics.median(inserts) * 1e6
    # Each save beside the insert that followed it, a millisecond apart: the
    # median of those ratios is not swayed by the disk speeding up or slowing
    # down under other work, as a ratio of two medians is.
    paired = statistics.median(s / i for s, i in zip(saves, inserts, strict=True))
    return {
        "save_us": save,
        "insert_us": bare,
        "save_over_insert": paired,
        "save_over_insert_of_medians": save / bare,
        "durability": settings,
    }


def _bare_insert(queue: RunQueue) -> Any:
    """A function inserting row ``i`` (the row a save of one step writes) in its own transaction."""
    row = ("bench", "output", json.dumps("ok"), 1)
    if queue.backend == "sqlite":
        conn = queue.conn  # type: ignore[attr-defined]
        conn.execute("CREATE TABLE bare (run_id TEXT, kind TEXT, name TEXT, value TEXT, epoch INTEGER)")

        def sqlite_insert(i: int) -> None:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO bare VALUES (?, ?, ?, ?, ?)", (*row[:2], f"s{i}", *row[2:]))
            conn.execute("COMMIT")

        return sqlite_insert
    pg = queue.db.conn  # type: ignore[attr-defined]
    pg.execute("CREATE TABLE bare (run_id text, kind text, name text, value text, epoch bigint)")

    def pg_insert(i: int) -> None:
        pg.execute("INSERT INTO bare VALUES (%s, %s, %s, %s, %s)", (*row[:2], f"s{i}", *row[2:]))

    return pg_insert


def measure(
    backend: str,
    dsn: str | None,
    counts: tuple[int, ...],
    runs: int,
    steps: int,
    rounds: int,
    save_steps: int,
    log: Any,
) -> dict[str, Any]:
    """Every figure of one backend (see the module docstring)."""
    # SQLite: where the benchmark's databases are made. PostgreSQL: the
    # server's disk is not known from here; the temporary directory is
    # probed (the same disk when the server runs on this machine).
    probe = tempfile.gettempdir()
    fsyncs = [fsync_us(probe)]
    drains: list[dict[str, Any]] = []
    costs: list[dict[str, Any]] = []
    for r in range(rounds):
        for workers in counts:
            with fresh(backend, dsn) as url:
                elapsed, per_write, commits = drain(url, workers, runs, steps)
            drains.append(
                {
                    "round": r,
                    "workers": workers,
                    "runs_per_s": runs / elapsed,
                    "saves_per_s": runs * steps / elapsed,
                    "saves_per_write": per_write,
                    "commits_per_run": commits,
                }
            )
            log({"backend": backend, **drains[-1]})
        fsyncs.append(fsync_us(probe))
        # One reading of the save's cost a round: a reading scatters by about
        # 0.04x from one to the next (the disk, the machine), so the figure
        # judged is the median of the rounds' readings.
        with fresh(backend, dsn) as url:
            costs.append(save_cost(url, save_steps))
        log({"backend": backend, "round": r, **costs[-1]})
    cost = _median_cost(costs)
    fsyncs.append(fsync_us(probe))
    runs_per_s = {w: statistics.median(d["runs_per_s"] for d in drains if d["workers"] == w) for w in counts}
    written = {
        w: statistics.median(d["saves_per_write"] for d in drains if d["workers"] == w) for w in counts
    }
    per_run = {
        w: statistics.median(d["commits_per_run"] for d in drains if d["workers"] == w) for w in counts
    }
    per_round = (
        [_rate(drains, r, 2) / _rate(drains, r, 1) for r in range(rounds)]
        if 1 in counts and 2 in counts
        else []
    )
    fsync = statistics.median(fsyncs)
    result = {
        "runs": runs,
        "steps": steps,
        "rounds": rounds,
        "drains": drains,
        "runs_per_s": {str(w): v for w, v in runs_per_s.items()},
        "saves_per_write": {str(w): v for w, v in written.items()},
        "commits_per_run": {str(w): v for w, v in per_run.items()},
        "workers_2_over_1": statistics.median(per_round) if per_round else None,
        **cost,
        "fsync_us": fsync,
        "fsync_us_each": fsyncs,
        "fsyncs_per_s": 1e6 / fsync,
        "fsync_dir": probe,
        "commit_bound_runs_per_s": 1e6 / fsync / (steps + 2),
    }
    return result


def _median_cost(costs: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds' readings of :func:`save_cost` as one: the median of each figure, and every ratio."""
    save = statistics.median(c["save_us"] for c in costs)
    bare = statistics.median(c["insert_us"] for c in costs)
    return {
        "save_us": save,
        "insert_us": bare,
        "save_over_insert": statistics.median(c["save_over_insert"] for c in costs),
        "save_over_insert_each": [c["save_over_insert"] for c in costs],
        "save_over_insert_of_medians": save / bare,
        "durability": costs[-1]["durability"],
    }


def _rate(drains: list[dict[str, Any]], rnd: int, workers: int) -> float:
    return float(next(d["runs_per_s"] for d in drains if d["round"] == rnd and d["workers"] == workers))


def verdicts(backends: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target with its figure and whether it was met (``None``: not measured)."""
    out = []
    for backend, key, op, threshold, what in TARGETS:
        figure = backends.get(backend, {}).get(key)
        met = None if figure is None else (figure >= threshold if op == ">=" else figure <= threshold)
        out.append({"target": what, "backend": backend, "figure": figure, "threshold": threshold, "met": met})
    return out


def report(backends: dict[str, dict[str, Any]], targets: list[dict[str, Any]]) -> str:
    """The human table: runs/s, save costs, the disk's fsync rate, each verdict."""
    lines = []
    for backend, res in backends.items():
        lines.append(
            f"{backend}: disk fsync {res['fsync_us']:.0f} us median ({res['fsyncs_per_s']:.0f}/s; "
            f"each probe: {', '.join(f'{x:.0f}' for x in res['fsync_us_each'])} us); {res['durability']}"
        )
        for w, rate in res["runs_per_s"].items():
            lines.append(
                f"  {w} worker(s): {rate:8.1f} runs/s {rate * res['steps']:9.1f} step saves/s "
                f"(median of {res['rounds']}); {res['saves_per_write'][w]:.2f} saves per group commit, "
                f"{res['commits_per_run'][w]:.2f} commits a run"
            )
        if res["workers_2_over_1"] is not None:
            ratio = res["workers_2_over_1"]
            lines.append(f"  2 workers / 1 worker: {ratio:.2f}x (median of the rounds' ratios)")
        lines.append(
            f"  fenced save of one step {res['save_us']:7.0f} us, bare insert of that row "
            f"{res['insert_us']:7.0f} us (medians); {res['save_over_insert']:.2f}x (median of the rounds' "
            f"readings, each the median of its pairs' ratios: "
            f"{', '.join(f'{x:.2f}' for x in res['save_over_insert_each'])}); "
            f"one fsync {res['fsync_us']:.0f} us"
        )
        lines.append(
            f"  a run of {res['steps']} steps commits {res['steps'] + 2} times alone (claim, saves, finish): "
            f"at one fsync each, at most {res['commit_bound_runs_per_s']:.0f} runs/s one commit at a time"
        )
        lines.append(
            "  (commits a run: each worker's group commits, which hold its runs' saves and endings, and its"
            " claims, each of which may lease several runs)"
        )
    for t in targets:
        state = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        figure = "-" if t["figure"] is None else f"{t['figure']:.2f}"
        lines.append(f"target: {t['target']} (threshold {t['threshold']}): {figure} -> {state}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark: one JSON line per measurement, then a table and the verdicts."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.queue")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--cost-child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--cost-only", action="store_true",
                        help="only what a run costs (instructions, server CPU), no drains")
    parser.add_argument("--no-cost", action="store_true", help="only the drains and saves, no callgrind")
    parser.add_argument("--no-durations", action="store_true",
                        help="count a worker that records no step times, as the in-process run "
                             "(like for like with counts made before workers recorded them)")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: few runs, 1 and 2 workers, 1 round"
    )
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--dsn", default=os.environ.get("EKIT_TEST_POSTGRES_DSN"))
    parser.add_argument("--runs", type=int, default=1000, help="runs drained per measurement (default 1000)")
    parser.add_argument("--steps", type=int, default=5, help="steps per run (default 5)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of drains (default 3; --quick 1)")
    parser.add_argument("--json", metavar="PATH", help="write every figure and verdict as JSON")
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child[0], args.child[1], int(args.child[2]))
        return 0
    if args.cost_child:
        cost_child(args.cost_child)
        return 0
    counts: tuple[int, ...]
    if args.quick:
        runs, counts, rounds, save_steps = 20, (1, 2), 1, 50
    else:
        runs, counts, rounds, save_steps = args.runs, (1, 2, 4), 3, 300
    if args.rounds is not None:
        rounds = args.rounds
    backends: dict[str, dict[str, Any]] = {}
    names = [b for b in args.backends.split(",") if b != "postgres" or args.dsn]
    if len(names) < len(args.backends.split(",")):
        print("postgres: no --dsn nor EKIT_TEST_POSTGRES_DSN; left out", file=sys.stderr)

    def log(row: dict[str, Any]) -> None:
        print(json.dumps(row), flush=True)

    cost = None
    if args.no_durations:
        os.environ["EKIT_BENCH_NO_DURATIONS"] = "1"
    if not args.no_cost:
        cost = measure_cost({b: partial(fresh, b, args.dsn) for b in names}, args.steps, args.quick, log)
    for backend in [] if args.cost_only else names:
        backends[backend] = measure(
            backend,
            args.dsn,
            counts,
            runs,
            args.steps,
            rounds,
            save_steps,
            log,
        )
    targets = verdicts(backends)
    load = os.getloadavg()
    if cost is not None:
        print(report_cost(cost))
    print(report(backends, targets))
    print(f"load average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backends": backends, "targets": targets, "cost": cost, "load": load}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
