"""Outputs of the steps' own types (pydantic models, dataclasses, registered types) are stored and
restored as those types, through every store and the run queue, by the codec the workflow is given.

What users rely on: a step's typed output reaches ``result.outputs`` and the
steps downstream as the object returned, and after a resume from any store
as an equal object of the same type; loading a checkpoint never imports or
evaluates what it names; a stored dict that looks like a tagged object comes
back as that dict; an output that cannot be stored is refused as early as it
can be known (at construction from a return annotation, else before the
checkpoint reaches the store), naming the step and the type.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import enum
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import CheckpointError, WorkflowCheckpoint, rewind
from ekit_runtime import (
    Codec,
    JournalStore,
    JsonFileStore,
    PatternResult,
    PostgresStore,
    SqliteStore,
    Step,
    TokenUsage,
    UnencodableError,
    Workflow,
)
from ekit_runtime.queue import Worker, open_queue
from tests.support.queue_backends import fresh_postgres, queue_url

__all__ = ["queue_url"]

try:
    import pydantic
except ImportError:  # pragma: no cover - the test extra installs it
    pydantic = None  # type: ignore[assignment]


# -- the types a user's steps return ----------------------------------------------


@dataclasses.dataclass(frozen=True)
class Source:
    url: str
    score: float


class Tone(enum.Enum):
    CALM = "calm"
    URGENT = "urgent"


@dataclasses.dataclass
class Summary:
    title: str
    sources: list[Source]
    by_lang: dict[str, Source]
    best: Source | None = None
    tags: tuple[str, ...] = ()
    notes: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    tone: Tone = Tone.CALM


def make_summary(n: int) -> Summary:
    sources = [Source(f"https://example.org/{i}", i / 4) for i in range(n)]
    return Summary("t", sources, {"en": sources[0]}, None, ("a", "b"), {"x": [1, 2]}, Tone.URGENT)


if pydantic is not None:

    class Citation(pydantic.BaseModel):
        url: str
        quote: str

    class Answer(pydantic.BaseModel):
        text: str
        citations: list[Citation]
        created: dt.datetime
        extra: dict[str, Any] = pydantic.Field(default_factory=dict)

    def make_answer(n: int) -> Any:
        return Answer(
            text="an answer",
            citations=[Citation(url=f"u{i}", quote="q") for i in range(n)],
            created=dt.datetime(2024, 2, 29, 12, 30, tzinfo=dt.UTC),
            extra={"nested": {"$ekit": "looks tagged"}},
        )


KINDS = ["dataclass", pytest.param("pydantic", marks=pytest.mark.skipif(
    pydantic is None, reason="pydantic is not installed"))]


def typed_workflow(kind: str, ran: list[str], *, fail_once: list[bool] | None = None) -> Workflow:
    """produce -> T, then consume checks it got a T and returns another T; annotated, no registering."""
    make = make_summary if kind == "dataclass" else make_answer
    cls = Summary if kind == "dataclass" else Answer

    async def produce(ctx: Any) -> Summary:
        ran.append("produce")
        return make(2)  # type: ignore[no-any-return]

    async def produce_answer(ctx: Any) -> Answer:
        ran.append("produce")
        return make(2)  # type: ignore[no-any-return]

    async def consume(ctx: Any) -> list[Summary | Answer]:
        ran.append("consume")
        got = ctx["produce"]
        assert type(got) is cls, type(got)
        assert got == make(2)
        if fail_once is not None and not fail_once:
            fail_once.append(True)
            raise RuntimeError("the model provider timed out")
        return [got, make(1)]

    first = produce if kind == "dataclass" else produce_answer
    return Workflow(
        [Step("produce", first), Step("consume", consume, ("produce",))], codec=Codec())


# -- every store --------------------------------------------------------------------

STORES = ("json", "journal", "sqlite", "postgres")


@pytest.fixture
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], Any]]:
    """A function opening a fresh store object on one place, for the store kind ``request.param``."""
    kind = request.param
    if kind == "postgres":
        with fresh_postgres() as url:
            yield lambda: PostgresStore(url, run_id="typed")
        return
    opens: dict[str, Callable[[], Any]] = {
        "json": lambda: JsonFileStore(tmp_path / "cp.json"),
        "journal": lambda: JournalStore(tmp_path / "cp.jsonl"),
        "sqlite": lambda: SqliteStore(tmp_path / "cp.db", run_id="typed"),
    }
    yield opens[kind]


def _close(store: Any) -> None:
    close = getattr(store, "close", None)
    if close is not None:
        close()


def _load(opener: Callable[[], Any]) -> WorkflowCheckpoint:
    store = opener()
    try:
        loaded = store.load()
    finally:
        _close(store)
    assert loaded is not None
    return loaded  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("opener", STORES, indirect=True)
def test_a_typed_output_round_trips_through_the_store_and_a_resume_hands_downstream_the_same_type(
    opener: Callable[[], Any], kind: str
) -> None:
    ran: list[str] = []
    fail_once: list[bool] = []
    store = opener()
    with pytest.raises(RuntimeError, match="timed out"):
        typed_workflow(kind, ran, fail_once=fail_once).run_sync(checkpoint_fn=store)
    _close(store)
    assert ran == ["produce", "consume"]

    stored = _load(opener)
    tagged = stored.outputs["produce"]
    assert tagged["$ekit"] == "type" and tagged["type"].endswith(("Summary", "Answer"))

    # The resume pays nothing again; consume gets the type produce returned.
    ran.clear()
    store = opener()
    flow = typed_workflow(kind, ran)
    result = flow.run_sync(checkpoint_fn=store, resume_from=stored)
    _close(store)
    assert ran == ["consume"]
    make = make_summary if kind == "dataclass" else make_answer
    assert result.outputs["consume"] == [make(2), make(1)]
    assert [type(v) for v in result.outputs["consume"]] == [type(make(2))] * 2

    # What is stored now reads back as the same values, of the same types.
    final = _load(opener)
    assert final == result.checkpoint  # the checkpoint handed out is the stored form
    restored = flow.codec.decode_checkpoint(final)  # type: ignore[union-attr]
    assert dict(restored.outputs) == dict(result.outputs)
    assert type(restored.outputs["produce"]) is type(make(2))
    ran.clear()
    again = flow.run_sync(resume_from=final)
    assert ran == [] and dict(again.outputs) == dict(result.outputs)


@pytest.mark.parametrize("opener", STORES, indirect=True)
def test_typed_items_of_a_mapped_step_round_trip_through_the_store(opener: Callable[[], Any]) -> None:
    async def split(ctx: Any) -> list[Source]:
        return [Source(f"u{i}", i) for i in range(4)]

    async def rate(ctx: Any) -> Source:
        return Source(ctx["split"].url.upper(), ctx["split"].score * 2)

    flow = Workflow([Step("split", split),
                     Step("rate", rate, ("split",), map_over="split", context="dependencies")],
                    codec=Codec())
    store = opener()
    result = flow.run_sync(checkpoint_fn=store)
    _close(store)
    assert result.outputs["rate"] == [Source(f"U{i}", i * 2) for i in range(4)]
    loaded = _load(opener)
    restored = flow.codec.decode_checkpoint(loaded)  # type: ignore[union-attr]
    assert restored.outputs["rate[2]"] == Source("U2", 4)
    assert restored.outputs["rate"] == result.outputs["rate"]
    # Rerunning the mapped step from the stored split hands each item a Source again.
    resumed = flow.run_sync(resume_from=rewind(flow, loaded, "rate"))
    assert resumed.outputs["rate"] == result.outputs["rate"]


# -- the run queue --------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_a_queue_worker_stores_typed_outputs_and_a_resume_from_its_checkpoint_restores_them(
    queue_url: str, kind: str
) -> None:
    ran: list[str] = []
    flow = typed_workflow(kind, ran)
    q = open_queue(queue_url)
    try:
        run_id = q.submit("typed")
        asyncio.run(Worker(q, {"typed": flow}, poll=0.01).run_until_idle())
        assert q.status(run_id).status == "finished"
        stored = q.checkpoint(run_id)
    finally:
        q.close()
    assert stored is not None and ran == ["produce", "consume"]
    assert stored.outputs["produce"]["$ekit"] == "type"
    ran.clear()
    resumed = flow.run_sync(resume_from=rewind(flow, stored, "consume"))
    assert ran == ["consume"]  # consume asserts it was handed the type produce returned
    make = make_summary if kind == "dataclass" else make_answer
    assert resumed.outputs["consume"] == [make(2), make(1)]


# -- loading never runs what a checkpoint names ------------------------------------


def _hostile(tmp_path: Path, name: str) -> Path:
    path = tmp_path / "hostile.json"
    flow = typed_workflow("dataclass", [])
    with JsonFileStore(path) as store:
        flow.run_sync(checkpoint_fn=store)
    data = json.loads(path.read_text())
    data["outputs"]["produce"] = {"$ekit": "type", "type": name, "value": "echo pwned"}
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("name", ["os:system", "ekit_made_up_module_for_tests:Thing", "Summary"])
def test_a_checkpoint_naming_a_type_the_codec_has_not_registered_is_refused_importing_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    calls: list[object] = []
    monkeypatch.setattr(os, "system", lambda *a: calls.append(a) or 0)
    loaded = JsonFileStore(_hostile(tmp_path, name)).load()
    modules = set(sys.modules)
    ran: list[str] = []
    with pytest.raises(CheckpointError, match=r"'outputs\.produce'.*" + name.split(":")[0]) as caught:
        typed_workflow("dataclass", ran).run_sync(resume_from=loaded)
    assert isinstance(caught.value, ValueError)
    assert "has not registered" in str(caught.value)
    assert ran == [] and calls == []
    assert set(sys.modules) == modules
    assert "ekit_made_up_module_for_tests" not in sys.modules


def test_a_malformed_tag_or_data_its_type_refuses_is_refused_naming_the_step() -> None:
    flow = typed_workflow("dataclass", [])
    base = flow.run_sync().checkpoint.to_dict()
    bad = {
        "extra key": {"$ekit": "type", "type": "x", "value": 1, "more": 2},
        "unknown mark": {"$ekit": "pickle", "value": "..."},
        "fields wrong": {"$ekit": "type", "type": f"{__name__}:Source", "value": {"nope": 1}},
    }
    for case, output in bad.items():
        data = {**base, "outputs": {**base["outputs"], "produce": output}}
        with pytest.raises(CheckpointError, match=r"'outputs\.produce'"):
            flow.run_sync(resume_from=data)
        assert case


# -- a dict of the caller's that looks tagged ------------------------------------------


@pytest.mark.parametrize("opener", ["json", "sqlite"], indirect=True)
def test_a_dict_that_looks_like_a_tagged_object_comes_back_as_that_dict(
    opener: Callable[[], Any],
) -> None:
    lookalike = {"$ekit": "type", "type": "os:system", "value": "rm -rf /",
                 "inner": [{"$ekit": "dict", "value": {}}]}

    async def fake(ctx: Any) -> dict[str, Any]:
        return lookalike

    flow = Workflow([Step("fake", fake), Step("after", lambda c: c["fake"] == lookalike, ("fake",))],
                    codec=Codec())
    store = opener()
    flow.run_sync(checkpoint_fn=store)
    _close(store)
    loaded = _load(opener)
    assert loaded.outputs["fake"]["$ekit"] == "dict"  # escaped
    result = flow.run_sync(resume_from=rewind(flow, loaded, "after"))
    assert result.outputs["fake"] == lookalike and result.outputs["after"] is True


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["$ekit", "type", "value", "a"]), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(JSON)
def test_plain_data_decodes_to_itself_after_encoding_whatever_keys_it_uses(data: Any) -> None:
    codec = Codec(Source)
    stored = json.loads(json.dumps(codec.encode(data)))
    assert codec.decode(stored) == data
    assert codec.decode(json.loads(json.dumps(codec.encode([Source("u", 1.0), data])))) == [
        Source("u", 1.0), data]


# -- registering ------------------------------------------------------------------------


class Money:
    def __init__(self, amount: Decimal, currency: str) -> None:
        self.amount, self.currency = amount, currency

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Money) and (self.amount, self.currency) == (other.amount, other.currency)

    __hash__ = None  # type: ignore[assignment]


def test_a_type_registered_with_its_own_encode_and_decode_round_trips(tmp_path: Path) -> None:
    codec = Codec()
    codec.register(Money, encode=lambda m: [str(m.amount), m.currency],
                   decode=lambda d: Money(Decimal(d[0]), d[1]), name="money")

    async def price(ctx: Any) -> Money:
        return Money(Decimal("9.99"), "EUR")

    flow = Workflow([Step("price", price), Step("twice", lambda c: [c["price"], c["price"]], ("price",))],
                    codec=codec)
    with SqliteStore(tmp_path / "m.db", run_id="m") as store:
        flow.run_sync(checkpoint_fn=store)
    loaded = SqliteStore(tmp_path / "m.db", run_id="m").load()
    assert loaded is not None
    assert loaded.outputs["price"] == {"$ekit": "type", "type": "money", "value": ["9.99", "EUR"]}
    resumed = flow.run_sync(resume_from=rewind(flow, loaded, "twice"))
    assert resumed.outputs["twice"] == [Money(Decimal("9.99"), "EUR")] * 2


def test_register_refuses_what_it_cannot_store_and_names_taken_by_another_type() -> None:
    codec = Codec()
    with pytest.raises(ValueError, match=r"encode= .* and decode="):
        codec.register(Money)
    with pytest.raises(ValueError, match="both encode= and decode="):
        codec.register(Money, encode=str)
    with pytest.raises(ValueError, match="nothing to register"):
        codec.register(dict)
    codec.register(Source, name="source")
    with pytest.raises(ValueError, match="taken by"):
        codec.register(Summary, name="source")
    assert codec.register(Summary) is Summary  # usable as a decorator
    assert Source in codec and codec.names == ("source", f"{__name__}:Summary")


def test_each_output_is_encoded_once_however_many_saves_follow(tmp_path: Path) -> None:
    encoded: list[str] = []
    codec = Codec()
    codec.register(Money, encode=lambda m: encoded.append(m.currency) or [str(m.amount), m.currency],
                   decode=lambda d: Money(Decimal(d[0]), d[1]))
    steps = [Step("s0", lambda c: Money(Decimal(0), "c0"))] + [
        Step(f"s{i}", lambda c, i=i: Money(Decimal(i), f"c{i}"), (f"s{i - 1}",)) for i in range(1, 30)]
    saved: list[WorkflowCheckpoint] = []
    with JournalStore(tmp_path / "long.jsonl") as store:
        def save(cp: WorkflowCheckpoint) -> None:
            saved.append(cp)
            store.save(cp)
        Workflow(steps, codec=codec).run_sync(checkpoint_fn=save)
    assert sorted(encoded) == sorted(f"c{i}" for i in range(30))
    # Checkpoints of one run stay deltas of one another: the journal appends, never rewrites.
    assert all(b.delta_since(a).extends for a, b in itertools.pairwise(saved))
    lines = (tmp_path / "long.jsonl").read_bytes().splitlines()
    assert sum(b'"kind":"full"' in line for line in lines) == 1


def test_a_run_with_a_codec_and_only_plain_outputs_hands_out_the_core_checkpoints() -> None:
    saved: list[WorkflowCheckpoint] = []
    flow = Workflow([Step("a", lambda c: 1), Step("b", lambda c: [c["a"]], ("a",))], codec=Codec())
    result = flow.run_sync(checkpoint_fn=saved.append)
    assert result.checkpoint is saved[-1] and saved[-1].outputs == {"a": 1, "b": [1]}


def test_the_result_checkpoint_is_the_stored_form_even_without_a_checkpoint_fn(tmp_path: Path) -> None:
    flow = typed_workflow("dataclass", [])
    result = flow.run_sync()
    assert type(result.outputs["produce"]) is Summary
    assert result.checkpoint is not None and result.checkpoint.outputs["produce"]["$ekit"] == "type"
    with JsonFileStore(tmp_path / "later.json") as store:
        store.save(result.checkpoint)  # the caller saves it later: it encodes
    assert JsonFileStore(tmp_path / "later.json").load() == result.checkpoint


def test_usage_carried_by_a_pattern_result_of_a_typed_value_is_counted_and_the_value_stored() -> None:
    async def answer(ctx: Any) -> PatternResult[Source]:
        return PatternResult(Source("u", 1.0), cost=TokenUsage(3, 4, 1))

    result = Workflow([Step("answer", answer)], codec=Codec()).run_sync()
    assert result.outputs["answer"] == Source("u", 1.0) and result.cost == TokenUsage(3, 4, 1)
    assert result.checkpoint is not None and result.checkpoint.outputs["answer"]["$ekit"] == "type"


# -- refused as early as it can be known ------------------------------------------------


class Widget:
    """A plain class: no store holds it, and the codec was not told how."""


def test_a_step_annotated_to_return_a_type_no_store_holds_is_refused_at_construction() -> None:
    async def build(ctx: Any) -> list[Widget]:
        return [Widget()]

    with pytest.raises(UnencodableError, match=r"step 'build' .*Widget.*codec\.register") as caught:
        Workflow([Step("build", build)], codec=Codec())
    assert caught.value.step == "build"
    codec = Codec()
    codec.register(Widget, encode=lambda w: {}, decode=lambda d: Widget())
    assert Workflow([Step("build", build)], codec=codec).codec is codec


def test_an_unregistered_dataclass_returned_unannotated_is_refused_before_the_store_sees_it(
    tmp_path: Path,
) -> None:
    ran: list[str] = []

    def first(ctx: Any) -> int:
        ran.append("first")
        return 1

    def second(ctx: Any):  # type: ignore[no-untyped-def]  # no annotation: known when it returns
        ran.append("second")
        return Source("u", 1.0)

    path = tmp_path / "early.json"
    flow = Workflow([Step("first", first), Step("second", second, ("first",))], codec=Codec())
    with JsonFileStore(path) as store, pytest.raises(
            UnencodableError, match=r"step 'second' returned a dataclass .*Source.*register") as caught:
        flow.run_sync(checkpoint_fn=store, max_concurrency=1)
    assert caught.value.step == "second" and ran == ["first", "second"]
    loaded = JsonFileStore(path).load()
    assert loaded is not None and dict(loaded.outputs) == {"first": 1}  # the last good save stands


def test_without_a_codec_the_store_names_the_step_the_type_and_the_codec_to_give(
    tmp_path: Path,
) -> None:
    path = tmp_path / "plain.json"
    flow = Workflow([Step("second", lambda c: {"s": [Source("u", 1.0)]})])
    with JsonFileStore(path) as store, pytest.raises(
            UnencodableError, match=r"step 'second'.*Source.*codec=Codec\(Source\)") as caught:
        flow.run_sync(checkpoint_fn=store)
    assert caught.value.step == "second"
    assert JsonFileStore(path).load() is None


def test_a_registered_dataclass_whose_field_no_store_holds_is_refused_at_construction() -> None:
    @dataclasses.dataclass
    class Parts:
        widgets: list[Widget]

    codec = Codec(Parts)
    with pytest.raises(UnencodableError, match=r"field 'widgets' of dataclass .*Parts.*Widget"):
        Workflow([Step("parts", lambda c: Parts([]))], codec=codec)


def test_the_sdk_response_object_round_trips_and_unannotated_is_refused_naming_it(tmp_path: Path) -> None:
    chat = pytest.importorskip("openai.types.chat")
    reply = {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "local",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "Hello"}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }

    def unannotated(ctx: Any):  # type: ignore[no-untyped-def]
        return chat.ChatCompletion.model_validate(reply)

    with pytest.raises(UnencodableError, match=r"step 'ask' returned a pydantic model .*ChatCompletion"):
        Workflow([Step("ask", unannotated)], codec=Codec()).run_sync(
            checkpoint_fn=JsonFileStore(tmp_path / "refused.json"))

    flow = Workflow([Step("ask", unannotated),
                     Step("text", lambda c: c["ask"].choices[0].message.content, ("ask",))],
                    codec=Codec(chat.ChatCompletion))
    with JsonFileStore(tmp_path / "chat.json") as store:
        first = flow.run_sync(checkpoint_fn=store)
    loaded = JsonFileStore(tmp_path / "chat.json").load()
    assert loaded is not None
    resumed = flow.run_sync(resume_from=rewind(flow, loaded, "text"))
    assert type(resumed.outputs["ask"]) is chat.ChatCompletion
    assert resumed.outputs["ask"] == first.outputs["ask"] and resumed.outputs["text"] == "Hello"


def test_an_unregistered_enum_is_refused_rather_than_stored_as_its_bare_value() -> None:
    with pytest.raises(UnencodableError, match=r"step 'mood' returned an enum .*Tone"):
        Workflow([Step("mood", lambda c: {"tone": Tone.CALM})], codec=Codec()).run_sync(
            checkpoint_fn=lambda cp: None)
    result = Workflow([Step("mood", lambda c: {"tone": Tone.CALM})], codec=Codec(Tone)).run_sync()
    assert result.checkpoint is not None
    assert Codec(Tone).decode_checkpoint(result.checkpoint).outputs["mood"] == {"tone": Tone.CALM}


def test_a_typed_value_in_the_initial_context_is_stored_and_restored_too(tmp_path: Path) -> None:
    seen: list[object] = []

    def use(ctx: Any) -> str:
        seen.append(ctx["origin"])
        return str(ctx["origin"].url)

    flow = Workflow([Step("use", use)], codec=Codec(Source))
    with JsonFileStore(tmp_path / "ctx.json") as store:
        flow.run_sync({"origin": Source("u", 1.0)}, checkpoint_fn=store)
    loaded = JsonFileStore(tmp_path / "ctx.json").load()
    assert loaded is not None and loaded.context["origin"]["$ekit"] == "type"
    flow.run_sync(resume_from=rewind(flow, loaded, "use"))
    assert seen == [Source("u", 1.0), Source("u", 1.0)] and type(seen[1]) is Source
