"""``JsonFileStore``: the whole checkpoint in one JSON file, replaced atomically.

Each save writes the full checkpoint (``WorkflowCheckpoint.to_dict()``) to a
temporary file beside the target and renames it over the target, so a reader
(or a resume after a kill) sees the previous checkpoint or the new one, never
a mix. A save costs O(all outputs); for long runs see
:class:`~ekit_runtime.stores.JournalStore`.
"""

from __future__ import annotations

import json
import os

from ekit_core import WorkflowCheckpoint
from ekit_runtime.stores._common import (
    CorruptStoreError,
    Dumps,
    Loads,
    atomic_write,
    default_dumps,
    encode,
    require_checkpoint,
)

__all__ = ["JsonFileStore"]


class JsonFileStore:
    """Keep the latest checkpoint of a run in one JSON file.

    Use it as ``checkpoint_fn=store``; ``store.load()`` returns the saved
    checkpoint or ``None`` when the file does not exist yet. The file holds
    exactly ``cp.to_dict()``, so ``json.load`` reads it and ExecutionKit's
    three-key files load too.

    ``dumps``/``loads`` replace the JSON codec (for outputs JSON cannot hold);
    ``durable=False`` skips the fsyncs, which still survives a killed process
    but not a power cut. Saves are synchronous. One writer per file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        dumps: Dumps | None = None,
        loads: Loads | None = None,
        durable: bool = True,
    ) -> None:
        self.path = os.fspath(path)
        self.dumps: Dumps = dumps if dumps is not None else default_dumps
        self.loads: Loads = loads if loads is not None else json.loads
        self.durable = durable

    def save(self, checkpoint: WorkflowCheckpoint) -> None:
        """Replace the stored checkpoint with ``checkpoint``, atomically.

        Raises :class:`~ekit_runtime.stores.UnencodableError` (a ``ValueError``
        naming the step) before touching the file if an output cannot be encoded.
        """
        require_checkpoint(checkpoint)
        data = encode(
            checkpoint.to_dict(), self.dumps, checkpoint.outputs.items(), checkpoint.context
        )
        atomic_write(self.path, data, durable=self.durable)

    __call__ = save

    def load(self) -> WorkflowCheckpoint | None:
        """The stored checkpoint, or ``None`` if nothing was saved yet.

        Raises :class:`~ekit_runtime.stores.CorruptStoreError` for a file that
        does not decode and :class:`~ekit_core.CheckpointError` for one that
        decodes to something other than a checkpoint (both ``ValueError``).
        """
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        try:
            data = self.loads(raw.decode("utf-8"))
        except Exception as exc:
            raise CorruptStoreError(
                self.path, f"not a readable checkpoint ({type(exc).__name__}: {exc})"
            ) from exc
        try:
            return WorkflowCheckpoint.from_dict(data)
        except ValueError as exc:
            exc.add_note(f"while loading {self.path}")
            raise

    def __repr__(self) -> str:
        return f"JsonFileStore({self.path!r})"
