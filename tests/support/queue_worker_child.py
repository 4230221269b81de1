"""A worker process for the queue tests: ``python -m tests.support.queue_worker_child URL LOGDIR [options]``.

Drives the workflows of :data:`REGISTRY` from the queue at URL until it is
killed or gets SIGTERM (then it stops gracefully). Every step attempt
appends ``start RUN STEP ATTEMPT PID`` to ``LOGDIR/steps-PID.log`` before it
works and ``end ...`` after; every run this process marks finished appends
``finish RUN PID`` to ``LOGDIR/finish-PID.log``. Lines are single
``os.write`` calls on ``O_APPEND`` files, so a SIGKILL never leaves half a
line that the parent would misread.

Synchronisation is by files in LOGDIR, never by time: with ``--hold-after
N`` every step attempt after this process's N-th waits forever once it has
logged its start (and writes ``LOGDIR/held-PID.log``), so the parent knows
the process is mid-run; the ``stall`` workflow's ``a`` stalls this process
(and writes ``LOGDIR/stalled-PID.log``) when ``LOGDIR/stall-PID`` exists,
until ``LOGDIR/go`` does: by blocking the event loop (``stall-PID`` holds
``loop``), or by waiting politely, for the parent to SIGSTOP the process
(``sigstop``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from ekit_runtime import Step, Workflow
from ekit_runtime.queue import Ending, RunQueue, Worker, attempt_key, open_queue

LOGDIR = ""
HOLD_AFTER: int | None = None
_started = [0]


def _log(kind: str, line: str) -> None:
    fd = os.open(os.path.join(LOGDIR, f"{kind}-{os.getpid()}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _path(name: str) -> str:
    return os.path.join(LOGDIR, name)


async def _hold_if_asked() -> None:
    _started[0] += 1
    if HOLD_AFTER is not None and _started[0] > HOLD_AFTER:
        _log("held", f"held {os.getpid()}")
        await asyncio.Event().wait()


def _step(name: str) -> Any:
    async def run(ctx: dict[str, Any]) -> str:
        key = attempt_key()
        _log("steps", f"start {key.run_id} {name} {key.attempt} {os.getpid()}")
        await _hold_if_asked()
        await asyncio.sleep(float(ctx.get(f"{name}_delay", ctx.get("delay", 0.0))))
        _log("steps", f"end {key.run_id} {name} {key.attempt} {os.getpid()}")
        return f"{name}@{os.getpid()}"

    return run


async def _stall_a(ctx: dict[str, Any]) -> str:
    key = attempt_key()
    _log("steps", f"start {key.run_id} a {key.attempt} {os.getpid()}")
    try:
        with open(_path(f"stall-{os.getpid()}")) as f:  # noqa: ASYNC230 - a tiny local file
            how = f.read().strip()
    except FileNotFoundError:
        how = ""
    if how:
        _log("stalled", f"stalled {os.getpid()}")
    while how and not os.path.exists(_path("go")):  # noqa: ASYNC240
        if how == "loop":
            time.sleep(0.005)  # noqa: ASYNC251 - a sync call in an async step: the loop stalls
        else:
            await asyncio.sleep(0.005)  # the loop runs on, until the parent's SIGSTOP
    _log("steps", f"end {key.run_id} a {key.attempt} {os.getpid()}")
    return f"a@{os.getpid()}"


REGISTRY = {
    "crash": Workflow(
        [Step("a", _step("a")), Step("b", _step("b"), ("a",)), Step("c", _step("c"), ("a", "b"))]
    ),
    "slow": Workflow([Step("a", _step("a")), Step("b", _step("b"), ("a",)), Step("c", _step("c"), ("b",))]),
    # a, then three steps that each start only once a's output is in.
    "stall": Workflow(
        [Step("a", _stall_a)] + [Step(n, _step(n), ("a",)) for n in ("b", "c", "d")]
    ),
}


class _LoggedQueue:
    """The queue, logging each run this process marks finished (after the commit)."""

    def __init__(self, inner: RunQueue) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def write_many(
        self, saves: Any, endings: Sequence[Ending], lease_seconds: float, more: Any = None
    ) -> tuple[list[bool | Exception], list[Exception | None]]:
        # The worker ends its runs here, in the commit of the saves that meet
        # them. Logged before and after the commit: a kill in between leaves
        # only the first line, and the parent then asks the database.
        for end in endings:
            _log("finish", f"finishing {end.lease.run_id} {os.getpid()}")
        saved, ended = self._inner.write_many(saves, endings, lease_seconds, more)
        for end, outcome in zip(endings, ended, strict=True):
            if outcome is None:
                _log("finish", f"{end.status} {end.lease.run_id} {os.getpid()}")
        return saved, ended


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
    parser.add_argument("--hold-after", type=int, default=None)
    ns = parser.parse_args()
    LOGDIR = ns.logdir
    HOLD_AFTER = ns.hold_after
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(name)s: %(message)s")
    asyncio.run(_main(ns))
