"""Child process for the SIGINT test: a run with one step done and one in flight.

Prints ``ready`` once the first checkpoint is on disk, then waits to be
interrupted; prints what the sibling saw and exits 0 if KeyboardInterrupt
reached the caller of ``run_sync``.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

from ekit_runtime import Step, Workflow, WorkflowCheckpoint

# A child started from a shell's background job (`cmd &` without job control)
# inherits SIGINT ignored, and asyncio.run then (rightly) leaves it ignored:
# the SIGINT below would be lost and the run would wait forever. Give it the
# handler a script run from a terminal has, so that this tests the runner.
signal.signal(signal.SIGINT, signal.default_int_handler)

path = Path(sys.argv[1])


saves = 0


def save(cp: WorkflowCheckpoint) -> None:
    global saves
    path.write_text(json.dumps(cp.to_dict()))
    saves += 1
    print("ready" if saves == 1 else f"saved {cp.step_index}", flush=True)


async def forever(ctx: dict[str, Any]) -> str:
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        print("sibling cancelled", flush=True)
        raise
    return "never"


workflow = Workflow([Step("quick", lambda ctx: "done"), Step("slow", forever)])
try:
    workflow.run_sync(checkpoint_fn=save)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(0)
sys.exit(3)
