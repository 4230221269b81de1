"""Every part of a checkpoint survives every path that encodes, stores or rebuilds it.

What users rely on: the checkpoint a run hands out, through its workflow's
codec, through JSON, through each store (a full write or a delta on what the
store held before) and through the run queue, reads back holding every part
of the run's state: outputs (typed ones restored as their types), items,
usage, failures, versions, skips, shapes, outputs set aside, questions and
answers, durations, context. A part lost on the way is work paid again, or a
run that can never finish (issue 42, item 1: a codec dropped the questions,
so a run waiting for an answer could never be answered).

The checkpoint built here sets every field of ``WorkflowCheckpoint`` away
from its default, and a test checks that it does: a field added later must be
added here too, and then every path is checked to carry it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ekit_core import (
    Answer,
    DriveRecord,
    Exchange,
    FailureRecord,
    Question,
    Shape,
    TokenUsage,
    WorkflowCheckpoint,
)
from ekit_core.code import CacheHit
from ekit_core.ledger import Ledger
from ekit_runtime import (
    Codec,
    JournalStore,
    JsonFileStore,
    PostgresStore,
    RunWaiting,
    SqliteStore,
    Step,
    Workflow,
    ask,
)
from ekit_runtime.queue import Worker, open_queue
from tests.support.queue_backends import fresh_postgres, queue_url

__all__ = ["queue_url"]


@dataclasses.dataclass(frozen=True)
class Point:
    x: int
    y: int


CODEC = Codec(Point)
PUBLIC = tuple(f.name for f in dataclasses.fields(WorkflowCheckpoint) if not f.name.startswith("_"))
GRAPH = {"a": (), "m": ("a",), "b": ("m",), "c": ("a",), "d": ("b",), "loop": ("a",), "P/x": ("a",),
         "P": ("P/x",)}

# Every field, each away from its default, typed values where a codec encodes them.
FIELDS: dict[str, Any] = {
    "step_index": 5,
    "outputs": {"a": [1, 2], "m[0]": Point(1, 0), "m[1]": Point(2, 0), "m": [Point(1, 0), Point(2, 0)],
                "b": Point(7, 7), "loop#4": Point(4, 4)},
    "cost": TokenUsage(10, 20, 4),
    "context": {"topic": Point(0, 1)},
    "step_usage": {"m[0]": TokenUsage(1, 2, 1), "m[1]": TokenUsage(3, 4, 1)},
    "failures": {"d": FailureRecord("RuntimeError", "the provider timed out", 2,
                                    1_796_600_000.5, 1_796_600_003.25)},
    "fingerprint": "0123456789abcdef",
    "graph": GRAPH,
    "format_version": 3,
    "versions": {"b": "2"},
    "skipped": {"c": "condition wanted was false"},
    "shapes": {"m": Shape(map_over="a"), "c": Shape(when="wanted"),
               "loop": Shape(repeat=9, keep_last=1), "P": Shape(child="P/x")},
    "superseded": {"m": [Point(9, 9)]},
    "asked": {"b": (Exchange(Question("value", "Title?", {"words": 3}), Answer("Tides", "ann", 1.5)),
                    Exchange(Question("approval", "Send it?")))},
    "durations": {"a": 0.5, "m[0]": 1.25, "b": 2.0},
    "redone": {"b": 1, "m[0]": 2},
    "began": {"a": 1_796_599_990.125, "m[0]": 1_796_599_991.0, "b": 1_796_599_995.5},
    "held": {"m[0]": {"max_concurrency": 0.5, "resource:gpu": 0.25}, "b": {"limit:tokens_per_minute": 3.0}},
    "compacted": {"loop": 3},
    "compacted_retries": {"loop": 2},
    "code_fingerprints": {"a": "0f" * 16, "m": "1e" * 16, "b": "2d" * 16},
    "cache_hits": {"m[1]": CacheHit("4b" * 32, TokenUsage(30, 4, 1)), "b": CacheHit("5a" * 32)},
    "drives": (DriveRecord("host-a:41", 1_796_599_989.5), DriveRecord("host-b:7", 1_796_599_994.25)),
}


def full(**changes: Any) -> WorkflowCheckpoint:
    """The checkpoint of FIELDS (with ``changes``), made by ``__init__`` as a caller would."""
    fields = {**FIELDS, **changes}
    return WorkflowCheckpoint(**{
        k: MappingProxyType(v) if isinstance(v, dict) else v for k, v in fields.items()})


def core_made(cp: WorkflowCheckpoint) -> WorkflowCheckpoint:
    """``cp`` as the core makes checkpoints: on ledgers (the fast paths of codec and stores)."""
    return WorkflowCheckpoint.of_ledgers(
        Ledger(cp.outputs.items()), Ledger(cp.step_usage.items()), step_index=cp.step_index,
        cost=cp.cost, context=cp.context, failures=cp.failures, graph=cp.graph, versions=cp.versions,
        fingerprint=cp.fingerprint, format_version=cp.format_version, skipped=cp.skipped,
        shapes=cp.shapes, superseded=cp.superseded, asked=cp.asked, durations=cp.durations,
        redone=cp.redone, began=cp.began, compacted=cp.compacted, compacted_retries=cp.compacted_retries,
        code_fingerprints=cp.code_fingerprints, cache_hits=cp.cache_hits, drives=cp.drives,
        held=cp.held)


def parts(cp: WorkflowCheckpoint) -> dict[str, Any]:
    """Every public field of ``cp`` as plain values, for comparing two checkpoints field by field."""
    out = {}
    for name in PUBLIC:
        value = getattr(cp, name)
        out[name] = dict(value.items()) if hasattr(value, "items") else value
    return out


def assert_whole(got: WorkflowCheckpoint, want: WorkflowCheckpoint, path: str) -> None:
    mine, theirs = parts(got), parts(want)
    lost = [name for name in PUBLIC if mine[name] != theirs[name]]
    assert not lost, f"{path} lost or changed {lost}: " + "; ".join(
        f"{n}: {mine[n]!r} != {theirs[n]!r}" for n in lost)
    for name, value in want.outputs.items():
        assert type(got.outputs[name]) is type(value), (path, name)


def test_the_checkpoint_under_test_sets_every_field_away_from_its_default() -> None:
    # A field added to WorkflowCheckpoint must be set in FIELDS, so that every path below checks it.
    bare = parts(WorkflowCheckpoint(0, MappingProxyType({})))
    mine = parts(full())
    assert set(FIELDS) == set(PUBLIC)
    assert [name for name in PUBLIC if mine[name] == bare[name]] == []


@pytest.mark.parametrize("made", [full, lambda: core_made(full())], ids=["init", "core"])
def test_the_codec_and_json_carry_every_field(made: Callable[[], WorkflowCheckpoint]) -> None:
    cp = made()
    stored = CODEC.encode_checkpoint(cp)
    assert stored.outputs["b"] == {"$ekit": "type", "type": f"{__name__}:Point", "value": {"x": 7, "y": 7}}
    assert_whole(CODEC.decode_checkpoint(stored), cp, "the codec")
    text = json.dumps(stored.to_dict())
    assert_whole(CODEC.decode_checkpoint(json.loads(text)), cp, "JSON")


# -- the stores and the queue: a full write, and a write on what they held before ---------------

STORES = ("json", "journal", "sqlite", "postgres")


@pytest.fixture
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], Any]]:
    """A function opening a fresh store object on one place, for the store kind ``request.param``."""
    if request.param == "postgres":
        with fresh_postgres() as url:
            yield lambda: PostgresStore(url, run_id="whole")
        return
    opens: dict[str, Callable[[], Any]] = {
        "json": lambda: JsonFileStore(tmp_path / "cp.json"),
        "journal": lambda: JournalStore(tmp_path / "cp.jsonl"),
        "sqlite": lambda: SqliteStore(tmp_path / "cp.db", run_id="whole"),
    }
    yield opens[request.param]


def _reload(opener: Callable[[], Any]) -> list[tuple[str, WorkflowCheckpoint]]:
    """What a fresh store object reads: its checkpoint, and for a journal its history's last one."""
    with opener() as store:
        loaded = [("load", store.load())]
        if isinstance(store, JournalStore):
            loaded.append(("history", list(store.history())[-1]))
    return loaded


