"""``Workflow.run(only=[...])`` runs the chosen steps and what they need, and nothing else.

What users rely on: the selection's closure runs (recorded outputs skipped),
nothing outside it starts, the result says what was left out, and a later
run without ``only`` resumes the checkpoint and runs just the rest; bad
selections are refused, naming ``only`` and the name, before any step runs
or any checkpoint is saved; and the run's other options (isolated failures,
budgets, questions, rewinds, steps added while it runs) keep their meaning
within the selection.
"""

from __future__ import annotations

import asyncio
import io
from collections import Counter
from typing import Any

import pytest

from ekit_core import Answer, RunSettled, TokenUsage, WorkflowCheckpoint, answer, rewind
from ekit_runtime import (
    ApprovalDenied,
    BudgetExceeded,
    PatternResult,
    ProgressPrinter,
    RunWaiting,
    Step,
    Workflow,
    approve,
    ask,
)

ran: Counter[str] = Counter()


def _step(name: str, *deps: str, calls: int = 0, **shape: Any) -> Step:
    async def body(ctx: Any) -> Any:
        ran[name] += 1
        if shape.get("map_over"):
            return f"{name}({ctx[shape['map_over']]})"
        value = f"{name}<{','.join(sorted(str(ctx[d]) for d in deps if d in ctx))}>"
        if calls:
            return PatternResult(value, cost=TokenUsage(llm_calls=calls))
        return value

    return Step(name, body, deps, **shape)


def _branches() -> Workflow:
    """fetch -> (summary, translate -> polish) -> report; chunks maps over fetch's list."""
    async def fetch(ctx: Any) -> list[str]:
        ran["fetch"] += 1
        return ["p1", "p2"]

    return Workflow([
        Step("fetch", fetch),
        _step("summary", "fetch"),
        _step("translate", "fetch"),
        _step("polish", "translate"),
        _step("chunks", "fetch", map_over="fetch"),
        _step("report", "summary", "polish", "chunks"),
    ])


@pytest.fixture(autouse=True)
def _fresh() -> None:
    ran.clear()


def test_only_runs_the_selection_and_what_it_needs_and_a_resume_runs_the_rest() -> None:
    wf = _branches()
    saved: list[WorkflowCheckpoint] = []
    result = wf.run_sync(only=["summary"], checkpoint_fn=saved.append)
    assert dict(ran) == {"fetch": 1, "summary": 1}
    assert set(result.outputs) == {"fetch", "summary"} and result.ok
    assert result.left_out == ("translate", "polish", "chunks", "report")
    assert set(saved[-1].outputs) == {"fetch", "summary"}
    assert result.checkpoint is not None
    assert result.checkpoint.graph is not None
    assert result.checkpoint.fingerprint == wf.graph.fingerprint  # the whole workflow's

    ran.clear()
    rest = wf.run_sync(resume_from=result.checkpoint)
    assert dict(ran) == {"translate": 1, "polish": 1, "chunks": 2, "report": 1}  # (2 items)
    assert rest.left_out == () and rest.ok
    assert rest.outputs["summary"] == result.outputs["summary"]
    ran.clear()
    assert wf.run_sync().outputs == rest.outputs  # the same as one run of every step


def test_selecting_a_mapped_step_runs_what_it_maps_over_and_its_items() -> None:
    result = _branches().run_sync(only=["chunks"])
    assert dict(ran) == {"fetch": 1, "chunks": 2}
    assert result.outputs["chunks"] == ["chunks(p1)", "chunks(p2)"]
    assert result.left_out == ("summary", "translate", "polish", "report")


def test_a_resume_with_only_skips_what_is_recorded() -> None:
    wf = _branches()
    first = wf.run_sync(only=["summary"])
    ran.clear()
    second = wf.run_sync(only=["polish", "summary"], resume_from=first.checkpoint)
    assert dict(ran) == {"translate": 1, "polish": 1}
    assert second.left_out == ("chunks", "report")


@pytest.mark.parametrize(
    ("only", "message"),
    [
        ([], "only must name at least one step, got an empty list"),
        ("summary", "only must be a list of step names, got str 'summary'"),
        ({"summary"}, "only must be a list of step names, got set"),
        (["summary", 3], r"only\[1\] must be a step name \(a str\), got int 3"),
        (["sumary"], "only names unknown step 'sumary' \\(did you mean 'summary'\\?\\)"),
        (["nope"], "only names unknown step 'nope'$"),
        (["chunks[0]"], "only names 'chunks\\[0\\]', an item of the mapped step 'chunks', not a step"),
    ],
)
def test_a_bad_selection_is_refused_naming_it_before_anything_runs_or_is_saved(
    only: Any, message: str
) -> None:
    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(ValueError, match=message):
        _branches().run_sync(only=only, checkpoint_fn=saved.append)
    with pytest.raises(ValueError, match=message):
        _branches().runner(only=only)
    assert ran == Counter() and saved == []


