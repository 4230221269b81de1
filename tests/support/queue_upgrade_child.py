"""A process opening a queue file of an earlier layout: ``python -m tests.support.queue_upgrade_child PATH``.

It says ``waiting`` when it has read the earlier layout and asks for the
write lock to upgrade the file, then ``upgraded`` or ``found it upgraded``
(another process did it first) once it holds the lock, then ``opened N``
with the number of runs it sees.
"""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Callable
from typing import Any

from ekit_runtime.queue import SqliteQueue

_real_tx = SqliteQueue._tx
_real_upgrade = SqliteQueue._upgrade


def _upgrade(self: SqliteQueue, conn: sqlite3.Connection) -> bool:
    did = _real_upgrade(self, conn)
    print("upgraded" if did else "found it upgraded", flush=True)
    return did


def _tx(self: SqliteQueue, body: Callable[[sqlite3.Connection], Any], *, write: bool = True) -> Any:
    if getattr(body, "__func__", None) is _upgrade:
        print("waiting", flush=True)
    return _real_tx(self, body, write=write)


def main(path: str) -> None:
    SqliteQueue._upgrade = _upgrade  # type: ignore[method-assign]
    SqliteQueue._tx = _tx  # type: ignore[method-assign]
    with SqliteQueue(path) as queue:
        print(f"opened {len(queue.runs())}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
