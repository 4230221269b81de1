"""The dashboard's response times: ``python -m benchmarks.ui [--runs 10000] [--steps 2000]``.

Fills a fresh SqliteQueue (or, with ``--queue URL``, the empty queue at
that URL, e.g. a new PostgreSQL database) with ``--runs`` queued runs and
10 runs waiting for a person (the runs page shows them first, each
question read from its checkpoint), starts ``ekit ui``'s server on it in a
thread, and times (``time.perf_counter``, the median of ``--repeat``
requests, each over a new HTTP connection as urllib makes it) the runs
page's first page, a page in the middle, the last page, its JSON
(``/api/runs``, what the page polls), pages filtered by status, by
workflow and by both, and the page and JSON of two runs: one whose
checkpoint records a ``--steps``-step graph with a third of it recorded,
one whose mapped step recorded ``--steps`` items (each with an output of
text and its usage, shown in the outputs table). The targets
(docs/dashboard.md): under 300 ms for every request, the runs page's at
10,000 runs and a run page's at 2,000 steps or items; the exit code is 1
if one is missed.
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

TARGET_S = 0.3
WAITING = 10
_USAGE = {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0}


def _fill(queue: RunQueue, runs: int, steps: int) -> str:
    for i in range(runs):
        queue.submit("bench", {}, run_id=f"run-{i:06d}")
    for i in range(WAITING):
        queue.submit("asks", {}, run_id=f"asks-{i:02d}")
        lease = queue.claim("bench-worker", {"asks": None}, 600)
        assert lease is not None
        queue.save(lease, WorkflowCheckpoint.from_dict({
            "format_version": 3, "step_index": 1, "outputs": {"draft": "a draft " * 50}, "cost": _USAGE,
            "context": {}, "step_usage": {}, "graph": {"draft": [], "title": ["draft"]},
            "asked": {"title": [{"kind": "value", "prompt": "Title for this draft?"}]}}), 600)
        queue.park(lease, "step 'title' waits for an answer")
    queue.submit("items", {}, run_id="items")
    lease = queue.claim("bench-worker", {"items": None}, 600)
    assert lease is not None
    keys = [f"k{i:05d}" for i in range(steps)]
    outputs: dict[str, object] = {"split": {k: i for i, k in enumerate(keys)}}
    outputs.update({f"work[{k}]": {"n": i, "text": f"item {i} " * (i % 40)} for i, k in enumerate(keys)})
    queue.save(lease, WorkflowCheckpoint.from_dict({
        "format_version": 3, "step_index": len(outputs), "outputs": outputs,
        "cost": {"input_tokens": 120 * steps, "output_tokens": 30 * steps, "llm_calls": steps},
        "context": {}, "graph": {"split": [], "work": ["split"], "total": ["work"]},
        "shapes": {"work": {"map_over": "split"}},
        "step_usage": {f"work[{k}]": {"input_tokens": 120, "output_tokens": 30, "llm_calls": 1}
                       for k in keys},
    }), 600)
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
            (f"run page, {args.steps:,} items", "/run/items"),
            (f"/api/run, {args.steps:,} items", "/api/run/items"),
        ]
        figures = {}
        for label, path in timed:
            figures[label] = _time(base + path, args.repeat)
            print(f"{label:40s} {figures[label] * 1000:8.1f} ms (median of {args.repeat})")
        server.shutdown()
        server.server_close()
        queue.close()
    ok = True
    for what, runs_page in ((f"runs page at {args.runs:,} runs", True),
                            (f"run pages at {args.steps:,} steps or items", False)):
        worst = max(t for label, t in figures.items()
                    if label.startswith(("run page", "/api/run,")) != runs_page)
        ok = ok and worst < TARGET_S
        print(f"{what}: {worst * 1000:.0f} ms (the slowest request), target < {TARGET_S * 1000:.0f} ms: "
              f"{'met' if worst < TARGET_S else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
