"""No declared step is named like an item of another: item names stay unambiguous.

Items are named ``step[key]``; a graph with run-time shapes that declares a
step ``P[...]`` beside a step ``P`` is refused when it is built, with a
``ValueError`` naming both, whatever ``P``'s shape (mapped, conditional, a
join, or none), so no rule that tells items by their name can mistake a
declared step for one (a conditional ``a`` beside ``a[x]`` once made a
resume refuse the run's own checkpoint). Graphs without shapes have no
items and keep every name they accepted.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ekit_core import GraphError, GraphSpec
from ekit_core.shapes import Shape
from ekit_runtime import Step, Workflow


def _no(ctx: Any) -> bool:
    return False


@pytest.mark.parametrize("shape", [
    Shape(when="cond"), Shape(map_over="u"), Shape(join="any"), None,
], ids=["conditional", "mapped", "join", "plain-beside-shapes"])
def test_a_step_named_like_an_item_of_another_is_refused_naming_both(shape: Shape | None) -> None:
    shapes = {"a": shape} if shape is not None else {"z": Shape(when="cond")}
    deps = {"u": (), "v": (), "a": ("u", "v"), "z": (), "a[x]": ("a",)}
    with pytest.raises(GraphError, match=r"'a\[x\]'.*'a'") as caught:
        GraphSpec.of(deps, shapes)
    assert set(caught.value.steps) >= {"a", "a[x]"}


def test_item_chains_and_declaration_order_do_not_matter() -> None:
    deps = {"n[0]": (), "u": (), "m": ("u",), "n": ("m",)}
    with pytest.raises(GraphError, match=r"'n\[0\]'.*'n'"):
        GraphSpec.of(deps, {"m": Shape(map_over="u"), "n": Shape(map_over="m")})


def test_the_workflow_that_once_refused_its_own_checkpoint_is_refused_when_built() -> None:
    with pytest.raises(ValueError, match=r"'a\[x\]'.*'a'"):
        Workflow([Step("a", lambda ctx: 1, when=_no), Step("a[x]", lambda ctx: 2, ("a",))])


def test_a_graph_without_shapes_keeps_such_names() -> None:
    graph = GraphSpec.of({"a": (), "a[x]": ("a",)})
    assert graph.names == ("a", "a[x]")


def test_names_that_only_look_alike_are_accepted() -> None:
    GraphSpec.of({"a": (), "ab[x]": ("a",), "[x]": (), "a]": ()}, {"a": Shape(when="cond")})


@given(st.lists(st.text(alphabet="ab[]", min_size=1, max_size=4), min_size=1, max_size=6, unique=True))
def test_with_shapes_no_declared_name_is_another_followed_by_a_bracket(names: list[str]) -> None:
    clash = any(n != p and n.startswith(p + "[") for n in names for p in names)
    deps = {n: () for n in names}
    try:
        GraphSpec.of(deps, {names[0]: Shape(when="cond")})
    except GraphError:
        assert clash
    else:
        assert not clash


def test_a_rewind_keeps_the_questions_of_a_step_merely_named_like_an_item() -> None:
    # A graph without shapes may name a step "a[x]": it is no item of "a", so
    # rewinding "a" leaves its question alone.
    from ekit_core import rewind
    from ekit_runtime import RunWaiting, ask

    workflow = Workflow([Step("a", lambda ctx: 1), Step("a[x]", lambda ctx: ask("name?"))])
    with pytest.raises(RunWaiting) as waiting:
        workflow.run_sync()
    checkpoint = waiting.value.checkpoint
    assert set(rewind(workflow, checkpoint, "a").asked) == {"a[x]"}
