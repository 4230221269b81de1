"""Runs, steps and workers log through ``ekit.*`` loggers, silent until someone listens.

A retry is an INFO record of ``ekit.step`` holding the error and the delay,
with ``run_id``, ``step`` and ``attempt`` as attributes; each attempt's start
and success are DEBUG; a run's start and end are ``ekit.run`` records. A
queue worker's records name the worker, the workflow and the lease's epoch,
its runs' step records too. Nothing reaches stderr unless the application
configures logging, and a run nobody listens to builds no event for it.
``ekit worker`` prints them: text lines by default, JSON lines with
``--log-format json``, DEBUG with ``-v``, warnings only with ``-q``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ekit_core import RetryPolicy
from ekit_runtime import Step, Workflow
from ekit_runtime import logs as ekit_logs
from ekit_runtime.cli import main
from ekit_runtime.queue import Worker, open_queue
from ekit_runtime.queue.cli import _masking
from ekit_runtime.queue.worker import _Drive
from tests.support.queue_backends import queue_url

__all__ = ["queue_url"]

ROOT = Path(__file__).resolve().parents[2]
FAST = RetryPolicy(max_attempts=3, backoff_base=0.001)


def _flaky(fails: int) -> Any:
    """An async step that raises ``ConnectionError`` on its first ``fails`` calls."""
    calls = [0]

    async def run(ctx: Any) -> str:
        calls[0] += 1
        if calls[0] <= fails:
            raise ConnectionError(f"refused, call {calls[0]}")
        return "fetched"

    return run


async def _first(ctx: Any) -> int:
    return 1


def _workflow(fails: int = 1) -> Workflow:
    return Workflow([Step("first", _first), Step("fetch", _flaky(fails), ("first",), retry=FAST)])


def _ekit(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("ekit.")]


def _events(records: list[logging.LogRecord]) -> list[str]:
    return [getattr(r, "event", None) or "?" for r in records]


def test_a_retry_is_an_info_record_with_its_reason_delay_and_attempt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="ekit"):
        result = _workflow(fails=1).run_sync(run_id="r-1")
    assert result.outputs["fetch"] == "fetched"
    records = _ekit(caplog)
    assert _events(records) == ["run_started", "step_retrying", "run_settled"]
    retry = records[1]
    assert (retry.name, retry.levelno) == ("ekit.step", logging.INFO)
    assert (retry.run_id, retry.step, retry.attempt) == ("r-1", "fetch", 1)  # type: ignore[attr-defined]
    assert retry.error_type == "ConnectionError" and retry.error == "refused, call 1"  # type: ignore[attr-defined]
    assert retry.delay == pytest.approx(0.001)  # type: ignore[attr-defined]
    message = retry.getMessage()
    assert "'fetch'" in message and "attempt 1" in message and "ConnectionError: refused, call 1" in message
    assert "retrying in 1 ms" in message and "'r-1'" in message
    settled = records[2]
    assert settled.name == "ekit.run" and settled.outcome == "finished"  # type: ignore[attr-defined]
    assert (settled.completed, settled.total) == (2, 2)  # type: ignore[attr-defined]


def test_debug_adds_each_attempts_start_and_success_and_every_record_has_every_field(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.DEBUG, logger="ekit"):
        _workflow(fails=1).run_sync()
    records = _ekit(caplog)
    assert _events(records) == [
        "run_started",
        "step_started", "step_succeeded",  # first
        "step_started", "step_retrying", "step_started", "step_succeeded",  # fetch, attempts 1 and 2
        "run_settled",
    ]
    tried = [(r.step, r.attempt) for r in records[3:7]]  # type: ignore[attr-defined]
    assert tried == [("fetch", 1), ("fetch", 1), ("fetch", 2), ("fetch", 2)]
    every = ("step_started", "step_succeeded")
    assert all(r.levelno == logging.DEBUG for r in records if r.event in every)  # type: ignore[attr-defined]
    assert records[5].delay == pytest.approx(0.001)  # type: ignore[attr-defined]  # started after its delay
    for record in records:
        # A format naming any of them works on every ekit record; unset ones are None.
        assert all(hasattr(record, name) for name in ekit_logs.FIELDS)
        assert record.run_id is None and record.worker is None  # type: ignore[attr-defined]


def test_a_step_that_fails_for_good_and_the_run_that_fails_are_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="ekit"), pytest.raises(ConnectionError):
        _workflow(fails=9).run_sync(run_id="doomed")
    records = _ekit(caplog)
    assert _events(records) == ["run_started", "step_retrying", "step_retrying", "step_failed", "run_settled"]
    failed = records[3]
    assert (failed.step, failed.attempt, failed.error_type) == ("fetch", 3, "ConnectionError")  # type: ignore[attr-defined]
    assert "not retried" in failed.getMessage()
    assert records[4].outcome == "failed"  # type: ignore[attr-defined]
    # A run's own records stay at INFO: its failure reaches the caller as the exception.
    assert max(r.levelno for r in records) == logging.INFO


def test_a_resume_says_how_many_steps_its_checkpoint_recorded(caplog: pytest.LogCaptureFixture) -> None:
    saved: list[Any] = []
    with pytest.raises(ConnectionError):
        _workflow(fails=9).run_sync(checkpoint_fn=saved.append)
    with caplog.at_level(logging.INFO, logger="ekit"):
        _workflow(fails=0).run_sync(resume_from=saved[-1])
    first = _ekit(caplog)[0]
    assert first.event == "run_resumed" and (first.recorded, first.total) == (1, 2)  # type: ignore[attr-defined]
    assert "resumed, 1 of 2 steps done" in first.getMessage()


def test_a_run_nobody_listens_to_builds_no_event_and_a_level_change_counts_from_the_next_run() -> None:
    ekit = logging.getLogger("ekit")
    before = ekit.level
    try:
        ekit.setLevel(logging.WARNING)
        quiet = _workflow().runner(run_id="q")
        assert quiet.trace is None and not quiet.record_events and not quiet.state.events
        ekit.setLevel(logging.INFO)
        assert quiet.trace is None  # decided as the run was made
        heard = _workflow().runner(run_id="h")
        assert heard.trace is not None and heard.record_events
        # A trace of the caller's own still gets every event, the log callback after it.
        mine: list[Any] = []
        both = _workflow().runner(trace=mine.append)
        assert isinstance(both.trace, tuple) and both.trace[0] == mine.append and len(both.trace) == 2
    finally:
        ekit.setLevel(before)


SILENT = """
import asyncio, sys
from ekit_core import RetryPolicy
from ekit_runtime import Step, Workflow
from ekit_runtime.queue import Worker, open_queue