def _stored_after(opener: Callable[[], Any], saves: list[WorkflowCheckpoint]) -> None:
    """Save each of ``saves`` (the codec's form) with one store object; every reading is the last."""
    with opener() as store:
        for cp in saves:
            store.save(CODEC.encode_checkpoint(cp))
    for how, loaded in _reload(opener):
        assert_whole(CODEC.decode_checkpoint(loaded), saves[-1], f"{how} after {len(saves)} save(s)")


def earlier(cp: WorkflowCheckpoint, differ: frozenset[str], keep: int) -> WorkflowCheckpoint:
    """An earlier checkpoint of a run ending at ``cp``: its first ``keep`` outputs, and the fields
    in ``differ`` as they were before the run changed them (what a store may hold when ``cp`` comes)."""
    outputs = dict(list(cp.outputs.items())[:keep])
    before: dict[str, Any] = {
        "outputs": MappingProxyType(outputs),
        "step_index": keep,
        "step_usage": MappingProxyType({k: u for k, u in cp.step_usage.items() if k in outputs}),
        "durations": MappingProxyType({k: d for k, d in cp.durations.items() if k in outputs}),
        "began": MappingProxyType({k: b for k, b in cp.began.items() if k in outputs}),
        "held": MappingProxyType({k: h for k, h in cp.held.items() if k in outputs}),
    }
    older: dict[str, Any] = {
        "cost": TokenUsage(1, 1, 1),
        "context": MappingProxyType({"topic": Point(0, 0)}),
        "failures": MappingProxyType({}),
        "versions": MappingProxyType({"b": "1"}),
        "skipped": MappingProxyType({}),
        "superseded": MappingProxyType({}),
        "asked": MappingProxyType({"b": cp.asked["b"][:1]}),
        "redone": MappingProxyType({"b": 1}),
        "compacted": MappingProxyType({"loop": 2}),
        "compacted_retries": MappingProxyType({"loop": 1}),
        "code_fingerprints": MappingProxyType({"a": "0f" * 16, "b": "3c" * 16}),
        "cache_hits": MappingProxyType({"b": CacheHit("5a" * 32)}),
    }
    before.update({k: v for k, v in older.items() if k in differ})
    return dataclasses.replace(cp, **before, _outputs_ledger=None, _usage_ledger=None, _times=None)


