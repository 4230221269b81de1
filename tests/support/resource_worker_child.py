"""A worker process for the resource-cap tests.

``python -m tests.support.resource_worker_child URL DIR [options]``.

Drives the workflows of :data:`REGISTRY` until killed or sent SIGTERM. Their
steps tagged ``resource="api"`` keep a ledger of the attempts inside them
across every process, in ``DIR/ledger.json`` under an ``flock`` on
``DIR/ledger.lock``: on entering, an attempt drops the entries of processes
that are gone (killed), adds its own, and records how many are inside (the
high-water mark and each entry, with the time); on leaving it removes its
own. The file is replaced whole (``os.replace``), so a SIGKILL mid-write
leaves the previous ledger, and the lock dies with its holder.

With ``--hold`` every tagged attempt stays inside forever once it entered
(so the parent knows this process holds slots); ``delay`` in a run's
context is how long a tagged attempt stays inside otherwise, and ``meet``
how many worker processes must drive runs before any run ends (the ledger's
``drivers``).
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import logging
import os
import signal
import sys
import time
from typing import Any

from ekit_runtime import Step, Workflow
from ekit_runtime.queue import Worker, attempt_key, open_queue

DIR = ""
HOLD = False


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a killed child not yet reaped by the parent is a zombie: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _ledger(change: Any) -> None:
    """Apply ``change(state)`` to the ledger under its lock, and store it whole."""
    with open(os.path.join(DIR, "ledger.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = os.path.join(DIR, "ledger.json")
        try:
            with open(path) as f:
                state = json.load(f)
        except FileNotFoundError:
            state = {"inside": [], "max": 0, "entries": [], "exits": []}
        change(state)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)


def _enter(key: str) -> None:
    def change(state: dict[str, Any]) -> None:
        inside = [e for e in state["inside"] if _alive(e[0])]
        inside.append([os.getpid(), key])
        state["inside"] = inside
        state["max"] = max(state["max"], len(inside))
        state["entries"].append([time.time(), len(inside), os.getpid(), key])

    _ledger(change)


def _leave(key: str) -> None:
    def change(state: dict[str, Any]) -> None:
        state["inside"] = [e for e in state["inside"] if e != [os.getpid(), key]]
        state["exits"].append([time.time(), os.getpid(), key])

    _ledger(change)


def _tagged(name: str) -> Any:
    async def run(ctx: dict[str, Any]) -> str:
        key = str(attempt_key())
        _enter(key)
        if HOLD:
            await asyncio.Event().wait()
        try:
            await asyncio.sleep(float(ctx.get("delay", 0.05)))
        finally:
            _leave(key)
        return f"{name}@{os.getpid()}"

    return run


def _free(ctx: dict[str, Any]) -> str:
    return "free"


async def _meeting(ctx: dict[str, Any]) -> str:
    """Untagged: record that this process drives a run, then wait until ``ctx["meet"]`` processes
    do (none asked: at once). The run cannot end before, so its worker keeps its places busy
    and the other workers must take the rest: the work is shared however slowly they start."""
    meet = int(ctx.get("meet", 0))

    def joined(state: dict[str, Any]) -> None:
        state["drivers"] = sorted({*state.get("drivers", []), os.getpid()})

    _ledger(joined)
    seen: list[int] = []
    while len(seen) < meet:
        _ledger(lambda state: seen.__setitem__(slice(None), state.get("drivers", [])))
        if len(seen) < meet:
            await asyncio.sleep(0.02)  # (another process's write is what this waits for)
    return "free"


REGISTRY = {
    # Three tagged steps at once per run, and an untagged one beside them.
    "fan": Workflow(
        [Step(n, _tagged(n), resource="api") for n in ("a", "b", "c")]
        + [Step("free", _meeting), Step("end", _free, ("a", "b", "c", "free"))]
    ),
}


async def _main(args: argparse.Namespace) -> None:
    queue = open_queue(args.url)
    worker = Worker(
        queue, REGISTRY, max_runs=args.max_runs, lease_seconds=args.lease, heartbeat=args.heartbeat, poll=0.02
    )
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, worker.stop)
    print("ready", flush=True)
    await worker.run()
    queue.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("dir")
    parser.add_argument("--lease", type=float, default=1.0)
    parser.add_argument("--heartbeat", type=float, default=0.2)
    parser.add_argument("--max-runs", type=int, default=2)
    parser.add_argument("--hold", action="store_true")
    ns = parser.parse_args()
    DIR, HOLD = ns.dir, ns.hold
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(name)s: %(message)s")
    asyncio.run(_main(ns))
