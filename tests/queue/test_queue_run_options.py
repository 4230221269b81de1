"""A queued run is driven with the options it was submitted with, by real worker processes.

``submit(..., options=...)`` stores plain-data run options with the run; the
``ekit worker`` process that drives it applies them over its own defaults
(``--max-concurrency``, ``--budget-*``, ``--isolate-failures``) and gives it
what is code: an executor and a trace made for each run (``--trace``). Bad
options are refused, naming the option, before anything is stored.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ekit_core import TokenUsage
from ekit_runtime.cli import main
from ekit_runtime.queue import RunQueue, Worker, open_queue
from tests.support.queue_backends import queue, queue_url
from tests.support.queue_options_child import REGISTRY

__all__ = ["queue", "queue_url"]

ROOT = Path(__file__).resolve().parents[2]
FLOWS = "tests.support.queue_options_child:REGISTRY"


def _worker(url: str, *flags: str) -> dict[str, Any]:
    """Run ``ekit worker --until-idle`` as its own process; its JSON summary."""
    done = subprocess.run(
        [sys.executable, "-m", "ekit_runtime", "worker", "--queue", url, "--workflows", FLOWS,
         "--until-idle", "--lease", "10", "--max-runs", "1", *flags],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def _inflight_max(log: Path) -> int:
    """The most steps that were between ``enter`` and ``exit`` at once, from the ordered log."""
    now = peak = 0
    for line in log.read_text().split():
        now += {"enter": 1, "exit": -1}.get(line, 0)
        peak = max(peak, now)
    return peak


@pytest.mark.timeout(180)
def test_a_budget_in_the_options_stops_the_run_and_keeps_its_checkpoint(
    queue_url: str, tmp_path: Path
) -> None:
    with open_queue(queue_url) as q:
        q.submit("spend", {"logdir": str(tmp_path)}, run_id="capped", options={"budget": {"llm_calls": 2}})
        q.submit("spend", {"logdir": str(tmp_path)}, run_id="free")
    assert _worker(queue_url)["runs"] == {"failed": 1, "finished": 1}
    with open_queue(queue_url) as q:
        capped = q.status("capped")
        assert capped.status == "failed"
        assert capped.error is not None and capped.error.startswith("BudgetExceeded: token budget reached")
        checkpoint = q.checkpoint("capped")
        assert checkpoint is not None and sorted(checkpoint.outputs) == ["s1", "s2"]
        assert checkpoint.cost == TokenUsage(input_tokens=20, llm_calls=2)
        assert (capped.steps_done, capped.steps_total, capped.cost) == (2, 4, checkpoint.cost)
        assert capped.options == {"budget": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 2}}
        assert q.status("free").status == "finished" and q.status("free").steps_done == 4
    assert (tmp_path / "capped.log").read_text().split() == ["start:s1", "start:s2"]


@pytest.mark.timeout(180)
def test_max_concurrency_is_observed_and_a_run_s_own_overrides_the_worker_s(
    queue_url: str, tmp_path: Path
) -> None:
    with open_queue(queue_url) as q:
        q.submit("wide", {"logdir": str(tmp_path), "expect": 2}, run_id="two", options={"max_concurrency": 2})
        q.submit("wide", {"logdir": str(tmp_path), "expect": 3}, run_id="default")
    assert _worker(queue_url, "--max-concurrency", "3")["runs"] == {"finished": 2}
    # The steps wait until `expect` of them are in: a limit not applied would show more.
    assert _inflight_max(tmp_path / "two.log") == 2
    assert _inflight_max(tmp_path / "default.log") == 3


@pytest.mark.timeout(180)
def test_isolate_failures_runs_the_rest_and_fails_the_run_naming_the_step(
    queue_url: str, tmp_path: Path
) -> None:
    with open_queue(queue_url) as q:
        q.submit("isolate", {"logdir": str(tmp_path)}, run_id="own", options={"isolate_failures": True})
        q.submit("isolate", {"logdir": str(tmp_path)}, run_id="flag")
    assert _worker(queue_url, "--isolate-failures")["runs"] == {"failed": 2}
    with open_queue(queue_url) as q:
        for run_id in ("own", "flag"):
            info = q.status(run_id)
            assert info.error is not None
            assert info.error.startswith("StepsFailed: 1 step(s) failed with isolate_failures: 'b'")
            assert "RuntimeError: b broke" in info.error and "not started: 'c'" in info.error
            checkpoint = q.checkpoint(run_id)
            assert checkpoint is not None and sorted(checkpoint.outputs) == ["a", "d"]


@pytest.mark.timeout(180)
def test_the_trace_factory_is_called_once_per_drive_and_sees_its_events(
    queue_url: str, tmp_path: Path
) -> None:
    with open_queue(queue_url) as q:
        for run_id in ("t1", "t2"):
            q.submit("mapped", {"logdir": str(tmp_path)}, run_id=run_id)
    trace = "tests.support.queue_options_child:trace_factory"
    assert _worker(queue_url, "--trace", trace)["runs"] == {"finished": 2}
    for run_id in ("t1", "t2"):
        lines = (tmp_path / f"trace-{run_id}.log").read_text().splitlines()
        assert lines[0] == "call mapped" and lines.count("call mapped") == 1
        assert lines[1] == "RunStarted" and lines[-1] == "RunSettled"
        assert lines.count("StepFinished") == 6  # split, three items, their join, t


def test_bad_options_are_refused_naming_them_before_anything_is_stored(queue: RunQueue) -> None:
    for options, named in (
        ({"trace": print}, "'trace'"),
        ({"budget": lambda: 1}, "'budget'"),
        ({"budget": {"calls": 1}}, "calls"),
        ({"max_concurrency": 0}, "'max_concurrency'"),
        ({"max_concurrency": print}, "a callable"),
        ({"isolate_failures": "yes"}, "'isolate_failures'"),
        ("max_concurrency=2", "mapping"),
    ):
        with pytest.raises(ValueError, match=named):
            queue.submit("spend", {}, run_id="r", options=options)  # type: ignore[arg-type]
    assert queue.runs() == []
    with pytest.raises(ValueError, match="'bogus'"):
        Worker(queue, REGISTRY, defaults={"bogus": 1})
    with pytest.raises(ValueError, match="executor must be an ekit Executor"):
        Worker(queue, REGISTRY, executor=print)  # type: ignore[arg-type]


def test_a_resubmit_keeps_the_options_the_run_was_stored_with(queue: RunQueue) -> None:
    queue.submit("spend", {}, run_id="r", options={"max_concurrency": 2, "budget": TokenUsage(llm_calls=5)})
    assert queue.submit("spend", {}, run_id="r", options={"max_concurrency": 7}) == "r"
    assert queue.status("r").options == {
        "max_concurrency": 2, "budget": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 5}
    }


def test_ekit_queue_submit_takes_options_and_refuses_bad_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = str(tmp_path / "q.db")
    argv = ["queue", "--queue", url, "submit", "spend", "--run-id", "r", "--options",
            '{"budget": {"llm_calls": 3}}', "--option", "max_concurrency=2",
            "--option", "isolate_failures=true"]
    assert main(argv) == 0
    with open_queue(url) as q:
        assert q.status("r").options == {
            "budget": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 3},
            "max_concurrency": 2,
            "isolate_failures": True,
        }
    capsys.readouterr()
    for bad, said in (
        (["--option", "nope=1"], "unknown run option(s) in options: 'nope'"),
        (["--option", "max_concurrency"], "expected KEY=VALUE"),
        (["--options", "[1]"], "must be a JSON object"),
        (["--options", "{"], "--options is not JSON"),
    ):
        assert main(["queue", "--queue", url, "submit", "spend", "--run-id", "s", *bad]) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1
    with open_queue(url) as q:
        assert [r.run_id for r in q.runs()] == ["r"]


def test_the_help_documents_every_run_setting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--max-concurrency N", "--budget-calls N", "--budget-input-tokens N",
                 "--budget-output-tokens N", "--isolate-failures", "--executor MODULE:ATTR",
                 "--trace otel|progress|MODULE:ATTR", "overrides them name by name", "--durations"):
        assert flag in out
    assert main(["queue", "--queue", "q.db", "submit", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--option KEY=VALUE a run option stored with the run" in out
    assert "--options JSON the run options as one JSON object" in out


@pytest.mark.timeout(120)
def test_ekit_worker_traces_progress_per_run_and_refuses_bad_settings(tmp_path: Path) -> None:
    url = str(tmp_path / "q.db")
    with open_queue(url) as q:
        q.submit("mapped", {}, run_id="m")
        q.submit("mapped", {}, run_id="n")
    done = subprocess.run(
        [sys.executable, "-m", "ekit_runtime", "worker", "--queue", url, "--workflows", FLOWS, "--until-idle",
         "--trace", "progress", "--executor", "ekit_runtime.executors:DEFAULT_EXECUTOR"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    for run in ("m", "n"):  # two runs print side by side: every line names its run
        assert f"run {run}: run started: 3 steps" in lines  # the mapped step's items are not known yet
        assert any(line.startswith(f"run {run}: run finished: 6/6 steps") for line in lines)
        assert any(line.startswith(f"run {run}: [") for line in lines)
    for flags, said in (
        (["--executor", "os:path"], "--executor os:path: not an ekit Executor (got module)"),
        (["--executor", "nowhere"], "--executor nowhere: expected MODULE:ATTR"),
        (["--trace", "os:sep"], "--trace os:sep: not callable (got str)"),
        (["--max-concurrency", "0"], "run option 'max_concurrency' must be a positive int"),
        (["--budget-calls", "-1"], "llm_calls must be an int >= 0"),
    ):
        refused = subprocess.run(
            [sys.executable, "-m", "ekit_runtime", "worker", "--queue", url, "--workflows", FLOWS,
             "--until-idle", *flags],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
            timeout=120,
        )
        assert refused.returncode == 2 and said in refused.stderr, refused.stderr
