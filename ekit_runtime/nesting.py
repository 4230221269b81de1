"""Each child workflow's steps in its step's place: what :class:`~ekit_runtime.Workflow`
does with the steps it is given, when one of them declares ``child=``.

The names, the wiring and the output are the core's rule
(:func:`ekit_core.children.nest`); this module builds the shell's steps to
match: each child step's work wrapped to read its context with the child's
names (:func:`~ekit_runtime.children.in_child`), and the parent step, which
hands on the child's output.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from ekit_core.children import check_names, nest, output_of
from ekit_core.shapes import Shape
from ekit_runtime.child_runs import QueuedChild, run_queued_child
from ekit_runtime.children import Child, handed_on, in_child
from ekit_runtime.executors import DEFAULT_EXECUTOR
from ekit_runtime.step import Step

__all__ = ["flatten"]


def flatten(steps: Sequence[Step]) -> tuple[tuple[Step, ...], dict[str, Shape]]:
    """``steps`` with each step that declares a child replaced by its child's steps (named
    ``step/inner``) and by itself, handing on the child's output; and the shapes of the
    steps moved into the graph (their conditions keep the names their child gave them)."""
    out: list[Step] = []
    shapes: dict[str, Shape] = {}
    own: dict[str, set[str]] = {}
    for step in steps:
        child = step.child if isinstance(step, Step) else None
        if child is None or isinstance(child, str):  # (a str: a built workflow's, given again)
            out.append(step)
            continue
        declared = child if isinstance(child, Child) else Child(child)
        workflow = declared.workflow
        name = step.name
        if declared.queued:
            out.append(_queued(step, declared))
            continue
        nested = nest(name, step.depends_on, workflow.graph, declared.output)
        prefix = f"{name}/"
        names = frozenset(workflow.graph.names)  # (one set, shared by the child's steps)
        for inner, (moved, deps) in zip(workflow.steps, nested.steps.items(), strict=True):
            out.append(_moved(inner, moved, deps, prefix, workflow.code_policies.get(inner.name),
                              names))
        shapes.update(nested.shapes)
        repeat = step.repeat
        if repeat is not None:  # a loop whose body is the child: each iteration runs it whole
            cached = next((s.name for s in workflow.steps if s.cache), None)
            if cached is not None:
                raise ValueError(f"step {name + '/' + cached!r} of the body of loop {name!r}: "
                                 "cache=True is not supported in a loop's body (yet)")
        # Handing on is cheap work on the driver's loop: its own executor, whatever the run's
        # (a DaskExecutor refuses inline steps, and a worker process has nothing to do here).
        # A loop never runs it: the core records the loop's output as its last iteration's.
        # A child per item (map_over=): the core records the parent's output as its child's
        # output step's collected items'; it also depends on what it maps over.
        over = step.map_over
        out.append(Step(name, functools.partial(handed_on, nested.output),
                        (nested.output,) if over is None else (nested.output, over),
                        metadata=step.metadata, inline=True, executor=DEFAULT_EXECUTOR,
                        child=nested.output, repeat=repeat, map_over=over, item_key=step.item_key))
        shapes[name] = Shape(over, step.item_key, child=nested.output) if repeat is None else Shape(
            child=nested.output, repeat=repeat.max_iterations, keep_last=repeat.keep_last)
        own[name] = set(nested.steps)
    if own:
        check_names(own, [s.name for s in out], own)
    return tuple(out), shapes


def _queued(step: Step, declared: Child) -> Step:
    """The step whose child is a queued run of its own: one plain step of the parent's graph,
    whose work submits the child and waits for it (:func:`~ekit_runtime.child_runs.run_queued_child`).
    Async on the driver's loop, whatever the run's executor: it only reads and writes the queue."""
    output = output_of(step.name, declared.workflow.graph, declared.output)
    return Step(step.name, functools.partial(run_queued_child, QueuedChild(declared.workflow, output)),
                step.depends_on, metadata=step.metadata, inline=True, executor=DEFAULT_EXECUTOR,
                map_over=step.map_over, item_key=step.item_key, repeat=step.repeat)


def _moved(step: Step, name: str, deps: tuple[str, ...], prefix: str, policy: str | None,
           names: frozenset[str]) -> Step:
    """A child's ``step`` as the step ``name`` of the parent's graph; ``policy``, what a
    resume of the child does when the step's code changed, stays the step's own."""
    shaping = step.shaping
    if policy is not None and (shaping is None or shaping[7] is None):
        base = shaping or (None, None, None, "all", None, None, False, None)
        shaping = (*base[:7], policy, *base[8:])
    if shaping is not None:
        over, when = shaping[0], shaping[2]
        inner = shaping[8] if len(shaping) > 8 else None
        shaping = (
            None if over is None else prefix + over, shaping[1],
            None if when is None else in_child(prefix, when, names), *shaping[3:8],
            None if inner is None else prefix + inner,
        )
    return Step(name, in_child(prefix, step.run, names), deps, step.metadata, step.retry, step.timeout,
                step.blocking, step.context, step.inline, step.executor, step.version,
                shaping=shaping)
