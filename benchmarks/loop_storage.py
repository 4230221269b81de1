"""Bytes a loop's stores hold after 10, 100 and 1,000 iterations, with and without keep_last.

    python -m benchmarks.loop_storage [N ...]

One loop of ``N`` iterations, each returning 100 characters, saved after every
iteration into a journal, a JSON file and a SQLite store at once; prints each
file's size. A store must grow linearly with the iterations (the journal: by
one delta line per iteration, ``keep_last`` or not), and with ``keep_last`` the
JSON file and the SQLite run stay bounded.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ekit_runtime import Done, JournalStore, JsonFileStore, Repeat, SqliteStore, Step, Workflow


def _workflow(n: int, keep: int | None) -> Workflow:
    def turn(ctx: Any) -> Any:
        return Done("x" * 100) if ctx["agent"].number == n else "x" * 100

    return Workflow([Step("agent", turn, repeat=Repeat(n, keep_last=keep))])


def sizes(n: int, keep: int | None) -> dict[str, int]:
    """The bytes each store's file holds once a loop of ``n`` iterations ran."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        journal, document = JournalStore(folder / "j.jsonl"), JsonFileStore(folder / "f.json")
        rows = SqliteStore(folder / "s.db", run_id="r")

        def save(cp: Any) -> None:
            journal.save(cp)
            document.save(cp)
            rows.save(cp)

        _workflow(n, keep).run_sync(checkpoint_fn=save)
        journal.close()
        rows.close()
        return {name: os.path.getsize(folder / file)
                for name, file in (("journal", "j.jsonl"), ("json", "f.json"), ("sqlite", "s.db"))}


def main(argv: list[str]) -> None:
    counts = [int(a) for a in argv] or [10, 100, 1000]
    for keep in (None, 3):
        for n in counts:
            found = sizes(n, keep)
            print(f"keep_last={keep} iterations={n:>5}: journal {found['journal']:>9,} B, "
                  f"json file {found['json']:>9,} B, sqlite {found['sqlite']:>9,} B")


if __name__ == "__main__":
    main(sys.argv[1:])
