"""A real Ctrl-C (SIGINT) during a run: the sibling in flight is cancelled,
the final checkpoint holds what finished, and KeyboardInterrupt reaches the caller."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ekit_runtime import WorkflowCheckpoint

CHILD = Path(__file__).parents[1] / "support" / "sigint_child.py"
SWALLOW_CHILD = Path(__file__).parents[1] / "support" / "sigint_swallow_child.py"
ROOT = Path(__file__).resolve().parents[2]
# The children import this checkout's packages, not whichever one is installed.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigint_saves_a_final_checkpoint_and_cancels_the_sibling(tmp_path: Path) -> None:
    checkpoint = tmp_path / "cp.json"
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(checkpoint)],
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
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


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("where", ["checkpoint", "step"])
def test_sigint_is_not_lost_when_the_only_step_in_flight_swallows_its_cancellation(
    tmp_path: Path, where: str
) -> None:
    """With one task in flight the runner awaits it directly, so asyncio hands
    the run's cancellation to the step; the step swallowing it must not make
    the run go on (starting the next step and waiting forever).

    The child raises SIGINT in itself at a known moment: inside the sync
    checkpoint_fn just before the runner awaits the step, or inside the step
    while the runner awaits it.
    """
    checkpoint = tmp_path / "cp.json"
    child = subprocess.Popen(
        [sys.executable, str(SWALLOW_CHILD), str(checkpoint), where],
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        out, _ = child.communicate(timeout=15)  # a lost SIGINT: the run waits forever
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 0, out
    saves = ["saved 1", "step swallowed its cancellation", "saved 2"]
    if where == "step":
        saves = ["step swallowed its cancellation", "saved 1"]
    assert out.splitlines() == [*saves, "interrupted"]
    final = WorkflowCheckpoint.from_dict(json.loads(checkpoint.read_text()))
    assert "after" not in final.outputs
    assert final.outputs["slow"] == "stopped"
