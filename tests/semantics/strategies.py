"""Workflows the differential test draws besides ``combined_workflows``: short item-wise
chains where a bump, a failure or a question meets conditions decided item by item, and
workflows whose steps change shape between code phases (``allow_graph_change``).

``combined_workflows`` reaches these shapes too, but seldom: a chain with a condition
below a mapped step that has not collected when its code changes took a full run of the
suite to meet (issue 42, commit 15bb4bc).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import strategies as st

from tests.support.strategies import (
    MAPPABLE,
    Features,
    OutputKind,
    PlannedStep,
    PlannedWorkflow,
    combined_workflows,
)


def _tags(draw: st.DrawFn, phases: int) -> tuple[str, ...]:
    tags = ["v0"]
    for _ in range(1, phases):
        tags.append(tags[-1] + "+" if draw(st.booleans()) else tags[-1])
    return tuple(tags)


@st.composite
def chained_workflows(draw: st.DrawFn, upstream_changes: bool = False) -> PlannedWorkflow:
    """``s0`` (a list, a mapping or keyed records), ``s1`` mapped over it, whose items
    fail or ask (about half of them: see ``tests.semantics.world``), ``s2`` chained to
    ``s1`` item-wise (on ``s0`` too, at times) under a condition, two or three code
    phases in which ``s1`` changes (and ``s0``, which then fails or asks at times, with
    ``upstream_changes``), and at times ``s3`` after them all."""
    phases = draw(st.integers(2, 3))
    kind: OutputKind = draw(st.sampled_from(["list", "dict", "keyed"]))
    s1_asks = draw(st.booleans())
    s1_fails = draw(st.integers(0 if s1_asks else 1, 2))
    bumped = tuple(["v0"] * draw(st.integers(1, phases - 1)))
    steps = [
        # With upstream_changes, s0 changes too (s1's items are then set aside) and does
        # not always finish at once (they then stay aside while s1 changes: issue 42,
        # item 9); without, s1 changes under items of s2 decided on its old ones.
        PlannedStep("s0", (), kind, asks=upstream_changes and draw(st.integers(0, 2)) == 0,
                    fails=draw(st.integers(0, 1)) if upstream_changes else 0, attempts=1,
                    versions=_tags(draw, phases) if upstream_changes else ("v0",) * phases),
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


@dataclass(frozen=True)
class ReshapedWorkflow(PlannedWorkflow):
    """A planned workflow whose steps change shape between code phases (run with
    ``allow_graph_change=True``): ``shaped[phase]`` is its steps in that phase."""

    shaped: tuple[tuple[PlannedStep, ...], ...] = ()


def steps_at(plan: PlannedWorkflow, phase: int) -> tuple[PlannedStep, ...]:
    """``plan``'s steps in code phase ``phase`` (their shapes then)."""
    return plan.shaped[phase] if isinstance(plan, ReshapedWorkflow) else plan.steps


def _reshaped(step: PlannedStep, by_name: dict[str, PlannedStep], how: str) -> PlannedStep:
    if how == "when":  # a condition added or taken away
        return replace(step, when=None if step.when else "some")
    if how == "join":  # a join over alternatives made strict, or the reverse
        return replace(step, join_any=not step.join_any)
    if step.map_over is not None:  # a mapped step made plain
        return replace(step, map_over=None, item_key=None)
    over = next(d for d in step.deps if by_name[d].kind in MAPPABLE and by_name[d].map_over is None)
    return replace(step, map_over=over, item_key="id" if by_name[over].kind == "keyed" else None)


