"""What a step receives in the default mode: a copy-on-write ``StepContext``.

It must behave like the fresh ``dict`` ExecutionKit gave each step (initial
context plus the outputs finished before the step started), cost O(1) to
build, and keep every write private to the step that made it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from ekit_core.ledger import Ledger
from ekit_runtime import Step, Workflow, WorkflowCheckpoint
from ekit_runtime.context import StepContext
from tests.support.helpers import Gates, until

keys = st.sampled_from(["a", "b", "c", "d", "e", "topic"])
ops = st.lists(
    st.tuples(st.sampled_from(["set", "del", "get"]), keys, st.integers()), max_size=30
)


@given(
    st.dictionaries(keys, st.integers(), max_size=4),
    st.dictionaries(keys, st.integers(), max_size=4),
    ops,
)
def test_behaves_like_a_dict_of_context_and_outputs(
    base: dict[str, int], outputs: dict[str, int], operations: list[tuple[str, str, int]]
) -> None:
    ledger: Ledger[str, Any] = Ledger(outputs.items())
    context = StepContext(base, ledger)
    model = {**base, **outputs}
    for op, key, value in operations:
        if op == "set":
            context[key] = value
            model[key] = value
        elif op == "del":
            if key in model:
                del context[key]
                del model[key]
            else:
                try:
                    del context[key]
                except KeyError:
                    pass
                else:
                    raise AssertionError("deleting a missing key must raise KeyError")
        assert (key in context) == (key in model)
        assert context.get(key, "none") == model.get(key, "none")
    assert dict(context) == model and len(context) == len(model)
    assert sorted(context) == sorted(model)
    assert {**context} == model and context.copy() == model and type(context.copy()) is dict
    assert context | {"z": 1} == model | {"z": 1} and {"z": 1} | context == {"z": 1} | model
    assert dict(ledger) == outputs and base == dict(base)  # the sources never change


def test_missing_keys_raise_key_error_and_repr_is_bounded() -> None:
    context = StepContext({}, Ledger((f"k{i}", i) for i in range(100)))
    try:
        context["nope"]
    except KeyError as error:
        assert error.args == ("nope",)
    else:
        raise AssertionError("expected KeyError")
    assert len(repr(context)) < 200 and repr(context).endswith("...})")
    assert json.dumps(context.copy())  # what to hand to code that insists on a dict


def test_a_step_sees_outputs_finished_before_it_started_and_writes_stay_its_own() -> None:
    gates = Gates()
    seen: dict[str, dict[str, Any]] = {}

    async def writer(context: Any) -> str:
        context["scratch"] = "mine"
        del context["topic"]
        seen["writer"] = dict(context)
        return "w"

    async def reader(context: Mapping[str, Any]) -> str:
        seen["reader"] = dict(context)
        return "r"

    saved: list[WorkflowCheckpoint] = []
    wf = Workflow([
        Step("first", gates.step("first")),
        Step("writer", writer, ("first",)),
        Step("slow", gates.step("slow")),
        Step("reader", reader, ("writer",)),
    ])

    async def main() -> None:
        run = asyncio.create_task(wf.run({"topic": "owls"}, checkpoint_fn=saved.append))
        await until(lambda: len(gates.started) == 2)
        gates.release("first")
        await until(lambda: "reader" in seen)
        gates.release("slow")
        await run

    asyncio.run(main())
    assert seen["writer"] == {"first": "<first>", "scratch": "mine"}
    # The reader started after writer finished; it sees neither of writer's edits.
    assert seen["reader"] == {"topic": "owls", "first": "<first>", "writer": "w"}
    assert gates.contexts["slow"] == {"topic": "owls"}  # started before anything finished
    assert dict(saved[-1].context) == {"topic": "owls"}
    assert "scratch" not in saved[-1].outputs


def test_dependencies_mode_still_gets_a_plain_dict() -> None:
    kinds: list[type] = []
    wf = Workflow([
        Step("a", lambda context: kinds.append(type(context)) or 1),
        Step("b", lambda context: kinds.append(type(context)) or 2, ("a",), context="dependencies"),
    ])
    wf.run_sync()
    assert kinds == [StepContext, dict]
