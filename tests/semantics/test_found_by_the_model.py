"""Disagreements the differential test (``test_runtime_agrees_with_the_model.py``) found
between the runtime and the reference model, each cut down to a minimal reproducer.

Each was a bug of the runtime by the docs, now fixed (issue 43); the reproducers stay as
pins. A new one goes in as ``xfail(strict=True)`` until its fix takes the mark off.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from typing import Any

import pytest

from ekit_core import TokenUsage, WorkflowCheckpoint, audit, replay, rewind
from ekit_runtime import (
    BudgetExceeded,
    Done,
    PatternResult,
    Repeat,
    RetryPolicy,
    RunWaiting,
    Step,
    StepTimeoutError,
    Workflow,
    ask,
    attempt_key,
)


def _mapped(version: str) -> Workflow:
    return Workflow([
        Step("a", lambda ctx: [1, 2]),
        Step("m", lambda ctx: ask("ok?"), ("a",), version=version, map_over="a"),
    ])


def test_replay_accepts_a_bumped_mapped_step_with_questions() -> None:
    """A bump of a mapped step whose items asked (one answered and recorded, one waiting)
    is a legal resume: the recorded item is outdated and runs again (docs/checkpoint-format.md,
    "A changed step is not done"). The resume's first save records fewer outputs than the
    checkpoint it resumed, as every resume that lets go of outdated outputs does, and replay
    accepts that elsewhere (a collected mapped step, a failed item); here it reports
    ``step_index_decreased`` at that save (found by the model with questions on items)."""
    saved: list[WorkflowCheckpoint] = []
    starts: list[int] = []  # (how many saves each run makes depends on when its items ask)
    for version, answers in (("v0", None), ("v0", {"m[0]": "yes"}), ("v1", None)):
        starts.append(len(saved))
        with contextlib.suppress(RunWaiting):
            _mapped(version).run_sync(resume_from=saved[-1] if saved else None,
                                      checkpoint_fn=saved.append, answers=answers)
    answered, bumped = saved[starts[2] - 1], saved[starts[2]:]
    assert answered.step_index == 2 and set(answered.outputs) == {"a", "m[0]"}
    assert bumped and all(cp.step_index == 1 for cp in bumped)  # (m[0] outdated: let go of)
    assert dict(saved[-1].redone) == {"m": 1, "m[0]": 1, "m[1]": 1}
    report = replay(_mapped("v1"), saved)
    assert report.ok, [v.to_dict() for v in report.violations]


def test_an_item_that_times_out_is_named() -> None:
    """Each item is "a step of its own ... named summarize[0]: its own attempts, retries,
    timeout" (docs/concepts.md), and a timeout "names the step and its limit (step 'ask'
    timed out after 5s), so the failure record ... and ekit audit say what timed out"
    (docs/failures.md). An item's record, under ``m[1]``, says ``step 'm' timed out``:
    which of the items timed out is not in the message, nor in the raised error."""
    async def item(ctx: dict[str, int]) -> int:
        if ctx["a"] == 2:
            await asyncio.Event().wait()
        return ctx["a"]

    workflow = Workflow([Step("a", lambda ctx: [1, 2]),
                         Step("m", item, ("a",), map_over="a", timeout=0.05)])
    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(StepTimeoutError) as raised:
        workflow.run_sync(checkpoint_fn=saved.append)
    assert saved[-1].failures["m[1]"].message == "step 'm[1]' timed out after 0.05s"
    assert "m[1]" in str(raised.value)


def test_a_budget_reached_beside_an_early_cutoff_stops_the_run() -> None:
    """"Once the accumulated usage reaches any of them, no new step starts" (docs/failures.md).
    A resume after a bump of ``u``, which ``m`` maps over: ``u`` runs again and its usage
    reaches the budget, in the transition where the early cutoff keeps ``m``'s items (same
    input). ``c`` then starts and is paid, past the budget, and the run ends "finished".
    Without the mapped step the same resume stops at the budget (BudgetExceeded)."""
    paid: list[str] = []

    def step(name: str, value: object) -> Callable[[dict[str, object]], PatternResult[object]]:
        def run(ctx: dict[str, object]) -> PatternResult[object]:
            paid.append(name)
            return PatternResult(value, cost=TokenUsage(1, 1, 1))
        return run

    def workflow(version: str) -> Workflow:
        return Workflow([
            Step("u", step("u", [1, 2]), version=version),
            Step("m", step("m", "item"), ("u",), map_over="u"),
            Step("c", step("c", "C"), ("u",)),
        ])

    first = workflow("v0").run_sync(max_concurrency=1)
    assert first.checkpoint is not None and first.checkpoint.cost.llm_calls == 4
    paid.clear()
    with pytest.raises(BudgetExceeded):
        workflow("v1").run_sync(resume_from=first.checkpoint, max_concurrency=1,
                                budget=TokenUsage(llm_calls=5))
    assert paid == ["u"]


def test_a_condition_that_answered_is_not_asked_again() -> None:
    """The shell asks a condition "before a step's first attempt, and before each retry
    until the condition has answered" (docs/concepts.md). Here it answered (true) and the
    approval callback then raised: the retry asks the approval again, as it must, and the
    condition again too, though it had answered."""
    conditions: list[int] = []
    approvals: list[str] = []

    def condition(ctx: object) -> bool:
        conditions.append(1)
        return True

    def approve(name: str, metadata: object) -> bool:
        approvals.append(name)
        if len(approvals) == 1:
            raise ConnectionError("the flag service is busy")
        return True

    workflow = Workflow([Step("s", lambda ctx: "ok", when=condition,
                              retry=RetryPolicy(max_attempts=2, backoff_base=0))])
    assert workflow.run_sync(approval=approve).outputs["s"] == "ok"
    assert approvals == ["s", "s"]
    assert len(conditions) == 1


def _chain(version: str, calls: list[tuple[str, int]], fail: bool) -> Workflow:
    """``s3`` chained item-wise to ``s1``, which maps over ``s0``, and declared first."""
    def s1(ctx: dict[str, int]) -> int:
        calls.append(("s1", ctx["s0"]))
        if fail and ctx["s0"] == 2:
            raise ConnectionError("overloaded")
        return ctx["s0"] * 10

    def s3(ctx: dict[str, int]) -> int:
        calls.append(("s3", ctx["s1"]))
        return ctx["s1"] + 1

    return Workflow([Step("s3", s3, ("s1",), map_over="s1"),
                     Step("s0", lambda ctx: {"a": 1, "b": 2}, version=version),
                     Step("s1", s1, ("s0",), map_over="s0")])


def test_a_chain_declared_before_its_upstream_keeps_its_items_by_the_early_cutoff() -> None:
    """"An item whose new input encodes as its old one under the same key keeps its output
    and does not run, and so does, item by item, the chain downstream of a kept item"
    (docs/concepts.md, Early cutoff). Declaration order is not dependency order: with the
    chained step ``s3`` declared before ``s1``, a bump of ``s0`` kept ``s1[a]`` and ran
    ``s3[a]`` again on the same input (found by the model drawing loops, which reorders
    the declarations it draws)."""
    calls: list[tuple[str, int]] = []
    saved: list[WorkflowCheckpoint] = []
    _chain("v0", calls, True).run_sync(checkpoint_fn=saved.append, max_concurrency=1,
                                       isolate_failures=True)
    assert dict(saved[-1].outputs) == {"s0": {"a": 1, "b": 2}, "s1[a]": 10, "s3[a]": 11}
    calls.clear()
    result = _chain("v1", calls, False).run_sync(resume_from=saved[-1], max_concurrency=1)
    assert calls == [("s1", 2), ("s3", 20)]
    assert result.outputs["s3"] == {"a": 11, "b": 21}


def _agent(version: str, keys: list[str], keep_last: int | None = None) -> Workflow:
    def turn(ctx: dict[str, Any]) -> Any:
        keys.append(str(attempt_key()))
        return Done(version) if ctx["agent"].number == 3 else version

    return Workflow([Step("a", lambda ctx: 0),
                     Step("agent", turn, ("a",), version=version,
                          repeat=Repeat(5, keep_last=keep_last))])


class _Died(BaseException):
    """The process dies at a save."""


def test_a_bumped_loop_runs_the_iteration_it_was_at_under_a_new_key() -> None:
    """"Every step whose work changed (a bumped version ...) and every step and item downstream
    of it gets a new attempt number, whether the checkpoint records an output of it, a
    failure, a question, or nothing at all" (docs/concepts.md). Iteration ``agent#2`` ran
    under v0 and the process died saving it; the resume under v1 starts the loop again and
    reaches ``agent#2`` under the key the old code's attempt was sent with."""
    keys: list[str] = []
    saved: list[WorkflowCheckpoint] = []

    def save(cp: WorkflowCheckpoint) -> None:
        if "agent#2" in cp.outputs:
            raise _Died
        saved.append(cp)

    with contextlib.suppress(_Died):
        _agent("v0", keys).run_sync(checkpoint_fn=save, run_id="r", max_concurrency=1)
    assert keys == ["r/agent#1/1", "r/agent#2/1"]
    keys.clear()
    _agent("v1", keys).run_sync(resume_from=saved[-1], run_id="r", max_concurrency=1)
    assert keys == ["r/agent#1/2", "r/agent#2/2", "r/agent#3/1"]


