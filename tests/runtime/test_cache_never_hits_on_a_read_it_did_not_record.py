"""A cached step's output is handed back only when every way it could see its inputs was recorded.

What users rely on (docs/cache.md): a hit needs "the same values of
everything the step read". A step sees its context through more than
``ctx[key]``: its ``repr`` (an f-string of the context in a prompt), a deep
copy, ``copy()`` and ``|`` (which a step's context offers), the types the
values have (an ``int`` key is not a ``str`` key, a tuple not a list), and
the answers a person gave to its questions. Each of these, changed, is a
miss; and what works on an uncached step works on a cached one.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import RunWaiting, SqliteCache, Step, Workflow
from ekit_runtime.human import ask


def _run(cache: SqliteCache, fn: Callable[[Mapping[str, Any]], Any], context: dict[str, Any]) -> Any:
    wf = Workflow([Step("s", fn, cache=True)])
    return asyncio.run(wf.run(context, cache=cache)).outputs["s"]


@pytest.fixture()
def cache(tmp_path: Path) -> Any:
    made = SqliteCache(tmp_path / "cache.db")
    yield made
    made.close()


@pytest.mark.parametrize("show", [repr, str, lambda ctx: f"Context: {ctx}"], ids=["repr", "str", "fstring"])
def test_a_step_that_shows_its_context_misses_when_the_context_changes(
        cache: SqliteCache, show: Callable[[Any], str]) -> None:
    first = _run(cache, show, {"topic": "tides"})
    second = _run(cache, show, {"topic": "moons"})
    assert "tides" in first and "moons" in second


def test_a_step_that_deep_copies_its_context_misses_when_the_context_changes(cache: SqliteCache) -> None:
    def snapshot(ctx: Mapping[str, Any]) -> Any:
        return copy.deepcopy(ctx)["topic"]

    assert _run(cache, snapshot, {"topic": "tides"}) == "tides"
    assert _run(cache, snapshot, {"topic": "moons"}) == "moons"


def test_copy_and_merge_work_on_a_cached_step_as_on_any_other(cache: SqliteCache) -> None:
    def merged(ctx: Mapping[str, Any]) -> Any:
        return [ctx.copy()["topic"], (ctx | {"x": 1})["topic"], ({"x": 1} | ctx)["topic"]]  # type: ignore[attr-defined,operator]

    assert _run(cache, merged, {"topic": "tides"}) == ["tides"] * 3
    assert _run(cache, merged, {"topic": "moons"}) == ["moons"] * 3


@pytest.mark.parametrize(("one", "other"), [
    ({1: "a"}, {"1": "a"}),
    ((1, 2), [1, 2]),
    ({"k": (1,)}, {"k": [1]}),
], ids=["int-vs-str-key", "tuple-vs-list", "nested-tuple-vs-list"])
def test_values_that_encode_alike_but_differ_in_type_are_a_miss(cache: SqliteCache, one: Any,
                                                                 other: Any) -> None:
    def describe(ctx: Mapping[str, Any]) -> str:
        return repr(ctx["value"])

    assert _run(cache, describe, {"value": one}) == repr(one)
    assert _run(cache, describe, {"value": other}) == repr(other)


def test_the_answer_to_a_question_is_part_of_the_key(cache: SqliteCache) -> None:
    def asking(ctx: Mapping[str, Any]) -> str:
        return f"{ctx['topic']} in {ask('which colour?')}"

    wf = Workflow([Step("s", asking, cache=True)])

    def answered(colour: str) -> str:
        with pytest.raises(RunWaiting) as waiting:  # a fresh run asks: no answer is given yet
            asyncio.run(wf.run({"topic": "tides"}, cache=cache))
        resumed = asyncio.run(wf.run(resume_from=waiting.value.checkpoint, answers={"s": colour},
                                     cache=cache))
        return str(resumed.outputs["s"])

    assert answered("red") == "tides in red"
    assert answered("blue") == "tides in blue"
    assert answered("red") == "tides in red"


def test_deleting_a_key_reads_whether_it_was_there(cache: SqliteCache) -> None:
    def tidy(ctx: Any) -> str:
        try:
            del ctx["draft"]
        except KeyError:
            return "nothing to tidy"
        return "tidied"

    assert _run(cache, tidy, {"topic": "tides"}) == "nothing to tidy"
    assert _run(cache, tidy, {"topic": "tides", "draft": "d"}) == "tidied"
