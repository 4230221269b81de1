"""A worker's cost of publishing its runs' streams: ``python -m benchmarks.streams [--quick]``.

One ``Worker`` (``max_runs=4``, in this process) drains N runs of a 5-step
chain of async steps, four ways: each step reporting no ``partial()``
output or ``--partials`` pieces of it, and the worker publishing its runs'
streams (``stream=True``, the default) or not. Each round drains once each
way, on a fresh queue, in turn, so that the four meet the same machine
load; the figures are the medians of the rounds' runs/s, and each way's
cost is its slowdown against the same steps drained without a stream.

PostgreSQL uses ``--dsn`` or ``EKIT_TEST_POSTGRES_DSN``; without either it
is left out.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

from benchmarks.queue import fresh
from ekit_runtime import Step, Workflow, partial
from ekit_runtime.queue import Worker, open_queue

WAYS = (("no partials", 0, False), ("no partials", 0, True), ("partials", 1, False), ("partials", 1, True))


def chain(steps: int, pieces: int) -> Workflow:
    """A chain of ``steps`` async steps, each reporting ``pieces`` partial outputs (a token each)."""

    async def talk(ctx: dict[str, Any]) -> str:
        for i in range(pieces):
            partial(f"token {i} ")
        return "ok"

    return Workflow([Step(f"s{i}", talk, (f"s{i - 1}",) if i else ()) for i in range(steps)])


def drain(url: str, runs: int, steps: int, pieces: int, stream: bool) -> tuple[float, float]:
    """Runs per second one worker drains of ``runs`` runs (``pieces`` partials per step), and the
    process's CPU time per run (every thread's, in ms: less swayed by other processes' load)."""
    queue = open_queue(url)
    for _ in range(runs):
        queue.submit("chain")
    worker = Worker(queue, {"chain": chain(steps, pieces)}, max_runs=4, poll=0.01, stream=stream)
    began, cpu = time.perf_counter(), time.process_time()
    done = asyncio.run(worker.run_until_idle())
    elapsed, used = time.perf_counter() - began, time.process_time() - cpu
    queue.close()
    assert done == runs, f"drained {done} of {runs}"
    return runs / elapsed, used / runs * 1000


def main(argv: list[str] | None = None) -> int:
    """Print runs/s of each way, per backend, and the slowdown the stream costs."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.streams")
    parser.add_argument("--quick", action="store_true", help="fewer runs and one round")
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--dsn", default=os.environ.get("EKIT_TEST_POSTGRES_DSN"))
    parser.add_argument("--runs", type=int, default=None, help="runs per drain (default 400; --quick 100)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--partials", type=int, default=50, help="partial() calls per step (default 50)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3; --quick 1)")
    args = parser.parse_args(argv)
    runs = args.runs or (100 if args.quick else 400)
    rounds = args.rounds or (1 if args.quick else 3)
    for backend in args.backends.split(","):
        if backend == "postgres" and not args.dsn:
            continue
        rates: dict[tuple[str, int, bool], list[float]] = {way: [] for way in WAYS}
        cpus: dict[tuple[str, int, bool], list[float]] = {way: [] for way in WAYS}
        for _ in range(rounds):
            for way in WAYS:
                with fresh(backend, args.dsn) as url:
                    rate, cpu = drain(url, runs, args.steps, args.partials * way[1], way[2])
                    rates[way].append(rate)
                    cpus[way].append(cpu)
        print(f"{backend}: {runs} runs of a {args.steps}-step chain, 1 worker (max_runs 4), "
              f"median of {rounds} round(s)")
        for name, scale, stream in WAYS:
            way = (name, scale, stream)
            rate, cpu = statistics.median(rates[way]), statistics.median(cpus[way])
            base = statistics.median(rates[(name, scale, False)])
            base_cpu = statistics.median(cpus[(name, scale, False)])
            label = f"{name} ({args.partials * scale} per step)" if scale else name
            cost = "" if not stream else (
                f"  ({(base / rate - 1) * 100:+.0f}% time, {cpu - base_cpu:+.2f} ms CPU per run)"
            )
            print(f"  {label:<28} stream {'on ' if stream else 'off'}: {rate:8.1f} runs/s, "
                  f"{cpu:6.2f} ms CPU per run{cost}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
