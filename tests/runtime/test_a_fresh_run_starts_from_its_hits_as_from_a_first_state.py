"""A fresh run finds its hits before its first state, and starts where it always did (issue 45).

What users rely on: a run with nothing recorded looks its cached steps up
before it builds its first state, then builds that state once, from the
hits, as a resume starts from recorded outputs (the first state built and
thrown away cost a hit about 8k instructions). The state it starts from, and
so every checkpoint, event and output after, is the one the run started from
when it built the first state and then the state with the hits: for version
tags, a codec, a worker's drive, a trace, a context, run options, hits and
misses mixed. What this shortcut does not take (a resume, ``only=``, an
approval callback, a context that is not a plain dict) goes the first way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from ekit_core import TokenUsage, checkpoint_of
from ekit_runtime import Codec, SqliteCache, Step, Workflow
from ekit_runtime import workflow as workflow_module
from ekit_runtime.cache import at_start


def _topic(ctx: Mapping[str, Any]) -> str:
    return f"outline of {ctx.get('topic', 'nothing')}"


def _draft(ctx: Mapping[str, Any]) -> str:
    return f"draft from {ctx['outline']}"


def _review(ctx: Mapping[str, Any]) -> str:
    return f"review of {ctx['draft']}"


def _flow(options: Mapping[str, Any], *, review_cached: bool = True) -> Workflow:
    version = "2" if options.get("versions") else None
    return Workflow([
        Step("outline", _topic, cache=True, version=version),
        Step("draft", _draft, ("outline",), cache=True),
        Step("review", _review, ("draft",), cache=review_cached),  # (its inputs known at start)
        Step("polish", _review, ("review",), cache=True, version=version),
    ], codec=Codec() if options.get("codec") else None)


CASES: list[dict[str, Any]] = [
    {},
    {"versions": True},
    {"codec": True},
    {"worker": "w1"},
    {"trace": True},
    {"context": {"topic": "owls", "unread": 3}},
    {"run_id": "r-1", "max_concurrency": 2, "budget": TokenUsage(10**6, 10**6, 100),
     "isolate_failures": True},
    {"uncached_review": True},  # review runs: polish is looked up by its attempt, later
]


def _run_options(case: Mapping[str, Any], cache: SqliteCache, saved: list[Any]) -> dict[str, Any]:
    options: dict[str, Any] = {"cache": cache, "checkpoint_fn": saved.append}
    for name in ("worker", "run_id", "max_concurrency", "budget", "isolate_failures"):
        if name in case:
            options[name] = case[name]
    if case.get("trace"):
        options["trace"] = lambda event: None
    return options


def _started(tmp_path: Path, case: Mapping[str, Any], fresh: bool, monkeypatch: pytest.MonkeyPatch
             ) -> tuple[Any, dict[str, Any], list[Any], dict[str, Any]]:
    """The run's first state (as a checkpoint's dict), its hits, its checkpoints and outputs."""
    with monkeypatch.context() as patch:
        if not fresh:  # the first way: the first state, then the state with the hits
            patch.setattr(Workflow, "_fresh_lookup", lambda *args: False)
        flow = _flow(case, review_cached=not case.get("uncached_review"))
        saved: list[Any] = []
        with SqliteCache(tmp_path / "c.db") as cache:
            runner = flow.runner(case.get("context"), **_run_options(case, cache, saved))
            first = (checkpoint_of(runner.state).to_dict(), runner.state.events, runner.state.completed)
            hits = dict(runner.cache_hits)
            state = asyncio.run(runner.run())
        return first, hits, [c.to_dict() for c in saved], dict(state.outputs.as_dict())


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(c) or "plain")
def test_a_fresh_run_starts_from_the_state_the_first_way_gave(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: dict[str, Any]) -> None:
    monkeypatch.setattr(workflow_module, "time", lambda: 1_700_000_000.0)  # (a drive's clock)
    flow = _flow(case, review_cached=not case.get("uncached_review"))
    with SqliteCache(tmp_path / "c.db") as cache:
        asyncio.run(flow.run(case.get("context"), cache=cache))
    calls: list[str] = []
    real = at_start.hits_when_fresh

    def counted(*args: Any) -> Any:
        calls.append("fresh")
        return real(*args)

    monkeypatch.setattr(workflow_module, "hits_when_fresh", counted)
    fresh = _started(tmp_path, case, True, monkeypatch)
    assert calls == ["fresh"]  # (it took the shortcut)
    first_way = _started(tmp_path, case, False, monkeypatch)
    assert calls == ["fresh"]
    assert fresh == first_way
    first, hits, saved, outputs = fresh
    assert first[2] == len(hits) == (2 if case.get("uncached_review") else 4)
    assert set(outputs) == {"outline", "draft", "review", "polish"}
    assert set(saved[-1]["cache_hits"]) == {"outline", "draft", "review", "polish"} - (
        {"review"} if case.get("uncached_review") else set())


def test_what_the_shortcut_does_not_take_goes_the_first_way(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(workflow_module, "hits_when_fresh", lambda *args: calls.append("fresh") or {})
    flow = _flow({})
    with SqliteCache(tmp_path / "c.db") as cache:
        recorded = asyncio.run(flow.run(cache=cache)).checkpoint
        assert calls == ["fresh"]
        asyncio.run(flow.run(cache=cache, resume_from=recorded))
        asyncio.run(flow.run(cache=cache, only=["draft"]))
        asyncio.run(flow.run(cache=cache, approval=lambda step, attempt: True))
        asyncio.run(flow.run(_ReadOnly({"topic": "owls"}), cache=cache))
        assert calls == ["fresh"]
        with pytest.raises(ValueError, match="max_concurrency"):  # (checked by the state, as ever)
            flow.runner(cache=cache, max_concurrency=0)


class _ReadOnly(Mapping[str, Any]):
    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Any:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)