def test_with_isolate_failures_not_started_lists_selected_steps_only() -> None:
    async def broken(ctx: Any) -> str:
        raise RuntimeError("translation service down")

    wf = Workflow([
        _step("fetch"), Step("translate", broken, ("fetch",)), _step("polish", "translate"),
        _step("summary", "fetch"), _step("other", "fetch"), _step("report", "polish", "summary"),
    ])
    result = wf.run_sync(only=["report"], isolate_failures=True)
    assert set(result.failed) == {"translate"} and not result.ok
    assert result.not_started == ("polish", "report")
    assert result.left_out == ("other",)
    assert dict(ran) == {"fetch": 1, "summary": 1}


def test_a_budget_counts_the_selection_and_a_selection_done_is_done() -> None:
    wf = Workflow([_step("a", calls=1), _step("b", "a", calls=1), _step("c", "b", calls=1)])
    # The last selected step reaches the budget: the selection is recorded, the run finished.
    assert wf.run_sync(only=["b"], budget=TokenUsage(llm_calls=2)).left_out == ("c",)
    ran.clear()
    # Reached before the selection is done: the run stops as any run does.
    with pytest.raises(BudgetExceeded) as caught:
        wf.run_sync(only=["c"], budget=TokenUsage(llm_calls=1))
    assert set(caught.value.checkpoint.outputs) == {"a"} and dict(ran) == {"a": 1}


def test_a_selected_step_that_asks_parks_the_run_and_the_answer_resumes_the_selection() -> None:
    async def title(ctx: Any) -> str:
        ran["title"] += 1
        return f"{ask('What title?')}: {ctx['draft']}"

    wf = Workflow([_step("draft"), Step("title", title, ("draft",)), _step("other")])
    with pytest.raises(RunWaiting) as caught:
        asyncio.run(wf.run(only=["title"]))
    assert set(caught.value.questions) == {"title"} and "other" not in ran
    done = wf.run_sync(only=["title"], resume_from=caught.value.checkpoint, answers={"title": "Owls"})
    assert done.outputs["title"] == "Owls: draft<>" and done.left_out == ("other",)
    assert "other" not in ran


def test_a_rewound_step_selected_alone_runs_again_and_its_dependents_wait() -> None:
    wf = _branches()
    full = wf.run_sync()
    ran.clear()
    again = wf.run_sync(only=["translate"], resume_from=rewind(wf, full.checkpoint, "translate"))
    assert dict(ran) == {"translate": 1}
    assert again.left_out == ("polish", "report")


def test_steps_added_while_a_selective_run_goes_are_left_out() -> None:
    wf = Workflow([_step("a"), _step("b", "a"), _step("c")])

    async def main() -> Any:
        runner = wf.runner(only=["b"])
        async for state in runner.states():
            if "late" not in state.graph.index:
                runner.add_steps([_step("late", "a")])
        return runner

    runner = asyncio.run(main())
    assert runner.state.outcome == "finished"
    assert "late" not in ran and "c" not in ran and set(runner.state.outputs) == {"a", "b"}


def test_the_run_s_end_says_how_many_steps_it_left_out() -> None:
    events: list[Any] = []
    out = io.StringIO()
    printer = ProgressPrinter(out, tty=False)
    result = _branches().run_sync(only=["summary"], trace=[events.append, printer])
    settled = events[-1]
    assert isinstance(settled, RunSettled) and settled.outcome == "finished"
    assert (settled.completed, settled.left_out) == (2, settled.total - 2)
    # (of 8: the two items chunks makes of fetch's pages are in the run's graph, never started)
    assert "run finished: 2/8 steps (6 left out)" in out.getvalue()
    # Settled at once (the selection recorded already): the same count, from the first state.
    again: list[Any] = []
    _branches().run_sync(only=["summary"], resume_from=result.checkpoint, trace=again.append)
    assert isinstance(again[-1], RunSettled) and again[-1].left_out == 6


def test_a_recorded_denial_halts_a_selective_resume_unless_its_selection_is_recorded() -> None:
    async def pay(ctx: Any) -> str:
        ran["pay"] += 1
        approve("Spend $3?")
        return "paid"

    wf = Workflow([_step("a"), Step("pay", pay), _step("b", "a")])
    first = wf.run_sync(only=["a"])
    with pytest.raises(RunWaiting) as caught:
        wf.run_sync(only=["pay"], resume_from=first.checkpoint)
    denied = answer(caught.value.checkpoint, "pay", Answer.deny("too dear", by="ops"))
    ran.clear()
    with pytest.raises(ApprovalDenied):
        wf.run_sync(only=["b"], resume_from=denied)
    assert ran == Counter()
    assert wf.run_sync(only=["a"], resume_from=denied).left_out == ("pay", "b")