def test_a_bumped_loop_runs_its_compacted_iterations_under_new_keys() -> None:
    """The same promise for iterations ``keep_last`` compacted: they are done, counted in
    ``compacted`` (docs/checkpoint-format.md), and a bump runs the loop again from its first
    iteration; ``agent#1``'s output was let go of, and its new attempt went out under the
    old code's key ``r/agent#1/1``."""
    keys: list[str] = []
    first = _agent("v0", keys, keep_last=1).run_sync(run_id="r", max_concurrency=1)
    assert first.checkpoint is not None and dict(first.checkpoint.compacted) == {"agent": 2}
    keys.clear()
    _agent("v1", keys, keep_last=1).run_sync(resume_from=first.checkpoint, run_id="r",
                                              max_concurrency=1)
    assert keys == ["r/agent#1/2", "r/agent#2/2", "r/agent#3/2"]


def test_replay_accepts_a_compacted_iteration_run_again_after_a_bump() -> None:
    """A bump runs a loop again from its first iteration ("a loop whose code ... changed
    starts again from its first iteration", docs/checkpoint-format.md), so a compacted
    iteration is recorded again with the new code's output. Replay compared it with the
    output the old code recorded before compacting it (``output_changed``)."""
    saved: list[WorkflowCheckpoint] = []
    _agent("v0", [], keep_last=1).run_sync(checkpoint_fn=saved.append, run_id="r")
    _agent("v1", [], keep_last=1).run_sync(resume_from=saved[-1], checkpoint_fn=saved.append,
                                            run_id="r")
    report = replay(_agent("v1", [], keep_last=1), saved)
    assert report.ok, [v.to_dict() for v in report.violations]


