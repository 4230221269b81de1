"""How a checkpoint spells its graph: two strings, written and read here.

This module owns that rule. ``graph_steps`` holds the step names in
declaration order, separated by ``|``; ``graph_needs`` holds, in the same
order, each step's dependencies separated by ``,``, and those lists
separated by ``|`` (a step with no dependencies has an empty list). A
backslash goes before every ``\\``, ``|`` or ``,`` inside a name, in both
strings, so a name is spelt the same wherever it appears. No steps at all
is two empty strings.

Two strings, not a list per step, because a resume reads the graph only to
compare it with its own: parsing two strings costs a fraction of parsing a
list per step, and comparing them is a comparison of two strings (see
``WorkflowCheckpoint._records_graph``). They are decoded into a mapping only
when they are not the resuming graph's or something reads the graph itself,
and :func:`read` then checks every rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain

__all__ = ["GraphTextError", "check", "read", "spell"]

_SPECIAL = ("\\", "|", ",")


class GraphTextError(ValueError):
    """Malformed graph text; ``field`` is ``"graph_steps"`` or ``"graph_needs"``."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


def spell(
    names: Sequence[str], deps: Mapping[str, Sequence[str]], *, closed: bool = False
) -> tuple[str, str]:
    """``(graph_steps, graph_needs)`` for the steps ``names`` with dependencies ``deps``.

    Every name must be a ``str`` and not empty (an empty one is a
    ``ValueError``). ``closed=True`` says that every dependency is one of
    ``names`` (as in a valid graph), so that only ``names`` are looked at, for
    emptiness and for characters to escape.
    """
    # In the order of names; a graph's deps are (a mapping proxy's item
    # lookup, one per step, would cost more than the rest together).
    lists = list(deps.values()) if tuple(deps) == tuple(names) else [deps[n] for n in names]
    every = names if closed else [*names, *chain.from_iterable(lists)]
    if not all(every):
        raise ValueError("a graph's step names must not be empty")
    steps = "|".join(names)
    if closed:  # every name is in steps: nothing to escape if it holds only its separators
        plain = steps.count("|") == len(names) - 1 and "," not in steps and "\\" not in steps
    else:
        joined = "".join(every)
        plain = "|" not in joined and "," not in joined and "\\" not in joined
    if plain:  # the usual case: C loops only
        return steps, "|".join(map(",".join, lists))
    spelt = {name: _escaped(name) for name in every}
    return (
        "|".join(spelt[n] for n in names),
        "|".join(",".join(spelt[d] for d in ds) for ds in lists),
    )


def _escaped(name: str) -> str:
    for char in _SPECIAL:  # the backslash first, so that no escape is escaped again
        name = name.replace(char, "\\" + char)
    return name


def check(steps: str, needs: str) -> None:
    """The checks of :func:`read` that C loops can make, on text without a backslash:
    as many lists as steps, no empty name. Only a repeated step name is left to
    :func:`read`."""
    count = steps.count("|") + 1 if steps else 0
    listed = needs.count("|") + 1 if steps or needs else 0
    if listed != count:
        raise GraphTextError("graph_needs", f"has {listed} lists of dependencies for {count} steps")
    if steps and ("||" in steps or steps[0] == "|" or steps[-1] == "|"):
        raise GraphTextError("graph_steps", "holds an empty step name")
    if "," in steps:
        raise GraphTextError("graph_steps", "holds a ',' not escaped by a backslash")
    if ",," in needs or "|," in needs or ",|" in needs or needs[:1] == "," or needs[-1:] == ",":
        raise GraphTextError("graph_needs", "holds an empty dependency name")


def read(steps: str, needs: str) -> dict[str, tuple[str, ...]]:
    """The graph that ``steps`` and ``needs`` spell: step name to its dependencies.

    Raises :class:`GraphTextError` naming the string at fault for a lone
    backslash, an empty name, a step named twice, or a count of dependency
    lists other than the count of steps. Dependencies are not checked
    against the steps: the text is a record, compared with a graph, not one.
    """
    if "\\" not in steps and "\\" not in needs:
        check(steps, needs)
        names = [[name] for name in steps.split("|")] if steps else []
        lists = [entry.split(",") if entry else [] for entry in needs.split("|")] if steps else []
    else:
        names = _entries(steps, "graph_steps") if steps else []
        lists = _entries(needs, "graph_needs") if steps or needs else []
        if len(lists) != len(names):
            raise GraphTextError(
                "graph_needs", f"has {len(lists)} lists of dependencies for {len(names)} steps"
            )
        for entry in names:
            if len(entry) != 1:
                raise GraphTextError("graph_steps", "holds a ',' not escaped by a backslash")
            if not entry[0]:
                raise GraphTextError("graph_steps", "holds an empty step name")
        lists = [[] if entry == [""] else entry for entry in lists]
        if not all(map(all, lists)):
            raise GraphTextError("graph_needs", "holds an empty dependency name")
    graph: dict[str, tuple[str, ...]] = {}
    for (name,), listed in zip(names, lists, strict=True):
        if name in graph:
            raise GraphTextError("graph_steps", f"names step {name!r} twice")
        graph[name] = tuple(listed)
    return graph


def _entries(text: str, field: str) -> list[list[str]]:
    """``text`` cut at each ``|`` into lists, each cut at each ``,``, escapes undone."""
    entries: list[list[str]] = []
    items: list[str] = []
    item: list[str] = []
    chars = iter(text)
    for char in chars:
        if char == "\\":
            escaped = next(chars, "")
            if escaped not in _SPECIAL:
                raise GraphTextError(field, "holds a backslash that escapes none of \\ | ,")
            item.append(escaped)
        elif char == ",":
            items.append("".join(item))
            item = []
        elif char == "|":
            items.append("".join(item))
            entries.append(items)
            items, item = [], []
        else:
            item.append(char)
    items.append("".join(item))
    entries.append(items)
    return entries
