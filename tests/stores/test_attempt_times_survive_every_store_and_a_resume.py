"""When each attempt began and ended survives JSON, every store and a resume; bad times are refused.

A run with ``durations=True`` records, beside each timed output's duration,
when its attempt began (``began``, UTC epoch seconds), and for a step's
latest failed attempt when it began and ended (its failure record). What
users rely on: every store gives back each saved checkpoint with those
times (the journal and the SQL rows as deltas), a resume keeps the recorded
ones and adds its own, a checkpoint written before these fields loads and
resumes, and a hostile value (NaN, negative, past the year 2255, text, a
bool, an end before its beginning) is refused naming the field.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from ekit_core import CheckpointError, FailureRecord, WorkflowCheckpoint, checkpoint_of
from ekit_runtime import RetryPolicy, Step, Workflow
from tests.support.store_helpers import store_factories

FACTORIES = store_factories("run-1")


def workflow(flaky: list[bool], names: tuple[str, ...] = ("a", "b", "c")) -> Workflow:
    async def body(context: Any) -> str:
        return "ok"

    async def failing_once(context: Any) -> str:
        if flaky and flaky.pop():
            raise RuntimeError("down")
        return "ok"

    return Workflow([
        Step(n, failing_once if n == "b" else body, depends_on=(names[i - 1],) if i else (),
             retry=RetryPolicy(max_attempts=3, backoff_base=0))
        for i, n in enumerate(names)
    ])


def run(wf: Workflow, **options: Any) -> tuple[WorkflowCheckpoint, list[WorkflowCheckpoint]]:
    saved: list[WorkflowCheckpoint] = []
    given = options.pop("checkpoint_fn", None)

    def save(cp: WorkflowCheckpoint) -> None:
        saved.append(cp)
        if given is not None:
            given(cp)

    state = asyncio.run(wf.runner(checkpoint_fn=save, max_concurrency=1, durations=True, **options).run())
    return checkpoint_of(state), saved


def test_a_run_records_when_each_attempt_began_and_the_failed_one_ended() -> None:
    before = time.time()
    final, saved = run(workflow([True]))
    after = time.time()
    assert set(final.began) == set(final.durations) == {"a", "b", "c"}
    assert all(before - 1 <= t <= after + 1 for t in final.began.values())
    assert final.began["a"] <= final.began["b"] <= final.began["c"]
    failure = final.failures["b"]
    assert failure.began is not None and failure.ended is not None
    assert final.began["a"] <= failure.began <= failure.ended <= final.began["b"]
    for cp in saved:  # every checkpoint: a time for each timed output
        assert set(cp.began) == set(cp.durations)
    data = json.loads(json.dumps(final.to_dict()))
    assert data["began"] == dict(final.began) and data["failures"]["b"]["ended"] == failure.ended
    assert data["format_version"] == 1  # optional keys: no new format
    assert WorkflowCheckpoint.from_dict(data) == final


def test_a_run_without_durations_records_no_times() -> None:
    state = asyncio.run(workflow([True]).runner(checkpoint_fn=None).run())
    cp = checkpoint_of(state)
    assert not cp.began and cp.failures["b"].began is None
    assert "began" not in cp.to_dict() and "began" not in cp.to_dict()["failures"]["b"]


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_every_store_gives_back_each_saved_checkpoints_times(kind: str, tmp_path: Path) -> None:
    store = FACTORIES[kind](tmp_path)
    seen: list[WorkflowCheckpoint] = []

    def save(cp: WorkflowCheckpoint) -> None:
        store(cp)
        seen.append(FACTORIES[kind](tmp_path).load())

    _, saved = run(workflow([True]), checkpoint_fn=save)
    assert [dict(cp.began) for cp in seen] == [dict(cp.began) for cp in saved]
    assert [cp.failures.get("b") for cp in seen] == [cp.failures.get("b") for cp in saved]
    assert seen[-1].began and seen[-1].failures["b"].ended is not None


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_a_resume_keeps_the_recorded_times_and_adds_its_own(kind: str, tmp_path: Path) -> None:
    first, _ = run(workflow([], ("a", "b")))
    store = FACTORIES[kind](tmp_path)
    store(first)
    loaded = FACTORIES[kind](tmp_path).load()
    final, saved = run(workflow([], ("a", "b", "c")), resume_from=loaded, allow_graph_change=True)
    assert dict(final.began) == {**first.began, "c": final.began["c"]}
    assert all(set(cp.began) == set(cp.durations) for cp in saved)


def test_a_checkpoint_written_before_these_fields_loads_and_resumes() -> None:
    old = {"format_version": 1, "step_index": 1, "outputs": {"a": "ok"},
           "cost": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0},
           "failures": {"b": {"error_type": "RuntimeError", "message": "down", "attempts": 1}},
           "durations": {"a": 0.5}}
    cp = WorkflowCheckpoint.from_dict(old)
    assert not cp.began and cp.failures["b"] == FailureRecord("RuntimeError", "down", 1)
    final, _ = run(workflow([]), resume_from=cp)
    assert final.durations["a"] == 0.5 and "a" not in final.began  # never said: not made up
    assert set(final.began) == {"b", "c"}


BAD = [float("nan"), float("inf"), -1.0, 1e300, 2.0**53, "12:00", True, None, [1.0]]


@pytest.mark.parametrize("value", BAD, ids=repr)
def test_a_bad_began_time_is_refused_naming_it(value: object) -> None:
    data = {"format_version": 1, "step_index": 1, "outputs": {"a": 1},
            "cost": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0},
            "durations": {"a": 0.5}, "began": {"a": value}}
    with pytest.raises(CheckpointError, match=r"'began\.a'"):
        WorkflowCheckpoint.from_dict(json.loads(json.dumps(data)) if value is not None else data)


@pytest.mark.parametrize("value", BAD, ids=repr)
@pytest.mark.parametrize("key", ["began", "ended"])
def test_a_bad_failure_time_is_refused_naming_it(key: str, value: object) -> None:
    times: dict[str, object] = {"began": 1_800_000_000.0, "ended": 1_800_000_001.0, key: value}
    data = {"format_version": 1, "step_index": 0, "outputs": {},
            "cost": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0},
            "failures": {"b": {"error_type": "E", "message": "m", "attempts": 1, **times}}}
    with pytest.raises(CheckpointError, match=rf"'failures\.b\.{key}'"):
        WorkflowCheckpoint.from_dict(data)


def test_a_failed_attempt_that_ended_before_it_began_is_refused() -> None:
    data = {"format_version": 1, "step_index": 0, "outputs": {},
            "cost": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0},
            "failures": {"b": {"error_type": "E", "message": "m", "began": 5.0, "ended": 4.0}}}
    with pytest.raises(CheckpointError, match=r"'failures\.b\.ended'"):
        WorkflowCheckpoint.from_dict(data)
