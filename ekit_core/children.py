"""Child workflows: a step that runs another workflow, whose steps become steps of the graph.

This module owns what nesting a child *is*: how its steps are named and
wired into the parent's graph (:func:`nest`), which of them is its output,
and the readings over a graph that has children (:func:`children_of`,
:func:`parent_of`, :func:`rolled_up`). The rules that run the nested steps
are every step's rules, in :mod:`ekit_core.transitions`: nothing there
knows about children.

A step ``P`` with a child workflow ``C`` becomes, in the graph:

- one step ``P/s`` per step ``s`` of ``C`` (``C``'s own children nested in
  turn: ``P/s/t``), with ``C``'s dependencies prefixed, and shapes prefixed
  (``P/s`` maps over ``P/u``); every one of them (but a step that hands on
  its own child's output) also depends on ``P``'s declared dependencies:
  those are the child's inputs, which each of its steps sees as a run of
  ``C`` alone would see its initial context;
- ``P`` itself, whose one dependency is the child's output step ``P/o``
  (declared, or ``C``'s one sink: several sinks and no choice are refused),
  shaped ``Shape(child="P/o")``; the shell runs it as a step that hands on
  ``P/o``'s output, so what needs ``P`` sees the child's output.

So a child is a shape decided when the workflow is built: its steps are
known then, and the graph, its fingerprint and every checkpoint name them.
Each is recorded, resumed, retried, asked, budgeted and keyed as any step
is, and a crash in the child's seventh step resumes at the seventh. A
declared step named ``P/...`` beside such a ``P`` is refused, as ``P[...]``
and ``P#...`` are.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import NamedTuple

from ekit_core.errors import GraphError
from ekit_core.graph import GraphSpec
from ekit_core.shapes import Shape, child_name
from ekit_core.usage import NO_USAGE, TokenUsage

__all__ = ["Nested", "check_names", "children_of", "nest", "output_of", "parent_of", "rolled_up"]


class Nested(NamedTuple):
    """What :func:`nest` returns: the child's steps under their new names (name ->
    dependencies, in the child's order), their shapes, and the name of the output step."""

    steps: dict[str, tuple[str, ...]]
    shapes: dict[str, Shape]
    output: str


def output_of(parent: str, child: GraphSpec, output: str | None) -> str:
    """The child's output step (its own name): ``output`` if it is one of its steps, else its
    one sink; a ``GraphError`` naming ``parent`` otherwise."""
    if output is not None:
        if output not in child.index:
            raise GraphError(f"step {parent!r}: the output {output!r} is no step of its child "
                             f"workflow (steps: {', '.join(child.names[:8])})", [parent])
        return output
    needed = {d for deps in child.deps.values() for d in deps}
    sinks = [n for n in child.names if n not in needed]
    if len(sinks) != 1:
        raise GraphError(f"step {parent!r}: its child workflow has {len(sinks)} last steps "
                         f"({', '.join(map(repr, sinks[:8]))}): say which one is its output "
                         "(Child(workflow, output=...))", [parent])
    return sinks[0]


def nest(parent: str, inputs: tuple[str, ...], child: GraphSpec, output: str | None = None) -> Nested:
    """The steps of ``child`` as steps of the graph, under ``parent`` (see the module).

    ``inputs`` are the parent's declared dependencies. Pure: the caller
    adds the steps before ``parent`` and gives ``parent`` the dependency
    ``(nested.output,)`` and the shape ``Shape(child=nested.output)``.
    """
    out = output_of(parent, child, output)
    steps: dict[str, tuple[str, ...]] = {}
    for name in child.names:
        own = tuple(child_name(parent, d) for d in child.deps[name])
        shape = child.shapes.get(name)
        if shape is not None and shape.child is not None:  # (it hands on its own child's output)
            steps[child_name(parent, name)] = own
        else:
            steps[child_name(parent, name)] = (*own, *(d for d in inputs if d not in own))
    shapes: dict[str, Shape] = {}
    for name, shape in child.shapes.items():
        shapes[child_name(parent, name)] = replace(
            shape,
            map_over=None if shape.map_over is None else child_name(parent, shape.map_over),
            child=None if shape.child is None else child_name(parent, shape.child),
        )
    return Nested(steps, shapes, child_name(parent, out))


def check_names(parents: Iterable[str], names: Iterable[str], own: Mapping[str, Iterable[str]]) -> None:
    """Refuse a declared step named ``P/...`` beside a step ``P`` with a child, unless it is
    one of ``P``'s child's steps (``own[P]``): rules that tell a child's steps by their name
    (a graph's picture, an audit, a usage's roll-up) must never take another step for one."""
    prefixes = {f"{p}/": p for p in parents}
    if not prefixes:
        return
    for name in names:
        at = name.find("/", 1)
        while at > 0:
            parent = prefixes.get(name[:at + 1])
            if parent is not None and name not in own.get(parent, ()):
                raise GraphError(f"step {name!r} is named like a step of the child workflow of "
                                 f"step {parent!r} (named {parent}/step): rename one of them",
                                 [name, parent])
            at = name.find("/", at + 1)


def children_of(shapes: Mapping[str, Shape]) -> dict[str, str]:
    """Each step that runs a child workflow -> its child's output step, in declaration order."""
    return {n: s.child for n, s in shapes.items() if s.child is not None}


def parent_of(name: str, shapes: Mapping[str, Shape]) -> str | None:
    """The innermost step whose child workflow ``name`` (a step, an item ``s[k]`` or an
    iteration ``s#k`` of one) is a step of, or ``None`` for a step of the workflow itself."""
    at = name.rfind("/")
    while at > 0:
        owner = name[:at]
        shape = shapes.get(owner)
        if shape is not None and shape.child is not None:
            return owner
        at = name.rfind("/", 0, at)
    return None


def rolled_up(step_usage: Mapping[str, TokenUsage], parent: str) -> TokenUsage:
    """The usage of step ``parent`` with its child's: its own and every recorded step, item
    and iteration named ``parent/...`` (what a person reads as what the step cost)."""
    total = step_usage.get(parent, NO_USAGE)
    prefix = f"{parent}/"
    for name, usage in step_usage.items():
        if name.startswith(prefix):
            total = total + usage
    return total