def test_a_bumped_loop_sends_no_compacted_iteration_under_a_spent_key() -> None:
    """"Every step whose work changed ... and every step and item downstream of it gets a new
    attempt number" (docs/concepts.md). ``agent#1`` failed once and succeeded on attempt 2
    (key ``r/agent#1/2``); ``keep_last=1`` then compacted it, and with it its failure record,
    the only count of its failed attempt. A bump ran it again as attempt 1 + redone = 2:
    the key its old code's work was sent with. The checkpoint now keeps the most failed
    attempts of a loop's compacted iterations (``compacted_retries``)."""
    keys: list[str] = []
    failed: set[str] = set()

    def workflow(version: str) -> Workflow:
        def turn(ctx: dict[str, Any]) -> Any:
            key = str(attempt_key())
            keys.append(key)
            if ctx["agent"].number == 1 and version not in failed:
                failed.add(version)
                raise ConnectionError("overloaded")
            return Done(version) if ctx["agent"].number == 2 else version

        return Workflow([Step("agent", turn, version=version, repeat=Repeat(3, keep_last=1),
                              retry=RetryPolicy(max_attempts=2, backoff_base=0))])

    first = workflow("v0").run_sync(run_id="r", max_concurrency=1)
    assert keys == ["r/agent#1/1", "r/agent#1/2", "r/agent#2/1"]
    assert first.checkpoint is not None and dict(first.checkpoint.compacted) == {"agent": 1}
    keys.clear()
    workflow("v1").run_sync(resume_from=first.checkpoint, run_id="r", max_concurrency=1)
    assert not {"r/agent#1/1", "r/agent#1/2"} & set(keys), keys


def _beside_a_loop(keep_last: int | None) -> Workflow:
    """``agent`` loops until its 4th iteration beside ``b``; ``c`` needs both."""
    def agent(ctx: dict[str, Any]) -> Any:
        return Done("done") if ctx["agent"].number == 4 else ctx["agent"].number

    return Workflow([Step("a", lambda ctx: "a"), Step("b", lambda ctx: "b"),
                     Step("agent", agent, ("a",), repeat=Repeat(6, keep_last=keep_last)),
                     Step("c", lambda ctx: "c", ("agent", "b"))])


@pytest.mark.parametrize("keep_last", [None, 1, 2])
def test_replay_accepts_a_rewind_beside_a_loop_resumed_with_only_the_rewound_step(
        keep_last: int | None) -> None:
    """``step_index`` says "how many steps have finished" (docs/checkpoint-format.md), a
    compacted iteration included ("still done"), and replay holds that it never goes down.
    Rewinding ``b`` beside a compacting loop counted the loop's compacted iterations out of
    the rewound checkpoint's ``step_index``; and a resume with ``only=("b",)``, which holds
    the loop, counted none of its iterations: 8, then 3 after the resume's save."""
    workflow = _beside_a_loop(keep_last)
    saved: list[WorkflowCheckpoint] = []
    workflow.run_sync(checkpoint_fn=saved.append, run_id="r", max_concurrency=1)
    assert saved[-1].step_index == 8  # a, b, c, the loop and its 4 iterations
    rewound = rewind(workflow, saved[-1], "b")
    assert rewound.step_index == 6  # b and c let go of
    resumed: list[WorkflowCheckpoint] = []
    workflow.run_sync(resume_from=rewound, checkpoint_fn=resumed.append, run_id="r",
                      max_concurrency=1, only=("b",))
    assert [cp.step_index for cp in resumed] == [7]
    report = replay(workflow, [*saved, rewound, *resumed])
    assert report.ok, [v.to_dict() for v in report.violations]


def _per_topic(version: str, keys: list[str]) -> Workflow:
    def read(ctx: dict[str, Any]) -> str:
        keys.append(str(attempt_key()))
        return f"{version}: {ctx['topics']}"

    child = Workflow([Step("read", read, version=version)])
    return Workflow([Step("topics", lambda ctx: ["tides"]),
                     Step("research", depends_on=("topics",), child=child, map_over="topics")])


def test_a_bumped_child_per_item_runs_an_interrupted_item_under_a_new_key() -> None:
    """"Every step whose work changed (a bumped version ...) and every step and item downstream
    of it gets a new attempt number, whether the checkpoint records an output of it, a
    failure, a question, or nothing at all" (docs/concepts.md). Item ``research/read[0]`` of
    a child per item (concepts.md, "A child per item") ran under v0 and the process died
    saving it; the resume under v1 sends the key of the old code's attempt for the new work
    (found by the model once it knew children per item)."""
    keys: list[str] = []
    saved: list[WorkflowCheckpoint] = []

    def save(cp: WorkflowCheckpoint) -> None:
        if "research/read[0]" in cp.outputs:
            raise _Died
        saved.append(cp)

    with contextlib.suppress(_Died):
        _per_topic("v0", keys).run_sync(checkpoint_fn=save, run_id="r", max_concurrency=1)
    assert keys == ["r/research/read[0]/1"]
    keys.clear()
    _per_topic("v1", keys).run_sync(resume_from=saved[-1], run_id="r", max_concurrency=1)
    assert keys == ["r/research/read[0]/2"]


def test_audit_skips_a_child_per_item_over_no_items_after_a_bump() -> None:
    """A child per item over no items makes ``[]`` at once (docs/concepts.md, "A child per
    item"), and the resume of a bumped child collects it again with no attempt, as a mapped
    step over no items is (audit says that one is skipped). audit says the parent ``r``
    runs (found by the model's check of what audit says a resume skips)."""
    def workflow(version: str) -> Workflow:
        child = Workflow([Step("read", lambda ctx: 1, version=version)])
        return Workflow([Step("topics", lambda ctx: []),
                         Step("r", depends_on=("topics",), child=child, map_over="topics")])

    recorded = workflow("v0").run_sync().checkpoint
    rows = {row.name: row.action for row in audit(workflow("v1"), recorded).steps}
    assert rows == {"topics": "skip", "r/read": "skip", "r": "skip"}


def _per_item_two_steps(topics: list[str]) -> Workflow:
    child = Workflow([Step("c0", lambda ctx: f"c0 {ctx['topics']}"),
                      Step("c1", lambda ctx: f"c1 {ctx['c0']}", ("c0",))])
    return Workflow([Step("topics", lambda ctx: topics),
                     Step("r", depends_on=("topics",), child=child, map_over="topics")])


