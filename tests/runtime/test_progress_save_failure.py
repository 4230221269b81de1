"""ProgressPrinter says a run stopped because its checkpoint could not be saved, not "cancelled".

The core settles such a run as ``cancelled`` (it stops starting steps, as
on Ctrl-C), so the printer looks at the error the run is ending with.
A real cancellation still reads "run cancelled".
"""

from __future__ import annotations

import asyncio
import io
import os
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import JsonFileStore, ProgressPrinter, Step, StoreLockedError, Workflow, WorkflowCheckpoint


def _last_line(out: io.StringIO) -> str:
    return out.getvalue().replace("\r", "\n").rstrip("\n").rsplit("\n", 1)[-1]


@pytest.mark.parametrize("tty", [False, True])
def test_a_store_that_refuses_a_save_is_reported_as_such(tty: bool, tmp_path: Path) -> None:
    path = tmp_path / "cp.json"
    store = JsonFileStore(path)

    async def a(ctx: dict[str, Any]) -> int:
        os.unlink(f"{path}.lock")  # someone removes the lock while the run holds it
        return 1

    async def b(ctx: dict[str, Any]) -> int:
        return 2

    out = io.StringIO()
    workflow = Workflow([Step("a", a), Step("b", b, ("a",))])
    with pytest.raises(StoreLockedError, match="lost its write lock"):
        asyncio.run(workflow.run(checkpoint_fn=store, trace=ProgressPrinter(out, tty=tty)))
    line = _last_line(out)
    assert line.startswith("run stopped: its checkpoint could not be saved (StoreLockedError: ")
    assert "lost its write lock" in line
    assert "cancelled" not in out.getvalue()
    store.close()


def test_a_checkpoint_fn_that_raises_is_reported_with_its_error() -> None:
    def full(checkpoint: WorkflowCheckpoint) -> None:
        raise OSError(28, "No space left on device")

    async def a(ctx: dict[str, Any]) -> int:
        return 1

    out = io.StringIO()
    workflow = Workflow([Step("a", a), Step("b", a, ("a",))])
    with pytest.raises(OSError, match="No space"):
        asyncio.run(workflow.run(checkpoint_fn=full, trace=ProgressPrinter(out, tty=False)))
    assert _last_line(out).startswith(
        "run stopped: its checkpoint could not be saved "
        "(OSError: [Errno 28] No space left on device): 1/2 steps"
    )


def test_a_cancelled_run_still_reads_cancelled(tmp_path: Path) -> None:
    started = asyncio.Event()

    async def a(ctx: dict[str, Any]) -> int:
        started.set()
        await asyncio.Event().wait()
        return 1

    async def main(out: io.StringIO) -> None:
        with JsonFileStore(tmp_path / "cp.json") as store:
            run = asyncio.create_task(
                Workflow([Step("a", a)]).run(checkpoint_fn=store, trace=ProgressPrinter(out, tty=False))
            )
            await started.wait()
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run

    out = io.StringIO()
    asyncio.run(main(out))
    assert _last_line(out).startswith("run cancelled: 0/1 steps")