@st.composite
def reshaped_workflows(draw: st.DrawFn) -> ReshapedWorkflow:
    """A combined workflow (two or three code phases) in which one step changes shape
    from one phase on: a condition added or taken away, a join made strict or the
    reverse, a plain step mapped over a dependency or a mapped step made plain."""
    plan = draw(combined_workflows())
    phases = max(plan.phases, 2)
    by_name = {s.name: s for s in plan.steps}
    shaped = [list(plan.steps) for _ in range(phases)]
    for _ in range(1):  # (one step: two reshaped ones could make a graph no run may have)
        i = draw(st.integers(0, len(plan.steps) - 1))
        step = shaped[-1][i]
        ways = ["when"] + (["join"] if len(step.deps) >= 2 and step.map_over is None else [])
        if step.map_over is not None and by_name[step.map_over].map_over is None and not any(
                s.map_over == step.name for s in plan.steps):
            ways.append("map")  # (no step chained to it: it would be chained to nothing)
        if step.map_over is None and not step.join_any and not any(
                s.map_over == step.name for s in plan.steps) and any(
                by_name[d].kind in MAPPABLE and by_name[d].map_over is None for d in step.deps):
            ways.append("map")
        new = _reshaped(step, by_name, draw(st.sampled_from(ways)))
        since = draw(st.integers(1, phases - 1))
        for phase in range(since, phases):
            shaped[phase][i] = new
    versions = [replace(s, versions=(s.versions * phases)[:phases]) for s in plan.steps]
    shaped = [[replace(s, versions=v.versions) for s, v in zip(row, versions, strict=True)]
              for row in shaped]
    return ReshapedWorkflow(tuple(versions), phases, plan.features,
                            tuple(tuple(row) for row in shaped))


# -- workflows inside workflows (issue 44) ----------------------------------------------------


@dataclass(frozen=True)
class ParentStep(PlannedStep):
    """A step that runs a child workflow (``child``, its steps by their own names) and hands
    on the output of its step ``output``; with ``map_over`` once per item, with ``repeat``
    as a loop's body."""

    child: tuple[PlannedStep, ...] = ()
    output: str = ""


def flat_steps(steps: tuple[PlannedStep, ...], prefix: str = "") -> dict[str, PlannedStep]:
    """Every step of a planned workflow, children's steps included, by its name in the run
    (``P/c0``)."""
    found: dict[str, PlannedStep] = {}
    for s in steps:
        if isinstance(s, ParentStep):
            found.update(flat_steps(s.child, f"{prefix}{s.name}/"))
        found[prefix + s.name] = s
    return found


def _renamed(plan: PlannedWorkflow, letter: str, phases: int) -> tuple[PlannedStep, ...]:
    """``plan``'s steps named ``c0``, ``c1``... (a letter per level, so that no name of a
    child hides one of its parent's inputs), with ``phases`` version tags."""
    names = {s.name: letter + s.name[1:] for s in plan.steps}
    return tuple(replace(
        s, name=names[s.name], deps=tuple(names[d] for d in s.deps),
        map_over=None if s.map_over is None else names[s.map_over],
        versions=(s.versions * phases)[:phases]) for s in plan.steps)


def _sink(steps: tuple[PlannedStep, ...]) -> str:
    needed = {d for s in steps for d in s.deps}
    return next(s.name for s in reversed(steps) if s.name not in needed)


def _parent(draw: st.DrawFn, step: PlannedStep, child: list[PlannedStep], phases: int) -> PlannedStep:
    """``step`` made a parent of ``child``: its output step, drawn among the child's plain
    steps, makes what ``step`` made (so what maps over ``step`` still can); ``step`` as it
    was when the child has none."""
    plain = [i for i, c in enumerate(child) if c.map_over is None and c.repeat is None
             and not isinstance(c, ParentStep) and c.name not in {x.map_over for x in child}]
    if not plain:
        return step
    out = draw(st.sampled_from(plain), label="child output")
    child[out] = replace(child[out], kind=step.kind)
    return ParentStep(step.name, step.deps, step.kind, versions=("v0",) * phases,
                      child=tuple(child), output=child[out].name)


