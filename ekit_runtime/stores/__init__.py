"""Crash-safe checkpoint stores: ready-made ``checkpoint_fn`` callables (stdlib only).

Optional: the library needs none of them. Each store is called with a
:class:`~ekit_core.WorkflowCheckpoint` (``checkpoint_fn=store``; ``store.save``
is the same) and has ``load()``, returning the latest checkpoint or ``None``
when nothing was saved yet. A process killed at any instant, even mid-save,
leaves something ``load()`` reads: the previous checkpoint or the new one.

- :class:`JsonFileStore`: one JSON file, replaced atomically on each save.
- :class:`JournalStore`: an append-only JSON-lines journal of deltas; a save
  writes O(that step's output).
- :class:`SqliteStore`: many runs in one SQLite database, keyed by run id.

An output a store cannot encode raises :class:`UnencodableError` (a
``ValueError`` naming the step) before anything is written. One writer per
file (per run id for SQLite), enforced by a lock that dies with its holder:
a second writer is refused with :class:`StoreLockedError` (a ``ValueError``
naming the file or run), and ``load()`` never needs the lock; a lock file
that is not a regular file of this user's (a symlink...) is refused, never
written through. Under ``Workflow.run`` each store's ``prepare_run`` takes
the lock and checks what a save would refuse before the first step runs;
a path no save could write is refused when the store is made. Stores encode
with JSON unless given ``dumps``/``loads``; nothing here unpickles or
evaluates what it reads. Saves are synchronous: fast, local I/O on the
event loop's thread.
"""

from typing import TYPE_CHECKING, Any

from ekit_runtime.stores.errors import CorruptStoreError, StoreLockedError, UnencodableError
from ekit_runtime.stores.journal import JournalStore
from ekit_runtime.stores.jsonfile import JsonFileStore
from ekit_runtime.stores.sqlite import SqliteStore

if TYPE_CHECKING:
    from ekit_runtime.stores.postgres import PostgresStore

# Tracebacks name the package users import, not the private module.
for _error in (CorruptStoreError, StoreLockedError, UnencodableError):
    _error.__module__ = __name__
del _error

__all__ = [
    "CorruptStoreError",
    "JournalStore",
    "JsonFileStore",
    "PostgresStore",
    "SqliteStore",
    "StoreLockedError",
    "UnencodableError",
]


def __getattr__(name: str) -> Any:
    # PostgresStore imports psycopg (the optional "postgres" extra): only when asked for.
    if name == "PostgresStore":
        from ekit_runtime.stores.postgres import PostgresStore

        return PostgresStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