@pytest.mark.parametrize("opener", STORES, indirect=True)
def test_each_store_carries_every_field_written_whole(opener: Callable[[], Any]) -> None:
    _stored_after(opener, [full()])
    _stored_after(opener, [core_made(full())])


CHANGING = ("cost", "context", "failures", "versions", "skipped", "superseded", "asked", "redone",
            "compacted", "compacted_retries", "code_fingerprints", "cache_hits")


@pytest.mark.parametrize("opener", STORES, indirect=True)
@pytest.mark.parametrize("field", CHANGING)
def test_each_store_carries_a_field_that_changed_since_its_last_save(
    opener: Callable[[], Any], field: str
) -> None:
    # One field changed, one output added: what a store may write as a delta on its last save.
    cp = core_made(full())
    _stored_after(opener, [earlier(cp, frozenset({field}), len(cp.outputs) - 1), cp])


@pytest.mark.parametrize("opener", ["json", "journal", "sqlite"], indirect=True)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(differ=st.frozensets(st.sampled_from(CHANGING)), keep=st.integers(0, len(FIELDS["outputs"])),
       core=st.booleans())
def test_whatever_a_store_held_a_save_of_a_checkpoint_reads_back_whole(
    opener: Callable[[], Any], differ: frozenset[str], keep: int, core: bool
) -> None:
    cp = core_made(full()) if core else full()
    _stored_after(opener, [earlier(cp, differ, keep), cp])


