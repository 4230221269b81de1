"""The errors every store raises: what could not be encoded, what is damaged, who holds the lock.

Each is a ``ValueError`` (a bad value met, not a bug) carrying the fields a
caller needs to react without parsing the message. ``ekit_runtime.stores``
re-exports them under its own name.
"""

from __future__ import annotations

__all__ = [
    "CorruptStoreError",
    "StoreLockedError",
    "UnencodableError",
]


class UnencodableError(ValueError):
    """A value the store's ``dumps`` cannot encode; nothing was written.

    ``step`` names the step whose output is at fault (``None`` when the
    culprit is a context key or the checkpoint as a whole, which the message
    then names).
    """

    def __init__(self, message: str, step: str | None = None) -> None:
        super().__init__(message)
        self.step = step


class CorruptStoreError(ValueError):
    """Stored data that is damaged beyond what a crash can leave behind.

    ``path`` is the file or database and ``line`` the 1-based journal line at
    fault (``None`` when the damage is not tied to a line).
    """

    def __init__(self, path: str, problem: str, line: int | None = None) -> None:
        where = f"{path}, line {line}" if line is not None else path
        super().__init__(f"{where}: {problem}")
        self.path = path
        self.line = line


class StoreLockedError(ValueError):
    """Another writer has this store's file (or SQLite run): the save was refused, nothing written.

    Raised when another store object, in this process or another, holds the
    write lock; when this store lost its lock (its lock file was removed or
    replaced while held); and when what is stored changed since this store
    last read or wrote it, because another writer saved in between. Also
    when the store cannot take a write lock at all: its lock file is not a
    regular file of this user's (a symlink, a FIFO, a directory, a device, a
    file with other hard links, another user's file), which is never opened
    through a link nor written, or its folder is not writable by this user.
    ``path`` is the file or database, ``run_id`` the SQLite run (``None``
    for a file store), ``lock_path`` the lock file and ``pid`` the process
    holding it, when known. To take over deliberately, close the other store
    (or end its process), then ``load()`` and save again.
    """

    def __init__(
        self,
        path: str,
        problem: str,
        *,
        run_id: str | None = None,
        lock_path: str | None = None,
        pid: int | None = None,
    ) -> None:
        where = path if run_id is None else f"{path}, run {run_id!r}"
        super().__init__(f"{where}: {problem}")
        self.path = path
        self.run_id = run_id
        self.lock_path = lock_path
        self.pid = pid
