"""Run the ``ekit`` command for real, in a subprocess, and read what it said."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def ekit(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ekit_runtime", *args],
        cwd=cwd, capture_output=True, text=True, timeout=60,
        env=None if env is None else {**os.environ, **env},
        # Read back what the command wrote, escapes included, whatever it was.
        encoding="utf-8", errors="backslashreplace",
    )


def one_error_line(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode == 2, proc
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ekit:")]
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