def _plain(steps: list[PlannedStep]) -> list[int]:
    """The steps that may become parents: no map, loop or join (a condition is dropped)."""
    return [i for i, s in enumerate(steps) if s.map_over is None and s.repeat is None
            and not s.join_any]


@st.composite
def nested_workflows(draw: st.DrawFn, loops: bool = False) -> PlannedWorkflow:
    """A combined workflow in which a step or two run child workflows (themselves combined
    workflows of three steps, a child's child at times), each handing on its child's
    output step: any plain step of the child (``Child(output=...)``)."""
    plan = draw(combined_workflows(Features(loops=loops), max_steps=5))
    steps = list(plan.steps)
    for i in draw(st.lists(st.sampled_from(_plain(steps) or [-1]), min_size=1, max_size=2,
                           unique=True)):
        if i < 0:
            break
        child = list(_renamed(draw(combined_workflows(Features(loops=loops), max_steps=3)),
                              "c", plan.phases))
        if draw(st.booleans()) and _plain(child):  # a child's child
            j = draw(st.sampled_from(_plain(child)))
            grand = list(_renamed(draw(combined_workflows(Features(), max_steps=3)), "d",
                                  plan.phases))
            child[j] = _parent(draw, child[j], grand, plan.phases)
        steps[i] = _parent(draw, steps[i], child, plan.phases)
    return PlannedWorkflow(tuple(steps), plan.phases, plan.features)


@st.composite
def _plain_child(draw: st.DrawFn, phases: int) -> tuple[PlannedStep, ...]:
    """A child of one to three plain steps (a child per item's steps take no shape of their
    own): some ask, fail and retry, and change version between code phases."""
    steps: list[PlannedStep] = []
    for i in range(draw(st.integers(1, 3))):
        deps = tuple(draw(st.lists(st.sampled_from([s.name for s in steps]), max_size=2,
                                   unique=True))) if steps else ()
        fails, attempts = (draw(st.integers(1, 2)), draw(st.integers(1, 3))) \
            if draw(st.integers(0, 2)) == 0 else (0, 1)
        steps.append(PlannedStep(f"c{i}", deps, draw(st.sampled_from(["text", "typed"])),
                                 asks=draw(st.integers(0, 4)) == 0, fails=fails,
                                 attempts=attempts, versions=_tags(draw, phases)))
    return tuple(draw(st.permutations(steps)))


@st.composite
def per_item_workflows(draw: st.DrawFn, loops: bool = False) -> PlannedWorkflow:
    """A combined workflow in which a step runs a child per item of one of its inputs
    (``Step(child=..., map_over=...)``): the child's steps grow once per item."""
    plan = draw(combined_workflows(Features(loops=loops), max_steps=5))
    steps = list(plan.steps)
    by_name = {s.name: s for s in steps}
    mapped_over = {s.map_over for s in steps}
    can = [i for i in _plain(steps) if steps[i].name not in mapped_over and any(
        by_name[d].kind in MAPPABLE and by_name[d].map_over is None for d in steps[i].deps)]
    if not can:
        return plan
    s = steps[draw(st.sampled_from(can))]
    over = draw(st.sampled_from([d for d in s.deps if by_name[d].kind in MAPPABLE
                                 and by_name[d].map_over is None]))
    child = draw(_plain_child(plan.phases))
    steps[steps.index(s)] = ParentStep(
        s.name, s.deps, "list", over, "id" if by_name[over].kind == "keyed" else None,
        versions=("v0",) * plan.phases, child=child, output=_sink(child))
    return PlannedWorkflow(tuple(steps), plan.phases, plan.features)


# -- code that changes, and a cache shared by runs (issue 45) -----------------------------------


@dataclass(frozen=True)
class CodedWorkflow(PlannedWorkflow):
    """A planned workflow whose steps' code changes between code phases (``codes``: step ->
    its code in each phase, told apart by its fingerprint), run with ``on_code_change=policy``,
    and whose ``cached`` steps use a cache (``cache``: ``"memory"`` or ``"sqlite"``) that
    every run of the example shares, fresh runs included."""

    codes: tuple[tuple[str, tuple[str, ...]], ...] = ()
    policy: str | None = None
    cached: frozenset[str] = frozenset()
    cache: str = "memory"