@pytest.mark.parametrize("only", ["topics", "r/c0"])
@pytest.mark.parametrize("topics", [[], ["tides"]])
def test_only_leaves_a_child_per_item_outside_the_selection_alone(only: str,
                                                                   topics: list[str]) -> None:
    """``only`` "runs the named steps and every step they transitively need, and nothing
    else"; "a mapped step outside it is expanded when its input is recorded, but none of its
    items starts" (docs/concepts.md, "Running some of the steps"). With a child per item
    beside the selection the run raised ``KeyError`` naming a child step outside it."""
    result = _per_item_two_steps(topics).run_sync(only=[only])
    wanted = {"topics"} | ({"r/c0", *(f"r/c0[{i}]" for i in range(len(topics)))}
                           if only == "r/c0" else set())
    assert set(result.checkpoint.outputs) == wanted


def test_only_of_a_child_per_items_output_step_leaves_its_parent_alone() -> None:
    """Selecting the output step of a child per item runs it "and every step [it]
    transitively need[s], and nothing else" (docs/concepts.md): the parent ``r`` needs it
    and is outside the selection, yet it was recorded."""
    result = _per_item_two_steps(["tides"]).run_sync(only=["r/c1"])
    assert "r" not in result.checkpoint.outputs
    assert result.left_out == ("r",)
    # "a later run without only resumes one and runs exactly the rest"
    rest = _per_item_two_steps(["tides"]).run_sync(resume_from=result.checkpoint)
    assert rest.outputs["r"] == ["c1 c0 tides"] and rest.left_out == ()


def test_a_rewind_of_what_a_child_per_item_maps_over_runs_its_items_again() -> None:
    """``rewind(workflow, checkpoint, "topics")`` lets go of ``topics`` "and everything
    downstream" (docs/concepts.md); a child per item over it runs its items again, as a
    version bump of ``topics`` does. The rewind raised ``KeyError`` naming the child's step
    (found by the model's rewinds of an upstream)."""
    calls: list[str] = []
    child = Workflow([Step("c0", lambda ctx: calls.append(ctx["topics"]))])
    workflow = Workflow([Step("topics", lambda ctx: ["a", "b"]),
                         Step("r", depends_on=("topics",), child=child, map_over="topics")])
    recorded = workflow.run_sync().checkpoint
    calls.clear()
    rewound = rewind(workflow, recorded, "topics")
    assert not any(n.startswith("r/") for n in rewound.outputs)
    workflow.run_sync(resume_from=rewound)
    assert calls == ["a", "b"]


def test_a_child_per_item_sees_its_parents_inputs_whole() -> None:
    """"Every step of the child depends on the parent step's dependencies, and sees them by
    their names, as a run of the child alone sees its initial context"; a child per item's
    step sees "its child dependencies as the same item's outputs" (docs/concepts.md,
    decision 021). A parent's input ``notes``, itself mapped over ``topics``, was seen as
    the same item's ``notes[k]``, not as ``notes`` (found by the model: a digest of the
    inputs differed)."""
    seen: list[Any] = []
    child = Workflow([Step("c0", lambda ctx: seen.append((ctx["topics"], ctx["notes"])))])
    workflow = Workflow([
        Step("topics", lambda ctx: ["a", "b"]),
        Step("notes", lambda ctx: ctx["topics"].upper(), ("topics",), map_over="topics"),
        Step("r", depends_on=("topics", "notes"), child=child, map_over="topics"),
    ])
    workflow.run_sync(max_concurrency=1)
    assert seen == [("a", ["A", "B"]), ("b", ["A", "B"])]


def test_a_child_per_item_of_a_loops_output_runs() -> None:
    """"A step may map over" a loop's output (docs/concepts.md, Loops), and a child per item
    runs once per item of what it maps over ("A child per item"). Over a loop, the run
    raised ``InternalError`` ("nothing can start and nothing is running"): the loop's end
    grew the maps over it but not the children per item (found by the model)."""
    child = Workflow([Step("read", lambda ctx: f"read {ctx['agent']}")])
    workflow = Workflow([
        Step("agent", lambda ctx: Done(["a", "b"]), repeat=Repeat(2)),
        Step("r", depends_on=("agent",), child=child, map_over="agent"),
    ])
    assert workflow.run_sync().outputs["r"] == ["read a", "read b"]


def test_replay_accepts_a_resume_that_runs_changed_code_again() -> None:
    """A resume "runs [a step whose code changed] again with everything downstream, as a
    version bump does" (``on_code_change="again"``, docs/cache.md), and replay accepts a
    resume that drops "the outputs that were outdated when it began" (ekit_core.replay).
    It reported the changed step's output as ``output_removed``: it judged outdated
    outputs by version tags and dependencies, not by the recorded code fingerprints
    (found by the model once it drew code changes)."""
    def workflow(tone: str) -> Workflow:
        def draft(ctx: dict[str, Any]) -> str:
            return f"a {tone} draft"

        return Workflow([Step("draft", draft), Step("post", lambda ctx: ctx["draft"], ("draft",))],
                        on_code_change="again")

    saved: list[WorkflowCheckpoint] = []
    first = workflow("calm").run_sync(checkpoint_fn=saved.append)
    workflow("bold").run_sync(resume_from=first.checkpoint, checkpoint_fn=saved.append)
    assert saved[-1].outputs["draft"] == "a bold draft"
    report = replay(workflow("bold"), saved)
    assert report.ok, [v.to_dict() for v in report.violations]


def test_only_of_a_step_of_a_loops_body_is_refused_naming_the_loop() -> None:
    """``only`` runs "the named steps and every step they transitively need", and "a bad
    ``only`` is a ``ValueError`` naming the field and the name, raised before any step runs"
    (docs/concepts.md, "Running some of the steps"). Naming ``P/c0``, a step of the body of
    the loop ``P`` (concepts.md, "A loop whose body is a workflow"), the run raised
    ``InternalError`` ("nothing can start and nothing is running"): the body's iterations
    grow only with the loop, which the selection leaves out (found by the model). Such a
    step runs only as the loop's iterations, as an item runs only with its mapped step: it
    is refused by name, as an item is, before anything runs, and the loop selected runs
    its body."""
    calls: list[str] = []

    def c0(ctx: dict[str, Any]) -> Any:
        calls.append(f"c0#{ctx['P'].number}")
        return Done("x") if ctx["P"].number == 2 else "y"

    body = Workflow([Step("c0", c0)])
    workflow = Workflow([Step("P", child=body, repeat=Repeat(3))])
    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(ValueError, match=r"only names 'P/c0', a step of the body of the loop "
                                         r"'P'.*select 'P'"):
        workflow.run_sync(only=["P/c0"], checkpoint_fn=saved.append)
    assert calls == [] and saved == []
    result = workflow.run_sync(only=["P"])
    assert calls == ["c0#1", "c0#2"] and result.checkpoint.outputs["P/c0"] == "x"


