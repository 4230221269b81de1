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
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from ekit_core._frozen import twin
from ekit_core.graph import GraphSpec
from ekit_core.shapes import item_name, items_of

__all__ = [
    "Expanded",
    "Expansion",
    "ItemRef",
    "LoopError",
    "MapError",
    "collected",
    "expand",
    "expanders",
    "item_input",
    "iteration_of",
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


def item_ref(step: str, key: str, source: str, pick: int | str | None = None) -> ItemRef:
    """``ItemRef(step, key, source, pick)``, built fast: a map builds one per item (see ``_frozen``).

    The frozen ``__init__`` sets each field through ``object.__setattr__``:
    the fifth field, ``iteration`` (loops', 0 here), cost every item of a
    plain map about 1k instructions more; through the twin, no field costs that.
    """
    ref = _ItemRefTwin()
    ref.step, ref.key, ref.source, ref.pick, ref.iteration = step, key, source, pick, 0
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
class Expansion:
    """What a shaped run's mapped steps have become so far (held by its ``RunSpec``).

    ``expanders`` maps each step some step maps over to those steps (fixed
    for the run); ``items`` says what each item is an item of; ``members``
    lists each expanded mapped step's items in order, and ``kinds`` whether
    it collects into a list or a mapping; ``waits`` which mapped steps with
    no items wait for a dependency.
    """

    expanders: MappingProxyType[str, tuple[str, ...]]
    items: MappingProxyType[str, ItemRef] = field(default_factory=lambda: MappingProxyType({}))
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

    def grown(self, more: Expanded) -> Expansion:
        """This expansion with ``more`` added."""
        return Expansion(
            self.expanders,
            MappingProxyType({**self.items, **more.items}),
            MappingProxyType({**self.members, **more.members}) if more.members else self.members,
            MappingProxyType({**self.kinds, **more.kinds}) if more.kinds else self.kinds,
            self.waits,
            self.superseded,
            self.loops,
            self.ending,
            self.compacted,
        )


def expanders(graph: GraphSpec) -> MappingProxyType[str, tuple[str, ...]]:
    """``U -> the steps mapped over U`` for every ``U`` that is not itself mapped."""
    shapes = graph.shapes
    found: dict[str, list[str]] = {}
    for name, shape in shapes.items():
        over = shape.map_over
        if over is not None and not _is_mapped(graph, over):
            found.setdefault(over, []).append(name)
    return MappingProxyType({k: tuple(v) for k, v in found.items()})


def loops_of(graph: GraphSpec) -> tuple[str, ...]:
    """The loops of ``graph`` (steps that declare ``repeat``), in declaration order."""
    return tuple(n for n, s in graph.shapes.items() if s.repeat is not None)


def iteration_of(name: str, loops: Mapping[str, Any]) -> tuple[str, int] | None:
    """``(loop, k)`` if ``name`` is spelt as iteration ``k`` of one of ``loops``
    (``loop#k``, ``k`` a decimal int >= 1 without a leading zero), else ``None``."""
    at = name.rfind("#")
    if at <= 0:
        return None
    loop, number = name[:at], name[at + 1:]
    if loop not in loops or not number.isdigit() or not number.isascii() or number[0] == "0":
        return None
    return loop, int(number)


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
