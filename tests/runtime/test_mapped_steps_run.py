"""A step mapped over an upstream's output runs once per item, each item a full attempt unit.

What users rely on: items start as soon as their input exists and within
the run's limits; a chain of mapped steps runs item by item; each item
retries, fails, resumes and is keyed on its own; the mapped step's output is
the items' outputs in order (a mapping for a mapping); zero items is ``[]``;
an output that cannot be mapped over fails the mapped step, not the upstream.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ekit_core import RetryPolicy
from ekit_core.expansion import MapError
from ekit_runtime import Step, Workflow, WorkflowCheckpoint, attempt_key

NO_WAIT = RetryPolicy(max_attempts=3, backoff_base=0)


async def _split(ctx: Any) -> list[str]:
    return list(ctx["doc"])


def _pipeline(summarize: Any, critique: Any) -> Workflow:
    return Workflow([
        Step("split", _split),
        Step("summarize", summarize, ("split",), map_over="split", context="dependencies"),
        Step("critique", critique, ("summarize",), map_over="summarize", context="dependencies"),
        Step("merge", lambda ctx: "".join(ctx["critique"]), ("critique",), context="dependencies"),
    ])


def test_items_run_item_by_item_and_collect_in_order() -> None:
    second_stage_of_b = asyncio.Event()
    log: list[str] = []

    async def summarize(ctx: Any) -> str:
        piece = ctx["split"]
        log.append(f"summarize {piece}")
        if piece == "a":
            # Item a's first stage waits until item b is through its second:
            # item b's chain does not wait for the whole first stage.
            await asyncio.wait_for(second_stage_of_b.wait(), 30)
        return piece.upper()

    async def critique(ctx: Any) -> str:
        log.append(f"critique {ctx['summarize']}")
        if ctx["summarize"] == "B":
            second_stage_of_b.set()
        return ctx["summarize"] + "!"

    result = _pipeline(summarize, critique).run_sync({"doc": "ab"})
    assert result.outputs["summarize"] == ["A", "B"]
    assert result.outputs["critique"] == ["A!", "B!"]
    assert result.outputs["merge"] == "A!B!"
    assert log.index("critique B") < log.index("critique A")
    # Items live in the checkpoint, not in the result a caller reads.
    assert "summarize[0]" not in result.outputs
    assert result.checkpoint is not None and result.checkpoint.outputs["summarize[1]"] == "B"


def test_an_item_retries_alone_and_a_resume_runs_only_the_missing_items() -> None:
    calls: dict[str, int] = {}

    async def summarize(ctx: Any) -> str:
        piece = ctx["split"]
        calls[piece] = calls.get(piece, 0) + 1
        if piece == "b" and calls[piece] == 1:
            raise ConnectionError("a 429, once")
        if piece == "c":
            raise ValueError("c is broken")
        return piece.upper()

    wf = Workflow([
        Step("split", _split),
        Step("summarize", summarize, ("split",), map_over="split", context="dependencies",
             retry=RetryPolicy(max_attempts=2, backoff_base=0, retry_on=(ConnectionError,))),
    ])
    saved: list[WorkflowCheckpoint] = []
    # Isolated, so that c's failure does not withdraw b's retry.
    first = wf.run_sync({"doc": "abc"}, checkpoint_fn=saved.append, isolate_failures=True)
    assert set(first.failed) == {"summarize[2]"}
    assert calls == {"a": 1, "b": 2, "c": 1}
    last = saved[-1]
    assert {k: last.outputs[k] for k in ("summarize[0]", "summarize[1]")} == {
        "summarize[0]": "A", "summarize[1]": "B"}
    assert "summarize" not in last.outputs and last.failures["summarize[2]"].attempts == 1

    calls.clear()
    fixed = Workflow([
        Step("split", _split),
        Step("summarize", lambda ctx: ctx["split"].upper(), ("split",), map_over="split",
             context="dependencies"),
    ])
    result = fixed.run_sync(resume_from=last.to_dict())
    assert result.outputs["summarize"] == ["A", "B", "C"]
    assert calls == {}  # a and b were recorded: only c ran, in the fixed code


def test_isolated_failures_stop_only_what_needs_the_failed_item() -> None:
    async def summarize(ctx: Any) -> str:
        if ctx["split"] == "b":
            raise RuntimeError("b fails")
        return ctx["split"].upper()

    result = _pipeline(summarize, lambda ctx: ctx["summarize"] + "!").run_sync(
        {"doc": "abc"}, isolate_failures=True)
    assert not result.ok and set(result.failed) == {"summarize[1]"}
    assert result.checkpoint is not None
    recorded = result.checkpoint.outputs
    assert recorded["critique[0]"] == "A!" and recorded["critique[2]"] == "C!"
    assert {"critique[1]", "summarize", "critique", "merge"} <= set(result.not_started)


def test_items_share_the_runs_concurrency_limit() -> None:
    running, peak = [0], [0]

    async def summarize(ctx: Any) -> str:
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        running[0] -= 1
        return ctx["split"]

    wf = Workflow([Step("split", _split),
                   Step("summarize", summarize, ("split",), map_over="split", context="dependencies")])
    assert wf.run_sync({"doc": "abcdefgh"}, max_concurrency=3).outputs["summarize"] == list("abcdefgh")
    assert peak[0] == 3


def test_zero_items_mapping_inputs_and_item_keys() -> None:
    wf = _pipeline(lambda ctx: ctx["split"].upper(), lambda ctx: ctx["summarize"] + "!")
    assert wf.run_sync({"doc": ""}).outputs["merge"] == ""

    by_name = Workflow([
        Step("people", lambda ctx: {"ann": 3, "bob": 5}),
        Step("double", lambda ctx: ctx["people"] * 2, ("people",), map_over="people",
             context="dependencies"),
    ])
    result = by_name.run_sync()
    assert result.outputs["double"] == {"ann": 6, "bob": 10}
    assert result.checkpoint is not None and result.checkpoint.outputs["double[bob]"] == 10

    keyed = Workflow([
        Step("tickets", lambda ctx: [{"id": "T-9", "text": "x"}, {"id": "T-2", "text": "y"}]),
        Step("answer", lambda ctx: ctx["tickets"]["text"] * 2, ("tickets",), map_over="tickets",
             item_key="id", context="dependencies"),
    ])
    result = keyed.run_sync(run_id="r")
    assert result.outputs["answer"] == ["xx", "yy"]
    assert result.checkpoint is not None and result.checkpoint.outputs["answer[T-2]"] == "yy"


def test_each_item_has_its_own_attempt_key() -> None:
    seen: list[str] = []

    async def note(ctx: Any) -> str:
        seen.append(str(attempt_key()))
        return ctx["split"]

    wf = Workflow([Step("split", _split),
                   Step("s", note, ("split",), map_over="split", context="dependencies")])
    wf.run_sync({"doc": "xy"}, run_id="run-1")
    assert sorted(seen) == ["run-1/s[0]/1", "run-1/s[1]/1"]


def test_an_output_that_cannot_be_mapped_over_fails_the_mapped_step_and_keeps_the_upstream() -> None:
    wf = Workflow([Step("split", lambda ctx: 42),
                   Step("s", lambda ctx: 1, ("split",), map_over="split")])
    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(MapError, match="step 's' maps over 'split', but its output is of type int"):
        wf.run_sync(checkpoint_fn=saved.append)
    assert saved[-1].outputs["split"] == 42  # paid for, kept


def test_bad_shape_declarations_are_refused_before_anything_runs() -> None:
    with pytest.raises(ValueError, match="maps over 'x', which is not one of its dependencies"):
        Workflow([Step("x", lambda ctx: []), Step("s", lambda ctx: 1, map_over="x")])
    with pytest.raises(ValueError, match="item_key needs map_over"):
        Workflow([Step("x", lambda ctx: []), Step("s", lambda ctx: 1, ("x",), item_key="id")])
    with pytest.raises(ValueError, match=r"step .s\[0\]. is named like an item of step .s."):
        Workflow([Step("x", lambda ctx: []), Step("s", lambda ctx: 1, ("x",), map_over="x"),
                  Step("s[0]", lambda ctx: 1)])
    with pytest.raises(ValueError, match="when must be callable"):
        Step("s", lambda ctx: 1, when="yes")  # type: ignore[arg-type]


def test_each_item_is_timed_out_and_approved_on_its_own() -> None:
    from ekit_runtime import StepTimeoutError

    release = asyncio.Event()
    asked: list[str] = []

    async def summarize(ctx: Any) -> str:
        if ctx["split"] == "b":
            await release.wait()  # never set: this item runs past its timeout
        return ctx["split"].upper()

    def approve(name: str, metadata: Any) -> bool:
        asked.append(name)
        return True

    wf = Workflow([Step("split", _split),
                   Step("summarize", summarize, ("split",), map_over="split", timeout=0.2,
                        context="dependencies")])
    result = wf.run_sync({"doc": "abc"}, approval=approve, isolate_failures=True)
    assert set(result.failed) == {"summarize[1]"}
    assert isinstance(result.failed["summarize[1]"], StepTimeoutError)
    assert result.checkpoint is not None and result.checkpoint.outputs["summarize[2]"] == "C"
    assert sorted(asked) == ["split", "summarize[0]", "summarize[1]", "summarize[2]"]
