"""Run-time shapes: steps that run once per item, and steps that run only on a condition.

This module owns what a shape *is* and which declarations are valid; the
rules that expand and collect items and skip steps during a run live with
every other scheduling rule, in :mod:`ekit_core.transitions`.

A step may declare, beside its dependencies:

=============== ============================================================
``map_over=U``  run once per item of ``U``'s output (``U`` is one of its
                dependencies): a list or tuple gives one item per element,
                a mapping one per key. Each item is a step of its own,
                named ``step[key]``, with its own attempts, and sees the
                item as ``U``'s output. The step's own output is the list
                (or mapping) of the item outputs, in order, once all are
                done; zero items make it ``[]`` (or ``{}``) at once.
                Mapped over a step that is itself mapped, it runs item by
                item: ``N[k]`` depends on ``M[k]`` alone, not on all of ``M``.
``item_key=F``  key the items by the field ``F`` of each item (a mapping
                holding a ``str`` or ``int`` there, unique) instead of by
                position (or by the mapping's own keys).
``when=NAME``   the step runs only if its condition, evaluated by the shell
                once its dependencies are recorded, holds; ``NAME`` names the
                condition in the fingerprint. Otherwise it is recorded as
                skipped, with the reason, and so is every step that needs
                it, unless that step joins ``"any"``. A mapped step's
                condition is evaluated per item, and a skipped item is left
                out of the collected output.
``join="any"``  run once every dependency is recorded or skipped, if at least
                one is recorded (the join after alternative branches); it
                sees only the outputs that exist. All skipped: skipped too.
``repeat=N``    a loop: run again and again, one iteration at a time, until
                an iteration says it is done, at most ``N`` iterations.
                Iteration ``k`` is a step of its own, named ``step#k``, with
                its own attempts; it depends on the step's dependencies and
                on iteration ``k-1``, and is grown only once ``k-1`` is
                recorded. The step's own output is its last iteration's. An
                ``N``-th iteration that does not say it is done fails the
                step (a :class:`~ekit_core.expansion.LoopError`).
``keep_last=K`` a loop's checkpoints keep the outputs of its last ``K``
                iterations only: older ones are compacted (dropped and
                counted), so that a long loop's checkpoint stays bounded.
``child=O``     the step runs a child workflow, whose steps are steps of
                the graph named ``step/inner`` (see :mod:`ekit_core.children`);
                ``O`` is the child's output step (``step/inner``), the step's
                one dependency: its output is the step's own. With
                ``repeat``, the child is the loop's body: each iteration
                ``k`` runs every body step as ``step/inner#k``, and
                ``O#k``'s output is the iteration's (the state it carries).
=============== ============================================================

Validity (a :class:`~ekit_core.GraphError` naming the step): ``map_over``
names one of the step's dependencies; ``item_key`` needs ``map_over`` and
is not given to a step mapped over a mapped step (the items keep the
upstream's keys); ``join="any"`` needs dependencies and is not combined with
``map_over``; names are non-empty strings; no declared step is named like an
item of another declared step (``P[...]`` beside ``P``, whatever ``P``'s shape),
nor like an iteration of one (``P#...`` beside ``P``); ``repeat`` is an int
>= 1 and is not combined with ``map_over``, ``when`` or ``join="any"``;
``keep_last`` is an int >= 1 and needs ``repeat``; ``child`` names the
step's one dependency, spelt ``step/...``, and is combined with no other shape
but ``repeat`` (and ``keep_last``); a loop's body ends in its output alone and
its steps take no shape but a child and a map over an unmapped body step
(not on its output).

The fingerprint of a graph with shapes covers them (which steps map, over
what, keyed how; conditions by name; joins); a graph without any keeps the
fingerprint it always had.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from ekit_core.errors import GraphError

__all__ = ["NO_SHAPES", "Shape", "check_shapes", "child_name", "compacted_iteration", "item_name",
           "iteration_name", "iteration_of", "shapes_text"]

Join = Literal["all", "any"]


@dataclass(frozen=True, slots=True)
class Shape:
    """A step's run-time shape: see the module for what each field means."""

    map_over: str | None = None
    item_key: str | None = None
    when: str | None = None
    join: Join = "all"
    repeat: int | None = None
    keep_last: int | None = None
    child: str | None = None

    def to_dict(self) -> dict[str, str | int]:
        """Plain data, the fields that are set only (what a checkpoint records)."""
        data = {"map_over": self.map_over, "item_key": self.item_key, "when": self.when}
        plain: dict[str, str | int] = {k: v for k, v in data.items() if v is not None}
        if self.join != "all":
            plain["join"] = self.join
        if self.repeat is not None:
            plain["repeat"] = self.repeat
        if self.keep_last is not None:
            plain["keep_last"] = self.keep_last
        if self.child is not None:
            plain["child"] = self.child
        return plain

    @classmethod
    def from_dict(cls, data: object, where: str = "shape") -> Shape:
        """Rebuild from :meth:`to_dict`; anything else is a ``ValueError`` naming ``where``."""
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be an object, got {type(data).__name__}")
        unknown = sorted(set(data) - {"map_over", "item_key", "when", "join", "repeat", "keep_last",
                                   "child"})
        if unknown:
            raise ValueError(f"{where} has unknown field(s): {unknown}")
        for key in ("map_over", "item_key", "when", "child"):
            value = data.get(key)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{where}.{key} must be a non-empty string")
        join = data.get("join", "all")
        if join not in ("all", "any"):
            raise ValueError(f"{where}.join must be 'all' or 'any', got {join!r}")
        for key in ("repeat", "keep_last"):
            value = data.get(key)
            if value is not None and not _count(value):
                raise ValueError(f"{where}.{key} must be an int >= 1, got {value!r:.80}")
        return cls(data.get("map_over"), data.get("item_key"), data.get("when"), join,
                   data.get("repeat"), data.get("keep_last"), data.get("child"))

    @property
    def plain(self) -> bool:
        """Whether this shape declares nothing (a step without one)."""
        return self.map_over is None and self.when is None and self.join == "all" \
            and self.repeat is None and self.child is None


