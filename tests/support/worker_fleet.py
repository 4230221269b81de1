"""Worker processes of the queue tests (tests/support/queue_worker_child.py), killed at teardown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Fleet:
    """Worker processes of one test, stopped (SIGKILL) at teardown whatever happened."""

    def __init__(self, url: str, logdir: Path) -> None:
        self.url, self.logdir = url, logdir
        self.procs: list[subprocess.Popen[str]] = []

    def start(
        self, *, lease: float = 1.0, heartbeat: float = 0.2, max_runs: int = 2, hold_after: int | None = None
    ) -> subprocess.Popen[str]:
        argv = [sys.executable, "-m", "tests.support.queue_worker_child", self.url, str(self.logdir)]
        argv += ["--lease", str(lease), "--heartbeat", str(heartbeat), "--max-runs", str(max_runs)]
        if hold_after is not None:
            argv += ["--hold-after", str(hold_after)]
        with open(self.logdir / f"stderr-{len(self.procs)}", "w") as stderr:
            # The child keeps its own copy of the file descriptor.
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        self.procs.append(proc)
        return proc

    def stderr(self, index: int) -> str:
        return (self.logdir / f"stderr-{index}").read_text()

    def lines(self, kind: str) -> list[list[str]]:
        out = []
        for path in self.logdir.glob(f"{kind}-*.log"):
            out.extend(line.split() for line in path.read_text().splitlines())
        return out

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
