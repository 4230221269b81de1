"""A loop whose body is a child workflow, with ``keep_last``, saved to the journal (deltas
that let go of whole iterations, body map items included) and to SQLite: each store
gives back every checkpoint saved, and a resume from it runs nothing again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ekit_runtime import Done, JournalStore, Repeat, SqliteStore, Step, Workflow, WorkflowCheckpoint


def _agent(calls: list[str]) -> Workflow:
    def model(ctx: Any) -> list[str]:
        calls.append("model")
        return [f"q{ctx['agent'].number}.{i}" for i in range(ctx["agent"].number % 3)]

    def fold(ctx: Any) -> Any:
        calls.append("fold")
        seen = [*(ctx["agent"].previous or []), *ctx["tool"]]
        return Done(seen) if ctx["agent"].number == 6 else seen

    body = Workflow([Step("model", model),
                     Step("tool", lambda ctx: str(ctx["model"]).upper(), ("model",), map_over="model"),
                     Step("fold", fold, ("tool", "model"))])
    return Workflow([Step("agent", child=body, repeat=Repeat(9, keep_last=2))])


def test_the_journal_and_sqlite_give_back_a_compacting_loop_bodys_checkpoints(tmp_path: Path) -> None:
    calls: list[str] = []
    journal = JournalStore(tmp_path / "cp.jsonl")
    rows = SqliteStore(tmp_path / "cp.db", run_id="r1")
    saved: list[WorkflowCheckpoint] = []

    def save(cp: WorkflowCheckpoint) -> None:
        journal.save(cp)
        rows.save(cp)
        saved.append(cp)

    result = _agent(calls).run_sync(checkpoint_fn=save)
    journal.close()
    rows.close()
    assert dict(saved[-1].compacted) == {"agent": 4, "agent/tool[]": 4}  # (1 + 2 + 0 + 1 items)
    lines = (tmp_path / "cp.jsonl").read_text().splitlines()
    assert sum('"kind":"full"' in line for line in lines) == 1  # every save after: a delta
    reader = JournalStore(tmp_path / "cp.jsonl")
    assert list(reader.history()) == saved
    for store in (reader, SqliteStore(tmp_path / "cp.db", run_id="r1")):
        assert store.load() == saved[-1]
        calls.clear()
        assert _agent(calls).run_sync(resume_from=store.load()).outputs == result.outputs
        assert calls == []