def test_a_bumped_body_map_runs_its_recorded_items_again() -> None:
    """"A changed body step (its version or code) runs the loop again from its first
    iteration" (docs/concepts.md, "A loop whose body is a workflow"). Item ``P/c1#1[0]`` of
    a map inside the body, recorded under v0 before the process died, was kept by the
    resume under v1 and collected with v1's ``P/c1#1[1]`` (found by the model)."""
    class Died(BaseException):
        pass

    def workflow(version: str) -> Workflow:
        def tool(ctx: dict[str, Any]) -> str:
            if version == "v0" and ctx["c0"] == "b":
                raise Died
            return f"{version}:{ctx['c0']}"

        body = Workflow([Step("c0", lambda ctx: ["a", "b"]),
                         Step("c1", tool, ("c0",), map_over="c0", version=version),
                         Step("c2", lambda ctx: Done(ctx["c1"]), ("c1",))])
        return Workflow([Step("P", child=body, repeat=Repeat(2))])

    saved: list[WorkflowCheckpoint] = []
    with contextlib.suppress(Died):
        workflow("v0").run_sync(checkpoint_fn=saved.append, max_concurrency=1)
    assert "P/c1#1[0]" in saved[-1].outputs
    assert workflow("v1").run_sync(resume_from=saved[-1]).outputs["P"] == ["v1:a", "v1:b"]


def test_a_bumped_body_runs_the_iteration_it_was_at_under_new_keys() -> None:
    """"Every step whose work changed ... gets a new attempt number, whether the checkpoint
    records an output of it, a failure, a question, or nothing at all" (docs/concepts.md).
    ``P/c2#1``, the body's output step in the iteration the loop was at, ran under v0 and
    the process died before anything of it was saved; the resume under v1 sent the old
    attempt's key for the new work (found by the model: a loop's next iteration was counted
    by the loop's own name, which no step of a body has)."""
    keys: list[str] = []

    class Died(BaseException):
        pass

    def workflow(version: str, die: bool) -> Workflow:
        def fold(ctx: dict[str, Any]) -> Any:
            keys.append(str(attempt_key()))
            if die:
                raise Died
            return Done("x")

        body = Workflow([Step("c0", lambda ctx: "a", version=version),
                         Step("c2", fold, ("c0",), version=version)])
        return Workflow([Step("P", child=body, repeat=Repeat(2))])

    saved: list[WorkflowCheckpoint] = []
    with contextlib.suppress(Died):
        workflow("v0", True).run_sync(checkpoint_fn=saved.append, max_concurrency=1, run_id="r")
    assert keys == ["r/P/c2#1/1"]
    keys.clear()
    workflow("v1", False).run_sync(resume_from=saved[-1], max_concurrency=1, run_id="r")
    assert keys == ["r/P/c2#1/2"]


def test_a_kept_step_runs_an_interrupted_item_of_new_code_under_a_new_key() -> None:
    """"Attempt identity follows the work: a changed version or fingerprint ... never
    re-sends the attempt key of different work" (issue 45), and a step's attempt numbers
    are new "whether the checkpoint records an output of it, a failure, a question, or
    nothing at all" (docs/concepts.md). ``m[1]`` was interrupted under the old code with
    nothing recorded; ``keep`` keeps ``m[0]``, and ``m[1]`` runs the new code under the key
    the old code's attempt was sent with (found by a hunt of the model)."""
    keys: list[str] = []

    class Died(BaseException):
        pass

    def workflow(tone: str, die: bool) -> Workflow:
        def item(ctx: dict[str, Any]) -> str:
            keys.append(str(attempt_key()))
            if die and ctx["a"] == 2:
                raise Died
            return f"{tone} {ctx['a']}"

        return Workflow([Step("a", lambda ctx: [1, 2]),
                         Step("m", item, ("a",), map_over="a")], on_code_change="keep")

    saved: list[WorkflowCheckpoint] = []
    with contextlib.suppress(Died):
        workflow("calm", True).run_sync(checkpoint_fn=saved.append, max_concurrency=1, run_id="r")
    assert keys == ["r/m[0]/1", "r/m[1]/1"] and "m[0]" in saved[-1].outputs
    keys.clear()
    workflow("bold", False).run_sync(resume_from=saved[-1], max_concurrency=1, run_id="r")
    assert keys == ["r/m[1]/2"]


def test_audit_of_a_rewound_body_map_over_no_items_says_what_the_resume_keeps() -> None:
    """"An iteration that asked for none has none" (docs/concepts.md, "A loop whose body is
    a workflow"): a body map over an empty output is collected at once, with no attempt, as
    any map over no items is, and audit tells what a resume skips. After a rewind of the
    body's map step, the resume collects ``agent/tool#1`` again as it starts; audit raised
    ``KeyError`` (it read the iteration's dependencies from the declared graph, which has
    no ``agent/tool#1``; found by a hunt of the model with bodies drawn)."""
    body = Workflow([Step("model", lambda ctx: {}),
                     Step("tool", lambda ctx: ctx["model"], ("model",), map_over="model"),
                     Step("fold", lambda ctx: Done("x"), ("tool", "model"))])
    workflow = Workflow([Step("agent", child=body, repeat=Repeat(max_iterations=3))])
    rewound = rewind(workflow, workflow.run_sync().checkpoint, "agent/tool")
    assert dict(rewound.outputs) == {"agent/model#1": {}}
    rows = {row.name: row.action for row in audit(workflow, rewound).steps}
    assert rows["agent/model#1"] == rows["agent/tool#1"] == "skip"
    assert rows["agent/fold#1"] == "run"
    started: list[str] = []
    result = workflow.run_sync(resume_from=rewound, trace=lambda e: started.extend(
        [e.name] if type(e).__name__ == "StepStarted" else []))
    assert started == ["agent/fold#1"] and result.checkpoint.outputs["agent/tool#1"] == {}


