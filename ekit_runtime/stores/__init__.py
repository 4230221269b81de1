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
``ValueError`` naming the step) before anything is written. Stores encode
with JSON unless given ``dumps``/``loads``; nothing here unpickles or
evaluates what it reads. Saves are synchronous: fast, local I/O on the
event loop's thread.
"""

from ekit_runtime.stores._common import CorruptStoreError, UnencodableError
from ekit_runtime.stores.journal import JournalStore
from ekit_runtime.stores.jsonfile import JsonFileStore
from ekit_runtime.stores.sqlite import SqliteStore

__all__ = [
    "CorruptStoreError",
    "JournalStore",
    "JsonFileStore",
    "SqliteStore",
    "UnencodableError",
]
