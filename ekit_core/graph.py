"""The graph spec: step names and their dependencies, validated once.

This module owns every rule about the shape of a workflow: names are
non-empty strings and unique, dependencies name known steps other than the
step itself, and there is no cycle. A ``GraphSpec`` that exists is valid;
nothing downstream checks the shape again. What a step may declare about its
run-time shape (mapping over items, a condition, a join) is validated with
the graph by :mod:`ekit_core.shapes`, which says what each declaration means.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NoReturn

from ekit_core import appending
from ekit_core._frozen import twin
from ekit_core.appending import grown_names, grown_table, with_one
from ekit_core.errors import GraphError
from ekit_core.graph_text import spell
from ekit_core.shapes import NO_SHAPES, Shape, check_shapes, shapes_text

__all__ = ["CycleError", "GraphError", "GraphSpec", "grown_graph"]


_SHOWN = 5
"""Names shown at each end of a long list in an error message."""
_SUGGESTED = 3
"""Unknown dependencies that get a "did you mean" suggestion (each costs O(steps))."""


def _shorten(parts: Sequence[str], sep: str, what: str) -> str:
    """``parts`` joined by ``sep``, the middle left out (and counted) when there are many.

    A graph can have hundreds of thousands of steps: an error message listing
    them all would be megabytes on one line. The full list stays on the
    exception as data (``GraphError.steps``, ``CycleError.cycle``).
    """
    if len(parts) <= 2 * _SHOWN + 1:
        return sep.join(parts)
    left_out = len(parts) - 2 * _SHOWN
    return sep.join(
        [*parts[:_SHOWN], f"... ({left_out} {what} left out) ...", *parts[-_SHOWN:]]
    )


class CycleError(GraphError):
    """The dependencies form a cycle; ``cycle`` lists it, first step repeated last.

    The message shows the whole cycle when it is short, and its first and
    last steps, saying how many were left out, when it is long; ``cycle``
    always holds all of it.
    """

    def __init__(self, cycle: Iterable[str]) -> None:
        self.cycle: tuple[str, ...] = tuple(cycle)
        size = len(self.cycle) - 1
        label = "dependency cycle" if size <= 2 * _SHOWN else f"dependency cycle of {size} steps"
        super().__init__(
            f"{label}: {_shorten(self.cycle, ' -> ', 'steps')}", steps=self.cycle[:-1]
        )


def _refuse_edge(name: str, parents: tuple[str, ...], deps: Mapping[str, object]) -> NoReturn:
    if name in parents:
        raise GraphError(f"step {name!r} depends on itself", [name])
    unknown = [d for d in parents if d not in deps]
    shown = []
    for i, d in enumerate(unknown):
        hint = ""
        if i < _SUGGESTED:
            close = difflib.get_close_matches(d, deps.keys(), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
        shown.append(f"{d!r}{hint}")
    raise GraphError(
        f"step {name!r} depends on unknown step(s): {_shorten(shown, ', ', 'names')}",
        [name, *unknown],
    )


def _parse_entry(entry: object) -> tuple[str, list[str]]:
    """One ``(name, depends_on)`` pair, checked: the name and its dependency list."""
    if not isinstance(entry, tuple) or len(entry) != 2:
        raise GraphError(f"each step must be a (name, depends_on) pair, got {entry!r}")
    name, raw = entry
    if not isinstance(name, str):
        raise GraphError(f"step name must be a str, got {type(name).__name__} {name!r}")
    if not name:
        raise GraphError("step name must not be empty")
    if isinstance(raw, str):
        raise GraphError(
            f"step {name!r}: depends_on must be a collection of names, not the string {raw!r}",
            [name],
        )
    try:
        dep_list = list(raw)
    except TypeError:
        raise GraphError(
            f"step {name!r}: depends_on must be iterable, got {type(raw).__name__}", [name]
        ) from None
    for d in dep_list:
        if not isinstance(d, str):
            raise GraphError(
                f"step {name!r}: dependency names must be str, got {type(d).__name__} {d!r}",
                [name],
            )
    return name, dep_list


def _entries(pairs: list[Any]) -> tuple[list[str], dict[str, tuple[str, ...]], list[str]]:
    """The names in order, their dependencies (deduplicated), and the names given twice."""
    names: list[str] = []
    deps: dict[str, tuple[str, ...]] = {}
    duplicates: list[str] = []
    for entry in pairs:
        # The usual shape (a str and a tuple of at most one str) is checked
        # inline; anything else goes through _parse_entry.
        if type(entry) is tuple and len(entry) == 2:
            name, raw = entry
            if type(name) is str and name and type(raw) is tuple and (
                not raw or (len(raw) == 1 and type(raw[0]) is str)
            ):
                if name in deps:
                    duplicates.append(name)
                else:
                    names.append(name)
                    deps[name] = raw
                continue
        name, dep_list = _parse_entry(entry)
        if name in deps:
            duplicates.append(name)
            continue
        names.append(name)
        deps[name] = tuple(dict.fromkeys(dep_list))
    return names, deps, duplicates


def _find_cycle(
    deps: Mapping[str, tuple[str, ...]],
    names: tuple[str, ...],
    dependents: Mapping[str, tuple[str, ...]],
) -> list[str] | None:
    # Kahn's algorithm strips every step that can be ordered; anything left
    # sits on or behind a cycle, and following dependencies among the leftovers
    # must revisit a step.
    remaining = {n: len(deps[n]) for n in names}
    queue = [n for n in names if remaining[n] == 0]
    while queue:
        n = queue.pop()
        for m in dependents[n]:
            remaining[m] -= 1
            if remaining[m] == 0:
                queue.append(m)
    left = [n for n in names if remaining[n] > 0]
    if not left:
        return None
    stuck = set(left)
    path: list[str] = []
    seen: dict[str, int] = {}
    node = left[0]
    while node not in seen:
        seen[node] = len(path)
        path.append(node)
        node = next(d for d in deps[node] if d in stuck)
    # ``path`` runs along dependencies; report it in execution order.
    cycle = path[seen[node]:]
    cycle.reverse()
    return [*cycle, cycle[0]]


def _in_order(steps: Sequence[Any]) -> tuple[dict[str, int], dict[str, tuple[str, ...]]] | None:
    """The index and dependencies of ``steps`` (objects with ``name`` and
    ``depends_on``) when every dependency is declared before the steps that
    need it (the usual case, and then there is no cycle) and every field has
    the plain shape (a ``str`` name, a tuple of ``str``); ``None`` for
    anything else, which the step-by-step checks then accept or refuse,
    naming the fault.

    One loop, one membership test per edge, reading each step's two
    attributes directly: a resume builds the graph of every recorded step,
    so this is most of what it costs per step.
    """
    deps: dict[str, tuple[str, ...]] = {}
    for step in steps:
        name, raw = step.name, step.depends_on
        if type(name) is not str or type(raw) is not tuple or name in deps or not name:
            return None
        if raw:
            if len(raw) == 1:
                if type(raw[0]) is not str or raw[0] not in deps:
                    return None
            else:
                for d in raw:
                    if type(d) is not str or d not in deps:
                        return None
                if len(set(raw)) != len(raw):
                    return None
        deps[name] = raw
    return dict(zip(deps, range(len(deps)), strict=True)), deps


def _dependents(
    names: Sequence[str], deps: Mapping[str, tuple[str, ...]]
) -> dict[str, tuple[str, ...]]:
    """Each name's dependents, in declaration order (``()`` for none)."""
    # Most steps have at most one dependent: a 1-tuple, made a list only
    # for a second one (fewer objects for the collector to walk).
    children: dict[str, Any] = {}
    several: list[str] = []
    for name in names:
        for d in deps[name]:
            kids = children.get(d)
            if kids is None:
                children[d] = (name,)
            elif type(kids) is tuple:
                children[d] = [*kids, name]
                several.append(d)
            else:
                kids.append(name)
    for d in several:
        children[d] = tuple(children[d])
    dependents: dict[str, tuple[str, ...]] = dict.fromkeys(names, ())
    dependents.update(children)
    return dependents


