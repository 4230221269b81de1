"""Step selection: a run that executes only chosen steps and what they need.

This module owns the rule of a run's ``only`` option: which names a
selection may hold (:func:`check_only`), what it closes over
(:func:`closure`), which steps and items a selective run may start
(:func:`selected`), how its first state is narrowed to them
(:func:`narrowed`), and which steps it leaves for a later run
(:func:`left_out`). :mod:`ekit_core.transitions` applies it where steps
become ready; a run without ``only`` never reaches any of it.

The rule:

- ``only`` is a non-empty list (or tuple) of declared step names; the run
  may start those steps and every step they transitively need: their
  dependencies, which by the shapes' validity (:mod:`ekit_core.shapes`)
  include the step a mapped step maps over and every input of a join,
  whether or not it is conditional. The items of a selected mapped step
  are selected with it; the items of any other mapped step are not.
- A step of a loop's body (``L/s``, ``L`` a loop whose body is a workflow)
  is refused by name, as an item is: it runs only as the iterations
  ``L/s#k`` the loop grows, which a selection without the loop would never
  start. Select the loop: its body runs with it.
- Recorded outputs are still skipped; a step outside the selection never
  starts. Its graph, fingerprint and checkpoints are the whole workflow's,
  so a later run without ``only`` resumes and runs the rest.
- The run ends once every selected step is recorded or skipped (or as a
  run ends otherwise: a failure, a budget, a denial, a question left
  unanswered, a cancellation). The steps outside the selection left
  unrecorded are :func:`left_out`.
- A skip still passes to every step that needs the skipped one, selected
  or not (a full run would record the same skip, and a resume refuses a
  checkpoint that records a skip but not what it reaches); a join over
  alternatives outside the selection counts its skipped inputs but never
  starts.
- A mapped step outside the selection whose input is recorded is expanded
  (its recorded items are known, an early cutoff keeps what it keeps) but
  none of its items starts, it is never collected, and an input it cannot
  split fails nothing in this run. A skipped item still reaches the items
  chained to it (:func:`held_chained`), as in a run of every step.
- Steps added while the run goes (:mod:`ekit_core.growth`) are outside the
  selection, which is fixed when the run starts: they wait for a run
  without ``only``.

Everything here is O(selection) or O(graph) once per run, never per step.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ekit_core.expansion import Expanded, Expansion, mapped_children
from ekit_core.graph import GraphSpec
from ekit_core.shapes import item_name

if TYPE_CHECKING:
    from ekit_core.state import State

__all__ = [
    "check_only", "closure", "held_chained", "left_out", "narrowed", "needs", "selected", "split",
]


def check_only(graph: GraphSpec, only: object) -> tuple[str, ...]:
    """``only`` as a tuple of declared step names (each once), or a ``ValueError`` naming
    the field ``only`` and the bad name: not a list or tuple, empty, a name that is no
    string, an item of a mapped step (``M[key]``) rather than a step, a step of a loop's
    body (``L/s``) rather than the loop, an unknown name."""
    if not isinstance(only, list | tuple):
        raise ValueError(
            f"only must be a list of step names, got {type(only).__name__} {only!r:.80}"
        )
    if not only:
        raise ValueError("only must name at least one step, got an empty list")
    index = graph.index
    for i, name in enumerate(only):
        if not isinstance(name, str):
            raise ValueError(
                f"only[{i}] must be a step name (a str), got {type(name).__name__} {name!r:.80}"
            )
        if name in index:
            loop = _body_owner(graph, name)
            if loop is not None:
                raise ValueError(
                    f"only names {name!r}, a step of the body of the loop {loop!r}, which runs "
                    f"only as the loop's iterations: select {loop!r} (its body runs with it)"
                )
            continue
        owner = _item_owner(graph, name)
        if owner is not None:
            raise ValueError(
                f"only names {name!r}, an item of the mapped step {owner!r}, not a step: "
                f"select {owner!r} (its items run with it)"
            )
        close = difflib.get_close_matches(name, index.keys(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"only names unknown step {name!r}{hint}")
    return tuple(dict.fromkeys(only))


def _body_owner(graph: GraphSpec, name: str) -> str | None:
    """The loop whose body declares step ``name`` (``L/s``), or ``None``."""
    if "/" not in name:  # (most names: no test per shape)
        return None
    for step, shape in graph.shapes.items():
        if shape.repeat is not None and shape.child is not None and name.startswith(f"{step}/"):
            return step
    return None


def _item_owner(graph: GraphSpec, name: str) -> str | None:
    """The mapped step ``name`` would be an item of (``M[key]``), or ``None``."""
    if not name.endswith("]") or "[" not in name:
        return None
    for step, shape in graph.shapes.items():
        if shape.map_over is not None and name.startswith(f"{step}["):
            return step
    return None


def needs(graph: GraphSpec, name: str) -> tuple[str, ...]:
    """What step ``name`` cannot run without: its dependencies, and the step it maps over
    (one of them, by :func:`~ekit_core.shapes.check_shapes`; named apart so that the
    rule says so). A join's inputs and a conditional step's inputs are its dependencies."""
    deps = graph.deps[name]
    shape = graph.shapes.get(name)
    over = None if shape is None else shape.map_over
    if over is None or over in deps:
        return deps
    return (*deps, over)


def closure(graph: GraphSpec, only: Iterable[str]) -> frozenset[str]:
    """The steps of ``graph`` that ``only`` (checked names) transitively needs, those included."""
    seen: set[str] = set()
    todo = list(only)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(d for d in needs(graph, name) if d not in seen)
    return frozenset(seen)


def selected(selection: frozenset[str], shaped: Expansion | None, name: str) -> bool:
    """May a run selecting ``selection`` start step (or item) ``name``?"""
    if name in selection:
        return True
    ref = None if shaped is None else shaped.items.get(name)
    return ref is not None and ref.step in selection


def narrowed(
    names: tuple[str, ...], selection: frozenset[str], ready: list[int], pending: list[str]
) -> tuple[list[int], list[str], int]:
    """A first state's ready steps (declaration indices) and unsettled steps cut down to
    ``selection``, and how many unsettled steps that leaves out (what the run never settles)."""
    kept = [n for n in pending if n in selection]
    return [i for i in ready if names[i] in selection], kept, len(pending) - len(kept)


def split(more: Expanded, selection: frozenset[str]) -> tuple[Expanded, Expanded]:
    """An expansion as the selected mapped steps' part and the part a selective run never starts."""
    def part(keep: bool) -> Expanded:
        members = {m: v for m, v in more.members.items() if (m in selection) is keep}
        return Expanded(
            {n: d for n, d in more.steps.items() if more.items[n].step in members},
            {n: r for n, r in more.items.items() if r.step in members},
            members,
            {m: k for m, k in more.kinds.items() if m in members},
        )

    return part(True), part(False)


def held_chained(
    declared: GraphSpec, graph: GraphSpec, shaped: Expansion | None, selection: frozenset[str],
    item: str,
) -> tuple[str, ...]:
    """The items a selective run holds (of mapped steps outside ``selection``) chained to
    ``item`` (``N[k]`` for ``M[k]``, ``N`` mapped over ``M``): what a skip of ``item``
    reaches besides the steps it schedules, as it would in a run of every step."""
    ref = None if shaped is None else shaped.items.get(item)
    if ref is None:
        return ()
    return tuple(
        name for child in mapped_children(declared, ref.step)
        if child not in selection and (name := item_name(child, ref.key)) in graph.index
    )


def left_out(state: State) -> tuple[str, ...]:
    """The steps a selective run left for a later one: outside its selection, neither
    recorded nor skipped, in declaration order (then the steps added while it ran).
    ``()`` for a run without ``only``."""
    selection = state.spec.limits.only
    if selection is None:
        return ()
    outputs, skipped = state.outputs, state.skipped
    shaped = state.spec.shaped
    items: Mapping[str, Any] = shaped.items if shaped is not None else {}
    return tuple(
        n for n in state.spec.graph.names
        if n not in selection and n not in items and n not in outputs and n not in skipped
    )
