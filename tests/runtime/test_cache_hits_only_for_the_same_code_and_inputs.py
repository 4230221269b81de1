"""The cross-run cache hands back an output only for the same code and the same inputs (issue 45).

What users rely on: a step with ``cache=True``, run with ``run(cache=...)``,
is not paid again in a new run when its code and every value it read are the
same; any change to the code, the version, a value it read, or the item is a
miss; a context key it did not read spoils nothing. Both ready-made caches
behave the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ekit_core import TokenUsage
from ekit_runtime import Cache, Codec, DirectoryCache, PatternResult, SqliteCache, Step, Workflow
from tests.support.queue_backends import fresh_postgres

KINDS = ("sqlite", "directory", "postgres")


def open_cache(kind: str, where: Path) -> Cache:
    return SqliteCache(where / "cache.db") if kind == "sqlite" else DirectoryCache(where / "cache")


@pytest.fixture(params=KINDS)
def cache(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cache]:
    if request.param == "postgres":  # the real server (tests/support/queue_backends.py)
        from ekit_runtime.cache.postgres import PostgresCache

        with fresh_postgres() as url:
            made = PostgresCache(url)
            yield made
            made.close()
        return
    yield open_cache(request.param, tmp_path)


def _workflow(calls: list[str], critique: Callable[[Mapping[str, Any]], Any] | None = None,
              version: str | None = None, codec: Codec | None = None) -> Workflow:
    def draft(ctx: Mapping[str, Any]) -> str:
        calls.append("draft")
        return f"draft about {ctx['topic']}"

    def critique_v1(ctx: Mapping[str, Any]) -> PatternResult[str]:
        calls.append("critique")
        return PatternResult(f"critique of {ctx['draft']}", cost=TokenUsage(100, 20, 1))

    return Workflow([
        Step("draft", draft, cache=True),
        Step("critique", critique or critique_v1, depends_on=("draft",), cache=True, version=version),
    ], codec=codec)


def _run(wf: Workflow, cache: Cache, **context: Any) -> Any:
    return asyncio.run(wf.run({"topic": "tides", "style": "plain", **context}, cache=cache))


def test_a_second_run_pays_for_nothing(cache: Cache) -> None:
    calls: list[str] = []
    first = _run(_workflow(calls), cache)
    assert calls == ["draft", "critique"] and first.cost == TokenUsage(100, 20, 1)
    calls.clear()
    second = _run(_workflow(calls), cache)
    assert calls == []
    assert second.outputs == first.outputs
    assert second.cost == TokenUsage(0, 0, 0)


def test_a_key_the_step_did_not_read_spoils_nothing(cache: Cache) -> None:
    calls: list[str] = []
    _run(_workflow(calls), cache, style="plain")
    calls.clear()
    _run(_workflow(calls), cache, style="ornate")  # no step reads "style"
    assert calls == []


def test_a_changed_input_misses_and_what_reads_it_runs(cache: Cache) -> None:
    calls: list[str] = []
    _run(_workflow(calls), cache, topic="tides")
    calls.clear()
    result = _run(_workflow(calls), cache, topic="moons")
    assert calls == ["draft", "critique"]
    assert result.outputs["critique"] == "critique of draft about moons"


def test_changed_code_misses_and_the_old_entry_serves_the_old_code(cache: Cache) -> None:
    calls: list[str] = []
    _run(_workflow(calls), cache)

    def critique_v2(ctx: Mapping[str, Any]) -> str:
        calls.append("critique2")
        return f"harsh critique of {ctx['draft']}"

    calls.clear()
    assert _run(_workflow(calls, critique_v2), cache).outputs["critique"].startswith("harsh")
    assert calls == ["critique2"]  # the draft is a hit: its code and input did not change
    calls.clear()
    _run(_workflow(calls), cache)  # back to the first code: its entry is still there
    assert calls == []


def test_a_changed_version_misses(cache: Cache) -> None:
    calls: list[str] = []
    _run(_workflow(calls, version="1"), cache)
    calls.clear()
    _run(_workflow(calls, version="2"), cache)
    assert calls == ["critique"]


def test_items_of_a_mapped_step_are_cached_one_by_one(cache: Cache) -> None:
    calls: list[str] = []

    def make(n: int) -> Workflow:
        def parts(ctx: Mapping[str, Any]) -> list[str]:
            return [f"p{i}" for i in range(n)]

        def summarize(ctx: Mapping[str, Any]) -> str:
            calls.append(ctx["parts"])
            return ctx["parts"].upper()

        return Workflow([Step("parts", parts),
                         Step("summarize", summarize, depends_on=("parts",), map_over="parts",
                              cache=True)])

    asyncio.run(make(2).run(cache=cache))
    calls.clear()
    result = asyncio.run(make(3).run(cache=cache))
    assert calls == ["p2"]
    assert result.outputs["summarize"] == ["P0", "P1", "P2"]


@dataclass(frozen=True)
class Verdict:
    score: int
    words: tuple[str, ...]


def test_a_hit_hands_back_the_codec_s_types(cache: Cache) -> None:
    calls: list[str] = []

    def judge(ctx: Mapping[str, Any]) -> Verdict:
        calls.append("judge")
        return Verdict(3, ("a", "b"))

    def wf() -> Workflow:
        return Workflow([Step("judge", judge, cache=True)], codec=Codec(Verdict))

    first = asyncio.run(wf().run(cache=cache)).outputs["judge"]
    second = asyncio.run(wf().run(cache=cache)).outputs["judge"]
    assert calls == ["judge"]
    assert isinstance(second, Verdict) and second == first


def test_an_unencodable_input_is_never_a_hit(cache: Cache) -> None:
    calls: list[str] = []

    class Opaque:
        pass

    def step(ctx: Mapping[str, Any]) -> str:
        calls.append("step")
        return type(ctx["client"]).__name__

    for _ in range(2):
        asyncio.run(Workflow([Step("s", step, cache=True)]).run({"client": Opaque()}, cache=cache))
    assert calls == ["step", "step"]


def test_a_step_that_iterates_its_context_misses_when_a_key_is_added(cache: Cache) -> None:
    calls: list[str] = []

    def step(ctx: Mapping[str, Any]) -> int:
        calls.append("step")
        return len(ctx)

    asyncio.run(Workflow([Step("s", step, cache=True)]).run({"a": 1}, cache=cache))
    asyncio.run(Workflow([Step("s", step, cache=True)]).run({"a": 1}, cache=cache))
    assert calls == ["step"]
    asyncio.run(Workflow([Step("s", step, cache=True)]).run({"a": 1, "b": 2}, cache=cache))
    assert calls == ["step", "step"]


def test_hits_are_reported_with_what_they_saved(cache: Cache) -> None:
    calls: list[str] = []
    _run(_workflow(calls), cache)
    runner = _workflow(calls).runner({"topic": "tides"}, cache=cache)
    asyncio.run(runner.run())
    assert set(runner.cache_hits) == {"draft", "critique"}
    assert runner.cache_hits["critique"].saved == TokenUsage(100, 20, 1)


def test_a_bad_cache_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="cache must be"):
        asyncio.run(Workflow([Step("s", lambda ctx: 1, cache=True)]).run(cache="cache.db"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_age"):
        SqliteCache(":memory:", max_age=-1)


_value = st.one_of(st.integers(-3, 3), st.text("ab", max_size=2), st.lists(st.integers(0, 2), max_size=2))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before=st.dictionaries(st.sampled_from(["x", "y", "z"]), _value, min_size=3),
       after=st.dictionaries(st.sampled_from(["x", "y", "z"]), _value, min_size=3),
       item_before=st.integers(0, 1), item_after=st.integers(0, 1))
def test_a_hit_exactly_when_every_value_read_and_the_item_are_the_same(
    tmp_path: Path, before: dict[str, Any], after: dict[str, Any], item_before: int, item_after: int
) -> None:
    # The step reads x and y (never z): a hit exactly when x, y and the item are unchanged.
    calls: list[object] = []

    def make(item: int) -> Workflow:
        def parts(ctx: Mapping[str, Any]) -> list[int]:
            return [item]

        def step(ctx: Mapping[str, Any]) -> str:
            calls.append(ctx["parts"])
            return repr((ctx["x"], ctx.get("y"), ctx["parts"]))

        return Workflow([Step("parts", parts),
                         Step("s", step, depends_on=("parts",), map_over="parts", item_key=None,
                              cache=True)])

    where = tmp_path / f"c{len(list(tmp_path.iterdir()))}.db"
    cache = SqliteCache(where)
    asyncio.run(make(item_before).run(before, cache=cache))
    calls.clear()
    result = asyncio.run(make(item_after).run(after, cache=cache))
    same = (before["x"], before["y"], item_before) == (after["x"], after["y"], item_after)
    assert (calls == []) == same
    assert result.outputs["s"] == [repr((after["x"], after["y"], item_after))]
    cache.close()


def test_checkpoints_record_each_hit_with_its_key_and_resumes_keep_them(cache: Cache, tmp_path: Path) -> None:
    from ekit_core import audit
    from ekit_runtime import JsonFileStore

    calls: list[str] = []
    _run(_workflow(calls), cache)
    store = JsonFileStore(tmp_path / "run.json")
    asyncio.run(_workflow(calls).run({"topic": "tides"}, cache=cache, checkpoint_fn=store.save))
    saved = store.load()
    assert saved is not None
    assert set(saved.cache_hits) == {"draft", "critique"}
    assert saved.cache_hits["critique"].saved == TokenUsage(100, 20, 1)
    assert len(saved.cache_hits["critique"].key) == 64
    row = next(r for r in audit(_workflow(calls), saved).steps if r.name == "critique")
    assert "handed back by the cache" in row.why
    # A resume with nothing left to run keeps the record of where its outputs came from.
    again = asyncio.run(_workflow(calls).run(resume_from=saved.to_dict()))
    assert again.checkpoint is not None and again.checkpoint.cache_hits == saved.cache_hits


def test_trace_and_progress_show_each_hit_and_what_it_saved(cache: Cache) -> None:
    import io

    from ekit_core import RunStarted, StepCacheHit, StepFinished, StepSkipped, StepStarted
    from ekit_runtime import ProgressPrinter

    calls: list[str] = []
    _run(_workflow(calls), cache)
    events: list[object] = []
    out = io.StringIO()
    asyncio.run(_workflow(calls).run({"topic": "tides"}, cache=cache,
                                     trace=[events.append, ProgressPrinter(out)]))
    hits = [e for e in events if isinstance(e, StepCacheHit)]
    assert [h.name for h in hits] == ["draft", "critique"]
    assert hits[1].saved == TokenUsage(100, 20, 1)
    # Found as the run starts (their inputs known): told right after RunStarted, then
    # recorded as a resume records its steps, never started.
    assert isinstance(events[0], RunStarted) and events[1:3] == hits
    assert [e.name for e in events if isinstance(e, StepSkipped)] == ["draft", "critique"]
    assert not [e for e in events if isinstance(e, StepStarted | StepFinished)]
    assert "cache hit critique, saved 120 tokens" in out.getvalue()


def test_a_hit_whose_inputs_come_later_is_found_by_its_attempt_and_told(cache: Cache) -> None:
    from ekit_core import StepCacheHit, StepFinished

    calls: list[str] = []

    def workflow() -> Workflow:
        def topic(ctx: Mapping[str, Any]) -> str:  # not cached: runs every time
            calls.append("topic")
            return "tides"

        def write(ctx: Mapping[str, Any]) -> PatternResult[str]:
            calls.append("write")
            return PatternResult(f"essay on {ctx['topic']}", cost=TokenUsage(10, 5, 1))

        return Workflow([Step("topic", topic), Step("write", write, ("topic",), cache=True)])

    asyncio.run(workflow().run(cache=cache))
    events: list[object] = []
    result = asyncio.run(workflow().run(cache=cache, trace=events.append))
    assert calls == ["topic", "write", "topic"]
    assert result.outputs["write"] == "essay on tides" and result.cost == TokenUsage(0, 0, 0)
    hit = next(e for e in events if isinstance(e, StepCacheHit))
    finished = next(e for e in events if isinstance(e, StepFinished) and e.name == "write")
    assert hit.name == "write" and hit.saved == TokenUsage(10, 5, 1)
    assert events.index(hit) < events.index(finished)
    assert result.checkpoint is not None and set(result.checkpoint.cache_hits) == {"write"}
