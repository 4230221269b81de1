"""Child workflows where they meet the other features (issue 44's hostile review).

Each test pins what a user relies on at one meeting point: a child step's code
fingerprint follows its helpers (so a resume or a cache never takes old output
for new code); rewinding the step whose child it is runs its child again; a
child's codec keeps storing its typed outputs under a parent; a built
workflow's steps build it again (``Workflow([*w.steps, ...])``, as
docs/cache.md extends one); cancelling mid-child leaves no task behind; and
versions, answers and ``isolate_failures`` treat a child's step as any step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from ekit_core import WorkflowCheckpoint, rewind
from ekit_runtime import Child, Codec, Step, Workflow


def _json(cp: WorkflowCheckpoint) -> dict[str, Any]:
    return json.loads(json.dumps(cp.to_dict()))


def _child_with_helper(suffix: str) -> Workflow:
    """A child whose step calls a helper of its own module (the step's prompt), as
    test_code_fingerprints_follow_the_code does: ``suffix`` is the helper's edit."""
    source = (f"def helper(x):\n    return x + {suffix!r}\n"
              "def fetch(ctx):\n    return helper(ctx['topic'])\n")
    namespace: dict[str, Any] = {"__name__": "steps"}
    exec(compile(source, "<steps>", "exec"), namespace)
    return Workflow([Step("fetch", namespace["fetch"])], on_code_change="again")


def test_editing_a_child_steps_helper_changes_its_fingerprint_and_a_resume_runs_it() -> None:
    def parent(suffix: str) -> Workflow:
        return Workflow([Step("topic", lambda ctx: "cats"),
                         Step("P", depends_on=("topic",), child=_child_with_helper(suffix))])

    before, after = parent("!"), parent("?")
    assert before.code_fingerprints()["P/fetch"] != after.code_fingerprints()["P/fetch"], \
        "a child step's helper is not part of its code"
    # the same as the step's run alone, whatever else its child holds
    alone = _child_with_helper("!")
    assert before.code_fingerprints()["P/fetch"] == alone.code_fingerprints()["fetch"]
    grown = Workflow([*alone.steps, Step("more", lambda ctx: 0, ("fetch",))], on_code_change="again")
    assert Workflow([Step("P", child=grown)]).code_fingerprints()["P/fetch"] == \
        before.code_fingerprints()["P/fetch"], "adding a step to a child changed its other steps' code"
    recorded = before.run_sync().checkpoint
    assert recorded is not None
    assert after.run_sync(resume_from=_json(recorded)).outputs["P"] == "cats?"


def test_rewinding_the_step_whose_child_it_is_runs_its_child_again() -> None:
    calls: list[str] = []
    child = Workflow([Step("a", lambda ctx: calls.append("a") or len(calls)),
                      Step("b", lambda ctx: calls.append("b") or ctx["a"], ("a",))])
    workflow = Workflow([Step("topic", lambda ctx: calls.append("topic") or "cats"),
                         Step("P", depends_on=("topic",), child=child),
                         Step("after", lambda ctx: calls.append("after") or ctx["P"], ("P",))])
    first = workflow.run_sync().checkpoint
    assert first is not None
    calls.clear()
    again = rewind(workflow, first, "P")
    assert not any(n.startswith("P/") for n in again.outputs), "the child's outputs were kept"
    result = workflow.run_sync(resume_from=_json(again))
    assert calls == ["a", "b", "after"]
    assert result.outputs["after"] == 1
    # a rewind of one of its steps still lets go of that step and what follows only
    calls.clear()
    workflow.run_sync(resume_from=_json(rewind(workflow, first, "P/b")))
    assert calls == ["b", "after"]


@dataclass(frozen=True)
class Note:
    text: str


def test_a_childs_codec_stores_its_typed_outputs_under_a_parent_without_one() -> None:
    # The child registers Note by hand (its step is not annotated): run alone, its
    # checkpoints hold a Note as a tagged object, and a resume gives a Note back.
    # Nested, the parent's checkpoints must do as much, or they hold what no store can.
    child = Workflow([Step("write", lambda ctx: Note(f"on {ctx['topic']}")),
                      Step("read", lambda ctx: ctx["write"].text, ("write",))], codec=Codec(Note))
    for parent_codec in (None, Codec()):
        workflow = Workflow([Step("topic", lambda ctx: "cats"),
                             Step("P", depends_on=("topic",), child=child)], codec=parent_codec)
        saved: list[WorkflowCheckpoint] = []
        assert workflow.run_sync(checkpoint_fn=saved.append).outputs["P"] == "on cats"
        at = next(cp for cp in saved if "P/write" in cp.outputs and "P/read" not in cp.outputs)
        assert workflow.run_sync(resume_from=_json(at)).outputs["P"] == "on cats"


def test_a_built_workflows_steps_build_the_same_workflow_again() -> None:
    # docs/cache.md extends a workflow so: Workflow([*essay().steps, Step(...)])
    def is_long(ctx: Any) -> bool:
        return len(ctx["fetch"]) > 3

    child = Workflow([Step("fetch", lambda ctx: ctx["topic"] * 2),
                      Step("long", lambda ctx: "long", ("fetch",), when=is_long),
                      Step("done", lambda ctx: ctx.get("long", "short"), ("long",))])
    built = Workflow([Step("topic", lambda ctx: "cats"),
                      Step("P", depends_on=("topic",), child=Child(child, "done"))])
    again = Workflow([*built.steps])
    assert again.graph.fingerprint == built.graph.fingerprint
    assert again.graph.shapes == built.graph.shapes
    recorded = built.run_sync().checkpoint
    assert recorded is not None
    more = Workflow([*built.steps, Step("after", lambda ctx: ctx["P"] + "!", ("P",))])
    assert more.run_sync(resume_from=_json(recorded), allow_graph_change=True).outputs["after"] == "long!"


def test_cancelling_a_run_mid_child_cancels_every_step_in_flight_and_leaves_no_task() -> None:
    import asyncio
    import contextlib

    in_flight: list[str] = []
    cancelled: list[str] = []
    both = asyncio.Event()

    def held(name: str) -> Any:
        async def run(ctx: Any) -> Any:
            in_flight.append(name)
            if len(in_flight) == 3:
                both.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(name)
                raise
        return run

    inner = Workflow([Step("deep", held("deep"))])
    child = Workflow([Step("a", held("a")), Step("c", child=inner),
                      Step("o", lambda ctx: 0, ("a", "c"))])
    workflow = Workflow([Step("P", child=child), Step("Q", held("Q"))])

    async def main() -> set[asyncio.Task[Any]]:
        before = asyncio.all_tasks()
        run = asyncio.ensure_future(workflow.run())
        await both.wait()
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run
        return asyncio.all_tasks() - before - {run}

    assert asyncio.run(main()) == set(), "a task of the run outlived it"
    assert sorted(cancelled) == sorted(in_flight) == ["Q", "a", "deep"]


def test_versions_answers_and_isolated_failures_treat_a_childs_step_as_any_step() -> None:
    from ekit_runtime import RunWaiting, ask

    calls: list[str] = []

    def build(child_version: str | None = None, input_version: str | None = None,
              fail: bool = False) -> Workflow:
        def b(ctx: Any) -> str:
            calls.append("b")
            if fail:
                raise RuntimeError("down")
            return f"{ctx['a']}+{ask('how?')}"

        child = Workflow([Step("a", lambda ctx: calls.append("a") or ctx["topic"]),
                          Step("b", b, ("a",), version=child_version),
                          Step("side", lambda ctx: calls.append("side") or 1, ("a",)),
                          Step("o", lambda ctx: ctx["b"], ("b", "side"))])
        return Workflow([Step("topic", lambda ctx: calls.append("topic") or "cats",
                              version=input_version),
                         Step("P", depends_on=("topic",), child=child),
                         Step("Q", lambda ctx: calls.append("Q") or ctx["P"], ("P",)),
                         Step("other", lambda ctx: calls.append("other") or 0, ("topic",))])

    with pytest.raises(RunWaiting) as waiting:
        build().run_sync()
    assert list(waiting.value.questions) == ["P/b"]
    asked = _json(waiting.value.checkpoint)
    done = build().run_sync(resume_from=asked, answers={"P/b": "well"})
    assert done.outputs["Q"] == "cats+well" and done.checkpoint is not None
    recorded = _json(done.checkpoint)
    calls.clear()  # a bumped child step runs again with what follows it, and asks again
    with pytest.raises(RunWaiting):
        build(child_version="2").run_sync(resume_from=recorded)
    assert calls == ["b"]
    calls.clear()  # a bumped input of the parent runs its whole child again
    with pytest.raises(RunWaiting):
        build(input_version="2").run_sync(resume_from=recorded)
    assert sorted(calls) == ["a", "b", "other", "side", "topic"]
    calls.clear()  # a failing child step: its siblings and the rest of the run go on
    failed = build(fail=True).run_sync(isolate_failures=True)
    assert list(failed.failed) == ["P/b"] and failed.not_started == ("P/o", "P", "Q")
    assert sorted(calls) == ["a", "b", "other", "side", "topic"]


@pytest.mark.parametrize("option", [{"context": "dependencies"}, {"inline": True}])
def test_an_option_a_step_with_a_child_would_drop_is_refused_naming_it(option: dict[str, Any]) -> None:
    # (give it to the child's steps: the parent step's work is its child's)
    child = Workflow([Step("s", lambda ctx: 0)])
    with pytest.raises(ValueError, match=f"step 'P': a step with a child workflow cannot take "
                                         f"{next(iter(option))}"):
        Step("P", child=child, **option)


class _Counting(dict[str, Any]):
    """A context that counts the lookups made of it."""

    looked = 0

    def __contains__(self, key: object) -> bool:
        _Counting.looked += 1
        return super().__contains__(key)


def test_a_deeply_nested_childs_step_reads_its_context_in_lookups_linear_in_its_depth() -> None:
    from ekit_runtime.children import ChildContext

    depth = 20
    base = _Counting({"topic": "cats", "c0/c1/x": "deep x", "c0/y": "y of c0"})
    view: Any = base
    for i in range(depth):  # (as a step of a child's child ... is handed its context)
        view = ChildContext(view, f"c{i}/")
    _Counting.looked = 0
    assert view["topic"] == "cats"
    assert "topic" in view and "nothing" not in view
    assert _Counting.looked <= 3 * (depth + 1), f"{_Counting.looked} lookups for depth {depth}"
    two = ChildContext(ChildContext(base, "c0/"), "c1/")  # the child's own first, then outward
    assert (two["x"], two["y"], two["topic"]) == ("deep x", "y of c0", "cats")
    assert sorted(two) == ["topic", "x", "y"]
    two["z"] = 1
    assert base["c0/c1/z"] == 1 and two["z"] == 1 and len(two) == 4
    del two["z"]
    assert "c0/c1/z" not in base


def test_an_output_left_by_a_childs_removed_step_does_not_shadow_the_childs_input() -> None:
    # v1's child had a step "x"; v2's has none, and reads its input "x" (the parent's
    # dependency). The old "P/x" a graph-changing resume keeps is no step of v2's child.
    def build(child: Workflow) -> Workflow:
        return Workflow([Step("x", lambda ctx: "the parent's x"),
                         Step("P", depends_on=("x",), child=child)])

    v1 = build(Workflow([Step("x", lambda ctx: "v1's own x"), Step("o", lambda ctx: ctx["x"], ("x",))]))
    recorded = v1.run_sync().checkpoint
    assert recorded is not None and recorded.outputs["P"] == "v1's own x"
    v2 = build(Workflow([Step("o", lambda ctx: f"v2 reads {ctx['x']}", context="dependencies")]))
    result = v2.run_sync(resume_from=_json(recorded), allow_graph_change=True)
    assert result.outputs["P"] == "v2 reads the parent's x"
