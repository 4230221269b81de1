"""Workflows whose steps stream, for the stream tests' worker processes (``ekit worker --workflows``).

- ``talk``: one async step reporting ``n`` tokens (``t0 ``, ``t1 `` ...) through
  ``partial()``, yielding to the loop every 100 tokens as a step awaiting a
  model's next chunk does; it returns ``n``.
- ``fail``: a step that reports one token, then raises.
- ``slow``: ``n`` tokens, one every 10 ms.
- ``grow``: an async generator step yielding its text so far, ``n`` tokens
  (the text ``tokens(n)``), then a revision that does not extend it
  (``"revised"``), then ``"revised!"``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ekit_runtime import Step, Workflow, partial


async def talk(ctx: Any) -> int:
    n = int(ctx.get("n", 100))
    for i in range(n):
        partial(f"t{i} ")
        if i % 100 == 99:
            await asyncio.sleep(0)
    return n


async def slow(ctx: Any) -> int:
    """``n`` tokens, one every 10 ms: a step a test can kill its worker in the middle of."""
    n = int(ctx.get("n", 300))
    for i in range(n):
        partial(f"t{i} ")
        await asyncio.sleep(0.01)
    return n


async def grow(ctx: Any) -> Any:
    n = int(ctx.get("n", 100))
    text = ""
    for i in range(n):
        text += f"t{i} "
        yield text
        if i % 100 == 99:
            await asyncio.sleep(0)
    yield "revised"
    yield "revised!"


def fail(ctx: Any) -> None:
    partial("before the failure")
    raise ValueError("the step failed on purpose")


def tokens(n: int) -> str:
    """The text ``talk`` streams for ``n``."""
    return "".join(f"t{i} " for i in range(n))


WORKFLOWS = {
    "talk": Workflow([Step("talk", talk)]),
    "fail": Workflow([Step("fail", fail)]),
    "slow": Workflow([Step("slow", slow)]),
    "grow": Workflow([Step("grow", grow)]),
}
