"""A store that refuses a run before its first step keeps no lock: a fresh store object runs next.

``prepare_run`` takes the write lock and then checks what a save would
refuse, such as another writer having saved since this store loaded. When
it refuses, the refusing object (still referenced: by the caller, or by the
traceback of the error it raised) must not keep the lock, or the user's
next step, a new store object ``load()``ing what is stored and resuming,
is refused as "held by another store object in this process", and its run
never starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import Step, StoreLockedError, Workflow
from tests.support.store_helpers import store_factories

FACTORIES = store_factories("run")


def _workflow(ran: list[str]) -> Workflow:
    def paid(ctx: dict[str, Any]) -> str:
        ran.append("paid")  # an LLM call would be paid here
        return "output"

    return Workflow([Step("first", lambda ctx: "1"), Step("paid", paid, depends_on=["first"])])


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_a_store_refused_as_stale_lets_a_fresh_store_resume(tmp_path: Path, kind: str) -> None:
    make = FACTORIES[kind]
    ran: list[str] = []
    with make(tmp_path) as first:
        _workflow(ran).run_sync(checkpoint_fn=first)
    stale = make(tmp_path)
    loaded = stale.load()
    with make(tmp_path) as other:  # another writer runs (and saves) after stale loaded
        _workflow([]).run_sync(checkpoint_fn=other)
    ran.clear()
    with pytest.raises(StoreLockedError, match="since this store") as refused:
        _workflow(ran).run_sync(checkpoint_fn=stale, resume_from=loaded)
    assert ran == []
    fresh = make(tmp_path)  # `stale` and the traceback still hold their object
    try:
        result = _workflow(ran).run_sync(checkpoint_fn=fresh, resume_from=fresh.load())
    finally:
        fresh.close()
    assert dict(result.outputs) == {"first": "1", "paid": "output"}
    assert refused.value is not None
    stale.close()
