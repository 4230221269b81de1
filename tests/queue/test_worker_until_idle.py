"""``ekit worker --until-idle`` names every run it leaves waiting, and says so in its exit status.

A run of a workflow the worker does not have, a run begun by another
version of the graph, and a run still leased to a worker that died are each
a warning line saying why it was not taken, listed under ``"left"`` in the
JSON summary, and exit status 3; a queue drained to the last run exits 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ekit_runtime import Step, Workflow
from ekit_runtime.queue import open_queue
from ekit_runtime.queue.cli import EXIT_LEFT
from tests.support.queue_backends import queue_url

__all__ = ["queue_url"]

ROOT = Path(__file__).resolve().parents[2]
FLOWS = """
from ekit_runtime import Step, Workflow
WORKFLOWS = {"hello": Workflow([Step("greet", lambda ctx: "hello " + ctx["who"]),
                                Step("shout", lambda ctx: ctx["greet"].upper(), ("greet",))])}
"""


def _until_idle(cwd: Path, url: str) -> subprocess.CompletedProcess[str]:
    (cwd / "flows.py").write_text(FLOWS)
    argv = ["worker", "--queue", url, "--workflows", "flows:WORKFLOWS", "--until-idle", "--lease", "5"]
    return subprocess.run(
        [sys.executable, "-m", "ekit_runtime", *argv],
        cwd=cwd,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.timeout(120)
def test_runs_left_waiting_are_named_with_why_and_the_exit_status_says_so(
    queue_url: str, tmp_path: Path
) -> None:
    q = open_queue(queue_url)
    q.submit("ghost", run_id="unknown-workflow")
    # Begun by version 1 of "hello", whose graph had one step only.
    q.submit("hello", {"who": "v1"}, run_id="old-version", priority=9)
    older = Workflow([Step("greet", lambda ctx: "hi")])
    saved = []
    older.run_sync({"who": "v1"}, checkpoint_fn=saved.append)
    lease = q.claim("deploy-1", {"hello": older.graph.fingerprint}, 30)
    assert lease is not None and lease.run_id == "old-version"
    q.save(lease, saved[0], 30)
    q.release(lease)
    # Leased to a worker that died a moment ago: nobody renews it, but it has not expired.
    q.submit("hello", {"who": "dead"}, run_id="leased-to-the-dead", priority=5)
    dead = q.claim("dead-worker", {"hello": None}, 600)
    assert dead is not None and dead.run_id == "leased-to-the-dead"
    q.submit("hello", {"who": "owls"}, run_id="drivable")

    done = _until_idle(tmp_path, queue_url)
    assert done.returncode == EXIT_LEFT == 3, done.stderr
    summary = json.loads(done.stdout)
    assert summary["runs"] == {"finished": 1}
    left = summary["left"]
    assert set(left) == {"unknown-workflow", "old-version", "leased-to-the-dead"}
    assert "workflow 'ghost' is not one this worker has (it has 'hello')" in left["unknown-workflow"]
    assert "another version of workflow 'hello'" in left["old-version"]
    assert "leased to 'dead-worker' (epoch 1)" in left["leased-to-the-dead"]
    for run_id, why in left.items():
        assert f"run {run_id!r} was left in the queue: {why}" in done.stderr
    q.close()


@pytest.mark.timeout(60)
def test_a_drained_queue_exits_0_with_nothing_left(tmp_path: Path) -> None:
    url = str(tmp_path / "q.db")
    q = open_queue(url)
    q.submit("hello", {"who": "bats"})
    done = _until_idle(tmp_path, url)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["left"] == {} and json.loads(done.stdout)["runs"] == {"finished": 1}
    assert "left in the queue" not in done.stderr
    q.close()
