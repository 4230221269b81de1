"""``ekit worker`` and ``ekit queue`` as a user runs them, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.queue_backends import queue_url

__all__ = ["queue_url"]

ROOT = Path(__file__).resolve().parents[2]
FLOWS = """
from ekit_runtime import Step, Workflow
WORKFLOWS = {"hello": Workflow([Step("greet", lambda ctx: "hello " + ctx["who"]),
                                Step("shout", lambda ctx: ctx["greet"].upper(), ("greet",))])}
"""


def _ekit(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "ekit_runtime", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.timeout(120)
def test_submit_drain_inspect_and_audit(queue_url: str, tmp_path: Path) -> None:
    (tmp_path / "flows.py").write_text(FLOWS)
    q = ("--queue", queue_url)
    for who in ("owls", "bats"):
        done = _ekit(
            tmp_path, "queue", *q, "submit", "hello", "--context", json.dumps({"who": who}), "--run-id", who
        )
        assert done.returncode == 0, done.stderr
    again = _ekit(tmp_path, "queue", *q, "submit", "hello", "--context", "{}", "--run-id", "owls")
    assert json.loads(again.stdout) == {"run_id": "owls"}
    worker = _ekit(tmp_path, "worker", *q, "--workflows", "flows:WORKFLOWS", "--until-idle", "--lease", "5")
    assert worker.returncode == 0, worker.stderr
    assert json.loads(worker.stdout)["runs"] == {"finished": 2}
    listed = json.loads(_ekit(tmp_path, "queue", *q, "list", "--status", "finished", "--json").stdout)
    assert [r["run_id"] for r in listed] == ["owls", "bats"]
    checkpoint = _ekit(tmp_path, "queue", *q, "checkpoint", "owls")
    assert json.loads(checkpoint.stdout)["outputs"] == {"greet": "hello owls", "shout": "HELLO OWLS"}
    (tmp_path / "owls.json").write_text(checkpoint.stdout)
    audit = _ekit(tmp_path, "audit", "owls.json")
    assert audit.returncode == 0 and "skips 2 step(s), runs 0" in audit.stdout
    limits = _ekit(tmp_path, "queue", *q, "limits", "--max-in-flight", "3")
    assert json.loads(limits.stdout)["max_in_flight"] == 3
    assert json.loads(_ekit(tmp_path, "queue", *q, "prune", "--older-than", "3600").stdout) == {"deleted": 0}


def test_bad_input_is_one_line_and_exit_2(queue_url: str, tmp_path: Path) -> None:
    missing = _ekit(tmp_path, "queue", "--queue", queue_url, "status", "nope")
    assert missing.returncode == 2 and missing.stderr.strip() == "ekit: no run 'nope' in the queue"
    bad = _ekit(tmp_path, "worker", "--queue", queue_url, "--workflows", "nomodule:X", "--until-idle")
    assert bad.returncode == 2 and "cannot import it" in bad.stderr and "Traceback" not in bad.stderr
    url = _ekit(tmp_path, "queue", "--queue", "redis://x", "list")
    assert url.returncode == 2 and "expected sqlite:///PATH or postgresql://" in url.stderr
    context = _ekit(tmp_path, "queue", "--queue", queue_url, "submit", "hello", "--context", "{nope")
    assert context.returncode == 2 and "--context is not JSON" in context.stderr
