"""What the queued-child tests share: a claim, two queues on one database, a spawner whose
children never end, and real ``ekit worker`` processes with the step starts they log.

Each crash test writes its own workflows (``flows``: the source of a module holding ``WORKFLOWS``)
and reads its fault point from its own environment (``env``); what they share is how the
workers start (one run each, a short lease, the module beside them) and that every step start
is appended and fsynced to ``starts.log``, so the counts survive a SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime.queue import Lease, RunQueue, open_queue

ROOT = Path(__file__).resolve().parents[2]


def claimed(queue: RunQueue, run_id: str, workflow: str = "wf") -> Lease:
    """Claim ``run_id`` (the only claimable run of ``workflow``)."""
    lease = queue.claim("w", {workflow: None}, 600)
    assert lease is not None and lease.run_id == run_id
    return lease


@pytest.fixture
def queues(postgres_url: str) -> Iterator[tuple[RunQueue, RunQueue]]:
    """Two queues on one database: one connection for each side of a race."""
    first, second = open_queue(postgres_url), open_queue(postgres_url)
    try:
        yield first, second
    finally:
        first.close()
        second.close()


class NeverEnding:
    """A spawner whose children never end: a run of a queued child waits for it (and its
    checkpoint records the wait); the child of ``step`` is ``p/step``."""

    def child_run_id(self, step: str, number: int) -> str:
        return f"p/{step}"

    async def state(self, run_id: str, output: str) -> None:
        return None

    async def spawn(self, run_id: str, step: str, workflow: Any, context: Any) -> None:
        return None

STARTED = '''
def started(name):
    with open(LOG, "a", encoding="utf-8") as f:
        f.write(name + "\\n")
        f.flush()
        os.fsync(f.fileno())
'''
"""The flows' ``started(name)``: log a step's start durably (``LOG`` is ``CHILD_LOG``)."""


@contextmanager
def child_workers(tmp_path: Path, url: str, count: int, flows: str, env: Mapping[str, str],
                  *flags: str, tag: str = "") -> Iterator[list[subprocess.Popen[str]]]:
    """``count`` worker processes of one run each on ``flows``, stopped (SIGKILL) when the
    block ends; each one's stderr in ``stderr-{tag}-{i}`` (``stderr-{i}`` without a tag)."""
    (tmp_path / "flows.py").write_text(flows)
    environ = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", **env,
               "CHILD_LOG": str(tmp_path / "starts.log"), "CHILD_GATE": str(tmp_path / "gate"),
               "CHILD_MARK": str(tmp_path / "killed")}
    argv = [sys.executable, "-m", "ekit_runtime", "worker", "--queue", url, "--workflows", "flows:WORKFLOWS",
            "--lease", "2", "--heartbeat", "0.3", "--max-runs", "1", *flags]
    prefix = f"stderr-{tag}-" if tag else "stderr-"
    with contextlib.ExitStack() as files:
        errs = [files.enter_context(open(tmp_path / f"{prefix}{i}", "w")) for i in range(count)]
        procs = [subprocess.Popen(argv, cwd=tmp_path, env=environ, stdout=subprocess.DEVNULL, stderr=err,
                                  text=True) for err in errs]
        try:
            yield procs
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()


def starts(tmp_path: Path) -> Counter[str]:
    """How often each step started, from the workers' ``starts.log``."""
    log = tmp_path / "starts.log"
    return Counter(log.read_text().split()) if log.exists() else Counter()
