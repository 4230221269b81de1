"""A real process SIGKILLed in a child workflow's k-th step resumes from its store at the k-th.

The process (tests/support/child_workflow_kill_child.py) saves through a
journal, SQLite or PostgreSQL store after every step; it is killed while the
child's k-th step is in flight. A second process resumes from the store: no
step recorded before the kill starts again, and the run ends as an
uninterrupted one does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

CHILD = Path(__file__).resolve().parents[1] / "support" / "child_workflow_kill_child.py"
KINDS = ["journal", "sqlite", "postgres"]

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")


def _where(kind: str, tmp_path: Path) -> str:
    if kind == "postgres":
        dsn = os.environ.get("EKIT_TEST_POSTGRES_DSN")
        if not dsn:
            pytest.skip("EKIT_TEST_POSTGRES_DSN is not set")
        return dsn
    return str(tmp_path / ("cp.jsonl" if kind == "journal" else "cp.db"))


@pytest.mark.parametrize("k", [1, 4, 6])
@pytest.mark.parametrize("kind", KINDS)
def test_a_process_killed_in_the_childs_kth_step_resumes_at_the_kth(
        kind: str, k: int, tmp_path: Path) -> None:
    where, run_id, log = _where(kind, tmp_path), f"child-kill-{uuid.uuid4().hex}", tmp_path / "starts"
    argv = [sys.executable, str(CHILD), kind, where, run_id, str(log), str(k)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # (a deadlock detector: the child prints it, then waits)
        assert line == f"at {k}\n", proc.stderr.read() if proc.stderr else line
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    before = log.read_text().split()
    assert before == ["topic", *(f"research/s{i}" for i in range(1, k + 1))]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    outputs = json.loads(done.stdout.splitlines()[-1])
    expected = "cats" + "".join(f"+{i}" for i in range(1, 7))
    assert outputs["research"] == expected and outputs["report"] == f"on {expected}"
    after = log.read_text().split()[len(before):]
    assert after == [*(f"research/s{i}" for i in range(k, 7)), "report"], \
        "a step recorded before the kill started again, or one was skipped"
