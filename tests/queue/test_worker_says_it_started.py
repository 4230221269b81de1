"""``ekit worker`` says it started before it claims anything: its name, its queue, its workflows.

A worker on an empty queue used to print nothing until its first claim, so
a person could not tell a live worker from a stuck one. Its first log line
names the worker, the queue (its password masked) and the workflows it
serves; in JSON logs it is the ``worker_started`` event.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLOWS = """
from ekit_runtime import Step, Workflow
WORKFLOWS = {"hello": Workflow([Step("greet", lambda ctx: "hi")]),
             "bye": Workflow([Step("wave", lambda ctx: "bye")])}
"""


def _worker(cwd: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    (cwd / "flows.py").write_text(FLOWS)
    argv = ["worker", "--queue", str(cwd / "q.db"), "--workflows", "flows:WORKFLOWS", "--until-idle",
            "--name", "w-1", *flags]
    return subprocess.run(
        [sys.executable, "-m", "ekit_runtime", *argv], cwd=cwd, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.timeout(120)
def test_the_first_line_names_the_worker_its_queue_and_workflows(tmp_path: Path) -> None:
    done = _worker(tmp_path)
    assert done.returncode == 0, done.stderr
    first = done.stderr.splitlines()[0]
    assert "worker w-1: started" in first
    assert str(tmp_path / "q.db") in first and "bye, hello" in first


@pytest.mark.timeout(120)
def test_in_json_logs_it_is_the_worker_started_event(tmp_path: Path) -> None:
    done = _worker(tmp_path, "--log-format", "json")
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stderr.splitlines()[0])
    assert (record["event"], record["worker"]) == ("worker_started", "w-1")
