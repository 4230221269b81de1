"""Every reader of a run's progress counts it one way: :mod:`ekit_core.progress`.

A run with mapped steps, items skipped by a condition, a mapped step whose
items were all skipped, and a takeover (its first worker stopped mid-run,
another resuming it): the second worker's "resuming with" line, the run's
"resumed" and "finished" lines, ``RunInfo.steps_done``/``steps_total``
(``ekit queue list``), the ``ProgressPrinter`` and the dashboard's item
counts all say what ``run_progress``/``items_progress`` say of the run's
checkpoints. A skip is done but not recorded: a mapped step whose items were
all skipped is drawn ``skipped``, not as work recorded.
"""

from __future__ import annotations

import asyncio
import io
import logging
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import RunSettled, RunStarted, audit
from ekit_core.progress import Progress, items_progress, run_progress
from ekit_runtime import ProgressPrinter, Step, Workflow
from ekit_runtime.queue import Lease, SqliteQueue, Worker
from ekit_runtime.ui.sources import step_states
from tests.support.shaped_runs import cutoff_pipeline


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record)

    def one(self, event: str, worker: str | None = None) -> logging.LogRecord:
        found = [r for r in self.seen if getattr(r, "event", None) == event
                 and (worker is None or getattr(r, "worker", None) == worker)]
        assert len(found) == 1, [r.getMessage() for r in self.seen]
        return found[0]


def _workflow(blocked: asyncio.Event, go_on: list[bool]) -> Workflow:
    async def work(ctx: dict[str, Any]) -> int:
        if ctx["split"] == 6 and not go_on:
            blocked.set()
            await asyncio.Event().wait()  # (until the worker is stopped)
        return int(ctx["split"]) * 10

    return Workflow([
        Step("split", lambda ctx: [1, 2, 3, 4, 5, 6]),
        Step("work", work, ("split",), map_over="split"),
        Step("escalate", lambda ctx: "E", ("split",), map_over="split", when=lambda ctx: ctx["split"] > 4),
        Step("never", lambda ctx: "N", ("split",), map_over="split", when=lambda ctx: False),
        Step("end", lambda ctx: "done", ("work", "escalate", "never")),
    ])


@pytest.mark.timeout(120)
def test_the_worker_the_queue_the_printer_and_the_dashboard_count_alike(tmp_path: Path) -> None:
    records = _Records()
    ekit = logging.getLogger("ekit")
    level = ekit.level
    ekit.addHandler(records)
    ekit.setLevel(logging.INFO)
    try:
        asyncio.run(_scenario(tmp_path, records))
    finally:
        ekit.removeHandler(records)
        ekit.setLevel(level)


async def _scenario(tmp_path: Path, records: _Records) -> None:
    blocked, go_on = asyncio.Event(), []
    flow = _workflow(blocked, go_on)
    queue = SqliteQueue(tmp_path / "q.db")
    printers: list[ProgressPrinter] = []

    settled = asyncio.Event()

    def trace(lease: Lease) -> list[Any]:
        printers.append(ProgressPrinter(io.StringIO(), tty=False, graph=flow, tick=None))
        return [printers[-1], lambda event: settled.set() if isinstance(event, RunSettled) else None]

    queue.submit("w", run_id="r")
    first = Worker(queue, {"w": flow}, name="first", trace=trace, poll=0.05)
    driving = asyncio.ensure_future(first.run())
    waiting = [asyncio.ensure_future(e.wait()) for e in (blocked, settled)]
    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    assert blocked.is_set(), records.seen[-1].getMessage()  # (the run reached its last item, not an end)
    first.stop()
    await driving
    taken_over = queue.checkpoint("r")
    assert taken_over is not None
    at_takeover = run_progress(taken_over)
    assert 0 < at_takeover.done < (at_takeover.total or 0)

    go_on.append(True)
    second = Worker(queue, {"w": flow}, name="second", trace=trace, poll=0.05)
    assert await second.run_until_idle() == 1
    final_checkpoint = queue.checkpoint("r")
    assert final_checkpoint is not None
    final = run_progress(final_checkpoint)
    # 5 declared steps, 6 items of each of 3 mapped steps: 4 + 6 of escalate's and never's skipped.
    assert final == Progress(recorded=5 + 6 + 2, skipped=4 + 6, failed=0, total=5 + 18)

    claimed = records.one("claimed", "second")
    assert (claimed.recorded, getattr(claimed, "total", None)) == (at_takeover.done, at_takeover.total)  # type: ignore[attr-defined]
    assert f"resuming with {at_takeover.text()}" in claimed.getMessage()
    resumed = records.one("run_resumed")
    assert (resumed.recorded, resumed.total) == (at_takeover.done, at_takeover.total)  # type: ignore[attr-defined]
    settled = [r for r in records.seen if getattr(r, "event", None) == "run_settled"][-1]
    assert (settled.completed, settled.total) == (final.done, final.total)  # type: ignore[attr-defined]
    assert settled.getMessage().endswith(f"finished, {final.text()}")

    info = queue.status("r")
    assert (info.steps_done, info.steps_total) == (final.done, final.total)
    assert (printers[-1].done, printers[-1].total) == (final.done, final.total)

    states, items = step_states(audit(flow, final_checkpoint), flow.graph, "finished", (),
                                items_progress(flow.graph, final_checkpoint))
    assert items == {"work": (6, 6), "escalate": (2, 6), "never": (0, 6)}
    assert (states["work"], states["escalate"], states["never"]) == ("recorded", "recorded", "skipped")
    queue.close()