def test_an_item_of_a_body_map_is_retried_by_its_steps_policy() -> None:
    """"Iteration ``k`` runs every body step ``s`` as a step of its own, ``agent/s#k``, with
    everything a step has" (docs/concepts.md, "A loop whose body is a workflow"): a retry
    policy too, for the items of a body map as for any map's. An item ``P/c1#1[1]`` that
    failed once failed the run at its first attempt: the core looked its policy up by
    ``P/c1#1``, the iteration, which no policy names (found by a hunt of the model)."""
    calls: list[str] = []

    def tool(ctx: dict[str, Any]) -> str:
        calls.append(ctx["c0"])
        if calls.count("b") == 1 and ctx["c0"] == "b":
            raise ConnectionError("overloaded")
        return str(ctx["c0"])

    body = Workflow([Step("c0", lambda ctx: ["a", "b"]),
                     Step("c1", tool, ("c0",), map_over="c0",
                          retry=RetryPolicy(max_attempts=2, backoff_base=0)),
                     Step("c2", lambda ctx: Done(ctx["c1"]), ("c1",))])
    result = Workflow([Step("P", child=body, repeat=Repeat(2))]).run_sync(max_concurrency=1)
    assert result.outputs["P"] == ["a", "b"] and calls == ["a", "b", "b"]


def test_replay_accepts_a_bumped_body_running_its_compacted_iterations_again() -> None:
    """"A changed body step (its version or code) runs the loop again from its first
    iteration" (docs/concepts.md, "A loop whose body is a workflow"), and replay accepts
    the resumes a run makes (docs/auditing.md): an iteration recorded again by the changed
    body is its first output, not a changed one. Replay forgot only a one-step loop's
    compacted iterations (``P#1``) when the loop started again, and reported
    ``output_changed`` for ``P/c0#1`` and the item ``P/m#1[0]`` (found by a hunt of the
    model)."""
    def workflow(version: str) -> Workflow:
        def fold(ctx: dict[str, Any]) -> Any:
            return Done(ctx["m"]) if ctx["P"].number == 2 else ctx["m"]

        body = Workflow([Step("c0", lambda ctx: [f"{version}:{ctx['P'].number}"], version=version),
                         Step("m", lambda ctx: ctx["c0"], ("c0",), map_over="c0"),
                         Step("c1", fold, ("m",))])
        return Workflow([Step("P", child=body, repeat=Repeat(3, keep_last=1))])

    saved: list[WorkflowCheckpoint] = []
    workflow("v0").run_sync(checkpoint_fn=saved.append)
    assert saved[-1].compacted == {"P": 1, "P/m[]": 1}
    result = workflow("v1").run_sync(resume_from=saved[-1], checkpoint_fn=saved.append)
    assert result.outputs["P"] == ["v1:2"] and result.checkpoint.compacted == {"P": 1, "P/m[]": 1}
    report = replay(workflow("v1"), saved)
    assert report.ok, [v.to_dict() for v in report.violations]


def test_a_rewind_of_the_skip_above_a_body_loop_lets_it_run() -> None:
    """A rewind drops what it reaches "and everything downstream" (docs/concepts.md), skips
    included: their conditions are decided again. A loop whose body is a workflow, skipped
    because a condition above it was false, records its body's first iteration skipped too
    (``L/c0#1``); a rewind of the condition's step let go of ``L/c0``'s skip but kept
    ``L/c0#1``'s, and the resume refused the rewound checkpoint (``CheckpointError``: "records
    'L/c0#1' as skipped, yet not its loop"; found by a hunt of the model)."""
    go = [False]
    body = Workflow([Step("c0", lambda ctx: Done(ctx["a"]))])
    workflow = Workflow([Step("a", lambda ctx: "yes", when=lambda ctx: go[0]),
                         Step("L", depends_on=("a",), child=body, repeat=Repeat(3))])
    skipped = workflow.run_sync().checkpoint
    assert {"a", "L/c0#1", "L/c0", "L"} <= skipped.skipped.keys()
    go[0] = True
    rewound = rewind(workflow, skipped, "a")
    assert dict(rewound.skipped) == {}
    assert workflow.run_sync(resume_from=rewound).outputs["L"] == "yes"


def test_a_bumped_body_counts_an_iteration_it_records_only_a_failure_of() -> None:
    """Every step and item whose work changed gets a new attempt number "whether the
    checkpoint records an output of it, a failure, a question, or nothing at all", and
    ``redone`` counts it (docs/concepts.md), as it does an item ``m[0]`` rewound and then
    bumped (``redone`` 2). ``P/c1#2`` failed once and then finished; a rewind of the body
    let go of its output (``redone`` 1), and a bump of the body before the resume did not
    count it again: the resume counted only the iterations the recorded outputs grow, not
    those known by a failure record (found by a hunt of the model)."""
    failed: list[int] = []

    def workflow(version: str) -> Workflow:
        def fold(ctx: dict[str, Any]) -> Any:
            number = ctx["P"].number
            if number == 2 and not failed:
                failed.append(number)
                raise ConnectionError("overloaded")
            return Done(ctx["c0"]) if number == 2 else ctx["c0"]

        body = Workflow([Step("c0", lambda ctx: version, version=version),
                         Step("c1", fold, ("c0",), retry=RetryPolicy(2, backoff_base=0))])
        return Workflow([Step("P", child=body, repeat=Repeat(3))])

    recorded = workflow("v0").run_sync().checkpoint
    assert "P/c1#2" in recorded.failures and "P/c1#2" in recorded.outputs
    rewound = rewind(workflow("v0"), recorded, "P/c0")
    assert "P/c1#2" not in rewound.outputs and rewound.redone["P/c1#2"] == 1
    bumped = workflow("v1").run_sync(resume_from=rewound).checkpoint
    assert bumped.redone["P/c1#2"] == bumped.redone["P/c1#1"] == 2


