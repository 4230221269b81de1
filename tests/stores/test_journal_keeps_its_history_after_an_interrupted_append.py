"""A journal append cut short in a live process keeps the history before it.

What users rely on (docs/stores.md, issue 42 item 21): a journal only ever
grows by appends, and a crash in an append is a torn tail like any other,
cut off by the next save. When the append was cut short in a process that
goes on (Ctrl-C while the line is written, a full disk), the run's
wind-down saves once more through the same store: that save rewrote the
whole journal as one record, so ``history()`` (``ekit replay``) lost every
checkpoint before it. It now cuts off the bytes of the failed append and
appends after what stood.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest

import ekit_runtime.stores.journal as journal
from ekit_runtime import JournalStore, Step, Workflow


def _chain() -> Workflow:
    return Workflow([
        Step("a", lambda ctx: 1),
        Step("b", lambda ctx: 2, ("a",)),
        Step("c", lambda ctx: 3, ("b",)),
        Step("d", lambda ctx: 4, ("c",)),
    ])


@pytest.mark.parametrize("whole", [False, True], ids=["torn line", "whole line"])
def test_an_interrupted_append_is_cut_off_and_the_history_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, whole: bool
) -> None:
    path = tmp_path / "run.jsonl"
    real = journal.write_all
    appends: list[bytes] = []

    def interrupted(fd: int, data: bytes) -> None:
        appends.append(data)
        if len(appends) == 2:  # the second append: half of it (or all of it) written, then Ctrl-C
            real(fd, data if whole else data[: len(data) // 2])
            raise KeyboardInterrupt
        real(fd, data)

    monkeypatch.setattr(journal, "write_all", interrupted)
    with JournalStore(path, durable=False) as store, pytest.raises(KeyboardInterrupt):
        _chain().run_sync(checkpoint_fn=store)
    monkeypatch.undo()
    history = [sorted(cp.outputs) for cp in JournalStore(path).history()]
    assert history[:2] == [["a"], ["a", "b"]], history
    assert all(len(later) > len(earlier) for earlier, later in pairwise(history))
    assert len(history) >= 3 and JournalStore(path).torn_tail == 0
    with JournalStore(path, durable=False) as store:
        assert _chain().run_sync(checkpoint_fn=store, resume_from=store.load()).outputs["d"] == 4
