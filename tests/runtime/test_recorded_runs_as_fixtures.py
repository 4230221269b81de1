"""A workflow's tests run offline against a run recorded for real (issue 45).

What users rely on: ``executor=Recorded(location)`` hands every step the output
(and usage) a recorded checkpoint holds, from any store's file, never calling
the step; a step whose call the recording lacks fails naming it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ekit_core import TokenUsage
from ekit_runtime import Codec, JournalStore, JsonFileStore, PatternResult, SqliteStore, Step, Workflow
from ekit_runtime.recorded import NotRecordedError, Recorded


@dataclass(frozen=True)
class Verdict:
    score: int


def _workflow(live: bool, extra: bool = False) -> Workflow:
    def call(value: Any) -> Any:
        if not live:
            raise AssertionError("a recorded test called the model")
        return PatternResult(value, cost=TokenUsage(10, 5, 1))

    def outline(ctx: Mapping[str, Any]) -> Any:
        return call(["tides", "moons"])

    def section(ctx: Mapping[str, Any]) -> Any:
        return call(f"section on {ctx['outline']}")

    def judge(ctx: Mapping[str, Any]) -> Verdict:
        if not live:
            raise AssertionError("a recorded test called the model")
        return Verdict(len(ctx["section"]))

    steps = [Step("outline", outline), Step("section", section, ("outline",), map_over="outline"),
             Step("judge", judge, ("section",))]
    if extra:
        steps.append(Step("polish", lambda ctx: call("polished"), ("judge",)))
    return Workflow(steps, codec=Codec(Verdict))


@pytest.mark.parametrize("kind", ["json", "journal", "sqlite"])
def test_a_recorded_run_answers_every_call_offline(kind: str, tmp_path: Path) -> None:
    path = tmp_path / {"json": "run.json", "journal": "run.jsonl", "sqlite": "run.db"}[kind]
    store = {"json": lambda: JsonFileStore(path), "journal": lambda: JournalStore(path),
             "sqlite": lambda: SqliteStore(path, run_id="r1")}[kind]()
    live = asyncio.run(_workflow(live=True).run(checkpoint_fn=store.save))
    store.close()
    wf = _workflow(live=False)
    replayed = asyncio.run(wf.run(executor=Recorded(path, run_id="r1" if kind == "sqlite" else None,
                                                    codec=wf.codec)))
    assert replayed.outputs == live.outputs
    assert isinstance(replayed.outputs["judge"], Verdict)
    assert replayed.cost == live.cost == TokenUsage(30, 15, 3)


def test_a_call_the_recording_lacks_fails_naming_it(tmp_path: Path) -> None:
    live = asyncio.run(_workflow(live=True).run())
    wf = _workflow(live=False, extra=True)
    with pytest.raises(NotRecordedError, match="'polish'") as caught:
        asyncio.run(wf.run(executor=Recorded(live.checkpoint, codec=wf.codec)))
    assert caught.value.step == "polish"


def test_an_unreadable_recording_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="recording"):
        Recorded(tmp_path / "missing.json")
