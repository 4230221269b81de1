"""One runner's process: what :mod:`benchmarks.instructions` runs under
``valgrind --tool=callgrind``.

    python -m benchmarks.icount_child RUNNER SPEC [SPEC ...]
    python -m benchmarks.icount_child --no-fork RUNNER SPEC
    python -m benchmarks.icount_child --check RUNNER N
    python -m benchmarks.icount_child --write-checkpoint RUNNER N FILE

``SPEC`` is ``WORKLOAD:N`` (``chain``, ``fan_out``, ``fan_in``, ``map``) or
``resume:N:CHECKPOINT_FILE``: for ``resume``, ``N`` is the number of recorded
steps, the graph a chain of ``N + 10`` steps, and the file holds the checkpoint
text (written beforehand, outside valgrind, by the fourth form). ``map`` is
one root returning a list of ``N`` items and one step mapped over it
(``Step("m", fn, ("root",), map_over="root")``): ekit's runners only, the
others have no run-time map.

The first form imports the runner, then forks one child per ``SPEC``, one after
the other; each child runs its workload with no-op steps and exits, and the
parent prints ``PID STATUS SPEC`` as each ends (callgrind names each child's
count file by its pid). ``--no-fork`` runs the one ``SPEC`` in the process
itself. ``--check`` runs every workload at size ``N`` with checking bodies and
prints the outputs as JSON, for the smoke test to compare runners.

Runners: ``floor`` (``graphlib`` plus bare tasks, :func:`benchmarks.baselines.floor_run`),
``executionkit`` (0.4, via :func:`benchmarks.baselines.executionkit_run`), ``ekit``
(``Step(name, fn, depends_on)``: the default context), ``ekit[dependencies]``
(``context="dependencies"``) and ``setup`` (the setup alone: the graph dict and
the checkpoint text, no runner imported).

The process imports only the runner under test: :mod:`benchmarks.workloads`
imports ekit, so for the other runners :mod:`benchmarks.baselines` is imported
against a stand-in for it (it needs only the ``Graph`` type); each child checks
before it exits that no other library was imported, and exits 3 if one was.

The same at both sizes but for ``N`` (the setup, counted in every figure, about
2 to 4 k instructions per step: see the ``setup`` runner): building the graph
dict, reading the checkpoint text, then ``gc.collect()`` and ``gc.freeze()``
(as :mod:`benchmarks.run` does before each timed run), so that the collector
walks only the runner's own objects. Everything after that is the runner's:
building its steps and workflow, parsing the checkpoint (``json.loads``
included), running, returning the outputs.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import traceback
import types
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

__all__ = [
    "LEFT",
    "RUNNERS",
    "WORKLOADS",
    "Graph",
    "checkpoint_text",
    "checking_factory",
    "graph_for",
    "main",
    "noop_factory",
    "run_workload",
]

RUNNERS = ("floor", "executionkit", "ekit", "ekit[dependencies]", "setup")
WORKLOADS = ("chain", "fan_out", "fan_in", "resume", "map", "loop")
MAPPED = ("ekit", "ekit[dependencies]", "setup")
"""The runners that run the ``map`` workload (the baselines have no run-time map)."""
LEFT = 10
"""Steps left to run on resume."""

# Which top-level packages each runner's process must not import.
_LIBRARIES = ("ekit_core", "ekit_runtime", "executionkit", "langgraph")
_OWN = {
    "floor": (),
    "executionkit": ("executionkit",),
    "ekit": ("ekit_core", "ekit_runtime"),
    "ekit[dependencies]": ("ekit_core", "ekit_runtime"),
    "setup": (),
}

StepBody = Callable[[Any], Awaitable[Any]]
StepFactory = Callable[[str, tuple[str, ...]], StepBody]
Deps = dict[str, tuple[str, ...]]
Items = list[int] | None  # the root's output in the map workload, else None
RunnerFn = Callable[[Deps, StepFactory, "str | None", Items],
                    Coroutine[Any, Any, dict[str, Any]]]


class Graph:
    """What :mod:`benchmarks.baselines` reads of ``benchmarks.workloads.Graph``."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self.durations: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self.deps)


# -- graphs (the same shapes and names as benchmarks.workloads) ----------------


