"""Child process for the SIGINT-forwarding test: Ctrl-C while the run awaits its only task.

With one task in flight the runner awaits that task directly, and asyncio
hands a cancellation of the run to what it awaits: the step's task. A step
that swallows its cancellation (``except CancelledError: return ...``, or a
3.11 ``asyncio.wait_for`` racing its inner future) must not swallow the
run's. ``argv[2]`` says where the SIGINT is raised, in this process and so
at a known moment: ``checkpoint`` (inside the sync ``checkpoint_fn``, before
the runner awaits the step) or ``step`` (inside the step, while it does).

Prints what happened and exits 0 if KeyboardInterrupt reached the caller of
``run_sync``; the step after the swallowing one must never start.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

from ekit_runtime import Step, Workflow, WorkflowCheckpoint

# A child started from a shell's background job inherits SIGINT ignored, and
# asyncio.run then (rightly) leaves it ignored: give it the handler a script
# run from a terminal has, so that this tests the runner and not the shell.
signal.signal(signal.SIGINT, signal.default_int_handler)

path, where = Path(sys.argv[1]), sys.argv[2]
waiting = False  # the swallowing step is parked on its event


def save(cp: WorkflowCheckpoint) -> None:
    path.write_text(json.dumps(cp.to_dict()))
    print(f"saved {cp.step_index}", flush=True)
    if where == "checkpoint" and cp.step_index == 1:
        if not waiting:
            sys.exit(4)  # the moment this test means is not the one it got
        signal.raise_signal(signal.SIGINT)  # asyncio's handler cancels the run, here


async def swallows(ctx: dict[str, Any]) -> str:
    global waiting
    try:
        waiting = True
        if where == "step":
            signal.raise_signal(signal.SIGINT)
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        print("step swallowed its cancellation", flush=True)
        return "stopped"
    return "never"


async def after(ctx: dict[str, Any]) -> str:
    print("next step started", flush=True)
    await asyncio.Event().wait()
    return "never"


steps = [Step("slow", swallows), Step("after", after, ("slow",))]
if where == "checkpoint":
    steps.insert(0, Step("quick", lambda ctx: "done"))
try:
    Workflow(steps).run_sync(checkpoint_fn=save)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(0)
sys.exit(3)
