"""Child workflows in the shell: how a step declares one, and what a child's step sees.

The core owns what nesting is (:mod:`ekit_core.children`): the child's steps
are steps of the graph, ``research/fetch``, wired to the parent step's
dependencies, and the parent step hands on the child's output. This module
holds what a user writes and the shell's two small parts of it:

- :class:`Child`, given as ``Step("research", ("task",), child=Child(wf, output="draft"))``
  (or ``child=wf``, whose one last step is its output);
- :func:`in_child`, which wraps a child's step so that it reads its context
  (:mod:`ekit_runtime.nesting` puts each child's steps in its step's place
  when a :class:`~ekit_runtime.Workflow` is built);
- :class:`ChildContext`, what a child's step receives as its context: the
  step's own, read with the child's names (``ctx["fetch"]`` is
  ``research/fetch``'s output), falling back on the names outside the child
  (the parent's inputs), so the child's code runs unchanged as a step of its
  own workflow or of another's;
- ``Child(wf, queued=True)``, whose step runs the child as a queued run of its own
  (:mod:`ekit_runtime.child_runs`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

from ekit_core.graph import GraphSpec

__all__ = ["Child", "ChildContext", "Nestable", "handed_on", "in_child", "is_workflow", "unwrapped"]


class Nestable(Protocol):
    """What a child is: an ekit ``Workflow`` (its validated graph and its steps)."""

    @property
    def graph(self) -> GraphSpec:
        """The child's graph."""

    @property
    def steps(self) -> tuple[Any, ...]:
        """The child's steps, in the order of its graph."""

    @property
    def code_policies(self) -> Mapping[str, str]:
        """Step -> what a resume does when its code changed, for every fingerprinted step."""


@dataclass(frozen=True, slots=True)
class Child:
    """A child workflow as a step runs it: ``workflow``, and which of its steps is its
    ``output`` (what the step's dependents see; ``None``: its one last step)."""

    workflow: Nestable
    output: str | None = None
    queued: bool = False
    """In a queued run, run the child as a run of its own (its own id, status, lease and
    checkpoint; the parent parks holding no worker until it ends). Without a queue, the
    child runs inline, as one run inside the step. ``False``: its steps are the parent's."""

    def __post_init__(self) -> None:
        if not is_workflow(self.workflow):
            raise ValueError(f"Child.workflow must be an ekit Workflow, got "
                             f"{type(self.workflow).__name__}")
        if self.output is not None and (not isinstance(self.output, str) or not self.output):
            raise ValueError("Child.output must be a non-empty string or None")
        if not isinstance(self.queued, bool):
            raise ValueError(f"Child.queued must be True or False, got {self.queued!r:.80}")


class ChildContext(MutableMapping[str, Any]):
    """A child step's view of its context: ``view[k]`` reads ``prefix + k`` (a step of the
    same child), else ``k`` (what the parent step's dependencies, or the run, gave it).
    Writes are the step's own, as in any context. O(1) to build.

    A view of a view (a step of a child's child) reads ``P/c/k``, then ``P/k``, then
    ``k``: the innermost child's own first, then outward. It holds the run's context
    and those prefixes, so a read costs one lookup per level, not two per level
    compounded.
    """

    __slots__ = ("_names", "_outer", "_prefixes")

    def __init__(self, outer: MutableMapping[str, Any], prefix: str,
                 names: frozenset[str] | None = None) -> None:
        if isinstance(outer, ChildContext):
            self._outer: MutableMapping[str, Any] = outer._outer
            self._prefixes: tuple[str, ...] = (outer._prefixes[0] + prefix, *outer._prefixes)
            self._names: tuple[frozenset[str] | None, ...] = (names, *outer._names)
        else:
            self._outer, self._prefixes, self._names = outer, (prefix,), (names,)

    def _found(self, key: str) -> str | None:
        """The name of the run's context ``key`` reads, or ``None``: it is nowhere. A
        child's ``prefix + key`` only when ``key`` names one of its steps (or their items
        or iterations), given ``names``: an output a changed graph left under the prefix
        (a step the child no longer has) must not hide the child's input."""
        outer = self._outer
        for prefix, names in zip(self._prefixes, self._names, strict=True):
            if (names is None or _owned(key, names)) and prefix + key in outer:
                return prefix + key
        return key if key in outer else None

    def __getitem__(self, key: str) -> Any:
        if isinstance(key, str):
            found = self._found(key)
            if found is not None:
                return self._outer[found]
        return self._outer[key]

    def __contains__(self, key: object) -> bool:
        return self._found(key) is not None if isinstance(key, str) else key in self._outer

    def __setitem__(self, key: str, value: Any) -> None:
        self._outer[self._prefixes[0] + key] = value

    def __delitem__(self, key: str) -> None:
        found = self._found(key)
        del self._outer[key if found is None else found]

    def __iter__(self) -> Iterator[str]:
        prefixes, seen = self._prefixes, set()
        for key in self._outer:
            name = next((key[len(p):] for p in prefixes if key.startswith(p)), key)
            if name not in seen:  # (the first it reads, innermost first, hides the others)
                seen.add(name)
                yield name

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"ChildContext({self._prefixes[0]!r}, {len(self)} entries)"


def _owned(key: str, names: frozenset[str]) -> bool:
    """Whether ``key`` is one of ``names``, or an item (``s[k]``) or iteration (``s#k``) of one."""
    if key in names:
        return True
    cut = min((i for i in (key.find("["), key.find("#")) if i > 0), default=0)
    return cut > 0 and key[:cut] in names


def _sync_in_child(prefix: str, run: Callable[[Any], Any], names: frozenset[str] | None,
                   context: Any) -> Any:
    return run(ChildContext(context, prefix, names))


async def _async_in_child(prefix: str, run: Callable[[Any], Any], names: frozenset[str] | None,
                          context: Any) -> Any:
    return await run(ChildContext(context, prefix, names))


async def _stream_in_child(prefix: str, run: Callable[[Any], Any], names: frozenset[str] | None,
                           context: Any) -> Any:
    async with contextlib.aclosing(run(ChildContext(context, prefix, names))) as stream:
        async for value in stream:
            yield value


_WRAPPERS = (_sync_in_child, _async_in_child, _stream_in_child)


def is_workflow(value: object) -> bool:
    """Whether ``value`` is a workflow a step can run as its child (an ekit ``Workflow``;
    told by its graph, since the workflow's module imports this one)."""
    return isinstance(getattr(value, "graph", None), GraphSpec) and isinstance(
        getattr(value, "steps", None), tuple)


def handed_on(output: str, context: Mapping[str, Any]) -> Any:
    """The parent step's work: the child's output, as its own."""
    return context[output]


def in_child(prefix: str, run: Callable[[Any], Any],
             names: frozenset[str] | None = None) -> Callable[[Any], Any]:
    """``run`` called with its context seen from inside the child ``prefix`` names, whose
    steps are ``names`` (``None``: any name under ``prefix`` is the child's)
    (a partial of a module function: picklable, as Dask needs, and async, or an async
    generator, when ``run`` is: what the executors tell a step's kind by)."""
    wrapper = (_async_in_child if inspect.iscoroutinefunction(run)
               else _stream_in_child if inspect.isasyncgenfunction(run) else _sync_in_child)
    return functools.partial(wrapper, prefix, run, names)


def unwrapped(run: Any) -> Any:
    """The step's own function inside the wrappers :func:`in_child` put around it."""
    while isinstance(run, functools.partial) and run.func in _WRAPPERS:
        run = run.args[1]
    return run

