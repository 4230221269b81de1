"""Per-step overhead of a chain through ``DaskExecutor``, next to bare ``client.submit``.

    python -m benchmarks.dask_chain [--steps 200] [--repeats 11] [--workers 1] [--scheduler ADDRESS]

Both sides run the same chain of ``--steps`` tiny tasks (each adds one to its
predecessor's output) on the same cluster, through one asynchronous client on
one event loop: the floor submits each task with ``client.submit(...,
pure=False)`` and awaits it before the next; ekit runs a ``Workflow`` of as
many steps with ``executor=DaskExecutor(client)``. Repeats are interleaved
(the order flips on odd repeats) so noise hits both alike; the medians, their
ratio, and the median of each repeat's own ratio are printed. Without ``--scheduler`` a ``local_cluster`` of
``--workers`` worker processes is started (and stopped) for the run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from ekit_runtime import Step, Workflow
from ekit_runtime.dask import DaskExecutor, local_cluster

TARGET = 1.2  # ekit's per-step time may be at most this multiple of the floor's


def add_one(x: int) -> int:
    """The floor's task."""
    return x + 1


def step_body(previous: str | None, context: dict[str, Any]) -> int:
    """The ekit step: the same work, reading its predecessor from the context."""
    return 1 if previous is None else int(context[previous]) + 1


def chain(steps: int) -> Workflow:
    """``steps`` steps in a line, each seeing only its predecessor."""
    names = [f"s{i}" for i in range(steps)]
    return Workflow(
        [
            Step(
                name,
                partial(step_body, names[i - 1] if i else None),
                depends_on=(names[i - 1],) if i else (),
                context="dependencies",
            )
            for i, name in enumerate(names)
        ]
    )


async def bare(client: Any, steps: int) -> int:
    """The floor: submit, await, submit the next."""
    value = 0
    for _ in range(steps):
        value = await client.submit(add_one, value, pure=False)
    return value


async def timed(work: Callable[[], Awaitable[Any]]) -> float:
    gc.collect()
    began = time.perf_counter()
    await work()
    return time.perf_counter() - began


async def measure(address: str, steps: int, repeats: int) -> dict[str, Any]:
    """Median seconds per step of each side, interleaved, after one warm-up each."""
    import distributed

    workflow = chain(steps)
    async with distributed.Client(address, asynchronous=True) as client:
        executor = DaskExecutor(client)

        async def ekit() -> None:
            result = await workflow.run(executor=executor)
            assert result.outputs[f"s{steps - 1}"] == steps

        async def floor() -> None:
            assert await bare(client, steps) == steps

        await ekit()
        await floor()
        times: dict[str, list[float]] = {"ekit": [], "bare": []}
        for repeat in range(repeats):
            order = [("ekit", ekit), ("bare", floor)]
            for label, work in order if repeat % 2 == 0 else order[::-1]:
                times[label].append(await timed(work) / steps)
    ekit_s, bare_s = statistics.median(times["ekit"]), statistics.median(times["bare"])
    # Each repeat's two runs were neighbours in time: their ratio cancels slow
    # drifts in the machine's load, which the ratio of medians does not.
    paired = statistics.median(e / b for e, b in zip(times["ekit"], times["bare"], strict=True))
    return {
        "steps": steps,
        "repeats": repeats,
        "ekit": ekit_s,
        "bare": bare_s,
        "ratio": ekit_s / bare_s,
        "paired_ratio": paired,
    }


def report(figures: dict[str, Any]) -> str:
    """The figures as a few lines of text."""
    ratio = figures["ratio"]
    verdict = "met" if ratio <= TARGET else "NOT met"
    return (
        f"chain of {figures['steps']} steps, median of {figures['repeats']} interleaved repeats\n"
        f"  bare client.submit : {figures['bare'] * 1e3:8.3f} ms/step\n"
        f"  ekit DaskExecutor  : {figures['ekit'] * 1e3:8.3f} ms/step\n"
        f"  ratio {ratio:.3f}x (target <= {TARGET}x: {verdict}); "
        f"median of the per-repeat ratios {figures['paired_ratio']:.3f}x"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse arguments, run the benchmark, print and return its figures."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dask_chain", description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--scheduler", help="use this scheduler instead of starting a local cluster")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.repeats < 1 or args.workers < 1:
        parser.error("--steps, --repeats and --workers must be at least 1")
    if args.scheduler:
        figures = asyncio.run(measure(args.scheduler, args.steps, args.repeats))
    else:
        with local_cluster(n_workers=args.workers) as cluster:
            figures = asyncio.run(measure(cluster.scheduler_address, args.steps, args.repeats))
    print(report(figures))
    return figures


if __name__ == "__main__":
    # Run this module's functions under their importable name, not __main__,
    # so that both sides pickle their task by reference, as a library would.
    from benchmarks.dask_chain import main as _main

    _main()