@pytest.mark.parametrize("many", [False, True], ids=["save", "save_many"])
def test_the_queue_carries_every_field(queue_url: str, many: bool) -> None:
    cp = core_made(full())
    q = open_queue(queue_url)
    try:
        run_id = q.submit("w")
        lease = q.claim("me", {"w": None}, 60)
        assert lease is not None
        for saved in (earlier(cp, frozenset(CHANGING), 2), earlier(cp, frozenset({"versions"}), 4), cp):
            if many:  # the worker's group commit
                (outcome,) = q.save_many([(lease, CODEC.encode_checkpoint(saved))], 60)
                assert not isinstance(outcome, Exception), outcome
            else:
                q.save(lease, CODEC.encode_checkpoint(saved), 60)
            stored = q.checkpoint(run_id)
            assert stored is not None
            assert_whole(CODEC.decode_checkpoint(stored), saved, "the queue")
    finally:
        q.close()


# -- a run: a typed output, then a question (issue 42, item 1) ------------------------------------


def asking_workflow(ran: list[str]) -> Workflow:
    async def plan(ctx: Any) -> Point:
        ran.append("plan")
        return Point(1, 2)

    async def escalate(ctx: Any) -> str:
        ran.append("escalate")
        return f"{ctx['plan'].x}: {ask('Escalate to whom?')}"

    return Workflow([Step("plan", plan), Step("escalate", escalate, ("plan",))], codec=Codec())


def test_a_question_asked_after_a_typed_output_is_saved_and_answered() -> None:
    ran: list[str] = []
    flow = asking_workflow(ran)
    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(RunWaiting) as waiting:
        flow.run_sync(checkpoint_fn=saved.append)
    assert list(waiting.value.questions) == ["escalate"]
    assert list(saved[-1].asked) == ["escalate"] and waiting.value.checkpoint.asked == saved[-1].asked
    assert saved[-1].outputs["plan"]["$ekit"] == "type"
    result = flow.run_sync(resume_from=json.loads(json.dumps(saved[-1].to_dict())),
                           answers={"escalate": "ann"})
    assert result.outputs["escalate"] == "1: ann"
    assert ran == ["plan", "escalate", "escalate"]  # plan is not paid again


@pytest.mark.timeout(120)
def test_a_queued_run_with_a_typed_output_waits_naming_its_question_and_is_answered(queue_url: str) -> None:
    ran: list[str] = []
    flow = asking_workflow(ran)
    q = open_queue(queue_url)
    try:
        run_id = q.submit("asks")
        asyncio.run(Worker(q, {"asks": flow}, poll=0.01).run_until_idle())
        info = q.status(run_id)
        assert info.status == "waiting" and "escalate" in info.reason
        stored = q.checkpoint(run_id)
        assert stored is not None and list(stored.asked) == ["escalate"]
        q.answer(run_id, "escalate", "ann")
        asyncio.run(Worker(q, {"asks": flow}, poll=0.01).run_until_idle())
        assert q.status(run_id).status == "finished"
        final = q.checkpoint(run_id)
    finally:
        q.close()
    assert final is not None and final.outputs["escalate"] == "1: ann"
    assert ran == ["plan", "escalate", "escalate"]


@pytest.mark.parametrize("opener", ["json", "journal", "sqlite"], indirect=True)
def test_a_version_bumped_on_resume_is_saved_so_the_bumped_step_is_paid_once(
    opener: Callable[[], Any]
) -> None:
    ran: list[str] = []

    def flow(version: str, fail: str | None) -> Workflow:
        def step(name: str) -> Callable[[Any], str]:
            def run(ctx: Any) -> str:
                ran.append(name)
                if name == fail:
                    raise RuntimeError(f"{name} failed")
                return f"{name}{version}"
            return run
        return Workflow([Step("a", step("a")), Step("b", step("b"), ("a",), version=version),
                         Step("c", step("c"), ("b",))])

    with opener() as store:  # one store object for both runs: the second saves on the first's
        with pytest.raises(RuntimeError, match="b failed"):
            flow("1", "b").run_sync(checkpoint_fn=store)
        with pytest.raises(RuntimeError, match="c failed"):
            flow("2", "c").run_sync(checkpoint_fn=store, resume_from=store.load())
    with opener() as store:
        assert store.load().versions == {"b": "2"}
        result = flow("2", None).run_sync(resume_from=store.load())
    assert result.outputs["b"] == "b2"
    assert ran == ["a", "b", "b", "c", "c"]  # b under version 2 is paid once
