"""Workload graphs and the ekit runners that execute them.

A workload graph is plain data (:class:`Graph`): step names in declaration
order, each with its dependencies and, for the makespan workload, how long it
sleeps. Every runner (the library here, the baselines in
:mod:`benchmarks.baselines`) builds its own objects from the same graph, so
the figures compare schedulers, not inputs.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ekit_runtime import Step, Workflow

__all__ = [
    "Graph",
    "StepBody",
    "StepFactory",
    "chain",
    "checking_factory",
    "critical_path",
    "ekit_map_run",
    "ekit_run",
    "fan_in",
    "fan_out",
    "layered",
    "lower_bound",
    "makespan_dag",
    "map_steps",
    "noop_factory",
    "sleeping_factory",
]

StepBody = Callable[[dict[str, Any]], Awaitable[Any]]
StepFactory = Callable[[str, tuple[str, ...]], StepBody]
"""Makes the body of one step from its name and dependencies."""


@dataclass(frozen=True)
class Graph:
    """A DAG as plain data: ``deps[name]`` in declaration order, optional sleep times."""

    deps: dict[str, tuple[str, ...]]
    durations: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.deps)


# -- graph shapes -------------------------------------------------------------


def fan_out(children: int) -> Graph:
    """One root and ``children`` steps that each depend on it."""
    deps: dict[str, tuple[str, ...]] = {"root": ()}
    deps.update((f"c{i}", ("root",)) for i in range(children))
    return Graph(deps)


def fan_in(parents: int) -> Graph:
    """``parents`` independent steps and one ``join`` that depends on all of them."""
    deps: dict[str, tuple[str, ...]] = {f"p{i}": () for i in range(parents)}
    deps["join"] = tuple(deps)
    return Graph(deps)


def chain(n: int) -> Graph:
    """``n`` steps, each depending on the one before."""
    return Graph({f"s{i}": ((f"s{i - 1}",) if i else ()) for i in range(n)})


def layered(n: int, layers: int, seed: int) -> Graph:
    """``n`` steps in ``layers`` equal layers; each step after the first layer
    depends on 1 to 3 steps of the layer before it (seeded, so reproducible)."""
    rng = random.Random(seed)
    width = max(1, n // layers)
    deps: dict[str, tuple[str, ...]] = {}
    previous: list[str] = []
    for layer in range(layers):
        current = [f"l{layer}_{i}" for i in range(width)]
        for name in current:
            k = min(len(previous), rng.randint(1, 3))
            deps[name] = tuple(rng.sample(previous, k)) if previous else ()
        previous = current
    return Graph(deps)


def makespan_dag(seed: int, n: int = 60, median: float = 0.1, sigma: float = 0.6) -> Graph:
    """A random DAG of ``n`` steps sleeping lognormal times (``median`` seconds).

    Steps fall into 5 to 8 layers of random width; each step after the first
    layer depends on 1 to 3 earlier steps, at least one from the layer right
    before it, so the layers are the DAG's levels (what level-by-level
    batching waits on).
    """
    rng = random.Random(seed)
    layers = rng.randint(5, 8)
    # Random cut points give layers of uneven width, each at least one step.
    cuts = sorted(rng.sample(range(1, n), layers - 1))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    deps: dict[str, tuple[str, ...]] = {}
    durations: dict[str, float] = {}
    earlier: list[str] = []
    previous: list[str] = []
    for layer, size in enumerate(sizes):
        current = [f"m{layer}_{i}" for i in range(size)]
        for name in current:
            if previous:
                chosen = {rng.choice(previous)}
                extra = rng.randint(0, 2)
                chosen.update(rng.sample(earlier, min(extra, len(earlier))))
                deps[name] = tuple(sorted(chosen))
            else:
                deps[name] = ()
            durations[name] = median * math.exp(rng.gauss(0.0, sigma))
        earlier.extend(current)
        previous = current
    return Graph(deps, durations)


def critical_path(graph: Graph) -> float:
    """The longest sum of durations along any dependency path."""
    finish: dict[str, float] = {}
    for name, deps in graph.deps.items():  # declaration order is topological
        finish[name] = max((finish[d] for d in deps), default=0.0) + graph.durations[name]
    return max(finish.values())


def lower_bound(graph: Graph, workers: int) -> float:
    """No schedule on ``workers`` slots beats max(critical path, total work / workers)."""
    return max(critical_path(graph), sum(graph.durations.values()) / workers)


# -- step bodies --------------------------------------------------------------


async def _noop(context: dict[str, Any]) -> int:
    return 1


def noop_factory(name: str, deps: tuple[str, ...]) -> StepBody:
    """The same no-op body for every step: what is timed is the scheduler."""
    return _noop


def checking_factory(name: str, deps: tuple[str, ...]) -> StepBody:
    """A body whose output depends on its dependencies' outputs, to compare runners.

    Reads only ``deps`` from the context, so it gives the same output in
    either context mode and in every baseline.
    """

    async def body(context: dict[str, Any]) -> int:
        return (sum(context[d] for d in deps) * 31 + len(name)) % 1_000_003

    return body


def sleeping_factory(graph: Graph) -> StepFactory:
    """Bodies that sleep the graph's duration for their step (the makespan workload)."""

    def factory(name: str, deps: tuple[str, ...]) -> StepBody:
        seconds = graph.durations[name]

        async def body(context: dict[str, Any]) -> int:
            await asyncio.sleep(seconds)
            return 1

        return body

    return factory


# -- the library --------------------------------------------------------------


def ekit_steps(
    graph: Graph, factory: StepFactory, mode: Literal["all", "dependencies"]
) -> list[Step]:
    """The graph as ekit ``Step`` objects with context mode ``mode``."""
    return [Step(n, factory(n, d), d, context=mode) for n, d in graph.deps.items()]


async def ekit_run(
    graph: Graph,
    factory: StepFactory,
    *,
    mode: Literal["all", "dependencies"] = "dependencies",
    max_concurrency: int | None = None,
    checkpoint_fn: Callable[[Any], Any] | None = None,
) -> dict[str, Any]:
    """Build and run the graph with ekit, checkpointing to a list unless told otherwise."""
    saved: list[Any] = []
    workflow = Workflow(ekit_steps(graph, factory, mode))
    result = await workflow.run(
        checkpoint_fn=checkpoint_fn if checkpoint_fn is not None else saved.append,
        max_concurrency=max_concurrency,
    )
    return dict(result.outputs)


# -- the run-time map (issue 25) ----------------------------------------------


def map_steps(items: int, factory: StepFactory,
              mode: Literal["all", "dependencies"]) -> list[Step]:
    """A root returning ``items`` items and one step mapped over it: the map
    counterpart of :func:`fan_out` (one root, ``items`` children), grown at run time."""
    values = list(range(items))

    async def root(context: dict[str, Any]) -> list[int]:
        return values

    return [Step("root", root, context=mode),
            Step("m", factory("m", ("root",)), ("root",), map_over="root", context=mode)]


async def ekit_map_run(
    items: int,
    factory: StepFactory,
    *,
    mode: Literal["all", "dependencies"] = "dependencies",
    max_concurrency: int | None = None,
    checkpoint_fn: Callable[[Any], Any] | None = None,
) -> dict[str, Any]:
    """Run :func:`map_steps` with ekit, checkpointing to a list unless told otherwise."""
    saved: list[Any] = []
    workflow = Workflow(map_steps(items, factory, mode))
    result = await workflow.run(
        checkpoint_fn=checkpoint_fn if checkpoint_fn is not None else saved.append,
        max_concurrency=max_concurrency,
    )
    return dict(result.outputs)
