"""The dashboard's response times: ``python -m benchmarks.ui [--runs 10000] [--steps 2000]``.

Fills a fresh SqliteQueue (or, with ``--queue URL``, the empty queue at
that URL, e.g. a new PostgreSQL database) with ``--runs`` queued runs,
starts ``ekit ui``'s server on it in a thread, and times
(``time.perf_counter``, the median of ``--repeat`` requests, each over a
new HTTP connection as urllib makes it) the runs page's first page, a page
in the middle, the last page, its JSON (``/api/runs``, what the page
polls), pages filtered by status, by workflow and by both, and the page
and JSON of a run whose checkpoint records a ``--steps``-step graph with a
third of it recorded. The target (docs/dashboard.md) is under 1 s for the
runs page at 10,000 runs; the exit code is 1 if it is missed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence

from ekit_core import WorkflowCheckpoint
from ekit_runtime.queue import RunQueue, SqliteQueue, open_queue
from ekit_runtime.ui import QueueSource, make_server

TARGET_S = 1.0


def _fill(queue: RunQueue, runs: int, steps: int) -> str:
    for i in range(runs):
        queue.submit("bench", {}, run_id=f"run-{i:06d}")
    queue.submit("big", {}, run_id="big")
    lease = queue.claim("bench-worker", {"big": None}, 600)
    assert lease is not None
    names = [f"step_{i:04d}" for i in range(steps)]
    graph = {n: ([names[i - 1]] if i % 50 else []) for i, n in enumerate(names)}
    outputs = {n: i for i, n in enumerate(names[: steps // 3])}
    cp = WorkflowCheckpoint.from_dict({
        "format_version": 3, "step_index": len(outputs), "outputs": outputs,
        "cost": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0}, "context": {},
        "step_usage": {}, "graph": graph,
    })
    queue.save(lease, cp, 600)
    return "big"


def _time(url: str, repeat: int) -> float:
    took = []
    for _ in range(repeat):
        start = time.perf_counter()
        with urllib.request.urlopen(url, timeout=60) as r:
            r.read()
        took.append(time.perf_counter() - start)
    return statistics.median(took)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print one line per request timed; 1 if the runs page misses its target."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.ui", description=__doc__)
    p.add_argument("--runs", type=int, default=10_000)
    p.add_argument("--steps", type=int, default=2_000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--queue", help="an empty queue to fill (default: a SqliteQueue in a temporary folder)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        queue = open_queue(args.queue) if args.queue else SqliteQueue(os.path.join(d, "ui-bench.db"))
        started = time.perf_counter()
        big = _fill(queue, args.runs, args.steps)
        print(f"filled a {type(queue).__name__} with {args.runs:,} runs in "
              f"{time.perf_counter() - started:.1f} s")
        server = make_server(QueueSource(queue, "ui-bench"))
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        base = server.url.rstrip("/")
        middle = max(1, args.runs // 100)
        last = max(1, -(-(args.runs + 1) // 50))
        timed = [
            ("runs page, page 1", "/"),
            (f"runs page, page {middle}", f"/?page={middle}"),
            (f"runs page, page {last} (the last)", f"/?page={last}"),
            ("/api/runs (the page's poll)", "/api/runs"),
            ("runs page filtered by status", "/?status=running"),
            ("runs page filtered by workflow", "/?workflow=bench"),
            (f"status and workflow, page {middle}", f"/?status=queued&workflow=bench&page={middle}"),
            (f"run page, {args.steps:,}-step graph", f"/run/{big}"),
            (f"/api/run, {args.steps:,}-step graph", f"/api/run/{big}"),
        ]
        figures = {}
        for label, path in timed:
            figures[label] = _time(base + path, args.repeat)
            print(f"{label:40s} {figures[label] * 1000:8.1f} ms (median of {args.repeat})")
        server.shutdown()
        server.server_close()
        queue.close()
    # Every request of the runs page (any page, any filter, its JSON), not the run pages.
    worst = max(t for label, t in figures.items() if not label.startswith(("run page", "/api/run,")))
    ok = worst < TARGET_S
    print(f"runs page at {args.runs:,} runs: {worst * 1000:.0f} ms (its slowest request), "
          f"target < {TARGET_S * 1000:.0f} ms: "
          f"{'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