def test_a_rewind_in_the_iteration_a_body_loop_is_at_keeps_what_came_before() -> None:
    """``rewind(workflow, checkpoint, "agent/tool#3")`` "runs that step of iteration 3 and
    everything after it again" (docs/concepts.md, "A loop whose body is a workflow"), a
    mapped step's items with it. A rewind of the body's map step kept the map's items
    ``P/m#1[0]``, ``P/m#1[1]`` without their iteration ``P/m#1``, and in the iteration an
    unfinished loop was at also let go of ``P/c0#1`` before it (found by a hunt of the
    model: audit and the resume then disagreed on those items)."""
    calls: list[str] = []

    class Died(BaseException):
        pass

    def workflow(die: bool) -> Workflow:
        def fold(ctx: dict[str, Any]) -> Any:
            if die:
                raise Died
            return Done(ctx["m"])

        def tool(ctx: dict[str, Any]) -> str:
            calls.append(ctx["c0"])
            return str(ctx["c0"]).upper()

        body = Workflow([Step("c0", lambda ctx: calls.append("c0") or ["a", "b"]),
                         Step("m", tool, ("c0",), map_over="c0"),
                         Step("c2", fold, ("m", "c0"))])
        return Workflow([Step("P", child=body, repeat=Repeat(3))])

    saved: list[WorkflowCheckpoint] = []
    with contextlib.suppress(Died):
        workflow(True).run_sync(checkpoint_fn=saved.append, max_concurrency=1)
    assert set(saved[-1].outputs) == {"P/c0#1", "P/m#1[0]", "P/m#1[1]", "P/m#1"}
    assert rewind(workflow(False), saved[-1], "P/c2") == saved[-1]  # (nothing of c2 recorded)
    rewound = rewind(workflow(False), saved[-1], "P/m")
    assert set(rewound.outputs) == {"P/c0#1"}
    calls.clear()
    finished = workflow(False).run_sync(resume_from=rewound).checkpoint
    assert finished.outputs["P"] == ["A", "B"] and calls == ["a", "b"]
    assert set(rewind(workflow(False), finished, "P/m").outputs) == {"P/c0#1"}  # (ended too)


def test_a_bumped_body_runs_an_interrupted_item_of_its_map_under_a_new_key() -> None:
    """"Every step whose work changed ... and every step and item downstream of it gets a new
    attempt number, whether the checkpoint records an output of it, a failure, a question,
    or nothing at all" (docs/concepts.md). ``P/m#1[0]``, an item of a body's map, began
    under v0 and the process died with nothing of it saved; the resume under a bumped body
    sent v1's work under the same key: the resume counted the items of a body's map only
    for a one-step loop's prefix ``P#`` (found by a hunt of the model)."""
    keys: list[str] = []

    class Died(BaseException):
        pass

    def workflow(version: str, die: bool) -> Workflow:
        def tool(ctx: dict[str, Any]) -> str:
            keys.append(str(attempt_key()))
            if die:
                raise Died
            return f"{version}:{ctx['c0']}"

        body = Workflow([Step("c0", lambda ctx: ["a"], version=version),
                         Step("m", tool, ("c0",), map_over="c0"),
                         Step("c2", lambda ctx: Done(ctx["m"]), ("m",))])
        return Workflow([Step("P", child=body, repeat=Repeat(2))])

    saved: list[WorkflowCheckpoint] = []
    with contextlib.suppress(Died):
        workflow("v0", True).run_sync(checkpoint_fn=saved.append, max_concurrency=1, run_id="r")
    assert keys == ["r/P/m#1[0]/1"] and set(saved[-1].outputs) == {"P/c0#1"}
    keys.clear()
    workflow("v1", False).run_sync(resume_from=saved[-1], max_concurrency=1, run_id="r")
    assert keys == ["r/P/m#1[0]/2"]


def test_a_resume_of_a_compacted_body_map_settles_once_after_its_last_step() -> None:
    """A run ends with one ``RunSettled``, once nothing is left to run (docs/concepts.md).
    A resume of a loop whose body's map had items compacted (``keep_last``), given an
    answer for the step after the loop, told ``RunSettled("finished")`` before that step
    ran: it counted the compacted items, which it cannot name, as settled steps of its
    graph (found by a hunt of the model). The resumed checkpoints still count them in
    ``step_index``, which never goes down."""
    def fold(ctx: dict[str, Any]) -> Any:
        return Done("x") if ctx["P"].number == 2 else "y"

    body = Workflow([Step("c0", lambda ctx: [ctx["P"].number]),
                     Step("m", lambda ctx: ctx["c0"], ("c0",), map_over="c0"),
                     Step("c2", fold, ("m", "c0"))])
    workflow = Workflow([Step("P", child=body, repeat=Repeat(3, keep_last=1)),
                         Step("s4", lambda ctx: ask("ok?"), ("P",))])
    saved: list[WorkflowCheckpoint] = []
    with contextlib.suppress(RunWaiting):
        workflow.run_sync(checkpoint_fn=saved.append)
    waiting = saved[-1]
    assert waiting.compacted == {"P": 1, "P/m[]": 1} and "s4" in waiting.asked
    told: list[str] = []
    result = workflow.run_sync(resume_from=waiting, answers={"s4": "yes"}, checkpoint_fn=saved.append,
                               trace=lambda e: told.append(type(e).__name__))
    assert result.outputs["s4"] == "yes"
    assert [e for e in told if e in ("RunSettled", "StepStarted")] == ["StepStarted", "RunSettled"]
    assert all(a.step_index <= b.step_index for a, b in itertools.pairwise(saved))
    assert replay(workflow, saved).ok