def graph_for(workload: str, n: int) -> Deps:
    """The dependency dict of ``workload`` at size ``n`` (resume: ``n`` recorded + LEFT)."""
    if workload == "chain":
        return {f"s{i}": ((f"s{i - 1}",) if i else ()) for i in range(n)}
    if workload == "resume":
        return graph_for("chain", n + LEFT)
    if workload == "fan_out":
        deps: Deps = {"root": ()}
        deps.update((f"c{i}", ("root",)) for i in range(n))
        return deps
    if workload == "fan_in":
        deps = {f"p{i}": () for i in range(n)}
        deps["join"] = tuple(deps)
        return deps
    if workload == "map":  # the declared graph; the root's n items grow it as it runs
        return {"root": (), "m": ("root",)}
    if workload == "loop":  # none: one loop "agent" of n iterations, built from its size
        return {}
    raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")


# -- step bodies -----------------------------------------------------------------


async def _noop(context: Any) -> int:
    return 1


def noop_factory(name: str, deps: tuple[str, ...]) -> StepBody:
    """The same no-op body for every step."""
    return _noop


def checking_factory(name: str, deps: tuple[str, ...]) -> StepBody:
    """Like ``benchmarks.workloads.checking_factory``: an output that depends on
    the dependencies' outputs, read from the context, the same in every runner."""

    async def body(context: Any) -> int:
        total: int = sum(context[d] for d in deps)
        return (total * 31 + len(name)) % 1_000_003

    return body


# -- runners ---------------------------------------------------------------------


def _baselines() -> types.ModuleType:
    """:mod:`benchmarks.baselines`, without importing ekit if it is not imported yet."""
    if "benchmarks.baselines" not in sys.modules and "benchmarks.workloads" not in sys.modules:
        stand_in = types.ModuleType("benchmarks.workloads")
        stand_in.Graph = Graph  # type: ignore[attr-defined]
        stand_in.StepFactory = StepFactory  # type: ignore[attr-defined]
        sys.modules["benchmarks.workloads"] = stand_in
        try:
            import benchmarks.baselines
        finally:
            del sys.modules["benchmarks.workloads"]
    import benchmarks.baselines

    return benchmarks.baselines


def _static(items: Items) -> None:
    if items is not None:
        raise ValueError("the map workload needs a run-time map: ekit's runners only")


async def _floor(deps: Deps, factory: StepFactory, text: str | None,
                 items: Items) -> dict[str, Any]:
    import json

    _static(items)
    baselines = _baselines()
    resume = json.loads(text)["outputs"] if text is not None else None
    outputs: dict[str, Any] = await baselines.floor_run(Graph(deps), factory, resume=resume)
    return outputs


async def _executionkit(deps: Deps, factory: StepFactory, text: str | None,
                        items: Items) -> dict[str, Any]:
    import json

    _static(items)
    baselines = _baselines()
    resume = json.loads(text) if text is not None else None
    outputs: dict[str, Any] = await baselines.executionkit_run(Graph(deps), factory,
                                                               resume=resume)
    return outputs


def _ekit(mode: str | None) -> RunnerFn:
    async def run(deps: Deps, factory: StepFactory, text: str | None,
                  items: Items) -> dict[str, Any]:
        import json

        from ekit_runtime import Step, Workflow, WorkflowCheckpoint

        if items is not None and not deps:  # the loop workload: n iterations of "agent"
            steps = [_loop(len(items), mode)]
        elif items is not None:  # the map workload: root -> items, m mapped over root
            options: dict[str, Any] = {} if mode is None else {"context": mode}
            steps = [Step("root", _returning(items), **options),
                     Step("m", factory("m", ("root",)), ("root",), map_over="root",
                          **options)]
        elif mode is None:  # as a user writes it: the default context
            steps = [Step(name, factory(name, d), d) for name, d in deps.items()]
        else:
            steps = [Step(name, factory(name, d), d, context=mode)  # type: ignore[arg-type]
                     for name, d in deps.items()]
        saved: list[Any] = []
        if text is None:
            result = await Workflow(steps).run(checkpoint_fn=saved.append)
        else:
            start = WorkflowCheckpoint.from_dict(json.loads(text))
            result = await Workflow(steps).run(checkpoint_fn=saved.append, resume_from=start)
        return dict(result.outputs)

    return run


