"""A run in progress for tests/runtime/test_cli_rewind_output.py: it holds its store while step ``b`` waits.

``python -m tests.support.rewind_live_child KIND PATH FOLDER``: runs ``a`` then ``b``
(``b`` depends on ``a``) with a store of ``KIND`` (json, journal, sqlite;
SQLite under run id ``live``) at ``PATH``. Once ``a`` is saved (so the store
holds its write lock) ``b`` writes ``FOLDER/ready`` and waits for
``FOLDER/go``; then the run ends, saving ``b``'s output, and the child
exits 0 (1 if the run failed, printing why).
"""

from __future__ import annotations

import os
import sys
import time

from ekit_runtime import JournalStore, JsonFileStore, SqliteStore, Step, Workflow


def _wait_for(path: str, deadline: float) -> None:
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} within the deadline")
        time.sleep(0.01)


def main() -> int:
    kind, path, folder = sys.argv[1:4]
    if kind == "json":
        store = JsonFileStore(path)
    elif kind == "journal":
        store = JournalStore(path)
    else:
        store = SqliteStore(path, run_id="live")

    def b(ctx: object) -> str:
        with open(os.path.join(folder, "ready"), "w") as f:
            f.write(str(os.getpid()))
        _wait_for(os.path.join(folder, "go"), time.monotonic() + 60)
        return "b done"

    workflow = Workflow([Step("a", lambda ctx: "a done"), Step("b", b, ("a",))])
    try:
        with store:
            workflow.run_sync(checkpoint_fn=store)
    except Exception as exc:
        print(f"the live run failed: {type(exc).__name__}: {exc}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
