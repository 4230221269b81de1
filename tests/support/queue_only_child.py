"""A workflow for the queue's step-selection tests, driven by real ``ekit worker`` processes.

``ekit worker --workflows tests.support.queue_only_child:REGISTRY`` drives it.
Every step (and item) appends ``run-id step`` to ``<ctx["logdir"]>/starts.log``
with one ``os.write`` on an ``O_APPEND`` file when it starts, so a test reads
exactly which steps each run paid for.

- ``branches``: fetch (two pages); summary after fetch; translate after
  fetch, polish after translate; chunks mapped over fetch; report after
  summary, polish and chunks.
"""

from __future__ import annotations

import os
from typing import Any

from ekit_runtime import Step, Workflow
from ekit_runtime.queue import attempt_key


def _start(ctx: dict[str, Any], name: str) -> None:
    fd = os.open(os.path.join(ctx["logdir"], "starts.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, f"{attempt_key().run_id} {name}\n".encode())
    finally:
        os.close(fd)


def _step(name: str, *deps: str) -> Step:
    def run(ctx: dict[str, Any]) -> Any:
        _start(ctx, name)
        if name == "fetch":
            return ["p1", "p2"]
        if name == "chunks":
            return f"chunk of {ctx['fetch']}"
        return f"{name}<{','.join(str(ctx[d]) for d in deps)}>"

    return Step(name, run, deps, map_over="fetch" if name == "chunks" else None)


REGISTRY = {
    "branches": Workflow([
        _step("fetch"),
        _step("summary", "fetch"),
        _step("translate", "fetch"),
        _step("polish", "translate"),
        _step("chunks", "fetch"),
        _step("report", "summary", "polish", "chunks"),
    ]),
}


def starts(logdir: str) -> list[tuple[str, str]]:
    """``(run id, step)`` of every start so far, in order."""
    try:
        with open(os.path.join(logdir, "starts.log")) as f:
            return [(r, s) for r, s in (line.split() for line in f if line.strip())]
    except FileNotFoundError:
        return []