def test_a_resume_whose_early_cutoff_keeps_items_counts_them_once() -> None:
    # The kept items are told (skipped: their input is unchanged) before their step expands,
    # and the expansion counts them as recorded: the printer counted them twice (16 of 12).
    calls: list[str] = []
    first = cutoff_pipeline(calls, split_version="1").run_sync({"pieces": ["a", "b", "c"]})
    assert first.checkpoint is not None
    flow = cutoff_pipeline(calls, split_version="2")
    printer = ProgressPrinter(io.StringIO(), tty=False, graph=flow, tick=None)
    second = flow.run_sync({"pieces": ["a", "B2", "c", "d"]}, resume_from=first.checkpoint, trace=printer)
    assert second.checkpoint is not None
    final = run_progress(second.checkpoint)
    assert final == Progress(recorded=12, skipped=0, failed=0, total=12)
    assert (printer.done, printer.total, printer.skipped_by_condition) == (final.done, final.total, 0)


class _Flaky(RuntimeError):
    pass


def _random_flow(n: int, skip1: frozenset[int], skip2: frozenset[int], gate: bool,
                 failing: set[str]) -> Workflow:
    def item_step(name: str) -> Any:
        def run(ctx: dict[str, Any]) -> int:
            key = f"{name}[{ctx['split']}]"
            if key in failing:  # fails once, then succeeds (on a resume)
                failing.discard(key)
                raise _Flaky(key)
            return int(ctx["split"])

        return run

    return Workflow([
        Step("split", lambda ctx: list(range(n))),
        Step("m1", item_step("m1"), ("split",), map_over="split", when=lambda c: c["split"] not in skip1),
        Step("m2", item_step("m2"), ("split",), map_over="split", when=lambda c: c["split"] not in skip2),
        Step("c", lambda ctx: "C", ("split",), when=lambda c: gate),
        Step("end", lambda ctx: "E", ("m1", "m2", "c"), join="any"),
    ])


@pytest.mark.timeout(300)  # (for all the examples: a deadlock detector)
@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 5), skip1=st.frozensets(st.integers(0, 5)), skip2=st.frozensets(st.integers(0, 5)),
       gate=st.booleans(), fails=st.sets(st.sampled_from([f"m{k}[{i}]" for k in (1, 2) for i in range(5)])))
def test_every_run_s_counts_agree_with_its_checkpoint(
    n: int, skip1: frozenset[int], skip2: frozenset[int], gate: bool, fails: set[str]
) -> None:
    # A run that fails on a flaky item, resumed until it finishes: at each start and each end,
    # RunStarted, RunSettled and the printer count what run_progress counts of the checkpoint.
    flow = _random_flow(n, skip1, skip2, gate, set(fails))
    resume: Any = None
    for _ in range(len(fails) + 2):
        events: list[Any] = []
        saved: list[Any] = []
        printer = ProgressPrinter(io.StringIO(), tty=False, graph=flow, tick=None)
        try:
            flow.run_sync(resume_from=resume, checkpoint_fn=saved.append, trace=[events.append, printer])
            finished = True
        except (_Flaky, ExceptionGroup):  # (several items failing at once: a group of them)
            finished = False
        started = next(e for e in events if isinstance(e, RunStarted))
        if resume is not None:
            before = run_progress(resume)
            assert (started.recorded + started.skipped, started.total) == (before.done, before.total)
        after = run_progress(saved[-1] if saved else resume)
        settled = [e for e in events if isinstance(e, RunSettled)][-1]
        assert (settled.completed + settled.skipped, settled.total) == (after.done, after.total)
        assert (printer.done, printer.total) == (after.done, after.total)
        if finished:
            assert after.done == after.total
            return
        resume = saved[-1] if saved else resume
    raise AssertionError("the run never finished")
