"""Test helpers for the runtime: steps whose completion the test controls."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ekit_core import WorkflowCheckpoint
from ekit_core.graph_text import spell
from ekit_runtime import PatternResult, TokenUsage


async def until(condition: Callable[[], bool], *, turns: int = 10_000) -> None:
    """Yield to the event loop until ``condition()`` holds (no wall-clock waiting)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


class Gates:
    """Steps that record their start and finish only when the test releases them."""

    def __init__(self) -> None:
        self.events: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.started: list[str] = []
        self.finished: list[str] = []
        self.contexts: dict[str, dict[str, Any]] = {}

    def step(self, name: str, *, usage: TokenUsage | None = None) -> Callable[[dict[str, Any]], Any]:
        async def run(context: dict[str, Any]) -> Any:
            self.started.append(name)
            self.contexts[name] = dict(context)
            await self.events[name].wait()
            self.finished.append(name)
            value = f"<{name}>"
            return PatternResult(value, cost=usage) if usage is not None else value

        return run

    def release(self, *names: str) -> None:
        for name in names:
            self.events[name].set()

    def running(self) -> set[str]:
        return set(self.started) - set(self.finished)


def recorded_graph(data: Mapping[str, Any]) -> dict[str, list[str]]:
    """The graph a checkpoint dict records, step name to its dependencies (either spelling)."""
    graph = WorkflowCheckpoint.from_dict(dict(data)).graph or {}
    return {k: list(v) for k, v in graph.items()}


def with_recorded_graph(data: Mapping[str, Any], graph: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    """A copy of the checkpoint dict ``data`` recording ``graph`` instead, spelt as ``to_dict`` spells it."""
    out = {k: v for k, v in data.items() if k not in ("graph", "graph_steps", "graph_needs")}
    out["graph_steps"], out["graph_needs"] = spell(list(graph), graph)
    return out


def untimed(checkpoint: WorkflowCheckpoint) -> WorkflowCheckpoint:
    """``checkpoint`` without its ``durations`` (``began``, ``drives``): what two runs of one workflow
    agree on.

    Durations are clock readings, so checkpoints of separate runs differ in
    them alone; compare these, and the durations' names with
    :func:`timed_alike`.
    """
    import dataclasses
    from types import MappingProxyType

    return dataclasses.replace(checkpoint, durations=MappingProxyType({}), began=MappingProxyType({}),
                               drives=(), _times=None)


def timed_alike(a: WorkflowCheckpoint | None, b: WorkflowCheckpoint | None) -> bool:
    """Whether ``a`` and ``b`` are equal but for their durations' values: the same
    fields, and a duration for the same steps."""
    if a is None or b is None:
        return a is b
    return untimed(a) == untimed(b) and a.durations.keys() == b.durations.keys()
