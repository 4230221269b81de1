"""What ekit is measured against.

- :func:`floor_run`: the least an eager asyncio scheduler can do, with
  ``graphlib.TopologicalSorter`` and bare tasks and no checkpointing. What
  ekit costs beyond it is ekit's overhead.
- :func:`level_run`: level-by-level batching (start a level, wait for all of
  it, start the next), ExecutionKit's schedule, without needing ExecutionKit.
- :func:`executionkit_run` and :func:`langgraph_run`: the real libraries,
  from the optional ``bench`` extra; :func:`missing` says why one is absent.

Every runner takes the same :class:`~benchmarks.workloads.Graph` and step
factory and returns the outputs it computed (LangGraph keeps no per-step
outputs, so it returns none).
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections import deque
from collections.abc import Mapping
from graphlib import TopologicalSorter
from typing import Any

from benchmarks.workloads import Graph, StepFactory

__all__ = ["executionkit_run", "floor_run", "langgraph_run", "level_run", "missing"]


def missing(library: str) -> str | None:
    """``None`` if ``library`` (``executionkit`` or ``langgraph``) can be imported, else a note."""
    if importlib.util.find_spec(library) is None:
        return f"{library} not installed (pip install -e '.[bench]')"
    return None


async def floor_run(
    graph: Graph,
    factory: StepFactory,
    *,
    max_concurrency: int | None = None,
    resume: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Run eagerly: a step starts as soon as its dependencies are done.

    Each step sees only its dependencies' outputs. Steps already in
    ``resume`` are skipped. Completions are collected by done-callbacks
    rather than ``asyncio.wait``, which would re-register on every pending
    task per call and make wide graphs quadratic: the floor must be cheap.
    """
    deps = graph.deps
    bodies = {name: factory(name, d) for name, d in deps.items()}
    sorter = TopologicalSorter(deps)
    sorter.prepare()
    outputs: dict[str, Any] = dict(resume or {})
    finished: deque[tuple[str, asyncio.Task[Any]]] = deque()
    wakeup: list[asyncio.Future[None]] = []
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    running = 0

    async def limited(name: str, context: dict[str, Any]) -> Any:
        assert limit is not None
        async with limit:
            return await bodies[name](context)

    def launch(name: str) -> None:
        context = {d: outputs[d] for d in deps[name]}
        coro = limited(name, context) if limit else bodies[name](context)
        task = asyncio.create_task(coro)

        def done(t: asyncio.Task[Any]) -> None:
            finished.append((name, t))
            if wakeup and not wakeup[0].done():
                wakeup[0].set_result(None)

        task.add_done_callback(done)

    loop = asyncio.get_running_loop()
    while sorter.is_active():
        ready = sorter.get_ready()
        while ready:
            for name in ready:
                if name in outputs:
                    sorter.done(name)
                else:
                    launch(name)
                    running += 1
            ready = sorter.get_ready()
        if not running:
            continue
        while not finished:
            wakeup[:] = [loop.create_future()]
            await wakeup[0]
        while finished:
            name, task = finished.popleft()
            outputs[name] = task.result()
            running -= 1
            sorter.done(name)
    return outputs


def levels(graph: Graph) -> list[list[str]]:
    """The graph's steps grouped by depth (longest dependency path from a root)."""
    depth: dict[str, int] = {}
    grouped: list[list[str]] = []
    for name, deps in graph.deps.items():  # declaration order is topological
        d = max((depth[p] + 1 for p in deps), default=0)
        depth[name] = d
        if d == len(grouped):
            grouped.append([])
        grouped[d].append(name)
    return grouped


async def level_run(
    graph: Graph, factory: StepFactory, *, max_concurrency: int | None = None
) -> dict[str, Any]:
    """Run one level at a time, each level to its end before the next starts."""
    outputs: dict[str, Any] = {}
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(name: str) -> Any:
        body = factory(name, graph.deps[name])
        context = {d: outputs[d] for d in graph.deps[name]}
        if limit is None:
            return await body(context)
        async with limit:
            return await body(context)

    for level in levels(graph):
        results = await asyncio.gather(*(one(n) for n in level))
        outputs.update(zip(level, results, strict=True))
    return outputs


async def executionkit_run(
    graph: Graph,
    factory: StepFactory,
    *,
    max_concurrency: int | None = None,
    resume: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """ExecutionKit 0.4.0's ``Workflow``, checkpointing to a list.

    ExecutionKit has no ``max_concurrency`` argument: it runs each ready
    batch at most 10 at a time (its ``DEFAULT_MAX_CONCURRENCY``), which is
    what the makespan workload asks for, so the argument is only checked.
    ``resume`` is a checkpoint dict in ExecutionKit's format.
    """
    import executionkit.workflow as ek

    if max_concurrency not in (None, 10):
        raise ValueError("ExecutionKit runs batches at most 10 at a time")
    steps = [ek.Step(n, factory(n, d), d) for n, d in graph.deps.items()]
    saved: list[Any] = []
    start = ek.WorkflowCheckpoint.from_dict(dict(resume)) if resume is not None else None
    result = await ek.Workflow(steps).run(checkpoint_fn=saved.append, resume_from=start)
    return dict(result.outputs)


async def langgraph_run(
    graph: Graph, factory: StepFactory, *, max_concurrency: int | None = None
) -> dict[str, Any]:
    """LangGraph: one node per step, an edge (a join for several) per dependency,
    ``InMemorySaver`` checkpointing every superstep.

    Its state is one integer channel with a last-write-wins reducer, the
    cheapest state that lets any number of nodes write in one superstep; the
    step bodies run with an empty context, so it returns no outputs.
    """
    from typing import Annotated, TypedDict

    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import END, START, StateGraph

    def last(_old: int, new: int) -> int:
        return new

    # The functional form: this module's postponed annotations would leave a
    # class body's hints as strings that LangGraph cannot resolve in a closure.
    State = TypedDict("State", {"v": Annotated[int, last]})  # noqa: UP013

    def node(name: str) -> Any:
        body = factory(name, ())

        async def run(state: Any) -> dict[str, int]:
            await body({})
            return {"v": 1}

        return run

    builder = StateGraph(State)
    has_dependents: set[str] = set()
    for name, deps in graph.deps.items():
        builder.add_node(name, node(name))
        has_dependents.update(deps)
    for name, deps in graph.deps.items():
        if not deps:
            builder.add_edge(START, name)
        elif len(deps) == 1:
            builder.add_edge(deps[0], name)
        else:
            builder.add_edge(list(deps), name)  # a join: waits for every dependency
        if name not in has_dependents:
            builder.add_edge(name, END)
    app = builder.compile(checkpointer=InMemorySaver())
    config: dict[str, Any] = {
        "configurable": {"thread_id": "bench"},
        "recursion_limit": len(graph) + 10,
    }
    if max_concurrency is not None:
        config["max_concurrency"] = max_concurrency
    await app.ainvoke({"v": 0}, config)
    return {}
