"""A store handed over as ``functools.partial(store.save, ...)`` is still checked before the first step.

``Workflow.run`` calls the store's ``prepare_run`` when ``checkpoint_fn`` is
the store or its bound ``save``; a partial of either (how a caller binds
arguments, as the queue's ``Worker`` does for its own saves) saves through
the same store, so a store another process holds must be refused before
the step, which records that it ran, is paid for.
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import StoreLockedError, Workflow
from ekit_runtime.step import Step
from tests.support.store_helpers import Holder, store_factories

FACTORIES = store_factories("crash-run")  # the run crash_child.py holds
NAMES = {"json": "cp.json", "journal": "cp.jsonl", "sqlite": "cp.db"}


def _workflow(ran: list[str]) -> Workflow:
    async def paid(ctx: dict[str, Any]) -> str:
        ran.append("paid")  # an LLM call would be paid here
        return "output"

    return Workflow([Step("paid", paid)])


WRAPS = {
    "partial-of-save": lambda store: functools.partial(store.save),
    "partial-of-store": lambda store: functools.partial(store),
    "partial-of-partial": lambda store: functools.partial(functools.partial(store.save)),
}


@pytest.mark.parametrize("wrap", sorted(WRAPS))
@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_a_held_store_behind_a_partial_is_refused_before_the_first_step(
    tmp_path: Path, kind: str, wrap: str
) -> None:
    store = FACTORIES[kind](tmp_path)
    ran: list[str] = []
    with Holder(kind, tmp_path / NAMES[kind]), pytest.raises(StoreLockedError):
        _workflow(ran).run_sync(checkpoint_fn=WRAPS[wrap](store))
    assert ran == []
    store.close()


def test_iterate_checks_a_store_behind_a_partial_too(tmp_path: Path) -> None:
    store = FACTORIES["json"](tmp_path)
    ran: list[str] = []

    async def main() -> None:
        async for _ in _workflow(ran).iterate(checkpoint_fn=functools.partial(store.save)):
            pass

    with Holder("json", tmp_path / "cp.json"), pytest.raises(StoreLockedError):
        asyncio.run(main())
    assert ran == []
    store.close()


def test_a_free_store_behind_a_partial_runs_and_saves(tmp_path: Path) -> None:
    ran: list[str] = []
    with FACTORIES["journal"](tmp_path) as store:
        _workflow(ran).run_sync(checkpoint_fn=functools.partial(store.save))
        assert ran == ["paid"]
        loaded = store.load()
    assert loaded is not None and loaded.outputs == {"paid": "output"}