def _loop(n: int, mode: str | None) -> Any:
    """``Step("agent", turn, repeat=Repeat(n + 1))``, whose ``n``-th iteration returns ``Done``:
    a no-op iteration, as a chain's step is a no-op step."""
    from ekit_runtime import Done, Repeat, Step

    async def turn(context: Any) -> Any:
        number = context["agent"].number
        return Done(number) if number == n else number

    options: dict[str, Any] = {} if mode is None else {"context": mode}
    return Step("agent", turn, repeat=Repeat(n + 1), **options)


def _returning(items: list[int]) -> StepBody:
    async def root(context: Any) -> list[int]:
        return items

    return root


async def _setup_only(deps: Deps, factory: StepFactory, text: str | None,
                      items: Items) -> dict[str, Any]:
    return {}


_RUN: dict[str, RunnerFn] = {
    "floor": _floor,
    "executionkit": _executionkit,
    "ekit": _ekit(None),
    "ekit[dependencies]": _ekit("dependencies"),
    "setup": _setup_only,
}


def _import_runner(runner: str) -> None:
    """Import what ``runner`` needs before the setup, so that the setup runs alike."""
    if runner in ("floor", "executionkit"):
        _baselines()
    if runner == "executionkit":
        import executionkit.workflow  # noqa: F401
    elif runner.startswith("ekit"):
        import ekit_runtime  # noqa: F401
    if runner != "setup":
        import json  # noqa: F401


def run_workload(runner: str, workload: str, n: int, text: str | None = None,
                 factory: StepFactory = noop_factory) -> dict[str, Any]:
    """Run ``workload`` at size ``n`` with ``runner`` in a fresh event loop; its outputs."""
    if runner not in _RUN:
        raise ValueError(f"unknown runner {runner!r}; choose from {', '.join(RUNNERS)}")
    if (workload == "resume") != (text is not None):
        raise ValueError("a checkpoint text is needed for resume, and only for resume")
    items = list(range(n)) if workload in ("map", "loop") else None
    return asyncio.run(_RUN[runner](graph_for(workload, n), factory, text, items))


# -- resume checkpoints (written outside valgrind) -------------------------------


def checkpoint_text(runner: str, recorded: int) -> str:
    """The JSON text of a checkpoint of a ``recorded + LEFT``-step chain of no-op
    steps (each output 1) with the first ``recorded`` steps recorded, in the
    runner's format: ekit's own (from a real run, in the runner's context mode),
    or ExecutionKit's ``to_dict`` format (which the floor reads the outputs of)."""
    import json

    if runner.startswith("ekit"):
        from ekit_runtime import Step, Workflow

        mode = "dependencies" if runner == "ekit[dependencies]" else "all"
        deps = graph_for("resume", recorded)
        steps = [Step(name, _noop, d, context=mode)  # type: ignore[arg-type]
                 for name, d in deps.items()]
        saved: list[Any] = []
        asyncio.run(Workflow(steps).run(checkpoint_fn=saved.append))
        for checkpoint in saved:
            if len(checkpoint.outputs) == recorded:
                return json.dumps(checkpoint.to_dict())
        raise RuntimeError(f"ekit saved no checkpoint with {recorded} steps recorded")
    names = list(graph_for("resume", recorded))[:recorded]
    return json.dumps({"step_index": recorded, "outputs": dict.fromkeys(names, 1),
                       "cost": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0}})


# -- the process -----------------------------------------------------------------


def _foreign(runner: str) -> list[str]:
    """The libraries other than ``runner``'s that this process has imported."""
    allowed = _OWN[runner]
    loaded = {name.partition(".")[0] for name in sys.modules}
    return sorted(lib for lib in _LIBRARIES if lib in loaded and lib not in allowed)


def _check(runner: str, n: int) -> dict[str, Any]:
    """Every workload at size ``n`` with checking bodies: outputs and steps run."""
    out: dict[str, Any] = {}
    for workload in WORKLOADS:
        if workload in ("map", "loop") and runner not in MAPPED:
            continue
        ran: list[str] = []

        def counting(name: str, deps: tuple[str, ...], ran: list[str] = ran) -> StepBody:
            body = checking_factory(name, deps)

            async def run(context: Any) -> Any:
                ran.append(name)
                return await body(context)

            return run

        text = checkpoint_text(runner, n) if workload == "resume" else None
        outputs = run_workload(runner, workload, n, text, counting)
        out[workload] = {"outputs": outputs, "ran": len(ran)}
    return out


