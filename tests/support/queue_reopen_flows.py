"""Workflows for the retry, rewind, fork and human-input queue tests, driven by real worker processes.

``ekit worker --workflows tests.support.queue_reopen_flows:WORKFLOWS`` loads them.
Every step attempt appends ``start RUN STEP ATTEMPT PID`` to
``$EKIT_TEST_LOGDIR/steps.log`` (one ``os.write`` on an ``O_APPEND`` file:
never half a line), the attempt number being ``attempt_key().attempt`` as
the step sees it. Synchronisation is by files in that folder, never by time:

- ``chain``: ``a``, ``b`` after ``a``, ``c`` after ``b``, ``d`` after ``a``.
  ``b`` fails unless the file ``fixed`` exists (two attempts in all: its
  policy retries once).
- ``hold``: ``a``, then ``b``, which waits (politely, the loop running on)
  until the file ``go`` exists, after writing ``holding``.
- ``ask``: ``a``, then ``pick``, which asks a person "Which colour?" and logs
  ``got RUN pick VALUE PID`` with the answer it received, then ``pay``,
  which asks for an approval and logs ``paid RUN PID`` once approved.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from ekit_core import RetryPolicy
from ekit_runtime import Step, Workflow, approve, ask
from ekit_runtime.queue import attempt_key


def _dir() -> str:
    return os.environ["EKIT_TEST_LOGDIR"]


def _log(line: str) -> None:
    fd = os.open(os.path.join(_dir(), "steps.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _started(name: str) -> str:
    key = attempt_key()
    _log(f"start {key.run_id} {name} {key.attempt} {os.getpid()}")
    return f"{name}@{os.getpid()}#{key.attempt}"


def _plain(name: str) -> Any:
    async def run(ctx: dict[str, Any]) -> str:
        return _started(name)

    return run


async def _b_needs_the_fix(ctx: dict[str, Any]) -> str:
    out = _started("b")
    if not os.path.exists(os.path.join(_dir(), "fixed")):  # noqa: ASYNC240 - a tiny local file
        raise RuntimeError("the file 'fixed' is missing")
    return out


async def _b_holds(ctx: dict[str, Any]) -> str:
    out = _started("b")
    with open(os.path.join(_dir(), "holding"), "w"):  # noqa: ASYNC230
        pass
    while not os.path.exists(os.path.join(_dir(), "go")):  # noqa: ASYNC110, ASYNC240 - another process's file
        await asyncio.sleep(0.01)
    return out


async def _pick(ctx: dict[str, Any]) -> str:
    _started("pick")
    colour = ask("Which colour?", details={"choices": ["red", "blue"]})
    _log(f"got {attempt_key().run_id} pick {colour} {os.getpid()}")
    return f"picked {colour}"


def _pay(ctx: dict[str, Any]) -> str:  # a sync step: its thread reads the answers too
    _started("pay")
    approve("Pay $3 for the call?", details={"usd": 3})
    _log(f"paid {attempt_key().run_id} - {os.getpid()}")
    return "paid"


WORKFLOWS = {
    "chain": Workflow(
        [
            Step("a", _plain("a")),
            Step("b", _b_needs_the_fix, ("a",), retry=RetryPolicy(max_attempts=2, backoff_base=0.0)),
            Step("c", _plain("c"), ("b",)),
            Step("d", _plain("d"), ("a",)),
        ]
    ),
    "hold": Workflow([Step("a", _plain("a")), Step("b", _b_holds, ("a",))]),
    "ask": Workflow([Step("a", _plain("a")), Step("pick", _pick, ("a",)), Step("pay", _pay, ("pick",))]),
}


def starts(logdir: str) -> list[tuple[str, str, int, int]]:
    """``(run, step, attempt, pid)`` of every attempt started so far, in order."""
    try:
        with open(os.path.join(logdir, "steps.log")) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    started = [line.split()[1:] for line in lines if line.startswith("start ")]
    return [(r, s, int(a), int(p)) for r, s, a, p in started]


def lines(logdir: str, kind: str) -> list[list[str]]:
    """The log's lines of ``kind`` (``got``, ``paid``), split into words after the kind."""
    try:
        with open(os.path.join(logdir, "steps.log")) as f:
            found = [line.split() for line in f.read().splitlines()]
    except FileNotFoundError:
        return []
    return [words[1:] for words in found if words[0] == kind]
