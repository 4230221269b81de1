"""A worker process for the queue tests: ``python -m tests.queue_worker_child URL LOGDIR [options]``.

Drives the workflows of :data:`REGISTRY` from the queue at URL until it is
killed or gets SIGTERM (then it stops gracefully). Every step attempt
appends ``start RUN STEP ATTEMPT PID`` to ``LOGDIR/steps-PID.log`` before it
works and ``end ...`` after; every run this process marks finished appends
``finish RUN PID`` to ``LOGDIR/finish-PID.log``. Lines are single
``os.write`` calls on ``O_APPEND`` files, so a SIGKILL never leaves half a
line that the parent would misread.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Any

from ekit_runtime import Step, Workflow
from ekit_runtime.queue import Lease, RunQueue, Worker, attempt_key, open_queue

LOGDIR = ""


def _log(kind: str, line: str) -> None:
    fd = os.open(os.path.join(LOGDIR, f"{kind}-{os.getpid()}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _step(name: str) -> Any:
    async def run(ctx: dict[str, Any]) -> str:
        key = attempt_key()
        _log("steps", f"start {key.run_id} {name} {key.attempt} {os.getpid()}")
        await asyncio.sleep(float(ctx.get(f"{name}_delay", ctx.get("delay", 0.0))))
        _log("steps", f"end {key.run_id} {name} {key.attempt} {os.getpid()}")
        return f"{name}@{os.getpid()}"

    return run


REGISTRY = {
    "crash": Workflow(
        [Step("a", _step("a")), Step("b", _step("b"), ("a",)), Step("c", _step("c"), ("a", "b"))]
    ),
    "slow": Workflow([Step("a", _step("a")), Step("b", _step("b"), ("a",)), Step("c", _step("c"), ("b",))]),
}


class _LoggedQueue:
    """The queue, logging each run this process marks finished (after the commit)."""

    def __init__(self, inner: RunQueue) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def finish(self, lease: Lease, status: Any, error: str | None = None) -> None:
        # Logged before and after the commit: a kill in between leaves only
        # the first line, and the parent then asks the database.
        _log("finish", f"finishing {lease.run_id} {os.getpid()}")
        self._inner.finish(lease, status, error)
        _log("finish", f"{status} {lease.run_id} {os.getpid()}")


async def _main(args: argparse.Namespace) -> None:
    queue = open_queue(args.url)
    worker = Worker(
        _LoggedQueue(queue),  # type: ignore[arg-type]
        REGISTRY,
        max_runs=args.max_runs,
        lease_seconds=args.lease,
        heartbeat=args.heartbeat,
        poll=0.02,
    )
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, worker.stop)
    print("ready", flush=True)
    await worker.run()
    queue.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("logdir")
    parser.add_argument("--lease", type=float, default=1.0)
    parser.add_argument("--heartbeat", type=float, default=0.2)
    parser.add_argument("--max-runs", type=int, default=2)
    ns = parser.parse_args()
    LOGDIR = ns.logdir
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(name)s: %(message)s")
    asyncio.run(_main(ns))