def _count(value: object) -> bool:
    """Whether ``value`` is an int >= 1 (not a bool): a loop's cap, or how many it keeps."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


NO_SHAPES: MappingProxyType[str, Shape] = MappingProxyType({})
"""The shapes of a graph that declares none."""


def item_name(step: str, key: str) -> str:
    """The name of item ``key`` of mapped step ``step``: ``step[key]``."""
    return f"{step}[{key}]"


def iteration_name(step: str, k: int) -> str:
    """The name of iteration ``k`` (from 1) of loop ``step``: ``step#k``."""
    return f"{step}#{k}"


def child_name(step: str, inner: str) -> str:
    """The name of step ``inner`` of the child workflow of step ``step``: ``step/inner``."""
    return f"{step}/{inner}"


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


def compacted_iteration(name: str, compacted: Mapping[str, int], shapes: Mapping[str, Any]
                        ) -> tuple[str, int] | None:
    """``(loop, k)`` if ``name`` is iteration ``k`` of a loop ``compacted`` counts, or of a
    step of its body (``L/s#k``, by ``shapes``: the loop's ``child``; or an item of one,
    ``L/m#k[key]``), and ``k`` is at most
    that count: recorded, its output let go of (``keep_last``). Else ``None``."""
    if not compacted:
        return None
    at = iteration_of(name, compacted)
    if at is None:
        cut = name.rfind("#")
        mark = name.find("[", cut)  # (an item of a body's map, L/m#k[key]: its iteration's)
        if cut > 0 and mark > cut:
            name = name[:mark]
        owner = name[:cut] if cut > 0 else ""
        loop = next((n for n in compacted if owner.startswith(f"{n}/")
                     and getattr(shapes.get(n), "child", None) is not None), None)
        if loop is None:
            return None
        at = iteration_of(f"{loop}{name[cut:]}", compacted)
    return at if at is not None and at[1] <= compacted[at[0]] else None