@dataclass(frozen=True, slots=True)
class GraphSpec:
    """A validated DAG of step names, in declaration order.

    Build one with :meth:`of` (or :meth:`of_steps`). ``names`` keeps
    declaration order, which is the order :func:`~ekit_core.plan` starts
    ready steps in.
    """

    # A tuple and read-only dicts, but for a large graph grown a few steps at a time (a
    # loop's): then tables appended to, shared with the graph before (ekit_core.appending).
    names: Sequence[str]
    deps: Mapping[str, tuple[str, ...]]
    index: Mapping[str, int] = field(repr=False)
    # The steps that declare a run-time shape (see ekit_core.shapes), in
    # declaration order; empty for a static graph.
    shapes: MappingProxyType[str, Shape] = field(
        default_factory=lambda: NO_SHAPES, repr=False, kw_only=True
    )
    # All built on first use. A resume reads the dependents of the steps it
    # runs only (see ekit_core.transitions), and compares a recorded graph
    # with this one's texts instead of hashing it (see ekit_core.compat).
    _dependents: MappingProxyType[str, tuple[str, ...]] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    _fingerprint: str | None = field(default=None, init=False, repr=False, compare=False)
    _texts: tuple[str, str] | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def of(
        cls,
        steps: Mapping[str, Iterable[str]] | Iterable[tuple[str, Iterable[str]]],
        shapes: Mapping[str, Shape] | None = None,
    ) -> GraphSpec:
        """Validate ``steps`` (name -> dependencies, or ``(name, deps)`` pairs).

        ``shapes`` maps steps to their run-time :class:`~ekit_core.shapes.Shape`
        (validated by :func:`~ekit_core.shapes.check_shapes`).

        Raises :class:`GraphError` (a ``ValueError``) for an empty or non-string
        name, a duplicate name, an unknown dependency (suggesting the closest
        step name) or a self-dependency, and :class:`CycleError` for a cycle.
        Messages stay short however large the graph: a long list of names is
        cut in the middle, saying how many were left out, while the
        exception's ``steps`` (and ``cycle``) hold all of them.
        """
        pairs = list(steps.items()) if isinstance(steps, Mapping) else list(steps)
        return cls._checked(pairs)._shaped(shapes)

    def _shaped(self, shapes: Mapping[str, Shape] | None) -> GraphSpec:
        """This graph with ``shapes``, checked (itself when there are none)."""
        if not shapes:
            return self
        checked = check_shapes(tuple(self.names), self.deps, shapes)
        if not checked:
            return self
        return GraphSpec(self.names, self.deps, self.index, shapes=checked)

    @classmethod
    def of_steps(cls, steps: Iterable[Any], shapes: Mapping[str, Shape] | None = None) -> GraphSpec:
        """:meth:`of` for objects with a ``name`` and a ``depends_on``
        attribute, such as the shell's ``Step``: the same spec, the same errors.

        A list declared in order (every dependency before the steps that
        need it, each name a ``str`` and each ``depends_on`` a tuple of them)
        is proved valid in one loop; anything else goes through the checks
        of :meth:`of`. An item without the two attributes is a
        :class:`GraphError` naming its position.
        """
        if type(steps) is not tuple and type(steps) is not list:
            steps = list(steps)  # read twice when the proof gives up
        try:
            proved = _in_order(steps)
        except AttributeError:
            proved = None
        if proved is None:
            pairs = []
            for i, step in enumerate(steps):
                try:
                    pairs.append((step.name, step.depends_on))
                except AttributeError:
                    raise GraphError(
                        f"steps[{i}] must have a name and a depends_on, got {type(step).__name__}"
                    ) from None
            return cls._checked(pairs)._shaped(shapes)
        index, deps = proved
        return cls(tuple(index), MappingProxyType(deps), MappingProxyType(index))._shaped(shapes)

    @classmethod
    def _checked(cls, pairs: list[Any]) -> GraphSpec:
        # Step by step: slower than _in_order, but it finds and names any fault.
        names, deps, duplicates = _entries(pairs)
        if duplicates:
            dup = sorted(set(duplicates))
            raise GraphError(
                f"duplicate step name(s): {_shorten([repr(d) for d in dup], ', ', 'names')}", dup
            )
        index = {n: i for i, n in enumerate(names)}
        # Declared in an order that puts every dependency first, a graph
        # cannot have a cycle: Kahn's pass is then skipped.
        ordered = True
        for name in names:
            position = index[name]
            for d in deps[name]:
                at = index.get(d)
                if at is None or d == name:
                    _refuse_edge(name, deps[name], deps)
                if at > position:
                    ordered = False
        names_t = tuple(names)
        spec = cls(names_t, MappingProxyType(deps), MappingProxyType(index))
        cycle = None if ordered else _find_cycle(deps, names_t, spec.dependents)
        if cycle is not None:
            raise CycleError(cycle)
        return spec

    def extended(self, added: Mapping[str, tuple[str, ...]]) -> GraphSpec:
        """This graph and ``added`` (name -> dependencies), appended in order.

        For steps the core derives (the items of a mapped step, a loop's
        iterations), whose dependencies are steps of this graph or earlier
        added ones, so no cycle can form: only the names are checked (new,
        non-empty strings, each once). O(added), amortized: a large graph
        grown by a few steps shares its tables with this one and appends to
        them (see :mod:`ekit_core.appending`), so a loop's iteration does not
        copy the graph.
        """
        index = self.index
        for name in added:
            if not isinstance(name, str) or not name or name in index:
                raise GraphError(f"cannot add step {name!r}: empty, not a string, or known", [str(name)])
        n = len(self.names)
        return GraphSpec(grown_names(self.names, tuple(added)), grown_table(self.deps, added),
                         grown_table(index, dict(zip(added, range(n, n + len(added)), strict=True))))

    def dependents_among(self, names: Iterable[str]) -> MappingProxyType[str, tuple[str, ...]]:
        """The dependents index cut down to ``names``: steps of this graph,
        each once, in declaration order (a resume's unrecorded steps).

        ``among[p]`` lists the steps of ``names`` that depend on ``p``, in
        the order of ``names``; every name in ``names`` has an entry. It
        costs the edges of ``names`` only.
        """
        return MappingProxyType(_dependents(tuple(names), self.deps))

    @property
    def dependents(self) -> MappingProxyType[str, tuple[str, ...]]:
        """Each step's dependents (the steps that list it), in declaration order."""
        dependents = self._dependents
        if dependents is None:
            dependents = MappingProxyType(_dependents(self.names, self.deps))
            object.__setattr__(self, "_dependents", dependents)
        return dependents

    @property
    def fingerprint(self) -> str:
        """``sha256:`` and the hex digest of the graph, whatever order its steps
        (and each step's dependencies) are declared in: what a checkpoint
        records to say which graph it belongs to."""
        fingerprint = self._fingerprint
        if fingerprint is None:
            fingerprint = _fingerprint(self.deps, shapes_text(self.shapes))
            object.__setattr__(self, "_fingerprint", fingerprint)
        return fingerprint

    @property
    def texts(self) -> tuple[str, str]:
        """``(graph_steps, graph_needs)``: this graph as a checkpoint records it
        (see :mod:`ekit_core.graph_text`), spelt on first read."""
        texts = self._texts
        if texts is None:
            texts = spell(self.names, self.deps, closed=True)
            object.__setattr__(self, "_texts", texts)
        return texts

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.index

    def to_dict(self) -> dict[str, Any]:
        """Plain data: ``{"steps": [{"name": ..., "depends_on": [...]}, ...], "fingerprint": ...}``.

        A step with a run-time shape carries it as ``"shape"`` (see :meth:`Shape.to_dict`).
        """
        steps: list[dict[str, Any]] = []
        for n in self.names:
            entry: dict[str, Any] = {"name": n, "depends_on": list(self.deps[n])}
            if n in self.shapes:
                entry["shape"] = self.shapes[n].to_dict()
            steps.append(entry)
        return {"steps": steps, "fingerprint": self.fingerprint}

    @classmethod
    def from_dict(cls, data: object) -> GraphSpec:
        """Rebuild a graph from :meth:`to_dict` output; malformed data is a ``GraphError``."""
        if not isinstance(data, dict):
            raise GraphError(f"graph must be a JSON object, got {type(data).__name__}")
        steps = data.get("steps")
        if not isinstance(steps, list):
            raise GraphError("graph field 'steps' must be a list")
        pairs: list[tuple[str, Iterable[str]]] = []
        shapes: dict[str, Shape] = {}
        for i, item in enumerate(steps):
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise GraphError(f"graph field 'steps[{i}]' must be an object with a 'name' string")
            depends_on = item.get("depends_on", [])
            if not isinstance(depends_on, list):
                raise GraphError(f"graph field 'steps[{i}].depends_on' must be a list")
            pairs.append((item["name"], depends_on))
            if "shape" in item:
                try:
                    shapes[item["name"]] = Shape.from_dict(item["shape"], f"steps[{i}].shape")
                except ValueError as exc:
                    raise GraphError(f"graph field {exc}") from None
        return cls.of(pairs, shapes)


