"""An output that cannot be stored fails its own step only: what finished beside it is saved.

What users rely on (docs/outputs.md, docs/stores.md): when a step returns an
output the store (or the workflow's codec) cannot encode, the run ends with
an ``UnencodableError`` naming that step, and the checkpoint saved holds
every other output that finished, those that finished in the same turn of
the loop included; a resume pays for that step only. Issue 42, item 2: the
store held nothing at all, and the sibling was paid again.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ekit_core import WorkflowCheckpoint
from ekit_runtime import (
    Codec,
    JournalStore,
    JsonFileStore,
    PostgresStore,
    SqliteStore,
    Step,
    UnencodableError,
    Workflow,
)
from ekit_runtime.queue import Worker, open_queue
from tests.support.queue_backends import fresh_postgres, queue_url

__all__ = ["queue_url"]


@dataclasses.dataclass(frozen=True)
class Verdict:
    ok: bool


# Each way an output cannot be stored: a dataclass the codec was not told, a value JSON has no form for.
KINDS = {
    "unregistered": (lambda: Codec(), lambda: Verdict(True)),
    "no codec": (lambda: None, lambda: {"seen": {1, 2}}),
}


def flow(kind: str, ran: list[str], *, fixed: bool = False, sync: bool = False) -> Workflow:
    """``start``, then ``good`` and ``bad`` (both finishing in the same turn), then ``after``."""
    codec, unstorable = KINDS[kind]

    def step(name: str, value: Callable[[], Any]) -> Any:
        def plain(ctx: Any) -> Any:
            ran.append(name)
            return value()

        async def run(ctx: Any) -> Any:
            return plain(ctx)

        return plain if sync else run

    bad = (lambda: "stored") if fixed else unstorable
    return Workflow([
        Step("start", step("start", lambda: 1)),
        Step("good", step("good", lambda: "paid for"), ("start",)),
        Step("bad", step("bad", bad), ("start",)),
        Step("after", step("after", lambda: 3), ("good", "bad")),
    ], codec=codec())


STORES = ("json", "journal", "sqlite", "postgres", "list")


@pytest.fixture
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], Any]]:
    """A function opening a fresh store object on one place, for the store kind ``request.param``."""
    if request.param == "postgres":
        with fresh_postgres() as url:
            yield lambda: PostgresStore(url, run_id="siblings")
        return
    saved: list[WorkflowCheckpoint] = []

    class ListStore:  # a checkpoint_fn of the caller's, which stores anything it is handed
        def __call__(self, cp: WorkflowCheckpoint) -> None:
            saved.append(cp)

        def load(self) -> WorkflowCheckpoint | None:
            return saved[-1] if saved else None

        def __enter__(self) -> ListStore:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    opens: dict[str, Callable[[], Any]] = {
        "json": lambda: JsonFileStore(tmp_path / "cp.json"),
        "journal": lambda: JournalStore(tmp_path / "cp.jsonl"),
        "sqlite": lambda: SqliteStore(tmp_path / "cp.db", run_id="siblings"),
        "list": ListStore,
    }
    yield opens[request.param]


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("opener", STORES, indirect=True)
def test_the_sibling_of_an_unstorable_output_is_saved_and_only_that_step_is_paid_again(
    opener: Callable[[], Any], kind: str, sync: bool
) -> None:
    if kind == "no codec" and opener.__name__ == "ListStore":
        pytest.skip("a list stores anything: nothing is refused")
    ran: list[str] = []
    with opener() as store, pytest.raises(UnencodableError) as refused:
        flow(kind, ran, sync=sync).run_sync(checkpoint_fn=store, max_concurrency=2)
    assert refused.value.step == "bad" and "'bad'" in str(refused.value)
    assert sorted(ran) == ["bad", "good", "start"]
    with opener() as store:
        stored = store.load()
    assert stored is not None
    assert dict(stored.outputs) == {"start": 1, "good": "paid for"}
    assert stored.step_index == 2

    ran.clear()
    with opener() as store:
        result = flow(kind, ran, fixed=True, sync=sync).run_sync(checkpoint_fn=store, resume_from=stored)
    assert ran == ["bad", "after"]  # good is not paid again
    assert result.outputs["good"] == "paid for" and result.outputs["after"] == 3


def test_an_unstorable_output_of_a_step_recorded_before_is_not_dropped_to_save() -> None:
    # Only outputs new since the last save that was accepted are left out to save the rest: an
    # output the store accepted before is never dropped (its dependents consumed it).
    saved: list[WorkflowCheckpoint] = []
    calls = 0

    def picky(cp: WorkflowCheckpoint) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise UnencodableError("refused the output of 'a' this time", step="a")
        saved.append(cp)

    chain = Workflow([Step("a", lambda ctx: 1), Step("b", lambda ctx: 2, ("a",))])
    with pytest.raises(UnencodableError, match="'a' this time"):
        chain.run_sync(checkpoint_fn=picky)
    assert [dict(cp.outputs) for cp in saved] == [{"a": 1}]


@pytest.mark.parametrize("opener", ["json", "sqlite"], indirect=True)
def test_the_final_save_of_an_interrupted_run_keeps_the_sibling_too(opener: Callable[[], Any]) -> None:
    # A step's KeyboardInterrupt in the same turn: the wind-down's save leaves out only 'bad'.
    async def good(ctx: Any) -> str:
        return "paid for"

    async def bad(ctx: Any) -> Any:
        return {"seen": {1, 2}}

    async def interrupted(ctx: Any) -> None:
        raise KeyboardInterrupt

    with opener() as store, pytest.raises(KeyboardInterrupt):
        Workflow([Step("good", good), Step("bad", bad), Step("interrupted", interrupted)]).run_sync(
            checkpoint_fn=store)
    with opener() as store:
        stored = store.load()
    assert stored is not None and dict(stored.outputs) == {"good": "paid for"}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync save", "async save"])
def test_an_unstorable_item_leaves_out_itself_and_its_collection_and_keeps_its_siblings(
    asynchronous: bool
) -> None:
    saved: list[WorkflowCheckpoint] = []
    ran: list[str] = []

    def save(cp: WorkflowCheckpoint) -> None:
        for name, value in cp.outputs.items():
            if isinstance(value, set) or (isinstance(value, list) and any(isinstance(v, set) for v in value)):
                raise UnencodableError(f"cannot encode the output of step {name!r}", step=name)
        saved.append(cp)

    async def save_later(cp: WorkflowCheckpoint) -> None:
        await asyncio.sleep(0)
        save(cp)

    async def each(ctx: Any) -> Any:
        n = ctx["split"]
        ran.append(f"m[{n}]")
        return {n} if n == 2 and not fixed else n * 10

    fixed = False
    mapped = Workflow([Step("split", lambda ctx: [1, 2, 3]),
                       Step("m", each, ("split",), map_over="split", context="dependencies")])
    with pytest.raises(UnencodableError, match="'m\\[1\\]'") as refused:
        mapped.run_sync(checkpoint_fn=save_later if asynchronous else save)
    assert "without the output of 'm[1]'," in "\n".join(refused.value.__notes__)
    assert dict(saved[-1].outputs) == {"split": [1, 2, 3], "m[0]": 10, "m[2]": 30}
    fixed, ran[:] = True, []
    result = mapped.run_sync(resume_from=saved[-1])
    assert ran == ["m[2]"] and result.outputs["m"] == [10, 20, 30]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(KINDS))
def test_in_the_queue_the_sibling_of_an_unstorable_output_is_saved(queue_url: str, kind: str) -> None:
    ran: list[str] = []
    q = open_queue(queue_url)
    try:
        run_id = q.submit("w")
        asyncio.run(Worker(q, {"w": flow(kind, ran)}, poll=0.01).run_until_idle())
        info = q.status(run_id)
        stored = q.checkpoint(run_id)
    finally:
        q.close()
    assert info.status == "failed" and info.error is not None and "'bad'" in info.error
    assert stored is not None and dict(stored.outputs) == {"start": 1, "good": "paid for"}
    ran.clear()
    result = flow(kind, ran, fixed=True).run_sync(resume_from=stored)
    assert ran == ["bad", "after"] and result.outputs["good"] == "paid for"
