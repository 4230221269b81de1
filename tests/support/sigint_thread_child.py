"""Child process for the tests of a SIGINT that the kernel gives to a step's thread.

CPython runs the Python handler (``asyncio.run``'s, which cancels the run)
in the main thread only; if the signal lands on another thread while the
main thread sleeps in the event loop, only a wakeup fd can wake it.

``argv[1]`` is the checkpoint file, ``argv[2]`` the mode:

- ``step-thread``: a sync step sends SIGINT to its own thread
  (``signal.pthread_kill``) once its sibling's output is saved, then keeps
  working until the caller of ``run_sync`` has its ``KeyboardInterrupt``.
- ``spawned-thread``: the same, from a thread the step started.
- ``repeat-any`` / ``repeat-step``: ``argv[3]`` runs in a row, each with a
  sync step that prints ``mid N`` and works until interrupted; the parent
  sends SIGINT to this process (``os.kill``) on reading it. In
  ``repeat-step`` every thread but the step's blocks SIGINT, so the kernel
  has to give the signal to the step's thread.

Prints what happened; exits 0 when every run ended by KeyboardInterrupt with
its finished outputs in the final checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from ekit_runtime import Step, Workflow, WorkflowCheckpoint
from tests.support.loop_asleep import wait_until_main_thread_sleeps_in_select

# A child of a shell's background job inherits SIGINT ignored, which asyncio.run
# leaves ignored: give it the handler a script run from a terminal has.
signal.signal(signal.SIGINT, signal.default_int_handler)

path, mode = Path(sys.argv[1]), sys.argv[2]
# A working step that nothing interrupts gives up after this, so that a lost
# signal shows as a wrong output rather than a child that never exits.
PATIENCE = 20.0
release = threading.Event()  # set once the caller has its KeyboardInterrupt
early_saved = threading.Event()
signalled = threading.Event()  # set by the thread that takes the signal, just before it does


def save(cp: WorkflowCheckpoint) -> None:
    path.write_text(json.dumps(cp.to_dict()))
    if "early" in cp.outputs:
        early_saved.set()


def kill_own_thread() -> None:
    wait_until_main_thread_sleeps_in_select()  # the case that hung, every time
    signalled.set()
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)


def signals(ctx: Any) -> str:
    """A sync step (so in a worker thread) that has its thread, or a thread of its own, take SIGINT."""
    if not early_saved.wait(PATIENCE):
        return "early never saved"
    if mode == "spawned-thread":
        helper = threading.Thread(target=kill_own_thread)
        helper.start()
        helper.join()
    else:
        kill_own_thread()
    # Still working (an LLM call in flight) while the run is interrupted.
    return "not interrupted" if not release.wait(PATIENCE) else "released"


async def forever(ctx: Any) -> str:
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        print("sibling cancelled", flush=True)
        raise
    return "never"


async def early(ctx: Any) -> str:
    return "early done"


def one_interrupted_run() -> None:
    workflow = Workflow(
        [
            Step("quick", lambda ctx: "done"),
            Step("signals", signals, ("quick",)),
            Step("forever", forever, ("quick",)),
            Step("early", early, ("quick",)),
        ]
    )
    try:
        workflow.run_sync(checkpoint_fn=save)
    except KeyboardInterrupt:
        release.set()
        final = WorkflowCheckpoint.from_dict(json.loads(path.read_text()))
        print(
            f"interrupted {sorted(final.outputs)} {sorted(final.failures)} "
            f"signalled={signalled.is_set()}",
            flush=True,
        )
        return
    print("run finished", flush=True)
    release.set()
    sys.exit(3)


def repeated_runs(count: int, step_only: bool) -> None:
    for i in range(count):
        working = threading.Event()

        def work(ctx: Any, i: int = i, working: threading.Event = working) -> str:
            if step_only:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            try:
                print(f"mid {i}", flush=True)
                return "not interrupted" if not working.wait(PATIENCE) else "released"
            finally:
                if step_only:  # the pool's thread serves the next run's step too
                    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

        workflow = Workflow([Step("quick", lambda ctx: "done"), Step("work", work, ("quick",))])
        try:
            workflow.run_sync(checkpoint_fn=save)
        except KeyboardInterrupt:
            working.set()
            final = WorkflowCheckpoint.from_dict(json.loads(path.read_text()))
            print(f"interrupted {i} {sorted(final.outputs)}", flush=True)
            continue
        print(f"run {i} finished", flush=True)
        sys.exit(3)


if mode.startswith("repeat-"):
    if mode == "repeat-step":
        # Inherited by every thread started from here on: only the step unblocks it.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    repeated_runs(int(sys.argv[3]), mode == "repeat-step")
else:
    one_interrupted_run()
sys.exit(0)
