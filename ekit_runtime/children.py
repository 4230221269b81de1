"""Child workflows in the shell: how a step declares one, and what a child's step sees.

The core owns what nesting is (:mod:`ekit_core.children`): the child's steps
are steps of the graph, ``research/fetch``, wired to the parent step's
dependencies, and the parent step hands on the child's output. This module
holds what a user writes and the shell's two small parts of it:

- :class:`Child`, given as ``Step("research", ("task",), child=Child(wf, output="draft"))``
  (or ``child=wf``, whose one last step is its output);
- :func:`flatten`, which :class:`~ekit_runtime.Workflow` calls when it is
  built: the declared steps with each child's steps in place;
- :class:`ChildContext`, what a child's step receives as its context: the
  step's own, read with the child's names (``ctx["fetch"]`` is
  ``research/fetch``'s output), falling back on the names outside the child
  (the parent's inputs), so the child's code runs unchanged as a step of its
  own workflow or of another's.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ekit_core.children import check_names, nest
from ekit_core.shapes import Shape

if TYPE_CHECKING:
    from ekit_runtime.step import Step
    from ekit_runtime.workflow import Workflow

__all__ = ["Child", "ChildContext", "flatten"]


@dataclass(frozen=True, slots=True)
class Child:
    """A child workflow as a step runs it: ``workflow``, and which of its steps is its
    ``output`` (what the step's dependents see; ``None``: its one last step)."""

    workflow: Workflow
    output: str | None = None

    def __post_init__(self) -> None:
        from ekit_runtime.workflow import Workflow  # (workflow imports this module)

        if not isinstance(self.workflow, Workflow):
            raise ValueError(f"Child.workflow must be an ekit Workflow, got "
                             f"{type(self.workflow).__name__}")
        if self.output is not None and (not isinstance(self.output, str) or not self.output):
            raise ValueError("Child.output must be a non-empty string or None")


class ChildContext(MutableMapping[str, Any]):
    """A child step's view of its context: ``view[k]`` reads ``prefix + k`` (a step of the
    same child), else ``k`` (what the parent step's dependencies, or the run, gave it).
    Writes are the step's own, as in any context. O(1) to build."""

    __slots__ = ("_outer", "_prefix")

    def __init__(self, outer: MutableMapping[str, Any], prefix: str) -> None:
        self._outer, self._prefix = outer, prefix

    def __getitem__(self, key: str) -> Any:
        outer = self._outer
        if isinstance(key, str):
            inner = self._prefix + key
            if inner in outer:
                return outer[inner]
        return outer[key]

    def __contains__(self, key: object) -> bool:
        return (isinstance(key, str) and self._prefix + key in self._outer) or key in self._outer

    def __setitem__(self, key: str, value: Any) -> None:
        self._outer[self._prefix + key] = value

    def __delitem__(self, key: str) -> None:
        inner = self._prefix + key
        del self._outer[inner if inner in self._outer else key]

    def __iter__(self) -> Iterator[str]:
        prefix, outer = self._prefix, self._outer
        cut = len(prefix)
        for key in outer:
            if key.startswith(prefix):
                yield key[cut:]
            elif prefix + key not in outer:
                yield key

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"ChildContext({self._prefix!r}, {len(self)} entries)"


def _sync_in_child(prefix: str, run: Callable[[Any], Any], context: Any) -> Any:
    return run(ChildContext(context, prefix))


async def _async_in_child(prefix: str, run: Callable[[Any], Any], context: Any) -> Any:
    return await run(ChildContext(context, prefix))


def _handed_on(output: str, context: Mapping[str, Any]) -> Any:
    """The parent step's work: the child's output, as its own."""
    return context[output]


def in_child(prefix: str, run: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``run`` called with its context seen from inside the child ``prefix`` names
    (a partial of a module function: picklable, as Dask needs, and async when ``run`` is)."""
    wrapper = _async_in_child if inspect.iscoroutinefunction(run) else _sync_in_child
    return functools.partial(wrapper, prefix, run)


def unwrapped(run: Any) -> Any:
    """The step's own function inside the wrappers :func:`in_child` put around it."""
    while isinstance(run, functools.partial) and run.func in (_sync_in_child, _async_in_child):
        run = run.args[1]
    return run


def flatten(steps: Sequence[Step]) -> tuple[tuple[Step, ...], dict[str, Shape]]:
    """``steps`` with each step that declares a child replaced by its child's steps (named
    ``step/inner``) and by itself, handing on the child's output; and the shapes of the
    steps moved into the graph (their conditions keep the names their child gave them)."""
    from ekit_runtime.step import Step

    out: list[Step] = []
    shapes: dict[str, Shape] = {}
    own: dict[str, set[str]] = {}
    for step in steps:
        child = step.child if isinstance(step, Step) else None
        if child is None:
            out.append(step)
            continue
        declared = child if isinstance(child, Child) else Child(child)
        workflow = declared.workflow
        name = step.name
        nested = nest(name, step.depends_on, workflow.graph, declared.output)
        prefix = f"{name}/"
        for inner, (moved, deps) in zip(workflow.steps, nested.steps.items(), strict=True):
            out.append(_moved(inner, moved, deps, prefix))
        shapes.update(nested.shapes)
        out.append(Step(name, functools.partial(_handed_on, nested.output), (nested.output,),
                        metadata=step.metadata, inline=True, child=nested.output))
        shapes[name] = Shape(child=nested.output)
        own[name] = set(nested.steps)
    if own:
        check_names(own, [s.name for s in out], own)
    return tuple(out), shapes


def _moved(step: Step, name: str, deps: tuple[str, ...], prefix: str) -> Step:
    """A child's ``step`` as the step ``name`` of the parent's graph."""
    from ekit_runtime.step import Step

    shaping = step.shaping
    if shaping is not None:
        over, when = shaping[0], shaping[2]
        inner = shaping[8] if len(shaping) > 8 else None
        shaping = (
            None if over is None else prefix + over, shaping[1],
            None if when is None else in_child(prefix, when), *shaping[3:8],
            None if inner is None else prefix + inner,
        )
    return Step(name, in_child(prefix, step.run), deps, step.metadata, step.retry, step.timeout,
                step.blocking, step.context, step.inline, step.executor, step.version,
                shaping=shaping)
