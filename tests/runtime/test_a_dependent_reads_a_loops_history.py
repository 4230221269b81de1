"""A step that needs a loop reads its history with ``history(loop)``, not only its last output.

Dependents see a loop's last iteration's output under its name (docs/concepts.md,
Loops); ``ekit_runtime.history`` hands them, and each iteration, the recorded
iterations with their numbers, and says how many ``keep_last`` compacted. An
iteration it cannot hand back raises ``HistoryError`` naming ``loop#k``; a step
that does not need the loop gets a ``LookupError`` naming it. A resume (through
JSON) and a rewind hand the same history an uninterrupted run does.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from ekit_core import WorkflowCheckpoint, rewind
from ekit_runtime import Done, History, HistoryError, Repeat, Step, Workflow, history

ENDS_AT = 5


def _workflow(seen: list[tuple[int, int, list[tuple[int, Any]]]], keep_last: int | None = None,
              fail_at: int | None = None) -> Workflow:
    def turn(ctx: dict[str, Any]) -> Any:
        it = ctx["agent"]
        past = history("agent")
        seen.append((it.number, past.compacted, list(past.items())))
        if it.number == fail_at:
            raise KeyboardInterrupt  # the process dies in this iteration
        value = {"n": it.number}
        return Done(value) if it.number == ENDS_AT else value

    def report(ctx: dict[str, Any]) -> Any:
        past = history("agent")
        assert ctx["agent"] == past[len(past)]  # its output is the last iteration's
        return {"len": len(past), "compacted": past.compacted, "kept": list(past.items())}

    return Workflow([Step("task", lambda ctx: "t"),
                     Step("agent", turn, ("task",), repeat=Repeat(9, keep_last=keep_last)),
                     Step("report", report, ("agent",))])


def test_a_dependent_and_each_iteration_read_the_iterations_recorded_before_them() -> None:
    seen: list[tuple[int, int, list[tuple[int, Any]]]] = []
    result = _workflow(seen).run_sync()
    assert result.outputs["report"] == {
        "len": ENDS_AT, "compacted": 0, "kept": [(k, {"n": k}) for k in range(1, ENDS_AT + 1)]}
    assert seen == [(k, 0, [(j, {"n": j}) for j in range(1, k)]) for k in range(1, ENDS_AT + 1)]


def test_keep_last_counts_what_it_compacted_and_names_an_iteration_it_cannot_hand_back() -> None:
    seen: list[tuple[int, int, list[tuple[int, Any]]]] = []
    result = _workflow(seen, keep_last=2).run_sync()
    assert result.outputs["report"] == {"len": 5, "compacted": 3,
                                        "kept": [(4, {"n": 4}), (5, {"n": 5})]}
    assert seen[-1] == (5, 2, [(3, {"n": 3}), (4, {"n": 4})])  # (iteration 5 is not kept yet)
    past = History("agent", 3, ({"n": 4}, {"n": 5}))
    with pytest.raises(HistoryError, match=r"agent#2: iteration 2 of loop 'agent' was compacted "
                                           r"\(keep_last\).*kept are iterations 4 to 5") as err:
        past[2]
    assert (err.value.loop, err.value.iteration) == ("agent", 2)
    with pytest.raises(HistoryError, match=r"agent#6: loop 'agent' has no iteration 6 recorded"):
        past[6]
    with pytest.raises(HistoryError, match="agent#0"):
        past[0]
    assert isinstance(HistoryError("a", 1, "m"), LookupError)


def test_only_a_step_that_needs_the_loop_reads_it() -> None:
    def nosy(ctx: dict[str, Any]) -> Any:
        return history("agent")

    workflow = Workflow([Step("agent", lambda ctx: Done(1), repeat=Repeat(3)),
                         Step("after", lambda ctx: 0, ("agent",)),
                         Step("nosy", nosy, ("after",))])
    with pytest.raises(LookupError, match="step 'nosy' cannot read the history of 'agent'"):
        workflow.run_sync()
    with pytest.raises(LookupError, match=r"history\('agent'\) is only set inside a step"):
        history("agent")


def test_an_async_step_reads_it_too() -> None:
    async def report(ctx: dict[str, Any]) -> Any:
        await asyncio.sleep(0)
        return len(history("agent"))

    workflow = Workflow([Step("agent", lambda ctx: Done(0) if ctx["agent"].number == 3 else 0,
                              repeat=Repeat(5)),
                         Step("report", report, ("agent",))])
    assert workflow.run_sync().outputs["report"] == 3


@pytest.mark.parametrize("keep_last", [None, 2])
def test_a_resume_through_json_reads_what_an_uninterrupted_run_reads(keep_last: int | None) -> None:
    calm: list[tuple[int, int, list[tuple[int, Any]]]] = []
    whole = _workflow(calm, keep_last).run_sync().outputs["report"]
    seen: list[tuple[int, int, list[tuple[int, Any]]]] = []
    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(KeyboardInterrupt):
        _workflow(seen, keep_last, fail_at=4).run_sync(checkpoint_fn=saved.append)
    data = json.loads(json.dumps(saved[-1].to_dict()))
    seen.clear()
    resumed = _workflow(seen, keep_last).run_sync(resume_from=data)
    assert resumed.outputs["report"] == whole
    assert seen == calm[3:]  # iteration 4 on, each seeing what it saw uninterrupted


def test_a_rewound_iteration_reads_the_iterations_before_it() -> None:
    seen: list[tuple[int, int, list[tuple[int, Any]]]] = []
    workflow = _workflow(seen)
    first = workflow.run_sync()
    assert first.checkpoint is not None
    seen.clear()
    again = workflow.run_sync(resume_from=rewind(workflow, first.checkpoint, "agent#3"))
    assert [number for number, _, _ in seen] == [3, 4, 5]
    assert seen[0] == (3, 0, [(1, {"n": 1}), (2, {"n": 2})])
    assert again.outputs["report"] == first.outputs["report"]