def check_shapes(
    names: tuple[str, ...], deps: Mapping[str, tuple[str, ...]], shapes: Mapping[str, Shape]
) -> MappingProxyType[str, Shape]:
    """``shapes`` (step -> :class:`Shape`) if valid for this graph, else a ``GraphError``."""
    checked: dict[str, Shape] = {}
    for name, shape in shapes.items():
        if name not in deps:
            raise GraphError(f"shape given for unknown step {name!r}", [name])
        if not isinstance(shape, Shape):
            raise GraphError(f"step {name!r}: shape must be a Shape, got {type(shape).__name__}", [name])
        for field_name in ("map_over", "item_key", "when", "child"):
            value = getattr(shape, field_name)
            if value is not None and (not isinstance(value, str) or not value):
                raise GraphError(f"step {name!r}: {field_name} must be a non-empty string", [name])
        if shape.join not in ("all", "any"):
            raise GraphError(f"step {name!r}: join must be 'all' or 'any', got {shape.join!r}", [name])
        for field_name in ("repeat", "keep_last"):
            value = getattr(shape, field_name)
            if value is not None and not _count(value):
                raise GraphError(f"step {name!r}: {field_name} must be an int >= 1, got {value!r:.80}",
                                 [name])
        if not shape.plain or shape.item_key is not None or shape.keep_last is not None:
            checked[name] = shape
    for name, shape in checked.items():
        _check_one(name, shape, deps, checked)
    if checked:
        _check_item_like(names, deps)
    return MappingProxyType({n: checked[n] for n in names if n in checked})


def _check_item_like(names: tuple[str, ...], deps: Mapping[str, tuple[str, ...]]) -> None:
    """Refuse a step named ``P[...]`` beside a step ``P``: the name of one of ``P``'s items;
    and one named ``P#...``: the name of one of ``P``'s iterations.

    Whatever ``P``'s shape: rules that tell items by their name (a resume,
    a rewind, a selection) must never take a declared step for one, and a
    graph change may map ``P`` later. O(total length of the names).
    """
    for mark, what, spelt in (("[", "an item", "step[key]"), ("#", "an iteration", "step#k")):
        for name in names:
            at = name.find(mark, 1)  # (a step "" is refused before: no owner at 0)
            while at > 0:
                owner = name[:at]
                if owner in deps:
                    raise GraphError(
                        f"step {name!r} is named like {what} of step {owner!r} ({what[3:]}s are "
                        f"named {spelt}): rename one of them", [name, owner])
                at = name.find(mark, at + 1)


def _check_one(name: str, shape: Shape, deps: Mapping[str, tuple[str, ...]],
               shapes: Mapping[str, Shape]) -> None:
    over = shape.map_over
    if over is not None and over not in deps[name]:
        raise GraphError(f"step {name!r} maps over {over!r}, which is not one of its dependencies",
                         [name, over])
    if shape.item_key is not None:
        if over is None:
            raise GraphError(f"step {name!r}: item_key needs map_over", [name])
        if over in shapes and shapes[over].map_over is not None:
            raise GraphError(
                f"step {name!r} maps over the mapped step {over!r}: its items keep "
                f"{over!r}'s keys, so it takes no item_key", [name])
    if shape.repeat is not None:
        clash = ("map_over" if over is not None else "when" if shape.when is not None
                 else "join='any'" if shape.join == "any" else None)
        if clash is not None:
            raise GraphError(f"step {name!r}: repeat cannot be combined with {clash}", [name])
    elif shape.keep_last is not None:
        raise GraphError(f"step {name!r}: keep_last needs repeat", [name])
    if shape.child is not None:
        own = (shape.child,) if over is None else (shape.child, over)  # (mapped: and its input)
        if deps[name] != own or not shape.child.startswith(f"{name}/"):
            raise GraphError(f"step {name!r}: its child's output {shape.child!r} must be its one "
                             f"dependency (with what it maps over), a step named "
                             f"{name + '/...'!r}", [name])
        clash = ("when" if shape.when is not None else "join='any'" if shape.join == "any"
                 else "map_over and repeat" if over is not None and shape.repeat is not None
                 else "map_over over a mapped step" if over is not None and over in shapes
                 and shapes[over].map_over is not None else None)
        if clash is not None:
            raise GraphError(f"step {name!r}: a child workflow cannot be combined with {clash} "
                             "(yet)", [name])
        if shape.repeat is not None or over is not None:
            _check_body(name, shape.child, deps, shapes, over is not None)
    if shape.join == "any":
        if not deps[name]:
            raise GraphError(f"step {name!r}: join='any' needs dependencies", [name])
        if over is not None:
            raise GraphError(f"step {name!r}: join='any' cannot be combined with map_over", [name])


