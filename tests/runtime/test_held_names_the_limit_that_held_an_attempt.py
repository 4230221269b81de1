"""A run that records times records which limit held each attempt before it began, and how long.

What users rely on (docs/checkpoint-format.md, ``held``): a recorded output's
entry names each limit that held its attempt (the run's ``max_concurrency``,
a retry's delay, whatever a ``before_attempt`` hook reports with
``note_hold``: a queue's fleet limits) with the seconds it did, only for the
attempts a limit held; nothing for a run that does not record times. The
record survives JSON and a resume, and goes with its output (a rewind).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from ekit_core import CheckpointError, RetryPolicy, WorkflowCheckpoint, rewind
from ekit_runtime import Step, Workflow
from ekit_runtime.attempt import Attempt, note_hold

SECONDS = 0.15


async def _slow(ctx: Any) -> str:
    await asyncio.sleep(SECONDS)
    return "done"


def _saved(workflow: Workflow, **options: Any) -> WorkflowCheckpoint:
    saves: list[WorkflowCheckpoint] = []
    workflow.run_sync(checkpoint_fn=saves.append, **options)
    return saves[-1]


def test_max_concurrency_holds_each_ready_step_until_a_place_frees() -> None:
    flow = Workflow([Step(name, _slow) for name in ("a", "b", "c")])
    cp = _saved(flow, max_concurrency=1, durations=True)
    assert "a" not in cp.held  # it began at once
    assert {n: list(h) for n, h in cp.held.items()} == {"b": ["max_concurrency"], "c": ["max_concurrency"]}
    # b waited for a, c for a and b: each as long as those ran (give or take the loop's turns).
    ends = {n: cp.began[n] + cp.durations[n] for n in cp.began}
    for name, since in (("b", cp.began["a"]), ("c", cp.began["a"])):
        held = cp.held[name]["max_concurrency"]
        assert held >= SECONDS * 0.9 * (1 if name == "b" else 2)
        assert held <= cp.began[name] - since + 0.01
    assert cp.began["c"] >= ends["b"] - 1e-3
    assert json.loads(json.dumps(cp.to_dict()))["held"] == {k: dict(v) for k, v in cp.held.items()}


def test_nothing_is_recorded_when_no_limit_held_or_times_are_not_recorded() -> None:
    flow = Workflow([Step(name, _slow) for name in ("a", "b", "c")])
    assert _saved(flow, max_concurrency=3, durations=True).held == {}  # room for all three
    untimed = _saved(flow, max_concurrency=1)
    assert untimed.held == {} and "held" not in untimed.to_dict()


def test_a_retry_delay_is_recorded_as_what_held_the_retry() -> None:
    failed: list[int] = []

    async def flaky(ctx: Any) -> str:
        if not failed:
            failed.append(1)
            raise RuntimeError("once")
        return "ok"

    retry = RetryPolicy(max_attempts=2, backoff_base=SECONDS)
    cp = _saved(Workflow([Step("flaky", flaky, retry=retry)]), durations=True)
    assert dict(cp.held["flaky"]) == {"retry_delay": SECONDS}
    assert cp.began["flaky"] >= cp.failures["flaky"].ended + SECONDS * 0.9  # type: ignore[operator]


def test_a_hook_names_its_own_limit_and_the_record_survives_a_resume_but_not_a_rewind() -> None:
    async def admit(attempt: Attempt) -> None:
        if attempt.step.name == "b":
            await asyncio.sleep(SECONDS)
            note_hold("limit:tokens_per_minute", SECONDS / 2)
            note_hold("resource:gpu", SECONDS / 2)

    flow = Workflow([Step("a", _slow), Step("b", _slow, ("a",)), Step("c", _slow, ("b",))])
    cp = _saved(flow, durations=True, before_attempt=admit, run_id="held-1")
    assert dict(cp.held) == {"b": {"limit:tokens_per_minute": SECONDS / 2, "resource:gpu": SECONDS / 2}}
    assert list(cp.held["b"]) == ["limit:tokens_per_minute", "resource:gpu"]  # in the order they held
    read = WorkflowCheckpoint.from_dict(json.loads(json.dumps(cp.to_dict())))
    assert read.held == cp.held
    # A resume keeps the record of what it skips (here, all but c), and saves it again.
    again = _saved(flow, durations=True, resume_from=rewind(flow.graph, read, "c"))
    assert again.held == cp.held and set(again.began) == {"a", "b", "c"}
    # A rewound step loses its record with its output, and its new attempt records its own.
    rewound = rewind(flow.graph, read, "b")
    assert "b" not in rewound.held and "b" not in rewound.began
    redone = _saved(flow, durations=True, resume_from=rewound, max_concurrency=1)
    assert "b" not in redone.held  # nothing held its new attempt


@pytest.mark.parametrize(("held", "field"), [
    ({"b": {}}, "held.b"),
    ({"b": {"max_concurrency": -1}}, "held.b.max_concurrency"),
    ({"b": {"max_concurrency": True}}, "held.b.max_concurrency"),
    ({"b": {"": 1.0}}, "held.b"),
    ({"b": [1]}, "held.b"),
    ([1], "held"),
])
def test_a_malformed_record_is_refused_naming_its_field(held: Any, field: str) -> None:
    no_cost = {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0}
    data = {"step_index": 1, "outputs": {"b": 1}, "cost": no_cost,
            "durations": {"b": 1.0}, "began": {"b": 1.0}, "held": held}
    with pytest.raises(CheckpointError) as caught:
        WorkflowCheckpoint.from_dict(data)
    assert caught.value.field == field
