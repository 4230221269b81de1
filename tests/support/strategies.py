"""Hypothesis strategies shared by the property tests: random DAGs, and random workflows
that combine every feature for the runtime (plain data: the tests build the callables)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hypothesis import strategies as st

from ekit_core import GraphSpec


@st.composite
def dags(draw: st.DrawFn, min_steps: int = 1, max_steps: int = 12) -> GraphSpec:
    """A random DAG: each step depends on a random subset of earlier steps.

    Declaration order is shuffled so that it is not always a topological order.
    """
    n = draw(st.integers(min_steps, max_steps))
    names = [f"s{i}" for i in range(n)]
    deps: dict[str, list[str]] = {}
    for i, name in enumerate(names):
        deps[name] = draw(st.lists(st.sampled_from(names[:i]), unique=True, max_size=3)) if i else []
    order = draw(st.permutations(names))
    return GraphSpec.of([(name, deps[name]) for name in order])


@st.composite
def shaped_dags(draw: st.DrawFn, min_steps: int = 2, max_steps: int = 7,
                loops: bool = True) -> GraphSpec:
    """A random DAG with run-time shapes: steps that map over a dependency (item-wise
    chains too), conditional steps (mapped ones too: per-item conditions), and joins
    over alternatives (``join="any"``); with ``loops``, loops too (``repeat``, some
    keeping their last iterations only). Every condition is named ``cond``."""
    from ekit_core.shapes import Shape

    size = draw(st.integers(min_steps, max_steps), label="steps")
    deps: dict[str, tuple[str, ...]] = {}
    shapes: dict[str, Shape] = {}
    for i in range(size):
        name = f"s{i}"
        earlier = list(deps)
        parents = tuple(draw(st.lists(st.sampled_from(earlier), max_size=3, unique=True))) if earlier else ()
        deps[name] = parents
        kind = draw(st.sampled_from(["plain", "plain", "map", "when", "join",
                                     *(["loop"] if loops else [])]))
        if kind == "loop":
            shapes[name] = Shape(repeat=draw(st.integers(1, 4)),
                                 keep_last=draw(st.sampled_from([None, None, 1, 2])))
        elif kind == "map" and parents:
            over = draw(st.sampled_from(parents))
            shapes[name] = Shape(map_over=over, when="cond" if draw(st.booleans()) else None)
        elif kind == "when":
            shapes[name] = Shape(when="cond")
        elif kind == "join" and len(parents) >= 2:
            shapes[name] = Shape(join="any")
    return GraphSpec.of(deps, shapes)


# -- workflows for the runtime: every feature together ----------------------------------------

OutputKind = Literal["text", "typed", "list", "dict", "keyed"]
"""What a plain step returns: text, a typed value (a dataclass, through a codec), or
something others can map over: a list, a mapping, or a list of records keyed by ``id``."""

MAPPABLE: tuple[OutputKind, ...] = ("list", "dict", "keyed")


@dataclass(frozen=True)
class Features:
    """Which features the combined strategy may draw. A flag that is off here keeps out a
    combination that a known, still open defect breaks (issue 42): switch it on once fixed."""

    codec: bool = True
    questions: bool = True
    # Issue 42, item 1 (fixed): a codec and a question could not meet.
    codec_with_questions: bool = True
    conditions: bool = True
    # Issue 42, item 10 (fixed): a retry after a condition that raised ran without asking it.
    conditions_that_raise: bool = True
    retries: bool = True
    version_bumps: bool = True
    rewinds: bool = True
    # Issue 42, item 11 (fixed): an attempt that asked a question, or was interrupted, under
    # the old code (or the old input) lent its key to the new work.
    attempt_keys_name_work: bool = True
    # Loops (issue 44): off by default, since not every test that builds these knows them.
    loops: bool = False


@dataclass(frozen=True)
class PlannedStep:
    """One step of a combined workflow, as plain data (the test builds the callables).

    ``versions`` holds its version tag in each code phase (a bump between two
    phases is a new tag); ``fails`` is how many attempts of each (step, input)
    fail before one succeeds, across runs; ``attempts`` its retry policy's
    ``max_attempts``; ``when`` its condition (``"raises"``: raises once per
    input, then decides as ``"some"`` does).
    """

    name: str
    deps: tuple[str, ...]
    kind: OutputKind = "text"
    map_over: str | None = None
    item_key: str | None = None
    when: Literal["some", "raises"] | None = None
    join_any: bool = False
    asks: bool = False
    fails: int = 0
    attempts: int = 1
    versions: tuple[str, ...] = ("v0",)
    repeat: int | None = None  # a loop of at most this many iterations
    keep_last: int | None = None
    until: bool = False  # the loop ends by its until (else its iterations return Done)


@dataclass(frozen=True)
class PlannedWorkflow:
    """A combined workflow: its steps, in declaration order, and how many code phases it has."""

    steps: tuple[PlannedStep, ...]
    phases: int
    features: Features

    @property
    def typed(self) -> bool:
        """Whether any step returns a typed value (the workflow then needs a codec)."""
        return any(s.kind == "typed" for s in self.steps)


def _is_mapped(steps: dict[str, PlannedStep], name: str) -> bool:
    return steps[name].map_over is not None


@st.composite
def combined_workflows(draw: st.DrawFn, features: Features = Features(),
                       max_steps: int = 6) -> PlannedWorkflow:
    """A random workflow combining mapped steps (over lists, mappings and keyed records,
    zero items included; item-wise chains), conditions, joins over alternatives, steps
    that ask a person, typed outputs, transient failures with retries, and a version
    history of up to three code phases."""
    size = draw(st.integers(3, max_steps), label="steps")
    phases = draw(st.integers(1, 3), label="phases") if features.version_bumps else 1
    typed_ok = features.codec
    asks_ok = features.questions
    steps: dict[str, PlannedStep] = {}
    for i in range(size):
        name = f"s{i}"
        earlier = list(steps)
        deps = tuple(draw(st.lists(st.sampled_from(earlier), min_size=1, max_size=3, unique=True))
                     ) if earlier else ()
        over_choices = [d for d in deps if steps[d].kind in MAPPABLE or _is_mapped(steps, d)]
        shape = draw(st.sampled_from(["plain", "map", "map", "map", "join"]
                                     + ["loop", "loop"] * features.loops), label="shape")
        map_over = draw(st.sampled_from(over_choices)) if shape == "map" and over_choices else None
        join_any = shape == "join" and len(deps) >= 2
        kinds: list[OutputKind] = ["list", "text", "dict", "keyed"]
        if typed_ok:
            kinds.append("typed")
        kind: OutputKind = "text" if map_over is not None else draw(st.sampled_from(kinds))
        if map_over is not None and typed_ok and draw(st.booleans()):
            kind = "typed"  # items that return typed values
        item_key = "id" if (map_over is not None and steps[map_over].kind == "keyed"
                            and not _is_mapped(steps, map_over)) else None
        when: Literal["some", "raises"] | None = None
        repeat = keep_last = None
        until = False
        if shape == "loop":  # (a loop is never mapped, conditional or a join: ekit_core.shapes)
            map_over, item_key = None, None
            repeat = draw(st.integers(1, 4), label="max_iterations")
            keep_last = draw(st.none() | st.integers(1, 2), label="keep_last")
            until = draw(st.booleans(), label="until")
        if features.conditions and not join_any and repeat is None and draw(st.integers(0, 3)) == 0:
            when = "raises" if features.conditions_that_raise and draw(st.booleans()) else "some"
        asks = (asks_ok and (kind != "typed" or features.codec_with_questions)
                and draw(st.integers(0, 4)) == 0)
        fails, attempts = 0, 1
        if features.retries and draw(st.integers(0, 3)) == 0:
            fails, attempts = draw(st.integers(1, 2)), draw(st.integers(1, 3))
        tags = [f"v{draw(st.integers(0, 1))}"]
        for _ in range(1, phases):
            tags.append(tags[-1] + "+" if draw(st.booleans()) else tags[-1])
        steps[name] = PlannedStep(name, deps, kind, map_over, item_key, when, join_any, asks,
                                  fails, attempts, tuple(tags), repeat, keep_last, until)
        if kind == "typed":
            asks_ok = asks_ok and features.codec_with_questions
        if asks:
            typed_ok = typed_ok and features.codec_with_questions
    order = draw(st.permutations(list(steps)), label="declaration order")
    return PlannedWorkflow(tuple(steps[n] for n in order), phases, features)
