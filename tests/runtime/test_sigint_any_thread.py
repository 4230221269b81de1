"""Ctrl-C ends a run whichever thread the kernel gives the SIGINT to.

Python runs signal handlers in the main thread only. A SIGINT that lands on
a sync step's thread (or one the step started) used to leave the main thread
asleep in the event loop for as long as the step worked: no cancellation, no
final checkpoint, no exit. The children here make the signal land there
(``pthread_kill`` of the step's own thread, or every other thread blocking
it) and must end at once, their finished outputs saved.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.support.loop_asleep import wait_until_main_thread_sleeps_in_select

CHILD = Path(__file__).parents[1] / "support" / "sigint_thread_child.py"
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
# A child that ends does so in well under a second; one whose signal was lost
# works on for its 20 s of patience.
PROMPT = 10.0

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def _lines(child: subprocess.Popen[str]) -> queue.Queue[str | None]:
    """The child's stdout lines as they come (None at its end), read by a thread."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _next(lines: queue.Queue[str | None], what: str) -> str | None:
    try:
        return lines.get(timeout=PROMPT)
    except queue.Empty:
        raise AssertionError(f"the child said nothing within {PROMPT}s while {what}") from None


@pytest.mark.parametrize("mode", ["step-thread", "spawned-thread"])
def test_sigint_on_a_step_thread_ends_the_run_with_its_final_checkpoint(
    tmp_path: Path, mode: str
) -> None:
    """The step's own thread, or a thread it started, takes the SIGINT while the
    step works on: the run is cancelled at once (the step still working), the
    final checkpoint holds both finished outputs, and KeyboardInterrupt reaches
    the caller of run_sync."""
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(tmp_path / "cp.json"), mode],
        stdout=subprocess.PIPE, text=True, env=ENV,
    )
    try:
        out, _ = child.communicate(timeout=PROMPT)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 0, out
    assert out.splitlines() == [
        "sibling cancelled",
        # Both finished outputs; nothing recorded as failed; the step's thread took the signal.
        "interrupted ['early', 'quick'] [] signalled=True",
    ]


@pytest.mark.parametrize("mode", ["repeat-any", "repeat-step"])
def test_repeated_real_sigint_mid_step_always_ends_the_run(tmp_path: Path, mode: str) -> None:
    """25 runs in one process, each interrupted by a real SIGINT sent to the
    process while a sync step works: each ends at once with the finished
    output saved. In ``repeat-step`` only the step's thread accepts SIGINT,
    so the kernel delivers every one of them there."""
    runs = 25
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(tmp_path / "cp.json"), mode, str(runs)],
        stdout=subprocess.PIPE, text=True, env=ENV,
    )
    lines = _lines(child)
    try:
        for i in range(runs):
            assert _next(lines, f"waiting for run {i} to be mid-step") == f"mid {i}"
            wait_until_main_thread_sleeps_in_select(child.pid)
            os.kill(child.pid, signal.SIGINT)
            said = _next(lines, f"waiting for run {i} to end after its SIGINT")
            assert said == f"interrupted {i} ['quick']"
        assert _next(lines, "exiting") is None
        assert child.wait(timeout=PROMPT) == 0
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