calls = [0]
async def flaky(ctx):
    calls[0] += 1
    if calls[0] == 1:
        raise ConnectionError("refused")
    return "ok"
async def broken(ctx):
    raise ValueError("always")

flows = {
    "flaky": Workflow([Step("fetch", flaky, retry=RetryPolicy(max_attempts=2, backoff_base=0.001))]),
    "broken": Workflow([Step("fail", broken)]),
}
print(flows["flaky"].run_sync(run_id="direct").outputs["fetch"])
calls[0] = 0
queue = open_queue(sys.argv[1])
queue.submit("flaky", run_id="queued")
queue.submit("broken", run_id="bad")
print(asyncio.run(Worker(queue, flows, poll=0.01).run_until_idle()))
queue.close()
"""


def test_nothing_reaches_stderr_unless_the_application_configures_logging(tmp_path: Path) -> None:
    # A retry, a failed queued run (a WARNING of ekit.worker): without the
    # NullHandler, Python's last-resort handler would print that warning.
    script = tmp_path / "silent.py"
    script.write_text(SILENT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "q.db")],
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok", "2"]
    assert done.stderr == ""


def test_the_json_and_text_formatters_write_one_line_per_record_with_the_attributes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="ekit"):
        _workflow(fails=1).run_sync(run_id="r-json")
    records = _ekit(caplog)
    lines = [ekit_logs.JsonFormatter().format(r) for r in records]
    assert all("\n" not in line for line in lines)
    retry = json.loads(lines[1])
    assert retry["logger"] == "ekit.step" and retry["level"] == "INFO" and retry["event"] == "step_retrying"
    assert (retry["run_id"], retry["step"], retry["attempt"]) == ("r-json", "fetch", 1)
    assert retry["error_type"] == "ConnectionError" and retry["delay"] == pytest.approx(0.001)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", retry["time"])
    assert "worker" not in retry  # None attributes are left out
    text = ekit_logs.TextFormatter().format(records[1])
    assert re.fullmatch(r"\S+Z INFO ekit\.step: run 'r-json': step 'fetch' attempt 1 failed .*", text)


def test_log_event_sets_every_field_and_refuses_unknown_ones(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ekit"), ekit_logs.log_fields(worker="w1", epoch=3):
        ekit_logs.log_event(ekit_logs.WORKER, logging.INFO, "parked", "run %r parked: %s", "r9", "why",
                            run_id="r9", step="ask", reason="why")
        ekit_logs.log_event(ekit_logs.WORKER, logging.DEBUG, "hidden", "not enabled")
    (record,) = _ekit(caplog)
    assert record.getMessage() == "run 'r9' parked: why"
    assert (record.event, record.worker, record.epoch, record.run_id, record.step, record.attempt) == (  # type: ignore[attr-defined]
        "parked", "w1", 3, "r9", "ask", None)
    assert record.funcName == test_log_event_sets_every_field_and_refuses_unknown_ones.__name__
    with pytest.raises(ValueError, match="unknown field"), ekit_logs.log_fields(colour="red"):
        pass


def test_a_worker_logs_claims_endings_and_its_runs_steps_with_its_fields(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    queue = open_queue(str(tmp_path / "q.db"))
    flows = {"flaky": _workflow(fails=1), "broken": _workflow(fails=9)}
    queue.submit("flaky", run_id="good")
    queue.submit("broken", run_id="bad")
    with caplog.at_level(logging.INFO, logger="ekit"):
        asyncio.run(Worker(queue, flows, name="w-test", poll=0.01).run_until_idle())
    queue.close()
    records = _ekit(caplog)
    by_run: dict[str, list[logging.LogRecord]] = {}
    for record in records:
        assert record.worker == "w-test"  # type: ignore[attr-defined]
        by_run.setdefault(record.run_id, []).append(record)  # type: ignore[attr-defined]
    good = by_run["good"]
    assert _events(good) == ["claimed", "run_started", "step_retrying", "run_settled", "finished"]
    assert {(r.workflow, r.epoch) for r in good} == {("flaky", 1)}  # type: ignore[attr-defined]
    assert "claimed run 'good' (workflow 'flaky', epoch 1, new)" in good[0].getMessage()
    bad = by_run["bad"]
    assert _events(bad)[-1] == "failed" and bad[-1].levelno == logging.WARNING
    assert bad[-1].error == "ConnectionError: refused, call 3"  # type: ignore[attr-defined]


@pytest.mark.timeout(120)
def test_a_lost_lease_is_a_warning_record_naming_the_run_and_epoch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def stall(ctx: Any) -> int:
        time.sleep(0.9)  # noqa: ASYNC251 - blocks the loop past the lease: the stall under test
        return 1

    flows = {"stalls": Workflow([Step("a", stall), Step("b", _first, ("a",))])}
    queue = open_queue(str(tmp_path / "q.db"))
    queue.submit("stalls", run_id="stalled")
    worker = Worker(queue, flows, name="w-slow", lease_seconds=0.3, heartbeat=0.1, poll=0.01)

    async def until_lost() -> None:
        lost = asyncio.Event()
        watch = logging.Handler()
        watch.emit = lambda record: lost.set() if record.__dict__.get("event") == "lease_lost" else None  # type: ignore[method-assign]
        ekit_logs.WORKER.addHandler(watch)
        try:
            running = asyncio.create_task(worker.run())
            await asyncio.wait_for(lost.wait(), timeout=60)
            worker.stop()  # else it claims the run again once its lease has expired
            await running
        finally:
            ekit_logs.WORKER.removeHandler(watch)

    with caplog.at_level(logging.INFO, logger="ekit"):
        asyncio.run(until_lost())
    queue.close()
    lost = [r for r in _ekit(caplog) if r.event == "lease_lost"]  # type: ignore[attr-defined]
    assert lost and all(r.levelno == logging.WARNING for r in lost)
    first = lost[0]
    assert (first.run_id, first.epoch, first.worker, first.workflow) == ("stalled", 1, "w-slow", "stalls")  # type: ignore[attr-defined]
    assert "finished" not in _events(_ekit(caplog))


FLOWS = """
import os
from ekit_core import RetryPolicy
from ekit_runtime import Step, Workflow

