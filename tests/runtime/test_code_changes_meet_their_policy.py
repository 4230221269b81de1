"""A resume knows when a step's code changed since its output was recorded (issue 45).

What users rely on: with ``on_code_change`` set, each checkpoint records the
fingerprint of the code that made each step's output; on resume a step whose
code changed runs again (``"again"``, as a ``version`` bump, with what is
downstream and a new attempt key), is kept (``"keep"``, and ``audit`` says so),
or the resume is refused before anything runs (``"refuse"``, naming the steps).
A workflow that asks for none records none and pays for none.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import WorkflowCheckpoint, audit
from ekit_core.code import CodeChangedError
from ekit_runtime import Step, Workflow, attempt_key

Calls = list[str]


def _steps(calls: Calls, critique: Callable[[Mapping[str, Any]], Any], **options: Any) -> list[Step]:
    def draft(ctx: Mapping[str, Any]) -> str:
        calls.append("draft")
        return "draft"

    def publish(ctx: Mapping[str, Any]) -> str:
        calls.append("publish")
        return f"published {ctx['critique']}"

    return [
        Step("draft", draft),
        Step("critique", critique, depends_on=("draft",), **options),
        Step("publish", publish, depends_on=("critique",)),
    ]


def _critique_v1(calls: Calls) -> Callable[[Mapping[str, Any]], Any]:
    def critique(ctx: Mapping[str, Any]) -> str:
        calls.append("critique")
        return "too long"
    return critique


def _critique_v2(calls: Calls) -> Callable[[Mapping[str, Any]], Any]:
    def critique(ctx: Mapping[str, Any]) -> str:
        calls.append("critique")
        return "too short"  # the edited prompt
    return critique


def _first_run(policy: str | None = "again") -> WorkflowCheckpoint:
    calls: Calls = []
    wf = Workflow(_steps(calls, _critique_v1(calls)), on_code_change=policy)  # type: ignore[arg-type]
    result = asyncio.run(wf.run())
    assert result.checkpoint is not None
    return result.checkpoint


def test_checkpoints_record_the_code_that_made_each_output() -> None:
    cp = _first_run()
    assert set(cp.code_fingerprints) == {"draft", "critique", "publish"}
    back = WorkflowCheckpoint.from_dict(json.loads(json.dumps(cp.to_dict())))
    assert back.code_fingerprints == cp.code_fingerprints


def test_a_workflow_that_asks_for_none_records_none() -> None:
    cp = _first_run(policy=None)
    assert cp.code_fingerprints == {}
    assert "code_fingerprints" not in cp.to_dict()


def test_changed_code_runs_again_with_what_is_downstream() -> None:
    cp = _first_run("again")
    calls: Calls = []
    wf = Workflow(_steps(calls, _critique_v2(calls)), on_code_change="again")
    result = asyncio.run(wf.run(resume_from=cp))
    assert calls == ["critique", "publish"]
    assert result.outputs["publish"] == "published too short"
    assert result.checkpoint is not None
    assert result.checkpoint.code_fingerprints["critique"] != cp.code_fingerprints["critique"]


def test_unchanged_code_runs_nothing_again() -> None:
    cp = _first_run("again")
    calls: Calls = []
    wf = Workflow(_steps(calls, _critique_v1(calls)), on_code_change="again")
    asyncio.run(wf.run(resume_from=cp))
    assert calls == []


def test_keep_keeps_the_output_and_audit_says_the_code_changed() -> None:
    cp = _first_run("keep")
    calls: Calls = []
    wf = Workflow(_steps(calls, _critique_v2(calls)), on_code_change="keep")
    report = audit(wf, cp)
    row = next(r for r in report.steps if r.name == "critique")
    assert row.action == "skip"
    assert "kept although the code changed" in row.why
    result = asyncio.run(wf.run(resume_from=cp))
    assert calls == []
    assert result.outputs["critique"] == "too long"
    assert result.checkpoint is not None  # still says which code made the kept output
    assert result.checkpoint.code_fingerprints["critique"] == cp.code_fingerprints["critique"]


def test_refuse_names_the_steps_before_anything_runs() -> None:
    cp = _first_run("refuse")
    calls: Calls = []
    wf = Workflow(_steps(calls, _critique_v2(calls)), on_code_change="refuse")
    with pytest.raises(CodeChangedError) as caught:
        asyncio.run(wf.run(resume_from=cp))
    assert caught.value.steps == ("critique",)
    assert isinstance(caught.value, ValueError)
    assert "'critique'" in str(caught.value)
    assert calls == []
    report = audit(wf, cp)
    assert any(a.kind == "code_changed" and "critique" in a.message for a in report.anomalies)


def test_a_step_policy_overrides_the_workflow_policy() -> None:
    cp = _first_run("again")
    calls: Calls = []
    wf = Workflow(_steps(calls, _critique_v2(calls), on_code_change="keep"), on_code_change="again")
    asyncio.run(wf.run(resume_from=cp))
    assert calls == []


def test_audit_shows_a_step_that_runs_again_because_its_code_changed() -> None:
    cp = _first_run("again")
    calls: Calls = []
    wf = Workflow(_steps(calls, _critique_v2(calls)), on_code_change="again")
    row = next(r for r in audit(wf, cp).steps if r.name == "critique")
    assert row.action == "run" and row.reason == "outdated"
    assert row.outdated is not None and "code changed since recorded" in row.outdated


def test_a_checkpoint_recorded_without_fingerprints_is_adopted_not_rerun() -> None:
    cp = _first_run(policy=None)
    calls: Calls = []
    wf = Workflow(_steps(calls, _critique_v2(calls)), on_code_change="refuse")
    result = asyncio.run(wf.run(resume_from=cp))
    assert calls == []
    assert result.checkpoint is not None and "critique" in result.checkpoint.code_fingerprints


def test_changed_code_never_resends_the_attempt_key_of_other_work() -> None:
    keys: dict[str, list[str]] = {"v1": [], "v2": []}

    def keyed(tag: str, answer: str) -> Callable[[Mapping[str, Any]], Any]:
        if tag == "v1":
            def critique(ctx: Mapping[str, Any]) -> str:
                keys["v1"].append(str(attempt_key()))
                return answer
        else:
            def critique(ctx: Mapping[str, Any]) -> str:
                keys["v2"].append(str(attempt_key()))
                return answer + "!"
        return critique

    calls: Calls = []
    first = asyncio.run(Workflow(_steps(calls, keyed("v1", "a")), on_code_change="again").run(run_id="r"))
    assert first.checkpoint is not None
    asyncio.run(Workflow(_steps(calls, keyed("v2", "a")), on_code_change="again").run(
        run_id="r", resume_from=first.checkpoint))
    assert keys["v1"] and keys["v2"]
    assert not set(keys["v1"]) & set(keys["v2"])


def test_bad_policies_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="on_code_change"):
        Workflow([Step("a", lambda ctx: 1)], on_code_change="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"step 'a'.*on_code_change"):
        Step("a", lambda ctx: 1, on_code_change="sometimes")


@st.composite
def _changes(draw: st.DrawFn) -> tuple[list[tuple[int, ...]], set[int], list[str]]:
    n = draw(st.integers(2, 6))
    deps = [tuple(sorted(draw(st.sets(st.integers(0, i - 1), max_size=2)))) if i else () for i in range(n)]
    changed = draw(st.sets(st.integers(0, n - 1)))
    policies = draw(st.lists(st.sampled_from(["again", "keep", "refuse"]), min_size=n, max_size=n))
    return deps, changed, policies


@settings(max_examples=60, deadline=None)
@given(_changes())
def test_a_resume_follows_each_changed_step_s_policy(case: tuple[list[tuple[int, ...]], set[int], list[str]]
                                                     ) -> None:
    deps, changed, policies = case
    calls: list[int] = []

    def make(i: int, tag: str) -> Callable[[Mapping[str, Any]], Any]:
        def step(ctx: Mapping[str, Any]) -> str:
            calls.append(i)
            return f"{i}:{tag}"
        return step

    def workflow(edited: set[int]) -> Workflow:
        return Workflow([Step(f"s{i}", make(i, "new" if i in edited else "old"),
                              depends_on=tuple(f"s{d}" for d in d_), on_code_change=policies[i])  # type: ignore[arg-type]
                         for i, d_ in enumerate(deps)])

    first = asyncio.run(workflow(set()).run())
    calls.clear()
    refused = sorted(i for i in changed if policies[i] == "refuse")
    if refused:
        with pytest.raises(CodeChangedError) as caught:
            asyncio.run(workflow(changed).run(resume_from=first.checkpoint))
        assert caught.value.steps == tuple(f"s{i}" for i in refused)
        assert calls == []
        return
    asyncio.run(workflow(changed).run(resume_from=first.checkpoint))
    again = {i for i in changed if policies[i] == "again"}
    for i, d_ in enumerate(deps):  # what is downstream of a step run again runs again
        if any(d in again for d in d_):
            again.add(i)
    assert sorted(calls) == sorted(again)


@pytest.mark.parametrize("edited", [False, True])
def test_an_attempt_cut_off_on_old_code_lends_its_key_only_to_the_same_code(edited: bool) -> None:
    keys: list[str] = []
    arrived: list[asyncio.Event] = []  # the event of the run in progress, set as its step begins

    def critique_for(tag: str) -> Callable[[Mapping[str, Any]], Any]:
        async def critique(ctx: Mapping[str, Any]) -> str:
            keys.append(str(attempt_key()))
            if arrived:
                arrived[-1].set()
            if tag == "old":
                await asyncio.Event().wait()  # cut off while in flight
            return tag
        return critique

    def workflow(tag: str) -> Workflow:
        return Workflow([Step("draft", lambda ctx: "d"),
                         Step("critique", critique_for(tag), depends_on=("draft",))],
                        on_code_change="again")

    async def cut_off(resume_from: Any = None) -> list[Any]:
        saved: list[Any] = []
        arrived.append(asyncio.Event())
        task = asyncio.ensure_future(workflow("old").run(run_id="r", checkpoint_fn=saved.append,
                                                         resume_from=resume_from))
        await arrived[-1].wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return saved

    saved = asyncio.run(cut_off())
    assert "draft" in saved[-1].outputs and "critique" not in saved[-1].outputs
    if edited:
        asyncio.run(workflow("new").run(run_id="r", resume_from=saved[-1]))
        assert keys[1] != keys[0]  # other code: another key
    else:
        asyncio.run(cut_off(saved[-1]))
        assert keys[1] == keys[0]  # the same code, the same work: the same key
