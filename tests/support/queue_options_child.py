"""Workflows for the queue's run-option tests, driven by real ``ekit worker`` processes.

``ekit worker --workflows tests.support.queue_options_child:REGISTRY`` drives them.
Every step appends one line to ``<ctx["logdir"]>/<run id>.log`` (single
``os.write`` calls on an ``O_APPEND`` file, one worker process, one event
loop, so the order of the lines is the order things happened):

- ``spend``: a chain s1 -> s2 -> s3 -> s4, each reporting one LLM call and
  10 input tokens; s2 waits for ``<logdir>/go`` when ``ctx["hold"]`` is set.
- ``wide``: ``root``, then six steps that each log ``enter``, wait until
  ``ctx["expect"]`` of them are in at once (or all six have entered), let
  the loop run the other ready steps, and log ``exit``: the max seen in
  flight is what max_concurrency allowed.
- ``isolate``: a; b (fails) after a; c after b; d after a.
- ``mapped``: split (three items); each mapped over; then t.

:func:`trace_factory` is a ``--trace MODULE:ATTR``: each call appends
``call`` to ``<logdir>/trace-<run id>.log`` and returns a callback that
appends each event's class name.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

from ekit_core import TokenUsage
from ekit_runtime import PatternResult, Step, Workflow
from ekit_runtime.queue import Lease, attempt_key


def write(path: str, line: str) -> None:
    """Append one line to ``path`` with a single write."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _log(ctx: dict[str, Any], line: str) -> None:
    write(os.path.join(ctx["logdir"], f"{attempt_key().run_id}.log"), line)


def _lines(ctx: dict[str, Any]) -> list[str]:
    try:
        with open(os.path.join(ctx["logdir"], f"{attempt_key().run_id}.log")) as f:
            return f.read().split()
    except FileNotFoundError:
        return []


async def _until(condition: Callable[[], bool], seconds: float = 30.0) -> None:
    """Poll a condition on files another process (or step) writes, giving up after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:  # noqa: ASYNC110 - files, no Event to await
        await asyncio.sleep(0.005)


def _spend(name: str) -> Any:
    async def run(ctx: dict[str, Any]) -> Any:
        _log(ctx, f"start:{name}")
        if name == "s2" and ctx.get("hold"):
            await _until(lambda: os.path.exists(os.path.join(ctx["logdir"], "go")), seconds=60)
        return PatternResult(name, cost=TokenUsage(input_tokens=10, llm_calls=1))

    return run


def _wide(name: str) -> Any:
    async def run(ctx: dict[str, Any]) -> str:
        _log(ctx, "enter")

        def enough() -> bool:
            lines = _lines(ctx)
            entered = lines.count("enter")
            return entered - lines.count("exit") >= ctx["expect"] or entered == 6

        await _until(enough)
        # Let every other step that may start now start (each one is a task on
        # this loop, ready at once): a limit not applied shows as one more in.
        for _ in range(100):
            await asyncio.sleep(0)
        _log(ctx, "exit")
        return name

    return run


def _fail(ctx: dict[str, Any]) -> str:
    raise RuntimeError("b broke")


REGISTRY = {
    "spend": Workflow(
        [Step("s1", _spend("s1"))]
        + [Step(f"s{i}", _spend(f"s{i}"), (f"s{i - 1}",)) for i in range(2, 5)]
    ),
    "wide": Workflow(
        [Step("root", lambda ctx: "root")] + [Step(f"w{i}", _wide(f"w{i}"), ("root",)) for i in range(6)]
    ),
    "isolate": Workflow(
        [
            Step("a", lambda ctx: "a"),
            Step("b", _fail, ("a",)),
            Step("c", lambda ctx: "c", ("b",)),
            Step("d", lambda ctx: "d", ("a",)),
        ]
    ),
    "mapped": Workflow(
        [
            Step("split", lambda ctx: ["x", "y", "z"]),
            Step("each", lambda ctx: "done", ("split",), map_over="split"),
            Step("t", lambda ctx: "t", ("each",)),
        ]
    ),
}


def trace_factory(lease: Lease) -> Callable[[Any], None]:
    """One trace callback per drive, logging the drive and each event it receives."""
    path = os.path.join(lease.context["logdir"], f"trace-{lease.run_id}.log")
    write(path, f"call {lease.workflow}")
    return lambda event: write(path, type(event).__name__)
