"""replay(): recorded checkpoint sequences of real and simulated runs are legal; tampering is caught."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ekit_core import (
    Cancelled,
    CheckpointError,
    Failed,
    GraphSpec,
    Input,
    Interrupted,
    ReplayReport,
    State,
    Succeeded,
    TokenUsage,
    WorkflowCheckpoint,
    apply,
    checkpoint_of,
    initial_state,
    plan,
    replay,
)
from ekit_core.rewind import downstream
from ekit_runtime import Step, Workflow
from tests.support.strategies import dags

DIAMOND = GraphSpec.of({"a": [], "b": ["a"], "c": ["a"], "d": ["b", "c"]})


def _output(name: str) -> dict[str, Any]:
    return {"step": name, "text": f"output of {name}"}


def _usage(name: str) -> TokenUsage:
    n = sum(map(ord, name))
    return TokenUsage(n % 97, n % 13, 1)


def simulate(
    graph: GraphSpec, data: st.DataObject
) -> tuple[list[WorkflowCheckpoint], list[int]]:
    """Drive the pure core with random completions, failures, crashes and resumes.

    Returns every checkpoint saved, in order, and the indices at which a run
    resumed after a *soft* crash (one that saved a closing checkpoint), which
    replay must report as resumes. A *hard* crash saves nothing and resumes
    from the last checkpoint; a failure halts the run, which is then resumed.
    """
    cps: list[WorkflowCheckpoint] = []
    expected_resumes: list[int] = []
    pending_soft = False
    state: State = initial_state(graph)
    rounds = 0
    while True:
        rounds += 1
        batch = plan(state)
        if batch:
            state = apply(state, batch.starts)
        running = state.running_steps()
        if not running:
            if state.complete:
                break
            # Halted by a failure: a new run resumes from the last checkpoint.
            state = _resume(graph, cps, data)
            continue
        done = data.draw(
            st.lists(st.sampled_from(running), min_size=1, unique=True), label="completed"
        )
        results: list[Any] = []
        for name in done:
            fail = rounds < 25 and data.draw(st.integers(0, 4), label=f"fail {name}") == 0
            results.append(
                Failed(name, RuntimeError(f"{name} broke"))
                if fail
                else Succeeded(name, _output(name), _usage(name))
            )
        state = apply(state, results)
        if pending_soft:
            expected_resumes.append(len(cps))
            pending_soft = False
        cps.append(checkpoint_of(state))
        if state.complete:
            break
        crash = data.draw(st.sampled_from(["none", "none", "none", "hard", "soft"]), label="crash")
        if crash == "soft":
            # Cancellation: in-flight attempts are interrupted, a closing save is made.
            closing: list[Input] = [Cancelled()]
            closing += [Interrupted(n) for n in state.running_steps()]
            cps.append(checkpoint_of(apply(state, closing)))
            pending_soft = True
        if crash != "none":
            state = _resume(graph, cps, data)
    return cps, expected_resumes


def _resume(graph: GraphSpec, cps: list[WorkflowCheckpoint], data: st.DataObject) -> State:
    if not cps:
        return initial_state(graph)
    last = cps[-1]
    # Half the time resume from the loaded dict, as a new process would.
    source = last.to_dict() if data.draw(st.booleans(), label="from dict") else last
    return initial_state(graph, source)


def _loaded(cps: list[WorkflowCheckpoint]) -> list[dict[str, Any]]:
    return [json.loads(json.dumps(cp.to_dict())) for cp in cps]


def _kinds(report: ReplayReport) -> set[tuple[int, str | None, str]]:
    return {(v.index, v.step, v.kind) for v in report.violations}


PROPERTY = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@PROPERTY
@given(graph=dags(max_steps=9), data=st.data())
def test_every_simulated_run_with_crashes_and_resumes_replays_cleanly(
    graph: GraphSpec, data: st.DataObject
) -> None:
    cps, expected_resumes = simulate(graph, data)
    for sequence in (cps, _loaded(cps)):
        report = replay(graph, sequence)
        assert report.violations == (), report.format()
        assert list(report.resumes) == expected_resumes
        # Every step finishes exactly once, at the first checkpoint recording it.
        finished = [name for entry in report.timeline for name in entry.finished]
        assert sorted(finished) == sorted(graph.names)
        for name in graph.names:
            at = report.finished_at(name)
            assert at is not None and name in cps[at].outputs
            assert at == 0 or name not in cps[at - 1].outputs
            assert all(report.finished_at(d) is not None for d in graph.deps[name])
            assert all(report.finished_at(d) <= at for d in graph.deps[name])  # type: ignore[operator]
    # With no graph given, the graph recorded in the checkpoints is used.
    assert replay(None, _loaded(cps)).ok


@PROPERTY
@given(graph=dags(min_steps=2, max_steps=8), data=st.data())
def test_a_changed_output_is_reported_where_it_changed(
    graph: GraphSpec, data: st.DataObject
) -> None:
    cps = _loaded(simulate(graph, data)[0])
    candidates = [
        (i, name)
        for i in range(1, len(cps))
        for name in cps[i]["outputs"]
        if name in cps[i - 1]["outputs"]
    ]
    assume(candidates)
    i, name = data.draw(st.sampled_from(candidates), label="tamper")
    tampered = copy.deepcopy(cps)
    tampered[i]["outputs"][name] = "something else"
    report = replay(graph, tampered)
    assert (i, name, "output_changed") in _kinds(report), report.format()
    assert not report.ok


@PROPERTY
@given(graph=dags(min_steps=2, max_steps=8), data=st.data())
def test_a_removed_output_is_reported_where_it_went_missing(
    graph: GraphSpec, data: st.DataObject
) -> None:
    cps = _loaded(simulate(graph, data)[0])
    candidates = [
        (i, name) for i in range(1, len(cps)) for name in cps[i - 1]["outputs"]
    ]
    assume(candidates)
    i, name = data.draw(st.sampled_from(candidates), label="tamper")
    tampered = copy.deepcopy(cps)
    del tampered[i]["outputs"][name]
    tampered[i]["step_usage"].pop(name, None)
    report = replay(graph, tampered)
    assert (i, name, "output_removed") in _kinds(report), report.format()


@PROPERTY
@given(graph=dags(min_steps=2, max_steps=8), data=st.data())
def test_a_step_recorded_before_its_dependency_is_reported(
    graph: GraphSpec, data: st.DataObject
) -> None:
    cps = _loaded(simulate(graph, data)[0])
    report = replay(graph, cps)
    first = {name: report.finished_at(name) for name in graph.names}
    candidates = [(name, dep) for name in graph.names for dep in graph.deps[name]]
    assume(candidates)
    name, dep = data.draw(st.sampled_from(candidates), label="edge")
    at = first[name]
    assert at is not None
    # Hide the dependency's output up to and including the checkpoint that
    # first records ``name``: the record now claims ``name`` finished first.
    tampered = copy.deepcopy(cps)
    for cp in tampered[: at + 1]:
        cp["outputs"].pop(dep, None)
        cp["step_usage"].pop(dep, None)
    report = replay(graph, tampered)
    assert (at, name, "dependency_not_recorded") in _kinds(report), report.format()


def _diamond_run() -> list[WorkflowCheckpoint]:
    state = initial_state(DIAMOND)
    cps = []
    for names in (["a"], ["b"], ["c"], ["d"]):
        state = apply(state, [s for s in plan(state) if s.name in names])
        state = apply(state, [Succeeded(n, n.upper(), _usage(n)) for n in names])
        cps.append(checkpoint_of(state))
    return cps


def test_a_clean_sequence_gives_a_timeline() -> None:
    cps = _diamond_run()
    report = replay(DIAMOND, cps)
    assert report.ok and report.resumes == ()
    assert [e.finished for e in report.timeline] == [("a",), ("b",), ("c",), ("d",)]
    assert [e.step_index for e in report.timeline] == [1, 2, 3, 4]
    assert report.timeline[-1].cost == sum((_usage(n) for n in "abcd"), TokenUsage())
    assert "no violations" in report.format()
    assert json.loads(json.dumps(report.to_dict()))["ok"] is True


def test_resuming_from_an_older_checkpoint_is_a_resume_and_loses_outputs() -> None:
    cps = _diamond_run()
    state = initial_state(DIAMOND, cps[0])  # resume from checkpoint 0, not 1
    state = apply(state, [s for s in plan(state) if s.name == "c"])
    state = apply(state, [Succeeded("c", "C", _usage("c"))])
    report = replay(DIAMOND, [*cps[:2], checkpoint_of(state)])
    entry = report.timeline[2]
    assert entry.resumed and entry.resumed_from == 0 and entry.finished == ("c",)
    assert _kinds(report) == {(2, "b", "output_removed")}


def test_step_index_and_cost_going_down_are_reported() -> None:
    cps = [cp.to_dict() for cp in _diamond_run()]
    cps[2]["step_index"] = 1
    cps[3]["cost"]["input_tokens"] = 0
    kinds = _kinds(replay(DIAMOND, cps))
    assert (2, None, "step_index_decreased") in kinds
    assert (3, None, "cost_decreased") in kinds


def test_changed_usage_and_unknown_names_are_reported() -> None:
    cps = [cp.to_dict() for cp in _diamond_run()]
    cps[2]["step_usage"]["a"] = {"input_tokens": 1, "output_tokens": 0, "llm_calls": 0}
    cps[3]["outputs"]["stray"] = 1
    kinds = _kinds(replay(DIAMOND, cps))
    assert (2, "a", "usage_changed") in kinds
    assert (3, "stray", "unknown_step") in kinds


def test_a_single_tampered_checkpoint_yields_one_violation() -> None:
    cps = [cp.to_dict() for cp in _diamond_run()]
    cps[1]["outputs"]["a"] = "forged"
    report = replay(DIAMOND, cps)
    assert [(v.index, v.step, v.kind) for v in report.violations] == [(1, "a", "output_changed")]


def test_a_checkpoint_from_another_graph_is_reported_once() -> None:
    other = GraphSpec.of({"a": [], "b": ["a"], "c": ["a"], "d": ["b", "c"], "e": ["d"]})
    report = replay(other, _diamond_run())
    assert [(v.index, v.kind) for v in report.violations] == [(0, "fingerprint_mismatch")]
    assert "added: 'e'" in report.violations[0].message


def test_context_keys_in_a_first_executionkit_checkpoint_are_not_violations() -> None:
    legacy = {"step_index": 1, "outputs": {"topic": "x", "a": "A"}, "cost": TokenUsage().to_dict()}
    state = initial_state(DIAMOND, legacy)
    state = apply(state, [s for s in plan(state) if s.name == "b"])
    state = apply(state, [Succeeded("b", "B")])
    report = replay(DIAMOND, [legacy, checkpoint_of(state)])
    assert report.ok, report.format()
    assert report.timeline[0].finished == ("a",)


def test_bad_input_is_a_value_error_naming_the_checkpoint() -> None:
    with pytest.raises(CheckpointError, match=r"\[1\]\.outputs"):
        replay(DIAMOND, [_diamond_run()[0], {"step_index": 0, "outputs": [], "cost": {}}])
    with pytest.raises(ValueError, match="GraphSpec"):
        replay(object(), [])
    with pytest.raises(ValueError, match="records a graph"):
        replay(None, [{"step_index": 0, "outputs": {}, "cost": TokenUsage().to_dict()}])


def test_bad_input_keeps_a_field_name_that_contains_a_colon() -> None:
    # The step name is part of the field; the problem must come through whole
    # rather than being re-split out of the message at the first ": ".
    bad = {
        "step_index": 0, "outputs": {}, "cost": TokenUsage().to_dict(),
        "failures": {"fetch: v2": {"error_type": "E", "message": "m", "attempts": 0}},
    }
    with pytest.raises(CheckpointError) as info:
        replay(DIAMOND, [_diamond_run()[0], bad])
    assert info.value.field == "[1].failures.fetch: v2.attempts"
    assert info.value.problem == "must be at least 1"
    assert str(info.value) == (
        "checkpoint field '[1].failures.fetch: v2.attempts': must be at least 1"
    )


def test_replay_is_deterministic_and_does_not_mutate() -> None:
    cps = [cp.to_dict() for cp in _diamond_run()]
    before = copy.deepcopy(cps)
    assert replay(DIAMOND, cps) == replay(DIAMOND, cps)
    assert cps == before


# -- real runs of the runtime ---------------------------------------------------


def _workflow(gate: asyncio.Event, calls: list[str]) -> Workflow:
    async def make(name: str, ctx: dict[str, Any]) -> str:
        calls.append(name)
        if name == "c" and not gate.is_set():
            await gate.wait()
        return f"{name}:" + ",".join(sorted(k for k in ctx if len(k) == 1))

    def step(name: str, *deps: str) -> Step:
        async def run(ctx: dict[str, Any]) -> str:
            return await make(name, ctx)

        return Step(name, run, deps)

    return Workflow([step("a"), step("b", "a"), step("c", "a"), step("d", "b", "c")])


def test_a_cancelled_and_resumed_runtime_run_replays_with_its_resume() -> None:
    saved: list[WorkflowCheckpoint] = []

    async def scenario() -> None:
        gate = asyncio.Event()  # never set in the first run: "c" hangs there
        calls: list[str] = []
        wf = _workflow(gate, calls)
        b_done = asyncio.Event()

        def save(cp: WorkflowCheckpoint) -> None:
            saved.append(cp)
            if "b" in cp.outputs:
                b_done.set()

        task = asyncio.create_task(wf.run(checkpoint_fn=save))
        await b_done.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        crashed = len(saved)
        gate.set()
        result = await wf.run(checkpoint_fn=saved.append, resume_from=saved[-1])
        assert set(result.outputs) == {"a", "b", "c", "d"}
        report = replay(wf, saved)
        assert report.ok, report.format()
        assert report.resumes == (crashed,)
        assert report.timeline[crashed - 1].repeat
        assert report.timeline[crashed].resumed_from == crashed - 1
        # Loaded from JSON the same holds.
        assert replay(wf, [json.loads(json.dumps(cp.to_dict())) for cp in saved]).resumes == (
            crashed,
        )

    asyncio.run(scenario())


def test_a_failed_and_resumed_runtime_run_replays_cleanly() -> None:
    saved: list[WorkflowCheckpoint] = []
    attempts: list[str] = []

    def flaky(ctx: dict[str, Any]) -> str:
        attempts.append("b")
        if len(attempts) == 1:
            raise RuntimeError("transient")
        return "B"

    wf = Workflow(
        [
            Step("a", lambda ctx: "A"),
            Step("b", flaky, ("a",)),
            Step("c", lambda ctx: "C", ("b",)),
        ]
    )
    with pytest.raises(RuntimeError, match="transient"):
        wf.run_sync(checkpoint_fn=saved.append)
    wf.run_sync(checkpoint_fn=saved.append, resume_from=saved[-1].to_dict())
    report = replay(wf, saved)
    assert report.ok, report.format()
    assert any(e.failed == ("b",) for e in report.timeline)
    assert report.finished_at("c") == len(saved) - 1


# NaN outputs: nan != nan, so == alone would take an unchanged NaN for a
# changed output and a run going on for a resume.

CHAIN = GraphSpec.of({"a": [], "b": ["a"], "c": ["b"]})


def _nan_run(resume_from_file: bool) -> list[WorkflowCheckpoint]:
    """A run of CHAIN whose outputs hold NaN, killed after ``b`` and resumed."""
    computed_nan = float("inf") - float("inf")
    state = initial_state(CHAIN)
    cps = []
    for name in ("a", "b"):
        state = apply(state, plan(state).starts)
        state = apply(state, [Succeeded(name, {"score": computed_nan, "n": [computed_nan]})])
        cps.append(checkpoint_of(state))
    # Killed outright: the resume starts from the last checkpoint, read back
    # from its file (fresh NaN objects, another ledger) or kept in memory.
    source = json.loads(json.dumps(cps[-1].to_dict())) if resume_from_file else cps[-1]
    state = initial_state(CHAIN, source)
    state = apply(state, plan(state).starts)
    state = apply(state, [Succeeded("c", computed_nan)])
    cps.append(checkpoint_of(state))
    return cps


@pytest.mark.parametrize("resume_from_file", [True, False])
def test_nan_outputs_are_not_a_resume_nor_a_change(resume_from_file: bool) -> None:
    cps = _nan_run(resume_from_file)
    for sequence in (cps, _loaded(cps)):
        report = replay(CHAIN, sequence)
        assert report.ok, report.format()
        assert report.resumes == ()
        assert [e.finished for e in report.timeline] == [("a",), ("b",), ("c",)]
        assert report.timeline[-1].segment == 0


def test_a_nan_output_kept_across_a_real_resume_is_not_reported_changed() -> None:
    in_memory = _nan_run(resume_from_file=True)
    cps = _loaded(in_memory)
    # Checkpoint 0, read back from its file, saved again after checkpoint 1
    # (a resume from it): b is lost, but a, NaN and all, is unchanged.
    report = replay(CHAIN, [in_memory[0], in_memory[1], cps[0]])
    assert report.resumes == (2,) and report.timeline[2].resumed_from == 0
    assert _kinds(report) == {(2, "b", "output_removed"), (2, None, "step_index_decreased")}
    # A NaN output that became a number is still a change.
    forged = copy.deepcopy(cps)
    forged[2]["outputs"]["a"]["score"] = 0.0
    assert _kinds(replay(CHAIN, forged)) == {(2, "a", "output_changed")}


# Rules that one test alone (or none) guarded: a second, direct test for each.


def test_a_tampered_output_in_the_middle_is_one_violation_where_it_changed() -> None:
    cps = [cp.to_dict() for cp in _diamond_run()]
    cps[2]["outputs"]["b"] = "forged"  # checkpoint 3 holds the original again
    report = replay(DIAMOND, cps)
    assert [(v.index, v.step, v.kind) for v in report.violations] == [(2, "b", "output_changed")]
    assert "checkpoint 1 recorded" in report.violations[0].message


def test_changed_or_dropped_usage_is_reported_in_every_form() -> None:
    base = [cp.to_dict() for cp in _diamond_run()]
    a_usage = base[0]["step_usage"]["a"]
    other = {"input_tokens": 1, "output_tokens": 1, "llm_calls": 1}
    assert other != a_usage
    # Changed along with a dropped output (the record does not extend its predecessor).
    cps = copy.deepcopy(base)
    cps[2]["step_usage"]["a"] = other
    del cps[2]["outputs"]["b"], cps[2]["step_usage"]["b"]
    assert (2, "a", "usage_changed") in _kinds(replay(DIAMOND, cps))
    # Dropped while the output stays.
    cps = copy.deepcopy(base)
    del cps[2]["step_usage"]["a"]
    violations = [v for v in replay(DIAMOND, cps).violations if v.kind == "usage_changed"]
    assert [(v.index, v.step) for v in violations] == [(2, "a")]
    assert "no longer recorded" in violations[0].message
    # Recorded again, after being dropped, with another value.
    cps = copy.deepcopy(base)
    del cps[1]["outputs"]["a"], cps[1]["step_usage"]["a"]
    cps[2]["step_usage"]["a"] = other
    kinds = _kinds(replay(DIAMOND, cps))
    assert (2, "a", "usage_changed") in kinds and (1, "a", "output_removed") in kinds


@pytest.mark.parametrize("field", ["input_tokens", "output_tokens", "llm_calls"])
def test_cost_going_down_in_any_one_count_is_reported(field: str) -> None:
    cps = [cp.to_dict() for cp in _diamond_run()]
    assert cps[2]["cost"][field] > 0
    cps[3]["cost"][field] = cps[2]["cost"][field] - 1
    assert _kinds(replay(DIAMOND, cps)) == {(3, None, "cost_decreased")}


def test_a_step_recorded_with_its_dependency_in_one_checkpoint_is_legal() -> None:
    # A checkpoint_fn may skip saves: the docs allow a dependency recorded in
    # the same checkpoint as the step that needs it.
    cps = [cp.to_dict() for cp in _diamond_run()]
    report = replay(DIAMOND, [cps[1], cps[3]])
    assert report.ok, report.format()
    assert report.timeline[1].finished == ("c", "d")
    assert report.timeline[0].finished == ("a", "b")


def test_an_unknown_name_is_reported_each_time_it_is_newly_recorded_only() -> None:
    cps = [cp.to_dict() for cp in _diamond_run()]
    cps[1]["outputs"]["stray"] = 1
    cps[2]["outputs"]["stray"] = 1  # still there: not reported again
    kinds = _kinds(replay(DIAMOND, cps))
    assert {k for k in kinds if k[2] == "unknown_step"} == {(1, "stray", "unknown_step")}
    # Dropped, then back: its loss is reported, its return is not news.
    del cps[2]["outputs"]["stray"]
    cps[3]["outputs"]["stray"] = 1
    kinds = _kinds(replay(DIAMOND, cps))
    assert {k for k in kinds if k[1] == "stray"} == {
        (1, "stray", "unknown_step"), (2, "stray", "output_removed"),
    }
    # An ExecutionKit-style context key in the first checkpoint is no violation,
    # but the same kind of name appearing later is.
    first = {"step_index": 1, "outputs": {"a": "A", "topic": "owls"}, "cost": TokenUsage().to_dict()}
    later = {**first, "outputs": {**first["outputs"], "b": "B", "lang": "en"}, "step_index": 2}
    assert _kinds(replay(DIAMOND, [first, later])) == {(1, "lang", "unknown_step")}


def test_a_fingerprint_is_reported_at_each_change_not_at_each_checkpoint() -> None:
    cps = [cp.to_dict() for cp in _diamond_run()]
    other = GraphSpec.of({"x": []}).fingerprint
    cps[1]["fingerprint"] = cps[2]["fingerprint"] = other
    report = replay(DIAMOND, cps)
    assert [(v.index, v.kind) for v in report.violations] == [(1, "fingerprint_mismatch")]
    # Only the fingerprint was edited: a resume takes it, the record still says it was edited.
    assert f"is not that of the graph it records, which is this one ({DIAMOND.fingerprint})" in (
        report.violations[0].message)
    cps[3]["fingerprint"] = GraphSpec.of({"y": []}).fingerprint
    assert [v.index for v in replay(DIAMOND, cps).violations] == [1, 3]


def test_a_failure_alone_is_news_not_a_repeat_and_failures_keep_declaration_order() -> None:
    state = initial_state(DIAMOND)
    state = apply(state, plan(state).starts)
    state = apply(state, [Succeeded("a", "A")])
    first = checkpoint_of(state)
    state = apply(state, plan(state).starts)  # b and c
    state = apply(state, [Failed("c", ValueError("x")), Failed("b", ValueError("y"))])
    failed = checkpoint_of(state)
    report = replay(DIAMOND, [first, failed])
    entry = report.timeline[1]
    assert (entry.finished, entry.failed, entry.repeat, entry.resumed) == ((), ("b", "c"), False, False)
    # The next run's progress from there is one segment on: a failure is not
    # the closing save of a cancelled run.
    resumed = initial_state(DIAMOND, failed)
    resumed = apply(resumed, plan(resumed).starts)
    resumed = apply(resumed, [Succeeded("b", "B"), Succeeded("c", "C")])
    report = replay(DIAMOND, [first, failed, checkpoint_of(resumed)])
    assert report.resumes == () and report.timeline[-1].segment == 0
    # A first checkpoint that counts steps is not "nothing at all".
    counted = {"step_index": 1, "outputs": {}, "cost": TokenUsage().to_dict()}
    assert replay(DIAMOND, [counted]).timeline[0].repeat is False


def test_segments_are_counted_and_finished_at_is_the_first_record() -> None:
    cps = _diamond_run()
    closing = checkpoint_of(apply(initial_state(DIAMOND, cps[1]), [Cancelled()]))
    # After a cancelled run's closing save, a resume from checkpoint 0: c
    # runs, b is lost, then b is recorded again.
    state = initial_state(DIAMOND, cps[0])
    state = apply(state, [s for s in plan(state) if s.name == "c"])
    state = apply(state, [Succeeded("c", "C", _usage("c"))])
    without_b = checkpoint_of(state)
    state = apply(state, [s for s in plan(state) if s.name == "b"])
    state = apply(state, [Succeeded("b", "B", _usage("b"))])
    report = replay(DIAMOND, [cps[0], cps[1], closing, without_b, checkpoint_of(state)])
    assert report.finished_at("b") == 1
    assert [e.segment for e in report.timeline] == [0, 0, 0, 1, 1]
    assert report.timeline[3].resumed_from == 0
    assert "2 run segment(s)" in report.format()
    assert _kinds(report) == {(3, "b", "output_removed")}


# A resume may drop outputs that were outdated (a version tag bumped, the
# graph changed): legal, and said in the timeline. Anything else dropped or
# changed is still a violation.


def _flow(graph: GraphSpec, versions: dict[str, str], value: str = "v") -> Workflow:
    def make(name: str) -> Any:
        return lambda ctx: f"{name}:{value}"

    return Workflow([Step(n, make(n), graph.deps[n], version=versions.get(n)) for n in graph.names])


def _bumped_run() -> tuple[list[WorkflowCheckpoint], Workflow, int]:
    """A run of DIAMOND with b at version 1, then a resume with b at 2; and where that resume began."""
    saved: list[WorkflowCheckpoint] = []
    _flow(DIAMOND, {"b": "1"}).run_sync(checkpoint_fn=saved.append)
    first = len(saved)
    bumped = _flow(DIAMOND, {"b": "2"}, value="new")
    bumped.run_sync(checkpoint_fn=saved.append, resume_from=saved[-1])
    return saved, bumped, first


def test_a_resume_after_a_version_bump_is_legal_and_the_timeline_says_why() -> None:
    saved, bumped, at = _bumped_run()
    for sequence in (saved, _loaded(saved)):
        report = replay(bumped, sequence)
        assert report.ok, report.format()
        entry = report.timeline[at]  # the resumed run's first save
        assert entry.resumed and entry.resumed_from == at - 1 and entry.finished == ("b",)
        assert dict(entry.outdated) == {
            "b": "its version changed from '1' to '2'",
            "d": "it depends on 'b', which runs again",
        }
        assert [e.finished for e in report.timeline[at:]] == [("b",), ("d",)]
        assert "outdated: b (its version changed from '1' to '2')" in report.format()
        assert replay(None, sequence).ok


def test_outputs_dropped_or_changed_for_no_such_reason_are_still_violations() -> None:
    saved, bumped, at = _bumped_run()
    dropped = _loaded(saved)
    del dropped[at]["outputs"]["c"]  # c was not outdated
    dropped[at]["step_usage"].pop("c", None)
    assert (at, "c", "output_removed") in _kinds(replay(bumped, dropped))
    changed = _loaded(saved)
    changed[at]["outputs"]["a"] = "forged"
    assert _kinds(replay(bumped, changed)) == {(at, "a", "output_changed")}
    # Without a version change (nor a rewind: nothing counted redone), dropping d is a
    # loss and b's new output a change.
    same = _loaded(saved)
    same[at]["versions"] = same[at - 1]["versions"]
    same[at].pop("redone", None)
    kinds = _kinds(replay(bumped, same))
    assert {(at, "d", "output_removed"), (at, "b", "output_changed")} <= kinds


def test_a_resume_with_a_changed_graph_is_legal_and_says_how_the_graph_changed() -> None:
    old = GraphSpec.of({"fetch": [], "summary": ["fetch"], "email": ["summary"], "other": []})
    new = GraphSpec.of({"fetch": [], "style": [], "summary": ["fetch", "style"],
                        "email": ["summary"], "other": []})
    saved: list[WorkflowCheckpoint] = []
    _flow(old, {}).run_sync(checkpoint_fn=saved.append)
    at = len(saved)
    changed = _flow(new, {}, value="new")
    changed.run_sync(checkpoint_fn=saved.append, resume_from=saved[-1], allow_graph_change=True)
    for graph in (changed, None):
        report = replay(graph, _loaded(saved))
        assert report.ok, report.format()
        entry = report.timeline[at]
        assert entry.resumed and entry.finished == ("style",)
        assert entry.graph_changed == "added: 'style'; dependencies changed: 'summary'"
        assert set(entry.outdated) == {"summary", "email"}
    # Replayed against the old graph, the new checkpoints are from another one.
    kinds = _kinds(replay(old, saved))
    assert kinds == {(at, None, "fingerprint_mismatch")}
    # A record may not go back to an earlier graph once it is on this one.
    back = replay(changed, [*saved, saved[0]])
    assert [(v.index, v.kind) for v in back.violations if v.kind == "fingerprint_mismatch"] == [
        (len(saved), "fingerprint_mismatch")
    ]


@settings(max_examples=60, deadline=None)
@given(graph=dags(max_steps=8), data=st.data())
def test_any_version_bump_and_resume_replays_cleanly(graph: GraphSpec, data: st.DataObject) -> None:
    bumped = data.draw(st.sets(st.sampled_from(graph.names), min_size=1), label="bumped")
    saved: list[WorkflowCheckpoint] = []
    _flow(graph, {n: "1" for n in graph.names}).run_sync(checkpoint_fn=saved.append)
    first_run = len(saved)
    tags = {n: "2" if n in bumped else "1" for n in graph.names}
    _flow(graph, tags, value="new").run_sync(checkpoint_fn=saved.append, resume_from=saved[-1])
    report = replay(graph, _loaded(saved))
    assert report.ok, report.format()
    entry = report.timeline[first_run]
    assert entry.resumed and set(entry.outdated) == set(downstream(graph, bumped))
    again = [n for e in report.timeline[first_run:] for n in e.finished]
    assert sorted(again) == sorted(downstream(graph, bumped))
