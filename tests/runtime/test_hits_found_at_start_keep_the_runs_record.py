"""Hits found as a run starts are folded into the checkpoint the run starts from: every field
of the resumed record the run carries on (the workers that drove it, a loop's compacted counts)
must survive that fold, or the next save forgets them."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from ekit_runtime import Done, Repeat, SqliteCache, Step, Workflow, WorkflowCheckpoint


def _resumable(cp: WorkflowCheckpoint, forget: str) -> WorkflowCheckpoint:
    """``cp`` without ``forget``'s output, so the resume finds it in the cache at its start."""
    data = cp.to_dict()
    data["outputs"].pop(forget)
    return WorkflowCheckpoint.from_dict(data)


def test_a_hit_at_start_keeps_the_drives_and_a_loops_compacted_count(tmp_path: Path) -> None:
    cache = SqliteCache(tmp_path / "cache.db")
    calls: list[str] = []

    def workflow(stop_at: int | None) -> Workflow:
        def agent(ctx: Any) -> Any:
            k = ctx["agent"].number
            calls.append(f"agent#{k}")
            if k == stop_at:
                raise KeyboardInterrupt
            return Done(k) if k == 5 else k

        return Workflow([Step("cached", lambda ctx: "c", cache=True),
                         Step("agent", agent, ("cached",), repeat=Repeat(6, keep_last=1))])

    saved: list[WorkflowCheckpoint] = []
    with contextlib.suppress(KeyboardInterrupt):
        workflow(4).run_sync(run_id="r", checkpoint_fn=saved.append, cache=cache, worker="w1",
                             max_concurrency=1)
    assert dict(saved[-1].compacted) == {"agent": 2}
    calls.clear()
    done = workflow(None).run_sync(run_id="r", resume_from=_resumable(saved[-1], "cached"),
                                   checkpoint_fn=saved.append, cache=cache, worker="w2",
                                   max_concurrency=1)
    assert done.checkpoint is not None
    assert set(done.checkpoint.cache_hits) == {"cached"}
    assert [d.worker for d in done.checkpoint.drives] == ["w1", "w2"]
    assert calls == ["agent#4", "agent#5"], "a compacted or recorded iteration ran again"
    assert dict(done.checkpoint.compacted) == {"agent": 4}


def test_a_hit_at_start_keeps_the_workers_that_drove_the_run(tmp_path: Path) -> None:
    cache = SqliteCache(tmp_path / "cache.db")

    def workflow(interrupt: bool) -> Workflow:
        def write(ctx: Any) -> str:
            if interrupt:
                raise KeyboardInterrupt
            return f"{ctx['outline']}!"

        return Workflow([Step("outline", lambda ctx: "o", cache=True),
                         Step("write", write, ("outline",))])

    saved: list[WorkflowCheckpoint] = []
    with contextlib.suppress(KeyboardInterrupt):
        workflow(True).run_sync(run_id="r", checkpoint_fn=saved.append, cache=cache, worker="w1")
    assert [d.worker for d in saved[-1].drives] == ["w1"]
    done = workflow(False).run_sync(run_id="r", resume_from=_resumable(saved[-1], "outline"),
                                    cache=cache, worker="w2")
    assert done.checkpoint is not None and set(done.checkpoint.cache_hits) == {"outline"}
    assert [d.worker for d in done.checkpoint.drives] == ["w1", "w2"]