def test_a_body_loop_with_a_map_below_a_false_condition_is_skipped_whole() -> None:
    """A false condition skips its step "and every step that needs it" (docs/concepts.md):
    a loop whose body is a workflow is skipped with its body's first iteration. With a map
    in the body, the run ended in ``InternalError`` ("nothing can start and nothing is
    running"): the skip never reached ``L/c1#1``, the map's iteration, which waits for
    items rather than for a scheduled dependency (found by a hunt of the model)."""
    go = [False]
    body = Workflow([Step("c0", lambda ctx: [ctx["s0"]]),
                     Step("c1", lambda ctx: ctx["c0"], ("c0",), map_over="c0"),
                     Step("c2", lambda ctx: Done(ctx["c1"]), ("c1",))])
    workflow = Workflow([Step("s0", lambda ctx: "yes", when=lambda ctx: go[0]),
                         Step("L", depends_on=("s0",), child=body, repeat=Repeat(3))])
    skipped = workflow.run_sync().checkpoint
    assert {"s0", "L/c0#1", "L/c1#1", "L/c2#1", "L"} <= skipped.skipped.keys()
    assert workflow.run_sync(resume_from=skipped).checkpoint.skipped == skipped.skipped
    go[0] = True
    assert workflow.run_sync(resume_from=rewind(workflow, skipped, "s0")).outputs["L"] == ["yes"]


def test_a_rewind_of_a_compacted_body_step_runs_the_loop_again_whole() -> None:
    """A rewind of a body step runs every iteration of it "and everything after it" again
    (docs/concepts.md); its compacted iterations have no output left, so the loop lets go
    of its count and "runs again from its first iteration" (docs/checkpoint-format.md).
    The rewind kept ``P/c0#2``, which ran on iteration 1's output, beside a loop starting
    again from iteration 1 (found by a hunt of the model: audit and the resume disagreed)."""
    def fold(ctx: dict[str, Any]) -> Any:
        return Done(ctx["c0"]) if ctx["P"].number == 2 else ctx["c0"]

    body = Workflow([Step("c0", lambda ctx: f"{ctx['P'].number}:{ctx['P'].previous}"),
                     Step("c1", fold, ("c0",))])
    workflow = Workflow([Step("P", child=body, repeat=Repeat(3, keep_last=1))])
    ended = workflow.run_sync().checkpoint
    assert ended.compacted == {"P": 1} and "P/c0#2" in ended.outputs
    rewound = rewind(workflow, ended, "P/c1")
    assert dict(rewound.outputs) == {} and dict(rewound.compacted) == {}
    assert workflow.run_sync(resume_from=rewound).outputs["P"] == "2:1:None"


def test_a_bump_above_a_skipped_body_loop_decides_its_first_iteration_again() -> None:
    """"The conditions below what runs again are decided again" (docs/concepts.md): a bump
    of the step above a condition that skipped a loop whose body is a workflow lets go of
    the loop's skip and of its body's first iteration's, ``L/c0#1``, as of a one-step loop's
    ``L#1``. The resume kept ``L/c0#1`` skipped beside a loop deciding again (found by a
    hunt of the model: audit, the resume and the model disagreed)."""
    go = [False]

    def workflow(version: str) -> Workflow:
        body = Workflow([Step("c0", lambda ctx: Done(ctx["s1"]))])
        return Workflow([Step("s0", lambda ctx: version, version=version),
                         Step("s1", lambda ctx: ctx["s0"], ("s0",), when=lambda ctx: go[0]),
                         Step("L", depends_on=("s1",), child=body, repeat=Repeat(2))])

    skipped = workflow("v0").run_sync().checkpoint
    assert {"s1", "L/c0#1", "L/c0", "L"} <= skipped.skipped.keys()
    go[0] = True
    result = workflow("v1").run_sync(resume_from=skipped)
    assert result.outputs["L"] == "v1" and dict(result.checkpoint.skipped) == {}


def test_a_compacted_body_iteration_lets_go_of_its_old_items_failure_records() -> None:
    """A compacted iteration's "failure records went with their outputs"
    (docs/checkpoint-format.md, ``compacted_retries``). Item ``P/c1#1[v0]`` of a body's map
    failed; a bump ran iteration 1 again, whose map now has the item ``[v1]`` only, and
    ``keep_last=1`` then compacted iteration 1: its items' failure records went, but
    ``P/c1#1[v0]``'s stayed beside a compacted iteration (found by the model's body-loop
    draws)."""
    failed: set[str] = set()

    def tool(ctx: dict[str, Any]) -> str:
        key = str(ctx["c0"]["id"])
        if key not in failed:
            failed.add(key)
            raise ConnectionError("overloaded")
        return key

    def workflow(version: str) -> Workflow:
        def fold(ctx: dict[str, Any]) -> Any:
            if version == "v0":
                raise ConnectionError("down")
            return Done(ctx["c1"]) if ctx["P"].number == 2 else ctx["c1"]

        body = Workflow([Step("c0", lambda ctx: [{"id": version}], version=version),
                         Step("c1", tool, ("c0",), map_over="c0", item_key="id",
                              retry=RetryPolicy(2, backoff_base=0)),
                         Step("c2", fold, ("c1",))])
        return Workflow([Step("P", child=body, repeat=Repeat(3, keep_last=1))])

    first = workflow("v0").run_sync(max_concurrency=1, isolate_failures=True).checkpoint
    assert {"P/c1#1[v0]", "P/c2#1"} <= first.failures.keys()
    ended = workflow("v1").run_sync(max_concurrency=1, resume_from=first).checkpoint
    assert ended.compacted["P"] == 1 and ended.outputs["P"] == ["v1"]
    assert not [u for u in ended.failures if u.startswith("P/c1#1[")]