def _parse_spec(spec: str) -> tuple[str, int, str | None]:
    """``WORKLOAD:N[:CHECKPOINT_FILE]`` as its parts; ``ValueError`` if malformed."""
    workload, _, rest = spec.partition(":")
    n, _, path = rest.partition(":")
    if workload not in WORKLOADS or not n.isdigit() or bool(path) != (workload == "resume"):
        raise ValueError(f"bad measurement {spec!r}: want WORKLOAD:N, or resume:N:FILE")
    return workload, int(n), path or None


def measure_one(runner: str, workload: str, n: int, path: str | None) -> None:
    """The setup (the same at every size but for ``n``), then the measured run."""
    deps = graph_for(workload, n)
    items = list(range(n)) if workload in ("map", "loop") else None
    text = None
    if path is not None:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    gc.collect()
    gc.freeze()
    kept: list[dict[str, Any]] = []
    # -- the measured part: everything the runner does, from its imports on.
    asyncio.run(_kept(kept, _RUN[runner](deps, noop_factory, text, items)))
    del kept, deps, text, items


async def _kept(into: list[dict[str, Any]], run: Awaitable[dict[str, Any]]) -> None:
    # The outputs are kept aside, not returned: asyncio.run's teardown reprs
    # its main task (restoring the SIGINT handler formats an error message
    # holding the task), and a task's repr sorts the keys of a dict result,
    # n log n per measurement, but only in a process whose SIGINT is not
    # ignored: a count would then depend on how the process was started.
    into.append(await run)


def _forked(runner: str, spec: tuple[str, int, str | None]) -> int:
    """Run one measurement in a forked child; the child's pid."""
    pid = os.fork()
    if pid:
        return pid
    status = 0
    try:
        measure_one(runner, *spec)
        foreign = _foreign(runner)
        if foreign:
            print(f"icount_child: the {runner} process imported {', '.join(foreign)}",
                  file=sys.stderr)
            status = 3
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def main(argv: list[str] | None = None) -> int:
    """The child process: see the module docstring. Returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    usage = ("usage: python -m benchmarks.icount_child [--no-fork] RUNNER SPEC [SPEC ...]\n"
             "       python -m benchmarks.icount_child --check RUNNER N\n"
             "       python -m benchmarks.icount_child --write-checkpoint RUNNER N FILE\n"
             "SPEC is WORKLOAD:N, or resume:N:CHECKPOINT_FILE")
    fork = args[:1] != ["--no-fork"]
    if not fork:
        args = args[1:]
    if args[:1] == ["--write-checkpoint"] and len(args) == 4 and args[1] in _OWN \
            and args[2].isdigit():
        with open(args[3], "w", encoding="utf-8") as file:
            file.write(checkpoint_text(args[1], int(args[2])))
        return 0
    if args[:1] == ["--check"] and len(args) == 3 and args[1] in _OWN and args[2].isdigit():
        import json

        print(json.dumps(_check(args[1], int(args[2])), sort_keys=True))
        return _report_foreign(args[1])
    try:
        if len(args) < 2 or args[0] not in _OWN or (not fork and len(args) != 2):
            raise ValueError("want one runner and its measurements (one with --no-fork)")
        specs = [_parse_spec(spec) for spec in args[1:]]
    except ValueError as exc:
        print(f"{usage}\nicount_child: {exc}", file=sys.stderr)
        return 2
    runner = args[0]
    _import_runner(runner)
    gc.collect()
    gc.freeze()
    if not fork:
        measure_one(runner, *specs[0])
        return _report_foreign(runner)
    worst = 0
    for spec, text in zip(specs, args[1:], strict=True):
        pid = _forked(runner, spec)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        print(f"{pid} {status} {text}", flush=True)
        worst = worst or status
    return worst


def _report_foreign(runner: str) -> int:
    foreign = _foreign(runner)
    if foreign:
        print(f"icount_child: the {runner} process imported {', '.join(foreign)}",
              file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
