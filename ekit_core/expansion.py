"""What a mapped step becomes once its input exists: its items, their inputs, their collection.

Pure functions over a graph's declarations (:mod:`ekit_core.shapes`) and
recorded outputs; :mod:`ekit_core.transitions` calls them when an output a
step maps over is recorded (and when a resumed run starts), and grows the
run's graph by what they return.

- :func:`expand` turns the output of ``U`` into the items of every step
  mapped over ``U`` and, item by item, of every step mapped over those
  (an item-wise chain: ``N[k]`` depends on ``M[k]``, not on all of ``M``).
- :func:`item_input` is what an item sees as its mapped-over dependency.
- :func:`collected` is a mapped step's own output once its items are done.
- :func:`loops_of` names the loops (``repeat=``): each grows one iteration,
  ``step#k``, at a time; the rules that grow and end them are in
  :mod:`ekit_core.transitions`.
- :func:`bodies_of` names the steps of each loop whose body is a child
  workflow (``repeat=`` with ``child=``): each body step ``L/s`` grows one
  iteration ``L/s#k`` per iteration of ``L`` (:func:`body_iteration`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, cast

from ekit_core._frozen import twin
from ekit_core.appending import grown_table
from ekit_core.graph import GraphSpec
from ekit_core.shapes import compacted_iteration, item_name, items_of, iteration_name, iteration_of

__all__ = [
    "Expanded",
    "Expansion",
    "ItemRef",
    "LoopError",
    "MapError",
    "bodies_of",
    "body_iteration",
    "body_maps",
    "body_step_iteration",
    "child_items",
    "children_per_item",
    "collected",
    "compacted_iteration",
    "items_compacted",
    "expand",
    "expanders",
    "item_input",
    "iteration_of",
    "iterating",
    "loops_of",
    "mapped_children",
    "same_encoding",
]


class MapError(ValueError):
    """A mapped step's input cannot be split into items (it is not a list or a mapping, say).

    Raised by no call: it is the failure recorded for the mapped step, whose
    upstream's output stays recorded, so a resume after the fix pays only
    for the items.
    """


class LoopError(ValueError):
    """A loop reached its cap (``repeat=N``) without an iteration saying it is done.

    Raised by no call: it is the failure recorded for the loop step, whose
    iterations stay recorded, so no iteration is paid for again.
    """


@dataclass(frozen=True, slots=True)
class ItemRef:
    """Item ``key`` of mapped step ``step``: its input is ``pick`` of ``source``'s output.

    ``pick`` is a position or a mapping key; ``None`` means the whole output
    (the item of an item-wise chain, whose input is the upstream item's output).
    ``iteration`` is the number of an iteration of the loop ``step`` (from 1;
    0 for the item of a mapped step), whose ``source`` is the iteration
    before it (``""`` for the first).
    """

    step: str
    key: str
    source: str
    pick: int | str | None = None
    iteration: int = 0


_ItemRefTwin = twin(ItemRef)


def item_ref(step: str, key: str, source: str, pick: int | str | None = None,
             iteration: int = 0) -> ItemRef:
    """``ItemRef(step, key, source, pick, iteration)``, built fast: a map builds one per item,
    a loop one per iteration (see ``_frozen``).

    The frozen ``__init__`` sets each field through ``object.__setattr__``:
    the fifth field, ``iteration`` (loops', 0 for an item), cost every item of a
    plain map about 1k instructions more; through the twin, no field costs that.
    """
    ref = _ItemRefTwin()
    ref.step, ref.key, ref.source, ref.pick, ref.iteration = step, key, source, pick, iteration
    ref.__class__ = ItemRef
    made: ItemRef = ref  # (not typing.cast: a Python call per value built; see _frozen)
    return made


@dataclass(frozen=True, slots=True)
class Expanded:
    """What one expansion adds: the item steps (name -> dependencies, in order),
    what each item is, each mapped step's items in order, and whether each
    collects into a list or a mapping."""

    steps: dict[str, tuple[str, ...]] = field(default_factory=dict)
    items: dict[str, ItemRef] = field(default_factory=dict)
    members: dict[str, tuple[str, ...]] = field(default_factory=dict)
    kinds: dict[str, Literal["list", "dict"]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Nesting:
    """The tables of a run's loop bodies and children per item (see :func:`bodies_of` and
    ``children_per_item``), fixed when the run starts.

    Kept apart from :class:`Expansion` as one field: a loop copies its expansion at every
    iteration it grows, and each field copied costs every iteration of every loop (as five
    fields, these cost a one-step loop 13k instructions an iteration).
    """

    bodies: MappingProxyType[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    in_body: MappingProxyType[str, str] = field(default_factory=lambda: MappingProxyType({}))
    body_maps: MappingProxyType[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    per_item: MappingProxyType[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    per_item_over: MappingProxyType[str, tuple[str, ...]] = field(
        default_factory=lambda: MappingProxyType({}))


NO_NESTING = Nesting()


@dataclass(frozen=True, slots=True)
class Expansion:
    """What a shaped run's mapped steps have become so far (held by its ``RunSpec``).

    ``expanders`` maps each step some step maps over to those steps (fixed
    for the run); ``items`` says what each item is an item of; ``members``
    lists each expanded mapped step's items in order, and ``kinds`` whether
    it collects into a list or a mapping; ``waits`` which mapped steps with
    no items wait for a dependency.
    """

    expanders: MappingProxyType[str, tuple[str, ...]]
    # (A Ledger once large and grown by few: see ekit_core.appending.)
    items: Mapping[str, ItemRef] = field(default_factory=lambda: MappingProxyType({}))
    members: MappingProxyType[str, tuple[str, ...]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    kinds: MappingProxyType[str, Literal["list", "dict"]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    # A mapped step with no items waits for its dependencies instead: dependency -> such steps.
    waits: MappingProxyType[str, tuple[str, ...]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    # Outputs set aside for an early cutoff (see WorkflowCheckpoint.superseded).
    superseded: MappingProxyType[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # Each loop (``repeat=``) -> the number of its newest iteration grown so far.
    loops: MappingProxyType[str, int] = field(default_factory=lambda: MappingProxyType({}))
    # The iterations whose loop ends with them (the shell reported ``Ended``), in this fold.
    ending: frozenset[str] = frozenset()
    # Loop -> how many of its first iterations' outputs were compacted (``keep_last``).
    compacted: MappingProxyType[str, int] = field(default_factory=lambda: MappingProxyType({}))
    # The loops' bodies and the children per item: fixed for the run, so one field (each
    # field of this class is copied at every iteration a loop grows: see Nesting).
    nesting: Nesting = field(default_factory=lambda: NO_NESTING)

    @property
    def bodies(self) -> MappingProxyType[str, tuple[str, ...]]:
        """A loop whose body is a child workflow -> its body steps, dependencies first."""
        return self.nesting.bodies

    @property
    def in_body(self) -> MappingProxyType[str, str]:
        """Each body step -> its loop."""
        return self.nesting.in_body

    @property
    def body_maps(self) -> MappingProxyType[str, tuple[str, ...]]:
        """A body step that body steps map over -> those steps (see :func:`body_maps`)."""
        return self.nesting.body_maps

    @property
    def per_item(self) -> MappingProxyType[str, tuple[str, ...]]:
        """A step that runs a child per item -> its child's steps."""
        return self.nesting.per_item

    @property
    def per_item_over(self) -> MappingProxyType[str, tuple[str, ...]]:
        """What steps running a child per item map over -> those steps."""
        return self.nesting.per_item_over

    def grown(self, more: Expanded,
              loops: MappingProxyType[str, int] | None = None) -> Expansion:
        """This expansion with ``more`` added (and ``loops``, the loops' newest iterations, when given)."""
        return grown_expansion(self, grown_table(self.items, more.items), more.members, more.kinds,
                               self.loops if loops is None else loops)


_ExpansionTwin = twin(Expansion)  # (see ekit_core._frozen)


def grown_expansion(e: Expansion, items: Mapping[str, ItemRef],
                    members: Mapping[str, tuple[str, ...]] | None,
                    kinds: Mapping[str, Literal["list", "dict"]] | None,
                    loops: MappingProxyType[str, int]) -> Expansion:
    """``e`` with its ``items`` grown (by :mod:`ekit_core.appending`: O(what is added), not
    O(the items so far)), the ``members`` and ``kinds`` of the steps they are items of
    added, ``loops`` its loops' newest iterations: equal to ``Expansion(...)`` of those
    fields, built through a twin (see :mod:`ekit_core._frozen`), once per growth (each
    iteration of a loop)."""
    made = _ExpansionTwin()
    made.expanders = e.expanders
    made.items = items
    made.members = MappingProxyType({**e.members, **members}) if members else e.members
    made.kinds = MappingProxyType({**e.kinds, **kinds}) if kinds else e.kinds
    made.waits = e.waits
    made.superseded = e.superseded
    made.loops = loops
    made.ending = e.ending
    made.compacted = e.compacted
    made.nesting = e.nesting
    made.__class__ = Expansion
    grown: Expansion = made  # (not typing.cast: a Python call per value built; see _frozen)
    return grown


def expanders(graph: GraphSpec) -> MappingProxyType[str, tuple[str, ...]]:
    """``U -> the steps mapped over U`` for every ``U`` that is not itself mapped (nor a step
    of a loop's body: its steps map per iteration, see :func:`body_maps`)."""
    shapes = graph.shapes
    found: dict[str, list[str]] = {}
    inside = _in_bodies(graph)
    for name, shape in shapes.items():
        over = shape.map_over
        if over is not None and not _is_mapped(graph, over) and name not in inside \
                and shape.child is None:  # (a child per item grows its own: see children_per_item)
            found.setdefault(over, []).append(name)
    return MappingProxyType({k: tuple(v) for k, v in found.items()})


def loops_of(graph: GraphSpec) -> tuple[str, ...]:
    """The loops of ``graph`` (steps that declare ``repeat``), in declaration order."""
    return tuple(n for n, s in graph.shapes.items() if s.repeat is not None)


def bodies_of(graph: GraphSpec) -> dict[str, tuple[str, ...]]:
    """Each loop whose body is a child workflow (``repeat=`` with ``child=``) -> its body's
    steps (every step named ``loop/...``), each after its dependencies among them (then in
    declaration order): the order one iteration grows them in. Empty for most graphs."""
    found: dict[str, tuple[str, ...]] = {}
    for loop, shape in graph.shapes.items():
        if shape.repeat is None or shape.child is None:
            continue
        prefix = f"{loop}/"
        body = [n for n in graph.names if n.startswith(prefix)]
        inside = set(body)
        placed: dict[str, None] = {}
        while len(placed) < len(body):  # (a body is small, and acyclic: the graph is)
            for name in body:
                if name not in placed and all(d in placed for d in graph.deps[name] if d in inside):
                    placed[name] = None
        found[loop] = tuple(placed)
    return found


def _in_bodies(graph: GraphSpec) -> frozenset[str]:
    """The steps of ``graph``'s loops' bodies (none, at one test per shape, in most graphs)."""
    if not any(s.repeat is not None and s.child is not None for s in graph.shapes.values()):
        return frozenset()
    return frozenset(n for body in bodies_of(graph).values() for n in body)


def body_maps(graph: GraphSpec) -> dict[str, tuple[str, ...]]:
    """Each step of a loop's body that body steps map over -> those steps: once its iteration
    ``U#k`` is recorded, each such ``M`` expands into the items ``M#k[key]``, collected as
    ``M#k`` (a map per iteration)."""
    inside = _in_bodies(graph)
    found: dict[str, list[str]] = {}
    for name in inside:
        over = graph.shapes[name].map_over if name in graph.shapes else None
        if over is not None:
            found.setdefault(over, []).append(name)
    return {k: tuple(n for n in graph.names if n in v) for k, v in found.items()}


def children_per_item(graph: GraphSpec) -> dict[str, tuple[str, ...]]:
    """Each step that runs a child per item (``child=`` with ``map_over=``) -> its child's
    steps (``P/...``), each after its dependencies among them: once what it maps over is
    recorded, item ``key`` runs every one as ``P/s[key]`` (:func:`child_items`)."""
    found: dict[str, tuple[str, ...]] = {}
    for name, shape in graph.shapes.items():
        if shape.child is None or shape.map_over is None:
            continue
        prefix = f"{name}/"
        body = [n for n in graph.names if n.startswith(prefix)]
        inside, placed = set(body), dict[str, None]()
        while len(placed) < len(body):
            for n in body:
                if n not in placed and all(d in placed for d in graph.deps[n] if d in inside):
                    placed[n] = None
        found[name] = tuple(placed)
    return found


def child_items(graph: GraphSpec, parent: str, steps: tuple[str, ...], output: Any,
                into: Expanded) -> str | None:
    """Add to ``into`` the child of ``parent`` (its ``steps``) once per item of ``output``
    (what it maps over): ``P/s[key]`` depends on ``P/d[key]`` for each of its child
    dependencies ``P/d``, and on the parent's inputs as ``P/s`` does, and sees the item as
    what ``parent`` maps over; each ``P/s`` collects its items as a mapped step does.
    Returns why ``output`` has no items (then adds nothing), else ``None``."""
    shape = graph.shapes[parent]
    over = cast(str, shape.map_over)
    items = items_of(output, shape.item_key)
    if isinstance(items, str):
        return f"step {parent!r} maps over {over!r}, but {items}"
    inside = frozenset(steps)
    kind: Literal["list", "dict"] = "dict" if isinstance(output, Mapping) else "list"
    for step in steps:
        names = []
        for key, _value, pick in items:
            name = item_name(step, key)
            names.append(name)
            into.steps[name] = tuple(item_name(d, key) if d in inside else d
                                     for d in graph.deps[step])
            into.items[name] = ItemRef(step, key, over, pick)
        into.members[step] = tuple(names)
        into.kinds[step] = kind
    return None


def iterating(graph: GraphSpec) -> dict[str, None]:
    """The steps of ``graph`` whose iterations are named ``step#k``: its loops and the steps
    of its loops' bodies (a table for :func:`iteration_of`)."""
    table = dict.fromkeys(loops_of(graph))
    for body in bodies_of(graph).values():
        table.update(dict.fromkeys(body))
    return table


def body_iteration(graph: GraphSpec, loop: str, body: tuple[str, ...], k: int,
                   into: Expanded) -> None:
    """Add iteration ``k`` of ``loop``'s body (its steps ``body``, see :func:`bodies_of`) to
    ``into``: ``L/s#k`` depends on ``L/d#k`` for each body dependency ``L/d`` of ``L/s``
    and on the loop's inputs as ``L/s`` does; a body step with no dependency in the body
    also on the previous iteration's output step (``L/o#(k-1)``: the state the loop
    carries, its ``source``), so no step of iteration ``k`` starts before ``k-1`` ended."""
    inside = frozenset(body)
    for step in body:
        body_step_iteration(graph, loop, inside, step, k, into)


def body_step_iteration(graph: GraphSpec, loop: str, inside: frozenset[str], step: str, k: int,
                        into: Expanded) -> None:
    """Add iteration ``k`` of the body step ``step`` of ``loop`` (whose body steps are
    ``inside``) to ``into``: see :func:`body_iteration`."""
    before = iteration_name(cast(str, graph.shapes[loop].child), k - 1) if k > 1 else ""
    deps = tuple(f"{d}#{k}" if d in inside else d for d in graph.deps[step])
    if before and not any(d in inside for d in graph.deps[step]):
        deps = (*deps, before)
    name = iteration_name(step, k)
    into.steps[name] = deps
    into.items[name] = ItemRef(step, str(k), before, None, k)


def items_compacted(step: str) -> str:
    """The key of ``compacted`` that counts the items a loop body's mapped step ``step`` let
    go of with its compacted iterations (``step[]``: no step or item is named so), which a
    resume counts as done, not knowing their names any more."""
    return f"{step}[]"


def mapped_children(graph: GraphSpec, name: str) -> tuple[str, ...]:
    """The steps mapped over the mapped step ``name`` (its item-wise chain), in declaration order."""
    return tuple(n for n, s in graph.shapes.items() if s.map_over == name)


def _is_mapped(graph: GraphSpec, name: str) -> bool:
    shape = graph.shapes.get(name)
    return shape is not None and shape.map_over is not None


def expand(graph: GraphSpec, over: str, output: Any) -> tuple[Expanded, dict[str, str]]:
    """The items of every step mapped over ``over``, whose output is ``output``.

    Returns the expansion and, for each mapped step whose items cannot be
    made from ``output`` (not a list or mapping, a bad ``item_key``), why:
    such a step gets no items and fails.
    """
    result = Expanded()
    refused: dict[str, str] = {}
    for mapped in expanders(graph).get(over, ()):
        shape = graph.shapes[mapped]
        items = items_of(output, shape.item_key)
        if isinstance(items, str):
            refused[mapped] = f"step {mapped!r} maps over {over!r}, but {items}"
            continue
        kind: Literal["list", "dict"] = "dict" if isinstance(output, Mapping) else "list"
        names = []
        deps = graph.deps[mapped]
        for key, _value, pick in items:
            name = item_name(mapped, key)
            names.append(name)
            result.steps[name] = deps
            result.items[name] = item_ref(mapped, key, over, pick)
        result.members[mapped] = tuple(names)
        result.kinds[mapped] = kind
        _chain(graph, mapped, [k for k, _, _ in items], kind, result)
    return result, refused


def _chain(graph: GraphSpec, upstream: str, keys: list[str], kind: Literal["list", "dict"],
           result: Expanded) -> None:
    """Add, item by item, every step mapped over the mapped step ``upstream``."""
    for child in mapped_children(graph, upstream):
        others = tuple(d for d in graph.deps[child] if d != upstream)
        names = []
        for key in keys:
            name, source = item_name(child, key), item_name(upstream, key)
            names.append(name)
            result.steps[name] = (*others, source)
            result.items[name] = item_ref(child, key, source)
        result.members[child] = tuple(names)
        result.kinds[child] = kind
        _chain(graph, child, keys, kind, result)


def item_input(ref: ItemRef, outputs: Mapping[str, Any]) -> Any:
    """What item ``ref`` sees as its mapped-over dependency's output."""
    source = outputs[ref.source]
    return source if ref.pick is None else source[ref.pick]


_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def same_encoding(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` encode to the same JSON (the early-cutoff rule's equality).

    A tuple equals the list it holds, as it does once stored; values JSON
    cannot hold compare with ``==`` and the same type.
    """
    try:
        return _CANONICAL.encode(a) == _CANONICAL.encode(b)
    except (TypeError, ValueError):
        return type(a) is type(b) and bool(a == b)


def collected(
    members: tuple[str, ...], kind: Literal["list", "dict"], items: Mapping[str, ItemRef],
    outputs: Mapping[str, Any],
) -> list[Any] | dict[str, Any]:
    """A mapped step's output: its recorded items' outputs in order (skipped ones left out)."""
    if kind == "list":
        return [outputs[m] for m in members if m in outputs]
    return {items[m].key: outputs[m] for m in members if m in outputs}
