"""Workflows the differential test draws besides ``combined_workflows``: short item-wise
chains where a bump, a failure or a question meets conditions decided item by item.

``combined_workflows`` reaches these shapes too, but seldom: a chain with a condition
below a mapped step that has not collected when its code changes took a full run of the
suite to meet (issue 42, commit 15bb4bc).
"""

from __future__ import annotations

from hypothesis import strategies as st

try:  # (the helpers move to tests/support/)
    from tests.support.strategies import Features, PlannedStep, PlannedWorkflow
except ImportError:  # pragma: no cover
    from tests.strategies import Features, PlannedStep, PlannedWorkflow  # type: ignore[no-redef]


def _tags(draw: st.DrawFn, phases: int) -> tuple[str, ...]:
    tags = ["v0"]
    for _ in range(1, phases):
        tags.append(tags[-1] + "+" if draw(st.booleans()) else tags[-1])
    return tuple(tags)


@st.composite
def chained_workflows(draw: st.DrawFn) -> PlannedWorkflow:
    """``s0`` (a list, a mapping or keyed records), ``s1`` mapped over it, ``s2`` chained
    to ``s1`` item-wise (on ``s0`` too, at times), each item failing, asking or
    conditioned at random, with up to three code phases; and at times ``s3`` after them."""
    phases = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["list", "dict", "keyed"]))
    steps = [PlannedStep("s0", (), kind, asks=draw(st.integers(0, 3)) == 0,
                         versions=_tags(draw, phases))]
    for name, over, deps in (("s1", "s0", ("s0",)),
                             ("s2", "s1", draw(st.sampled_from([("s1",), ("s0", "s1")])))):
        fails = draw(st.integers(0, 2))
        steps.append(PlannedStep(
            name, deps, draw(st.sampled_from(["text", "typed"])), map_over=over,
            item_key="id" if kind == "keyed" and over == "s0" else None,
            when=draw(st.sampled_from([None, "some", "raises"])),
            asks=draw(st.integers(0, 3)) == 0, fails=fails,
            attempts=draw(st.integers(1, 2)) if fails else 1, versions=_tags(draw, phases)))
    if draw(st.booleans()):
        steps.append(PlannedStep("s3", ("s1", "s2"), "text", join_any=draw(st.booleans()),
                                 versions=_tags(draw, phases)))
    order = draw(st.permutations(steps))
    return PlannedWorkflow(tuple(order), phases, Features())