_GraphSpecTwin = twin(GraphSpec)  # (see ekit_core._frozen)


def grown_graph(graph: GraphSpec, name: str, deps: tuple[str, ...]) -> GraphSpec:
    """``graph.extended({name: deps})`` for one step the core derives (a loop's next
    iteration, once per iteration): the same graph, built through a twin (see
    :mod:`ekit_core._frozen`), each table grown by :func:`~ekit_core.appending.with_one`."""
    index = graph.index
    if not name or name in index:
        raise GraphError(f"cannot add step {name!r}: empty, or known", [name])
    names = graph.names
    made = _GraphSpecTwin()
    if type(names) is tuple and len(names) < appending.SMALL and type(index) is MappingProxyType:
        # (with_one's copies, inline: a loop in a small graph, once per iteration)
        more, at = graph.deps.copy(), index.copy()  # type: ignore[attr-defined]
        more[name], at[name] = deps, len(names)
        # (A concatenation, not (*names, name): that builds a list, then the tuple.)
        made.names = names + (name,)  # noqa: RUF005
        made.deps, made.index = MappingProxyType(more), MappingProxyType(at)
    else:
        made.names = grown_names(names, (name,))
        made.deps = with_one(graph.deps, name, deps)
        made.index = with_one(index, name, len(names))
    made.shapes = NO_SHAPES
    made._dependents = made._fingerprint = made._texts = None
    made.__class__ = GraphSpec
    grown: GraphSpec = made  # (not typing.cast: a Python call per value built; see _frozen)
    return grown