def _check_body(loop: str, output: str, deps: Mapping[str, tuple[str, ...]],
                shapes: Mapping[str, Shape], per_item: bool = False) -> None:
    """A loop's body (its child's steps, ``loop/...``): its output is its one last step (what
    ends an iteration: nothing of it may still run once the loop decides), and its steps
    take no shape of their own but a child's and a map over another (unmapped) body step
    that is not the output (conditions, joins, chained maps and loops inside a body are
    not grown per iteration yet)."""
    prefix = f"{loop}/"
    body = [n for n in deps if n.startswith(prefix)]
    if per_item:  # a child per item (map_over=): its steps take no shape of their own (yet)
        shaped = next((n for n in body if n in shapes and not shapes[n].plain), None)
        if shaped is not None:
            raise GraphError(f"step {shaped!r} of the child of mapped step {loop!r} cannot take "
                             "a shape of its own (yet)", [shaped, loop])
        return
    needed = {d for n in body for d in deps[n]}
    last = [n for n in body if n not in needed]
    if last != [output]:
        others = ", ".join(repr(n) for n in last if n != output) or "none"
        raise GraphError(f"step {loop!r}: the body of a loop must end in its output {output!r} "
                         f"alone: every body step leads to it (last steps besides: {others})",
                         [loop])
    for name in body:
        shape = shapes.get(name)
        if shape is None:
            continue
        over = shape.map_over
        clash = ("map_over on its output" if over is not None and name == output
                 else "map_over a step outside the body" if over is not None
                 and not over.startswith(prefix)
                 else "map_over a mapped step" if over is not None and over in shapes
                 and shapes[over].map_over is not None
                 else "when" if shape.when is not None
                 else "join='any'" if shape.join == "any" else "repeat"
                 if shape.repeat is not None else None)
        if clash is not None:
            raise GraphError(f"step {name!r} of the body of loop {loop!r} cannot take {clash} "
                             "(yet)", [name, loop])


_CANONICAL = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), sort_keys=True)


def shapes_text(shapes: Mapping[str, Shape]) -> str:
    """The canonical text of ``shapes`` that the fingerprint covers (``""`` for none)."""
    if not shapes:
        return ""
    return _CANONICAL.encode(sorted([n, s.to_dict()] for n, s in shapes.items()))


def items_of(output: Any, item_key: str | None) -> list[tuple[str, Any, int | str]] | str:
    """The items of a mapped-over output: ``(key, item, pick)`` in order, or why there are none.

    ``pick`` is what indexes the item in ``output`` (its position, or its
    key in a mapping). The reason (a string) says why ``output`` cannot be
    mapped over: it is not a list, tuple or mapping, a mapping key is not a
    string, or an ``item_key`` is missing, of the wrong type, or repeated.
    """
    if isinstance(output, list | tuple):
        picks: list[Any] = list(range(len(output)))
        values = list(output)
    elif isinstance(output, Mapping):
        picks = list(output)
        bad = next((k for k in picks if not isinstance(k, str)), None)
        if bad is not None:
            return f"its keys must be strings, got {type(bad).__name__} {bad!r:.80}"
        values = [output[k] for k in picks]
    else:
        return f"its output is of type {type(output).__name__}, not a list, tuple or mapping"
    if item_key is None:
        return [(str(p), v, p) for p, v in zip(picks, values, strict=True)]
    items: list[tuple[str, Any, int | str]] = []
    seen: set[str] = set()
    for p, v in zip(picks, values, strict=True):
        key = v.get(item_key) if isinstance(v, Mapping) else None
        if isinstance(key, bool) or not isinstance(key, str | int):
            return f"item {p!r:.80} has no str or int {item_key!r} field"
        text = str(key)
        if text in seen:
            return f"items repeat the key {item_key}={text!r:.80}"
        seen.add(text)
        items.append((text, v, p))
    return items