async def first(ctx):
    return 1

async def fetch(ctx):
    # Fails on its first attempt in this process, for each run.
    mark = os.path.join(os.path.dirname(__file__), "tried-" + ctx["who"])
    if not os.path.exists(mark):
        open(mark, "w").close()
        raise ConnectionError("429 too many requests")
    return "fetched " + ctx["who"]

WORKFLOWS = {"fetcher": Workflow([
    Step("first", first),
    Step("fetch", fetch, ("first",), retry=RetryPolicy(max_attempts=2, backoff_base=0.001)),
])}
"""


def _worker(cwd: Path, url: str, *options: str) -> subprocess.CompletedProcess[str]:
    (cwd / "flows.py").write_text(textwrap.dedent(FLOWS))
    argv = ["worker", "--queue", url, "--workflows", "flows:WORKFLOWS", "--until-idle", "--lease", "10",
            "--name", "w-proc", *options]
    return subprocess.run(
        [sys.executable, "-m", "ekit_runtime", *argv],
        cwd=cwd, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120,
    )


@pytest.mark.timeout(180)
def test_ekit_worker_prints_json_lines_for_claims_retries_and_finishes(
    queue_url: str, tmp_path: Path
) -> None:
    queue = open_queue(queue_url)
    for who in ("ann", "bob"):
        queue.submit("fetcher", {"who": who}, run_id=f"run-{who}")
    done = _worker(tmp_path, queue_url, "--log-format", "json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["runs"] == {"finished": 2}
    lines = [json.loads(line) for line in done.stderr.splitlines()]  # every line is one JSON object
    for who in ("ann", "bob"):
        mine = [line for line in lines if line.get("run_id") == f"run-{who}"]
        assert [line["event"] for line in mine] == [
            "claimed", "run_started", "step_retrying", "run_settled", "finished"], mine
        assert all(line["worker"] == "w-proc" and line["workflow"] == "fetcher" for line in mine)
        assert all(line["epoch"] == 1 for line in mine)
        retry = mine[2]
        assert retry["logger"] == "ekit.step" and (retry["step"], retry["attempt"]) == ("fetch", 1)
        assert retry["error_type"] == "ConnectionError" and retry["error"] == "429 too many requests"
        assert "429 too many requests" in retry["message"] and "retrying in" in retry["message"]
        assert queue.status(f"run-{who}").status == "finished"
    queue.close()


@pytest.mark.timeout(180)
def test_ekit_worker_prints_text_lines_and_v_and_q_set_how_many(tmp_path: Path) -> None:
    url = str(tmp_path / "q.db")
    queue = open_queue(url)
    queue.submit("fetcher", {"who": "cy"}, run_id="run-cy")
    queue.submit("nobody", run_id="orphan")  # a workflow this worker lacks: a warning line
    verbose = _worker(tmp_path, url, "-v")
    assert verbose.returncode == 3, verbose.stderr
    lines = verbose.stderr.splitlines()
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
    assert all(re.match(stamp + r" (DEBUG|INFO|WARNING) ekit\.\w+: ", line) for line in lines), lines
    assert any(re.fullmatch(stamp + r" INFO ekit\.worker: worker w-proc: claimed run 'run-cy' .*", line)
               for line in lines)
    for expected in (
        "DEBUG ekit.step: run 'run-cy': step 'fetch' attempt 2 started after a",
        "INFO ekit.step: run 'run-cy': step 'fetch' attempt 1 failed",
        "WARNING ekit.worker: worker w-proc: run 'orphan' was left in the queue",
    ):
        assert any(expected in line for line in lines), (expected, lines)
    queue.submit("fetcher", {"who": "di"}, run_id="run-di")
    quiet = _worker(tmp_path, url, "-q")
    assert quiet.returncode == 3 and queue.status("run-di").status == "finished"
    assert [line.split(" ", 2)[1] for line in quiet.stderr.splitlines()] == ["WARNING"], quiet.stderr
    queue.close()


def test_ekit_worker_in_process_leaves_logging_as_it_found_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "q.db").touch()
    ekit, root = logging.getLogger("ekit"), logging.getLogger()
    before = (list(ekit.handlers), ekit.level, ekit.propagate, list(root.handlers), root.level)
    sys.modules.pop("flows", None)
    (tmp_path / "flows.py").write_text(textwrap.dedent(FLOWS))
    sys.path.insert(0, str(tmp_path))
    try:
        assert main(["worker", "--queue", str(tmp_path / "q.db"), "--workflows", "flows:WORKFLOWS",
                     "--until-idle"]) == 0
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("flows", None)
    assert (list(ekit.handlers), ekit.level, ekit.propagate, list(root.handlers), root.level) == before
    capsys.readouterr()


def test_the_queue_password_is_masked_in_record_attributes() -> None:
    record = logging.LogRecord("ekit.step", logging.INFO, __file__, 1, "m", None, None)
    record.__dict__.update(error="cannot reach postgresql://u:hunter2SECRET@db/x", step="fetch")
    assert _masking("postgresql://u:hunter2SECRET@db/x")(record)
    assert "SECRET" not in record.__dict__["error"] and record.__dict__["step"] == "fetch"



def test_giving_back_a_run_another_worker_took_over_is_a_lost_lease_not_a_release(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stopping worker gives its runs back; one whose lease expired and was claimed anew is not its own."""
    queue = open_queue(str(tmp_path / "q.db"))
    queue.submit("stalls", run_id="taken")
    stale = queue.claim("w-old", {"stalls": None}, 0.001)
    assert stale is not None and stale.epoch == 1
    deadline = time.monotonic() + 60
    while (fresh := queue.claim("w-new", {"stalls": None}, 60.0)) is None and time.monotonic() < deadline:
        threading.Event().wait(0.01)  # the old lease's expiry is the clock's to reach
    assert fresh is not None and fresh.epoch == 2
    worker = Worker(queue, {"stalls": Workflow([Step("a", _first)])}, name="w-old")
    drive = _Drive(stale, valid_until=0.0)
    with caplog.at_level(logging.INFO, logger="ekit"):
        asyncio.run(worker._give_back(drive))
    (info,) = queue.runs()
    queue.close()
    assert drive.outcome == "lost"
    assert (info.status, info.owner) == ("running", "w-new")  # the new holder's lease is untouched
    (lost,) = [r for r in _ekit(caplog) if r.event == "lease_lost"]  # type: ignore[attr-defined]
    assert lost.levelno == logging.WARNING and "given back" in lost.getMessage()
    assert (lost.run_id, lost.epoch, lost.worker) == ("taken", 1, "w-old")  # type: ignore[attr-defined]
    assert "released" not in _events(_ekit(caplog))
