"""``JsonFileStore``: the whole checkpoint in one JSON file, replaced atomically.

Each save writes the full checkpoint (``WorkflowCheckpoint.to_dict()``) to a
temporary file beside the target and renames it over the target, so a reader
(or a resume after a kill) sees the previous checkpoint or the new one, never
a mix. A save costs O(all outputs); with the default codec the outputs saved
before are copied from their first encoding rather than encoded again (see
:class:`~ekit_runtime.stores.codec.OutputEncodings`). For long runs see
:class:`~ekit_runtime.stores.JournalStore`.
"""

from __future__ import annotations

import os
from typing import Any

from ekit_core import WorkflowCheckpoint
from ekit_runtime.stores.base import Store, require_checkpoint
from ekit_runtime.stores.codec import Dumps, Loads, OutputEncodings, codec
from ekit_runtime.stores.errors import CorruptStoreError, StoreLockedError
from ekit_runtime.stores.files import atomic_write, check_store_path, file_identity, identity, read_file
from ekit_runtime.stores.locks import WriteLock, check_folder_writable, holding

__all__ = ["JsonFileStore"]

# What the store knows of the file: nothing yet (a save replaces whatever is there).
_UNKNOWN: Any = object()


class JsonFileStore(Store):
    """Keep the latest checkpoint of a run in one JSON file.

    Use it as ``checkpoint_fn=store``; ``store.load()`` returns the saved
    checkpoint or ``None`` when the file does not exist yet. The file holds
    exactly ``cp.to_dict()``, so ``json.load`` reads it and ExecutionKit's
    three-key files load too.

    One writer per file, enforced: the first save takes a lock on
    ``<file>.lock``, held until :meth:`close` (or the end of a ``with``
    block, or of the process); a second writer is refused with
    :class:`~ekit_runtime.stores.StoreLockedError`, and so is a save after
    another writer replaced the file this store had loaded or saved.
    :meth:`load` never needs the lock.

    ``dumps``/``loads`` replace the JSON codec (for outputs JSON cannot hold);
    ``durable=False`` skips the fsyncs, which still survives a killed process
    but not a power cut. Saves are synchronous.

    A ``ValueError`` naming ``path`` when the store is made if no save could
    write it (its folder is missing, or it is a directory, a FIFO...); a
    symlink at ``path`` is followed (the file it points to is replaced, the
    lock goes beside that file). Under :meth:`Workflow.run
    <ekit_runtime.Workflow.run>` the rest is checked before the first step
    (:meth:`prepare_run`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        dumps: Dumps | None = None,
        loads: Loads | None = None,
        durable: bool = True,
    ) -> None:
        self.path = check_store_path(path)
        self.dumps, self.loads = codec(dumps, loads)
        self.durable = durable
        self._encodings = OutputEncodings(self.dumps, self.loads)
        # The lock goes beside the file the symlink (if any) points to; the
        # lambda must not hold ``self``, or the store could only be freed
        # (and its lock dropped) by the cycle collector.
        where = self.path
        self._lock = WriteLock(where, lambda: os.path.realpath(where) + ".lock")
        # The file as this store last read or wrote it: ``None`` if it was
        # absent, ``_UNKNOWN`` before the first load() or save.
        self._seen: Any = _UNKNOWN

    def save(self, checkpoint: WorkflowCheckpoint) -> None:
        """Replace the stored checkpoint with ``checkpoint``, atomically.

        Refuses, before touching the file, an output it cannot encode
        (``UnencodableError``) and a file another writer holds or replaced
        since this store last read or wrote it (``StoreLockedError``).
        """
        require_checkpoint(checkpoint)
        data = self._encodings.document_of(checkpoint, {})
        self._lock.hold()
        self._check_unchanged()
        self._seen = _UNKNOWN  # until the write is known to have happened
        atomic_write(self.path, data, durable=self.durable)
        self._seen = file_identity(self.path)

    __call__ = save

    def prepare_run(self, checkpoint: WorkflowCheckpoint) -> None:
        """Refuse now, before any step runs, a run whose saves this store would refuse.

        :meth:`Workflow.run <ekit_runtime.Workflow.run>` calls it with the
        checkpoint the run starts from. It takes the write lock (kept until
        :meth:`close`; a refusal keeps none it took), and raises
        :class:`~ekit_runtime.stores.StoreLockedError`
        if another writer holds it, its lock file is not a regular file of
        this user's, the folder is not writable, or another writer saved
        since this store loaded; :class:`~ekit_runtime.stores.UnencodableError`
        if a step name, version tag, context value or recorded output cannot
        be encoded. Writes nothing but the lock file.
        """
        require_checkpoint(checkpoint)
        self._encodings.check(checkpoint)
        with holding(self._lock):
            check_folder_writable(self.path, self._lock)
            self._check_unchanged()

    def _check_unchanged(self) -> None:
        if self._seen is not _UNKNOWN:
            now = file_identity(self.path)
            if now is not None and now != self._seen:
                raise StoreLockedError(
                    self.path,
                    "the file changed since this store last read or wrote it (another writer "
                    "saved in between); nothing was saved. load() again to continue from what "
                    "is stored",
                )

    def load(self) -> WorkflowCheckpoint | None:
        """The stored checkpoint, or ``None`` if nothing was saved yet.

        Raises :class:`~ekit_runtime.stores.CorruptStoreError` for a file that
        does not decode (NaN and infinities included: the default codec
        refuses them both ways) and :class:`~ekit_core.CheckpointError` for
        one that decodes to something other than a checkpoint (both
        ``ValueError``). Takes no lock.
        """
        try:
            st, raw = read_file(self.path)
            seen = identity(st)
        except FileNotFoundError:
            self._seen = None
            return None
        try:
            data = self.loads(raw.decode("utf-8"))
        except Exception as exc:
            raise CorruptStoreError(
                self.path, f"not a readable checkpoint ({type(exc).__name__}: {exc})"
            ) from exc
        try:
            checkpoint = WorkflowCheckpoint.from_dict(data)
        except ValueError as exc:
            exc.add_note(f"while loading {self.path}")
            raise
        self._encodings.seed(checkpoint.outputs)
        self._seen = seen
        return checkpoint

    def close(self) -> None:
        """Release the write lock (if this store took it); a later save takes it again."""
        self._lock.release()

    def __repr__(self) -> str:
        return f"JsonFileStore({self.path!r})"
