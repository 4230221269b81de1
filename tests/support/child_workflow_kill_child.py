"""Child process of tests/stores/test_a_killed_child_workflow_resumes_from_every_store.py.

``python child_workflow_kill_child.py KIND WHERE RUN_ID START_LOG K`` loads the
latest checkpoint from a store of KIND (``journal``, ``sqlite``, ``postgres``: WHERE
is a path or a DSN), and resumes a workflow whose step ``research`` runs a child
of 6 chained steps (``research/s1`` .. ``research/s6``) between ``topic`` and
``report``, saving through the store after each. Each step appends its name to
START_LOG when it starts. The first time ``research/sK`` starts, the process
prints ``at K`` and waits: the parent kills it there with SIGKILL, with steps
1..K-1 of the child recorded. Otherwise it prints the final outputs as JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from ekit_runtime import JournalStore, SqliteStore, Step, Workflow

STEPS = 6


def make_store(kind: str, where: str, run_id: str) -> Any:
    if kind == "journal":
        return JournalStore(where)
    if kind == "sqlite":
        return SqliteStore(where, run_id=run_id)
    if kind == "postgres":
        from ekit_runtime import PostgresStore
        return PostgresStore(where, run_id=run_id)
    raise ValueError(f"unknown store kind {kind!r}")


def workflow(log: str, stop_at: int) -> Workflow:
    def started(name: str) -> bool:
        """Log the start; whether this is the first start of ``name``."""
        with open(log, "a+", encoding="utf-8") as f:
            f.seek(0)
            first = name not in f.read().split()
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        return first

    def step(k: int) -> Any:
        async def run(ctx: Any) -> Any:
            if started(f"research/s{k}") and k == stop_at:
                print(f"at {k}", flush=True)
                await asyncio.Event().wait()  # until killed
            return f"{ctx['topic'] if k == 1 else ctx[f's{k - 1}']}+{k}"
        return run

    child = Workflow([Step(f"s{k}", step(k), (f"s{k - 1}",) if k > 1 else ())
                      for k in range(1, STEPS + 1)])
    return Workflow([
        Step("topic", lambda ctx: (started("topic") and "cats") or "cats"),
        Step("research", depends_on=("topic",), child=child),
        Step("report", lambda ctx: (started("report") and f"on {ctx['research']}") or
             f"on {ctx['research']}", ("research",)),
    ])


def main() -> None:
    kind, where, run_id, log, stop_at = sys.argv[1:6]
    store = make_store(kind, where, run_id)
    try:
        resume = store.load()
        result = workflow(log, int(stop_at)).run_sync(resume_from=resume, checkpoint_fn=store)
    finally:
        if hasattr(store, "close"):
            store.close()
    print(json.dumps(dict(result.outputs)), flush=True)


if __name__ == "__main__":
    main()