@st.composite
def coded_workflows(draw: st.DrawFn) -> CodedWorkflow:
    """A combined workflow (loops too) whose steps' code changes between phases without a
    version bump, under a policy, with some steps cached (those that ask no person: an
    answer is read, and a new run asks again)."""
    plan = draw(combined_workflows(Features(loops=draw(st.booleans())), max_steps=5))
    phases = max(plan.phases, 2)
    steps = tuple(replace(s, versions=(s.versions * phases)[:phases]) for s in plan.steps)
    if draw(st.integers(0, 2)) == 0:  # plain steps only: hits are then found as a run starts
        steps = tuple(replace(s, map_over=None, item_key=None, when=None, join_any=False,
                              repeat=None, keep_last=None, until=False) for s in steps)
    cached = frozenset(s.name for s in steps if s.repeat is None and not s.asks
                       and draw(st.booleans()))
    policy = draw(st.sampled_from([None, "again", "again", "keep", "keep", "refuse"]))
    # (with no policy only cached steps are fingerprinted: a change in another's code is
    # invisible, as the docs warn, and not drawn)
    codes = tuple((s.name, _tags(draw, phases) if policy or s.name in cached
                   else ("v0",) * phases) for s in steps)
    return CodedWorkflow(steps, phases, plan.features, codes, policy, cached,
                         draw(st.sampled_from(["memory", "sqlite"])))


@st.composite
def _body(draw: st.DrawFn, phases: int) -> tuple[PlannedStep, ...]:
    """A loop's body (decision 021): a model step (``c0``), at times tools mapped over what
    it asked for (``c1``), then a step that folds them in (``c2``), the body's one sink; no
    condition, join, loop or chained map inside (refused by name)."""
    def faults() -> dict[str, object]:
        fails = draw(st.integers(1, 2)) if draw(st.integers(0, 3)) == 0 else 0
        return {"asks": draw(st.integers(0, 5)) == 0, "fails": fails,
                "attempts": draw(st.integers(1, 3)) if fails else 1,
                "versions": _tags(draw, phases)}

    size = draw(st.integers(1, 3))
    if size == 1:
        return (PlannedStep("c0", (), draw(st.sampled_from(["text", "typed"])), **faults()),)  # type: ignore[arg-type]
    kind: OutputKind = draw(st.sampled_from(["list", "dict", "keyed"])) if size == 3 else "text"
    steps = [PlannedStep("c0", (), kind, **faults())]  # type: ignore[arg-type]
    if size == 2:
        return (*steps, PlannedStep("c1", ("c0",), "text", **faults()))  # type: ignore[arg-type]
    steps.append(PlannedStep("c1", ("c0",), draw(st.sampled_from(["text", "typed"])), "c0",
                             "id" if kind == "keyed" else None, **faults()))  # type: ignore[arg-type]
    steps.append(PlannedStep("c2", draw(st.sampled_from([("c1",), ("c1", "c0")])), "text",
                             **faults()))  # type: ignore[arg-type]
    return tuple(draw(st.permutations(steps)))


@st.composite
def body_workflows(draw: st.DrawFn) -> PlannedWorkflow:
    """A combined workflow (loops too) in which a step is a loop whose body is a child
    workflow (``Step(child=body, repeat=Repeat(...))``): iterations ``L/s#k``, maps inside
    them ``L/m#k[key]``, ``keep_last``, ``until`` or ``Done``."""
    plan = draw(combined_workflows(Features(loops=True), max_steps=5))
    steps = list(plan.steps)
    mapped_over = {s.map_over for s in steps}
    can = [i for i in _plain(steps) if steps[i].name not in mapped_over]
    if not can:
        return plan
    i = draw(st.sampled_from(can))
    body = draw(_body(plan.phases))
    s = steps[i]
    steps[i] = ParentStep(
        s.name, s.deps, "text", versions=("v0",) * plan.phases,
        repeat=draw(st.integers(1, 4), label="max_iterations"),
        keep_last=draw(st.none() | st.integers(1, 2), label="keep_last"),
        until=draw(st.booleans(), label="until"), child=body, output=_sink(body))
    return PlannedWorkflow(tuple(steps), plan.phases, plan.features)


