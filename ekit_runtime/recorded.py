"""Recorded runs as test fixtures: each step gets the output a recorded checkpoint holds.

A workflow's own tests can run offline against a run recorded for real:
``workflow.run(..., executor=Recorded("run.json"))`` hands each attempt the
output its step (or item, ``step[key]``) recorded, with the usage it
recorded, and never calls the step. A step the recording lacks fails with
:class:`NotRecordedError` naming it and the recording, as any step failure
does (``isolate_failures=True`` lets the rest run). The recording is the
checkpoint that resumes and the cache read, from any store's file (JSON, a
journal, SQLite with ``run_id``, a PostgreSQL URL), not a format of its own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ekit_core import WorkflowCheckpoint
from ekit_core.usage import NO_USAGE
from ekit_runtime.step import Attempt, Executor, PatternResult
from ekit_runtime.typed import Codec

__all__ = ["NotRecordedError", "Recorded"]


class NotRecordedError(LookupError):
    """A step asked for a call the recording does not hold; ``step`` names it (or its item)."""

    def __init__(self, step: str, source: str) -> None:
        super().__init__(f"step {step!r} has no recorded output in {source}: its call was not "
                         "recorded (record a run that makes it, or give the step its own executor)")
        self.step = step


class Recorded(Executor):
    """An executor handing each attempt the output its step recorded in ``recording``.

    ``recording`` is a :class:`~ekit_core.WorkflowCheckpoint`, its dict, or the
    location of any store's file or database (read with
    :func:`~ekit_runtime.sources.read_checkpoints`; ``run_id`` picks the run
    of a database), whose latest checkpoint is used. ``codec``: the
    workflow's codec, when the recording holds outputs of its types.
    """

    def __init__(self, recording: WorkflowCheckpoint | Mapping[str, Any] | str | os.PathLike[str], *,
                 run_id: str | None = None, codec: Codec | None = None) -> None:
        if isinstance(recording, WorkflowCheckpoint):
            checkpoint, self.source = recording, "the checkpoint given"
        elif isinstance(recording, Mapping):
            checkpoint, self.source = WorkflowCheckpoint.from_dict(dict(recording)), "the checkpoint given"
        elif isinstance(recording, str | os.PathLike):
            from ekit_runtime.sources import SourceError, read_checkpoints

            try:
                read = read_checkpoints(os.fspath(recording), run_id=run_id)
            except SourceError as exc:
                raise ValueError(f"recording: {exc}") from None
            checkpoint, self.source = read.latest, read.label
        else:
            raise ValueError(f"recording must be a checkpoint, its dict, or a store's location, "
                             f"got {type(recording).__name__}")
        if codec is not None:
            checkpoint = codec.decode_checkpoint(checkpoint)
        self.checkpoint = checkpoint

    async def run(self, attempt: Attempt) -> Any:
        """The output ``attempt``'s step (or item) recorded, with its recorded usage."""
        name = attempt.name
        outputs = self.checkpoint.outputs
        if name not in outputs:
            raise NotRecordedError(name, self.source)
        return PatternResult(outputs[name], cost=self.checkpoint.step_usage.get(name, NO_USAGE))