_CANONICAL = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), check_circular=False)


def _fingerprint(deps: Mapping[str, tuple[str, ...]], shapes: str = "") -> str:
    # Order-independent on purpose: declaring the same steps in another order
    # changes no dependency, so a checkpoint stays valid for it. The digest is
    # of the JSON text of [[name, [sorted deps]], ...] sorted by name.
    names = sorted(deps)
    every = "".join(names)  # dependencies are step names too
    if every.isascii() and every.isprintable() and '"' not in every and "\\" not in every:
        # Nothing to escape (the usual names): the same text, spelt out directly.
        canonical = "[" + ",".join([
            f'["{n}",[]]' if not (ds := deps[n])
            else f'["{n}",["{ds[0]}"]]' if len(ds) == 1
            else f'["{n}",["' + '","'.join(sorted(ds)) + '"]]'
            for n in names
        ]) + "]"
    else:
        # A tuple encodes as the list it holds; one of at most one name is sorted.
        canonical = _CANONICAL.encode(
            [[n, ds if len(ds := deps[n]) < 2 else sorted(ds)] for n in names]
        )
    if shapes:  # a static graph's fingerprint is what it always was
        canonical += "|shapes:" + shapes
    return "sha256:" + hashlib.sha256(canonical.encode("ascii")).hexdigest()