# -- loops whose body is a workflow, their rare meetings drawn together -----------------------


@st.composite
def _dense_body(draw: st.DrawFn, phases: int) -> tuple[PlannedStep, ...]:
    """A body as ``_body`` draws it, but mostly with its map (``c1`` over ``c0``), and its
    steps failing, retrying, asking and changing version far more often: a body map's
    failed and retried items, its questions and its bumps are what body defects need."""
    def faults() -> dict[str, object]:
        fails = draw(st.integers(0, 2))
        return {"asks": draw(st.integers(0, 2)) == 0, "fails": fails,
                "attempts": draw(st.integers(1, 3)) if fails else 1,
                "versions": _tags(draw, phases)}

    if draw(st.integers(0, 3)) == 0:
        return (PlannedStep("c0", (), draw(st.sampled_from(["text", "typed"])), **faults()),)  # type: ignore[arg-type]
    kind: OutputKind = draw(st.sampled_from(["list", "dict", "keyed"]))
    return tuple(draw(st.permutations([
        PlannedStep("c0", (), kind, **faults()),  # type: ignore[arg-type]
        PlannedStep("c1", ("c0",), draw(st.sampled_from(["text", "typed"])), "c0",
                    "id" if kind == "keyed" else None, **faults()),  # type: ignore[arg-type]
        PlannedStep("c2", draw(st.sampled_from([("c1",), ("c1", "c0")])), "text",
                    **faults())])))  # type: ignore[arg-type]


@st.composite
def body_loop_workflows(draw: st.DrawFn) -> PlannedWorkflow:
    """A small workflow around one loop ``L`` whose body is a workflow, drawing together
    what ``body_workflows`` meets only by chance: a condition above the loop (on ``s0``, or
    on ``s1`` below a bumped ``s0``: a body loop skipped whole), two or three code phases
    (bumps above the loop and in its body), ``keep_last`` most of the time (compacted
    iterations and items), a body map's failed, retried and asking items
    (``_dense_body``), and at times a step after it (``s2``) that asks."""
    phases = draw(st.integers(2, 3))
    body = draw(_dense_body(phases))
    gate = draw(st.booleans())  # (a condition of its own between s0 and the loop)
    when = st.sampled_from([None, "some", "some", "raises"])
    steps: list[PlannedStep] = [
        PlannedStep("s0", (), draw(st.sampled_from(["text", "list"])),
                    when=None if gate else draw(when), asks=draw(st.integers(0, 3)) == 0,
                    versions=_tags(draw, phases))]
    if gate:
        steps.append(PlannedStep("s1", ("s0",), "text", when=draw(when),
                                 versions=_tags(draw, phases)))
    steps.append(ParentStep(
        "L", (steps[-1].name,), "text", versions=("v0",) * phases,
        repeat=draw(st.sampled_from([1, 2, 3, 3, 4, 4]), label="max_iterations"),
        keep_last=draw(st.sampled_from([None, 1, 1, 2]), label="keep_last"),
        until=draw(st.booleans(), label="until"), child=body, output=_sink(body)))
    if draw(st.integers(0, 2)):
        steps.append(PlannedStep("s2", ("L",), "text", asks=draw(st.booleans()),
                                 versions=_tags(draw, phases)))
    return PlannedWorkflow(tuple(draw(st.permutations(steps))), phases, Features(loops=True))
