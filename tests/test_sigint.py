"""A real Ctrl-C (SIGINT) during a run: the sibling in flight is cancelled,
the final checkpoint holds what finished, and KeyboardInterrupt reaches the caller."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ekit_runtime import WorkflowCheckpoint

CHILD = Path(__file__).with_name("sigint_child.py")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigint_saves_a_final_checkpoint_and_cancels_the_sibling(tmp_path: Path) -> None:
    checkpoint = tmp_path / "cp.json"
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(checkpoint)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "ready"  # blocks until the first save
        child.send_signal(signal.SIGINT)
        out, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, out
    # The sibling is cancelled, then the final checkpoint is saved, then the
    # interrupt reaches the caller.
    assert out.splitlines() == ["sibling cancelled", "saved 1", "interrupted"]
    final = WorkflowCheckpoint.from_dict(json.loads(checkpoint.read_text()))
    assert dict(final.outputs) == {"quick": "done"}
    assert "slow" not in final.failures
