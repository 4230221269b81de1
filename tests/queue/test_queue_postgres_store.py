"""``PostgresStore`` alone, as a ``checkpoint_fn``, against the real server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import Step, Workflow
from tests.support.queue_backends import postgres_url

__all__ = ["postgres_url"]


def _flow(ran: list[str]) -> Workflow:
    def step(name: str, fail: bool = False) -> Any:
        async def run(ctx: dict[str, Any]) -> str:
            ran.append(name)
            if fail and ctx.get("fail"):
                raise RuntimeError("stopped")
            return f"{name} ✓ " + "x" * 1000

        return run

    return Workflow([Step("a", step("a")), Step("b", step("b", True), ("a",)), Step("c", step("c"), ("b",))])


def test_saves_load_back_and_a_stopped_run_resumes(postgres_url: str) -> None:
    dsn = postgres_url
    from ekit_runtime import PostgresStore

    store = PostgresStore(dsn, run_id="r1")
    assert store.load() is None
    ran: list[str] = []
    seen = []

    def save(cp: Any) -> None:
        store(cp)
        seen.append(PostgresStore(dsn, run_id="r1").load() == cp)

    with pytest.raises(RuntimeError):
        _flow(ran).run_sync({"fail": True}, checkpoint_fn=save)
    assert all(seen) and list(PostgresStore(dsn, run_id="r1").load().outputs) == ["a"]  # type: ignore[union-attr]
    ran.clear()
    resumed_from = PostgresStore(dsn, run_id="r1").load()
    _flow(ran).run_sync({"fail": False}, checkpoint_fn=save, resume_from=resumed_from)
    assert ran == ["b", "c"] and all(seen)
    assert store.runs() == ["r1"] and store.delete("r1") and store.load() is None
    store.close()


def test_a_save_writes_only_the_new_step(postgres_url: str) -> None:
    dsn = postgres_url
    import psycopg

    from ekit_runtime import PostgresStore

    store = PostgresStore(dsn, run_id="big")
    chain = Workflow([Step(f"s{i}", lambda ctx: "y" * 500, (f"s{i - 1}",) if i else ()) for i in range(50)])
    chain.run_sync(checkpoint_fn=store)
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*), max(seq) FROM ekit_entries WHERE run_id = 'big'").fetchone()
    # One output row per step (no usage row: the steps spent nothing), each
    # inserted once: a save that rewrote earlier rows would have drawn more
    # sequence numbers.
    assert row == (50, 50)
    loaded = store.load()
    assert loaded is not None and len(loaded.outputs) == 50
    store.close()


def test_importing_ekit_does_not_import_psycopg() -> None:
    code = "import sys, ekit_runtime, ekit_runtime.queue; assert 'psycopg' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
