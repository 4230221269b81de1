"""``ekit demo``: an interrupted run resumed from its checkpoint file, offline.

This module owns the demo: a simulated LLM pipeline of twelve steps (one
source step fans out to four summaries, each checked by a fact-check step,
which fan back in to a merge, a draft and a final polish). Steps sleep for a
random latency and report random token counts; nothing touches the network
and no API key is needed. The first run is cancelled, as Ctrl-C would, once
a set number of steps have finished; the second resumes from the checkpoint
file and shows what it skipped, what it ran and the tokens it did not spend
again.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ekit_core import (
    Event,
    RunStarted,
    StepFinished,
    StepInterrupted,
    StepSkipped,
    TokenUsage,
    WorkflowCheckpoint,
)
from ekit_runtime.progress import ProgressPrinter
from ekit_runtime.step import PatternResult, Step
from ekit_runtime.stores import JsonFileStore
from ekit_runtime.workflow import Workflow

__all__ = ["CHECKPOINT_FILE", "build_workflow", "main"]

CHECKPOINT_FILE = "ekit-demo-checkpoint.json"
"""The name of the checkpoint file the demo writes in its directory."""

_TOPICS = ("a", "b", "c", "d")
_TOTAL = 1 + 2 * len(_TOPICS) + 3  # fetch, a summary and a check per topic, three to finish


def _llm(
    name: str, seed: int, fast: bool, make: Callable[[Mapping[str, Any]], str]
) -> Callable[[dict[str, Any]], Any]:
    # Each step draws from its own generator, seeded by the demo seed and its
    # name, so a resumed run simulates exactly what the first run would have.
    async def run(context: dict[str, Any]) -> PatternResult[str]:
        rng = random.Random(f"{seed}:{name}")
        latency = rng.uniform(0.001, 0.01) if fast else rng.uniform(0.2, 1.2)
        usage = TokenUsage(rng.randint(300, 1500), rng.randint(80, 600), 1)
        await asyncio.sleep(latency)
        return PatternResult(make(context), cost=usage)

    return run


def build_workflow(seed: int = 7, *, fast: bool = False) -> Workflow:
    """The demo pipeline: 12 simulated LLM steps with a fan-out of four and a fan-in."""

    def fetch(context: Mapping[str, Any]) -> str:
        return f"{len(_TOPICS)} source documents about {context['question']}"

    steps = [Step("fetch_sources", _llm("fetch_sources", seed, fast, fetch))]
    def summarize(topic: str) -> Callable[[Mapping[str, Any]], str]:
        return lambda context: f"summary of document {topic}"

    def fact_check(topic: str) -> Callable[[Mapping[str, Any]], str]:
        return lambda context: f"checked: {context[f'summarize_{topic}']}"

    for t in _TOPICS:
        steps.append(
            Step(
                f"summarize_{t}",
                _llm(f"summarize_{t}", seed, fast, summarize(t)),
                depends_on=("fetch_sources",),
                context="dependencies",
            )
        )
        steps.append(
            Step(
                f"fact_check_{t}",
                _llm(f"fact_check_{t}", seed, fast, fact_check(t)),
                depends_on=(f"summarize_{t}",),
                context="dependencies",
            )
        )
    checks = tuple(f"fact_check_{t}" for t in _TOPICS)
    steps += [
        Step(
            "merge_findings",
            _llm("merge_findings", seed, fast, lambda c: "; ".join(c[n] for n in checks)),
            depends_on=checks,
            context="dependencies",
        ),
        Step(
            "draft_report",
            _llm("draft_report", seed, fast, lambda c: f"draft on {c['question']}"),
            depends_on=("merge_findings",),
            context="dependencies",
        ),
        Step(
            "polish_report",
            _llm(
                "polish_report",
                seed,
                fast,
                lambda c: f"Report: {c['question']} ({len(_TOPICS)} sources checked)",
            ),
            depends_on=("draft_report",),
            context="dependencies",
        ),
    ]
    return Workflow(steps)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="ekit demo",
        description=(
            "Run a simulated LLM pipeline (no network, no API key), interrupt it midway, "
            "then resume it from its checkpoint file."
        ),
    )
    parser.add_argument("--seed", type=int, default=7, help="random seed (default 7)")
    parser.add_argument(
        "--fast", action="store_true", help="millisecond latencies instead of up to a second"
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="directory for the checkpoint file (default: a temporary directory, removed after)",
    )
    parser.add_argument(
        "--stop-after",
        type=int,
        default=6,
        help="interrupt the first run once this many steps have finished (default 6)",
    )
    args = parser.parse_args(list(argv) if argv is not None else None)
    if not 1 <= args.stop_after < _TOTAL:
        parser.error(f"--stop-after must be between 1 and {_TOTAL - 1}")
    return args


def _names(names: Sequence[str]) -> str:
    return ", ".join(names) if names else "-"


async def _interrupted_run(
    workflow: Workflow, context: Mapping[str, Any], store: JsonFileStore, stop_after: int
) -> list[str]:
    progress = ProgressPrinter()
    finished = 0
    interrupted: list[str] = []
    run: asyncio.Task[Any] | None = None

    def trace(event: Event) -> None:
        nonlocal finished
        progress(event)
        if isinstance(event, StepInterrupted):
            interrupted.append(event.name)
        elif isinstance(event, StepFinished):
            finished += 1
            # Counting completions, not seconds, makes the interruption
            # land at the same point of the run on any machine.
            if finished == stop_after and run is not None:
                run.cancel()

    run = asyncio.create_task(workflow.run(context, checkpoint_fn=store, trace=trace))
    try:
        await run
    except asyncio.CancelledError:
        if not run.cancelled():
            raise
        return interrupted
    else:
        raise RuntimeError("the demo run finished before it could be interrupted")


async def _resumed_run(
    workflow: Workflow, checkpoint: WorkflowCheckpoint, store: JsonFileStore
) -> tuple[list[str], list[str], Any]:
    progress = ProgressPrinter()
    skipped: list[str] = []
    ran: list[str] = []

    def trace(event: Event) -> None:
        progress(event)
        if isinstance(event, StepSkipped):
            skipped.append(event.name)
        elif isinstance(event, StepFinished):
            ran.append(event.name)
        elif isinstance(event, RunStarted):
            skipped.clear()
            ran.clear()

    # No initial context here: the checkpoint recorded it.
    result = await workflow.run(resume_from=checkpoint, checkpoint_fn=store, trace=trace)
    return skipped, ran, result


def _demo(args: argparse.Namespace, directory: Path) -> int:
    workflow = build_workflow(args.seed, fast=args.fast)
    path = directory / CHECKPOINT_FILE
    path.unlink(missing_ok=True)
    total = len(workflow.steps)
    say = print
    say(f"ekit demo: a simulated LLM pipeline of {total} steps (no network, no API key)")
    say(f"checkpoint file: {path}")
    say("")
    say(f"== run 1: interrupted (as if by Ctrl-C) once {args.stop_after} steps have finished ==")
    context = {"question": "why do resumable workflows matter?"}
    # Closed at the block's end, as a stopped process would let go of the
    # write lock: run 2 is the next writer of the same file.
    with JsonFileStore(path) as first:
        cut = asyncio.run(_interrupted_run(workflow, context, first, args.stop_after))
    say(f"cancelled in flight (not recorded, will run again): {len(cut)} ({_names(cut)})")

    # Read the file back as a fresh process would: nothing survives but the file.
    with JsonFileStore(path) as store:
        checkpoint = store.load()
        if checkpoint is None:
            say("error: the interrupted run left no checkpoint file")
            return 1
        recorded = list(checkpoint.outputs)
        say(f"recorded before the interruption: {len(recorded)} ({_names(recorded)})")
        say(f"tokens spent before the interruption: {checkpoint.cost.total_tokens}")
        say("")
        say(f"== run 2: resumed from {path.name} ==")
        skipped, ran, result = asyncio.run(_resumed_run(workflow, checkpoint, store))
    saved = sum(checkpoint.step_usage[n].total_tokens for n in skipped if n in checkpoint.step_usage)
    say(f"skipped on resume: {len(skipped)} ({_names(skipped)})")
    say(f"ran on resume: {len(ran)} ({_names(ran)})")
    say(f"tokens spent by the resume: {(result.cost - checkpoint.cost).total_tokens}")
    say(f"tokens saved by resuming: {saved}")
    say(f"outputs: {len(result.outputs)}/{total} steps")
    say(f"final answer: {result.outputs['polish_report']}")
    consistent = (
        sorted(skipped) == sorted(recorded)
        and sorted(skipped + ran) == sorted(s.name for s in workflow.steps)
        and len(result.outputs) == total
    )
    if not consistent:
        say("error: the resume did not skip exactly the recorded steps")
        return 1
    return 0


class _DirectoryError(Exception):
    """The demo cannot write its checkpoint file; the message names the directory."""


def _writable(directory: Path, label: str) -> None:
    """Create ``directory`` if needed and check that a file can be written in it.

    Checked before the first run starts, so that a read-only or missing
    folder is one clear line, not an error from deep inside a checkpoint save.
    """
    if directory.exists() and not directory.is_dir():
        raise _DirectoryError(f"{label} {directory}: not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".ekit-demo-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise _DirectoryError(
            f"{label} {directory}: cannot write the checkpoint file there "
            f"({exc.strerror or type(exc).__name__})"
        ) from None


def _run_in(args: argparse.Namespace, directory: Path, label: str) -> int:
    _writable(directory, label)
    try:
        return _demo(args, directory)
    except BrokenPipeError:
        raise  # stdout went away: the caller's to handle, not the folder's fault
    except OSError as exc:
        # The folder was usable a moment ago: it filled up, or was made
        # read-only or removed, during the run.
        where = exc.filename if exc.filename is not None else directory
        raise _DirectoryError(
            f"{label} {directory}: writing {where} failed ({exc.strerror or type(exc).__name__})"
        ) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo with command-line arguments ``argv`` (``sys.argv[1:]`` if None).

    Returns the exit status: 0 when the resume skipped exactly the steps the
    interrupted run recorded and finished the rest; 2, after one
    ``ekit: demo: ...`` line on stderr naming the folder, when the checkpoint
    file cannot be written (a read-only ``--dir``, say).
    """
    args = _parse(argv)
    try:
        if args.dir is not None:
            return _run_in(args, args.dir, "--dir")
        try:
            with tempfile.TemporaryDirectory(prefix="ekit-demo-") as tmp:
                return _run_in(args, Path(tmp), "temporary directory")
        except OSError as exc:
            raise _DirectoryError(
                f"cannot create a temporary directory in {tempfile.gettempdir()} "
                f"({exc.strerror or type(exc).__name__}); pass --dir"
            ) from None
    except _DirectoryError as exc:
        print(f"ekit: demo: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
