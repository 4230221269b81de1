"""Child workflows where they meet the other features (issue 44's hostile review).

Each test pins what a user relies on at one meeting point: a child step's code
fingerprint follows its helpers (so a resume or a cache never takes old output
for new code), rewinding the step whose child it is runs its child again, and
the rest of the run's options (versions, answers, conditions, retries,
timeouts, ``only=``, ``isolate_failures``, hostile names) treat a child's step
as any step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

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
    # the same as the step run alone
    alone = _child_with_helper("!").code_fingerprints()["fetch"]
    assert alone != _child_with_helper("?").code_fingerprints()["fetch"]
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
