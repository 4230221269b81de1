"""Workflows the differential test draws besides ``combined_workflows``: short item-wise
chains where a bump, a failure or a question meets conditions decided item by item.

``combined_workflows`` reaches these shapes too, but seldom: a chain with a condition
below a mapped step that has not collected when its code changes took a full run of the
suite to meet (issue 42, commit 15bb4bc).
"""

from __future__ import annotations

from hypothesis import strategies as st

from tests.support.strategies import Features, PlannedStep, PlannedWorkflow


def _tags(draw: st.DrawFn, phases: int) -> tuple[str, ...]:
    tags = ["v0"]
    for _ in range(1, phases):
        tags.append(tags[-1] + "+" if draw(st.booleans()) else tags[-1])
    return tuple(tags)


@st.composite
def chained_workflows(draw: st.DrawFn) -> PlannedWorkflow:
    """``s0`` (a list, a mapping or keyed records), ``s1`` mapped over it, whose items
    fail or ask (about half of them: see ``tests.semantics.world``), ``s2`` chained to
    ``s1`` item-wise (on ``s0`` too, at times) under a condition, two or three code
    phases in which ``s1`` changes, and at times ``s3`` after them all."""
    phases = draw(st.integers(2, 3))
    kind = draw(st.sampled_from(["list", "dict", "keyed"]))
    s1_asks = draw(st.booleans())
    s1_fails = draw(st.integers(0 if s1_asks else 1, 2))
    bumped = tuple(["v0"] * draw(st.integers(1, phases - 1)))
    steps = [
        PlannedStep("s0", (), kind, versions=("v0",) * phases),
        PlannedStep("s1", ("s0",), draw(st.sampled_from(["text", "typed"])), map_over="s0",
                    item_key="id" if kind == "keyed" else None, asks=s1_asks, fails=s1_fails,
                    attempts=1,
                    versions=bumped + ("v1",) * (phases - len(bumped))),
        PlannedStep("s2", draw(st.sampled_from([("s1",), ("s0", "s1")])), "text", map_over="s1",
                    when=draw(st.sampled_from(["some", "raises"])),
                    fails=draw(st.integers(0, 1)), versions=_tags(draw, phases)),
    ]
    if draw(st.booleans()):
        steps.append(PlannedStep("s3", ("s1", "s2"), "text", join_any=draw(st.booleans()),
                                 versions=_tags(draw, phases)))
    order = draw(st.permutations(steps))
    return PlannedWorkflow(tuple(order), phases, Features())
