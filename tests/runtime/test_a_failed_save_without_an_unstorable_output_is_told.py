"""When the save that leaves out an unstorable output fails too, the run's error says why.

What users rely on (docs/outputs.md): a run whose step returned an output
the store cannot encode saves every other output that finished and ends
with the ``UnencodableError`` naming that step; when that second save
fails for another reason (a full disk, a lost connection), nothing more is
saved and the last good checkpoint stands. The error the run ends with
must then say that the other outputs were not saved, and why: the second
failure was dropped without a word, so a user who fixed the step's type
and resumed paid for its siblings again with no hint that the store itself
had failed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ekit_core import WorkflowCheckpoint
from ekit_runtime import Step, UnencodableError, Workflow


def flow() -> Workflow:
    async def start(ctx: Any) -> int:
        return 1

    async def good(ctx: Any) -> str:
        return "paid for"

    async def bad(ctx: Any) -> Any:
        return {"seen": {1, 2}}

    return Workflow([Step("start", start), Step("good", good, ("start",)), Step("bad", bad, ("start",))])


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync save", "async save"])
def test_the_second_saves_own_failure_is_in_the_errors_notes(asynchronous: bool) -> None:
    saved: list[WorkflowCheckpoint] = []

    def save(cp: WorkflowCheckpoint) -> None:
        if "bad" in cp.outputs:
            raise UnencodableError("cannot encode the output of step 'bad'", step="bad")
        if "good" in cp.outputs:
            raise OSError(28, "No space left on device")
        saved.append(cp)

    async def save_later(cp: WorkflowCheckpoint) -> None:
        await asyncio.sleep(0)
        save(cp)

    with pytest.raises(UnencodableError, match="'bad'") as refused:
        flow().run_sync(checkpoint_fn=save_later if asynchronous else save, max_concurrency=2)
    notes = "\n".join(getattr(refused.value, "__notes__", ()))
    assert "No space left on device" in notes and "OSError" in notes
    assert "saved the checkpoint without" not in notes
    assert [dict(cp.outputs) for cp in saved] == [{}, {"start": 1}] or [
        dict(cp.outputs) for cp in saved] == [{"start": 1}]
