"""Run every benchmark workload against its baselines, print a table, write JSON.

    python -m benchmarks.run [--quick] [--only NAME[,NAME]] [--repeats N] [--json PATH]

Each case is timed in one process and one event loop, the library and its
baselines interleaved within every repeat (the order reversed on odd
repeats, ``gc.collect()`` and ``gc.freeze()`` before each run), so that noise on a shared
machine hits all of them alike. Compare the ratios; absolute times from
different runs or machines are not comparable.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import baselines, report
from benchmarks import workloads as wl

Thunk = Callable[[], Awaitable[Any]]
Runners = dict[str, Thunk | str]  # a str is the note saying why the runner is skipped
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "latest.json"
WORKLOADS = ("fan_out", "fan_in", "chain", "layered", "makespan", "persistence", "resume",
             "map")


@dataclass(frozen=True)
class Sizes:
    """How big each workload is; ``QUICK`` is the smoke-test version."""

    fan_out: int = 10_000
    fan_in: tuple[int, int] = (4_000, 16_000)  # parents of the one join
    chains: tuple[int, int, int] = (1_000, 4_000, 16_000)  # LangGraph-sized, 4k, 16k
    layered: tuple[int, int] = (5_000, 50)
    makespan_steps: int = 60
    makespan_median_s: float = 0.1
    makespan_seeds: tuple[int, ...] = (1, 2, 3, 4, 5)
    journal: tuple[int, ...] = (1_000, 4_000, 16_000)
    json_store: tuple[int, ...] = (1_000, 2_000)  # quadratic: 4k takes ~70 s per run
    resume: tuple[int, int] = (10_000, 10)  # steps, steps left to run
    map: tuple[int, ...] = (10_000, 25_000, 100_000)  # items; fan-out at each, alongside
    map_journal: tuple[int, ...] = (1_000, 10_000)  # items, through a JournalStore
    executionkit_chain_max: int = 4_000  # quadratic beyond: minutes per repeat
    langgraph_chain_max: int = 1_000  # quadratic: 4k steps take ~19 s per run


FULL = Sizes()
QUICK = Sizes(
    fan_out=200,
    fan_in=(100, 400),
    chains=(50, 100, 400),
    layered=(300, 10),
    makespan_steps=20,
    makespan_median_s=0.005,
    makespan_seeds=(1, 2),
    journal=(100, 400),
    json_store=(100,),
    resume=(500, 10),
    map=(100, 400),
    map_journal=(100, 400),
    executionkit_chain_max=400,
    langgraph_chain_max=100,
)


# -- timing ------------------------------------------------------------------


async def time_case(label: str, steps: int, runners: Runners, repeats: int) -> dict[str, Any]:
    """Time each runner ``repeats`` times, interleaved, and summarize each."""
    live = [name for name, thunk in runners.items() if not isinstance(thunk, str)]
    times: dict[str, list[float]] = {name: [] for name in live}
    for r in range(repeats):
        for name in live if r % 2 == 0 else live[::-1]:
            thunk = runners[name]
            assert not isinstance(thunk, str)
            # Freeze what the harness holds (every baseline library is imported
            # in this process) so that the collector's full passes during the
            # run walk the runner's own objects, not LangGraph's modules.
            gc.collect()
            gc.freeze()
            try:
                began = time.perf_counter()
                await thunk()
                times[name].append(time.perf_counter() - began)
            finally:
                gc.unfreeze()
    out: dict[str, Any] = {}
    for name, thunk in runners.items():
        out[name] = {"skipped": thunk} if isinstance(thunk, str) else report.summarize(
            times[name], steps)
    base = out.get("ekit", {}).get("median_s")
    for stats in out.values():
        if base and "median_s" in stats:
            stats["ratio_to_ekit"] = stats["median_s"] / base
    return {"label": label, "steps": steps, "runners": out}


def optional(library: str, thunk: Thunk) -> Thunk | str:
    """``thunk`` if ``library`` is installed, else the note saying it is not."""
    note = baselines.missing(library)
    return note if note is not None else thunk


async def verify(graph: wl.Graph) -> None:
    """Check, untimed, that the floor computes what the library computes.

    Doubles as a warm-up run of both.
    """
    expected = await wl.ekit_run(graph, wl.checking_factory)
    for name, got in (
        ("ekit[all]", await wl.ekit_run(graph, wl.checking_factory, mode="all")),
        ("floor", await baselines.floor_run(graph, wl.checking_factory)),
    ):
        if got != expected:
            raise AssertionError(f"{name} computed other outputs than ekit")


def micro_runners(graph: wl.Graph, *, executionkit: bool | str, langgraph: bool | str) -> Runners:
    """The library in both context modes, the floor, and the optional libraries."""
    noop = wl.noop_factory
    runners: Runners = {
        "ekit": lambda: wl.ekit_run(graph, noop),
        "ekit[all]": lambda: wl.ekit_run(graph, noop, mode="all"),
        "floor": lambda: baselines.floor_run(graph, noop),
    }
    runners["executionkit"] = (
        executionkit if isinstance(executionkit, str)
        else optional("executionkit", lambda: baselines.executionkit_run(graph, noop))
    )
    runners["langgraph"] = (
        langgraph if isinstance(langgraph, str)
        else optional("langgraph", lambda: baselines.langgraph_run(graph, noop))
    )
    return runners


# -- workloads ----------------------------------------------------------------


async def fan_out(sizes: Sizes, repeats: int) -> dict[str, Any]:
    """Workload 1: one root, many children."""
    graph = wl.fan_out(sizes.fan_out)
    await verify(graph)
    runners = micro_runners(graph, executionkit=True, langgraph=True)
    case = await time_case(str(sizes.fan_out), len(graph), runners, repeats)
    return {"status": "ok", "description": f"one root, {sizes.fan_out} children, no-op steps",
            "cases": [case]}


async def fan_in(sizes: Sizes, repeats: int) -> dict[str, Any]:
    """Workload 1b: many parents, one join; the 16k/4k ratio shows whether readiness is O(1)."""
    cases = []
    for n in sizes.fan_in:
        graph = wl.fan_in(n)
        await verify(graph)
        runners = micro_runners(graph, executionkit=True,
                                langgraph="skipped: one node with thousands of parents")
        cases.append(await time_case(str(n), len(graph), runners, repeats))
    small, big = sizes.fan_in
    lines = growth_lines(cases, small, big, ("ekit", "ekit[all]", "floor", "executionkit"))
    return {"status": "ok", "description": "independent no-op steps joined by one step",
            "cases": cases, "lines": lines}


def growth_lines(cases: list[dict[str, Any]], small: int, big: int,
                 runners: tuple[str, ...]) -> list[str]:
    """One line per runner: its time at ``big`` steps over its time at ``small``."""
    medians = {c["label"]: c["runners"] for c in cases}
    lines = []
    for runner in runners:
        a = medians[str(big)][runner].get("median_s")
        b = medians[str(small)][runner].get("median_s")
        if a and b:
            lines.append(f"{runner}: {big}/{small} time ratio {a / b:.2f} "
                         f"(linear is {big / small:.0f})")
    return lines


async def chain(sizes: Sizes, repeats: int) -> dict[str, Any]:
    """Workload 2: sequential chains; the 16k/4k ratio shows whether time is linear."""
    cases = []
    for n in sizes.chains:
        graph = wl.chain(n)
        await verify(graph)
        ek: bool | str = (n <= sizes.executionkit_chain_max) or (
            f"skipped above {sizes.executionkit_chain_max} steps (quadratic)")
        lg: bool | str = (n <= sizes.langgraph_chain_max) or (
            f"skipped above {sizes.langgraph_chain_max} steps (quadratic)")
        runners = micro_runners(graph, executionkit=ek, langgraph=lg)
        cases.append(await time_case(str(n), n, runners, repeats))
    _, mid, big = sizes.chains
    lines = growth_lines(cases, mid, big, ("ekit", "ekit[all]", "floor"))
    return {"status": "ok", "description": "sequential chains of no-op steps",
            "cases": cases, "lines": lines}


async def layered(sizes: Sizes, repeats: int) -> dict[str, Any]:
    """Workload 3: a seeded layered random DAG."""
    n, layers = sizes.layered
    graph = wl.layered(n, layers, seed=1)
    await verify(graph)
    runners = micro_runners(graph, executionkit=True, langgraph=True)
    case = await time_case(str(n), len(graph), runners, repeats)
    return {"status": "ok",
            "description": f"{n} steps in {layers} layers, 1-3 dependencies each, seed 1",
            "cases": [case]}


async def makespan(sizes: Sizes, repeats: int) -> dict[str, Any]:
    """Workload 4: simulated-latency DAGs at max_concurrency=10, against the lower bound."""
    workers = 10
    per_seed = []
    ratios: dict[str, list[float]] = {}
    for seed in sizes.makespan_seeds:
        graph = wl.makespan_dag(seed, sizes.makespan_steps, sizes.makespan_median_s)
        sleep = wl.sleeping_factory(graph)
        runners: Runners = {
            # 60 steps: the context mode costs nothing measurable here.
            "ekit": lambda g=graph, f=sleep: wl.ekit_run(g, f, max_concurrency=workers),
            "floor": lambda g=graph, f=sleep: baselines.floor_run(g, f, max_concurrency=workers),
            "level-by-level": lambda g=graph, f=sleep: baselines.level_run(
                g, f, max_concurrency=workers),
            "executionkit": optional("executionkit", lambda g=graph, f=sleep: (
                baselines.executionkit_run(g, f, max_concurrency=workers))),
            "langgraph": optional("langgraph", lambda g=graph, f=sleep: (
                baselines.langgraph_run(g, f, max_concurrency=workers))),
        }
        bound = wl.lower_bound(graph, workers)
        # Sleeps dominate and are the same every run, so repeats vary little;
        # capping them keeps the workload to about two minutes.
        case = await time_case(f"seed {seed}", len(graph), runners, min(repeats, 3))
        case["lower_bound_s"] = bound
        case["critical_path_s"] = wl.critical_path(graph)
        case["work_over_workers_s"] = sum(graph.durations.values()) / workers
        case["levels"] = len(baselines.levels(graph))
        for name, stats in case["runners"].items():
            if "median_s" in stats:
                stats["ratio_to_bound"] = stats["median_s"] / bound
                ratios.setdefault(name, []).append(stats["ratio_to_bound"])
        per_seed.append(case)
    summary = {name: {"median_ratio_to_bound": statistics.median(r), "per_seed": r}
               for name, r in ratios.items()}
    lines = [f"{name}: makespan / lower bound, median of {len(r['per_seed'])} seeds = "
             f"{r['median_ratio_to_bound']:.3f} (per seed: "
             + ", ".join(f"{x:.2f}" for x in r["per_seed"]) + ")"
             for name, r in summary.items()]
    return {"status": "ok",
            "description": f"seeded DAGs of {sizes.makespan_steps} steps sleeping lognormal "
            f"times (median {sizes.makespan_median_s * 1e3:.0f} ms), max_concurrency={workers}",
            "cases": per_seed, "summary": summary, "lines": lines}


def _bytes_written() -> int | None:
    """Bytes this process has passed to write() so far (Linux), else ``None``."""
    try:
        with open("/proc/self/io") as io:
            for line in io:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


async def persistence(sizes: Sizes, repeats: int) -> dict[str, Any]:
    """Workload 5: the chain checkpointing to the journal and JSON-file stores."""
    try:
        from ekit_runtime import stores
    except ImportError as exc:
        return {"status": "skipped", "note": f"ekit_runtime.stores not available ({exc})"}
    kinds = {"journal": stores.JournalStore, "json": stores.JsonFileStore}
    plan = [(kind, n) for kind, ns in (("journal", sizes.journal), ("json", sizes.json_store))
            for n in ns]
    cases = []
    with tempfile.TemporaryDirectory(prefix="ekit-bench-") as tmp:
        for kind, n in plan:
            graph = wl.chain(n)
            counter = iter(range(10**9))
            written: dict[bool, list[int]] = {True: [], False: []}

            def with_store(durable: bool, kind: str = kind, graph: wl.Graph = graph,
                           written: dict[bool, list[int]] = written,
                           counter: Any = counter) -> Thunk:
                async def run() -> None:
                    path = Path(tmp) / f"{kind}-{len(graph)}-{next(counter)}"
                    store = kinds[kind](path, durable=durable)
                    before = _bytes_written()
                    await wl.ekit_run(graph, wl.noop_factory, checkpoint_fn=store)
                    after = _bytes_written()
                    if before is not None and after is not None:
                        written[durable].append(after - before)
                    else:  # no /proc: the file's size (exact for the journal only)
                        written[durable].append(path.stat().st_size)
                    path.unlink()

                return run

            runners: Runners = {
                "ekit": lambda g=graph: wl.ekit_run(g, wl.noop_factory),
                f"ekit+{kind}": with_store(True),
                # Without fsync: the store's own CPU cost, apart from the disk's.
                f"ekit+{kind}(durable=False)": with_store(False),
            }
            # fsync and quadratic JSON rewrites make these slow: at most 3 repeats.
            case = await time_case(f"{kind} {n}", n, runners, min(repeats, 3))
            for durable, name in ((True, f"ekit+{kind}"), (False, f"ekit+{kind}(durable=False)")):
                case["runners"][name]["bytes_per_step"] = statistics.median(written[durable]) / n
            cases.append(case)
    summary: dict[str, Any] = {}
    journal = [c for c in cases if c["label"].startswith("journal")]
    per_step = [c["runners"]["ekit+journal"]["bytes_per_step"] for c in journal]
    if len(per_step) >= 2:
        summary["journal_bytes_per_step_growth"] = per_step[-1] / per_step[0]
    lines = []
    for case in cases:
        for runner, stats in case["runners"].items():
            if "bytes_per_step" in stats:
                lines.append(f"{case['label']}: {runner} wrote {stats['bytes_per_step']:.0f} "
                             f"bytes per step, {stats['per_step_us']:.1f} us per step")
    return {"status": "ok", "description": "chains checkpointing to a store (ekit list = no I/O)",
            "cases": cases, "summary": summary, "lines": lines}


async def resume(sizes: Sizes, repeats: int) -> dict[str, Any]:
    """Workload 6: parse a stored checkpoint of a long chain and finish its last steps."""
    from ekit_runtime import Step, Workflow

    n, left = sizes.resume
    graph = wl.chain(n)
    saved: list[Any] = []
    await wl.ekit_run(graph, wl.noop_factory, checkpoint_fn=saved.append)
    ekit_text = json.dumps(saved[n - left - 1].to_dict())
    done = {name: 1 for name in list(graph.deps)[: n - left]}
    plain_text = json.dumps({"step_index": n - left, "outputs": done,
                             "cost": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0}})

    async def ekit_resume(factory: wl.StepFactory = wl.noop_factory) -> dict[str, Any]:
        steps = [Step(s, factory(s, d), d, context="dependencies")
                 for s, d in graph.deps.items()]
        result = await Workflow(steps).run(resume_from=json.loads(ekit_text),
                                           checkpoint_fn=[].append)
        return dict(result.outputs)

    async def floor_resume(factory: wl.StepFactory = wl.noop_factory) -> dict[str, Any]:
        return await baselines.floor_run(graph, factory,
                                         resume=json.loads(plain_text)["outputs"])

    async def ek_resume(factory: wl.StepFactory = wl.noop_factory) -> dict[str, Any]:
        return await baselines.executionkit_run(graph, factory, resume=json.loads(plain_text))

    # Untimed check: each resumes to every output and runs exactly the steps left.
    for name, resume_fn in (("ekit", ekit_resume), ("floor", floor_resume)):
        ran: list[str] = []

        def counting(step: str, deps: tuple[str, ...], ran: list[str] = ran) -> wl.StepBody:
            async def body(context: dict[str, Any]) -> int:
                ran.append(step)
                return 1

            return body

        outputs = await resume_fn(counting)
        if len(outputs) != n or len(ran) != left:
            raise AssertionError(f"{name} resumed to {len(outputs)} outputs running "
                                 f"{len(ran)} steps, not {n} and {left}")
    runners: Runners = {"ekit": ekit_resume, "floor": floor_resume,
                        "executionkit": optional("executionkit", ek_resume),
                        "langgraph": "not expressible: LangGraph resumes from its own "
                        "checkpointer by thread id, not from a caller-stored dict"}
    case = await time_case(f"{n} ({left} left)", n, runners, repeats)
    return {"status": "ok", "description": f"json.loads + resume of a {n}-step chain "
            f"checkpoint with {left} steps left (Workflow construction included)",
            "cases": [case], "checkpoint_bytes": len(ekit_text)}


async def map_(sizes: Sizes, repeats: int) -> dict[str, Any]:
    """Workload 7 (issue 25): a run-time map against the static fan-out of as many steps.

    Each case times, in one process and interleaved, a root returning ``n``
    items with one step mapped over it, and one root with ``n`` children
    declared up front; per mode, the map's time over the fan-out's. The
    biggest size over the second shows how both grow (wall time, so cache
    misses count too: compare the map's growth with the fan-out's).
    """
    noop = wl.noop_factory
    cases = []
    for n in sizes.map:
        graph = wl.fan_out(n)
        got = await wl.ekit_map_run(n, wl.checking_factory)
        if got["root"] != list(range(n)) or len(got["m"]) != n:  # untimed check, a warm-up
            raise AssertionError("the map computed other outputs than its items")
        runners: Runners = {
            "ekit": partial(wl.ekit_map_run, n, noop),
            "ekit[all]": partial(wl.ekit_map_run, n, noop, mode="all"),
            "fan-out": partial(wl.ekit_run, graph, noop),
            "fan-out[all]": partial(wl.ekit_run, graph, noop, mode="all"),
        }
        case = await time_case(str(n), n, runners, repeats)
        r = case["runners"]
        case["map_over_fan_out"] = {
            "dependencies": r["ekit"]["median_s"] / r["fan-out"]["median_s"],
            "all": r["ekit[all]"]["median_s"] / r["fan-out[all]"]["median_s"]}
        cases.append(case)
    lines = [f"{c['label']} items: map time / fan-out time {c['map_over_fan_out']['all']:.2f} "
             f"(default context), {c['map_over_fan_out']['dependencies']:.2f} "
             f"(context='dependencies')" for c in cases]
    *_, mid, big = sizes.map
    lines += growth_lines(cases, mid, big, ("ekit", "ekit[all]", "fan-out", "fan-out[all]"))
    journal = await _map_journal(sizes, repeats)
    cases += journal
    lines += [f"{c['label']}: {runner} wrote {stats['bytes_per_item']:.1f} bytes per item"
              for c in journal for runner, stats in c["runners"].items()
              if "bytes_per_item" in stats]
    return {"status": "ok", "description": "a root returning n items and one step mapped "
            "over it, beside one root with n declared children; no-op steps",
            "cases": cases, "lines": lines, "summary": _map_summary(cases, sizes)}


async def _map_journal(sizes: Sizes, repeats: int) -> list[dict[str, Any]]:
    """The map through a JournalStore: time and bytes per item (the file's size, exact
    for an append-only journal), saving as the runner does with no-op items (the
    items finish together: a few saves) and with one save per item
    (``max_concurrency=1``; without fsync, or 10k fsyncs would be the time)."""
    from ekit_runtime import stores

    cases = []
    with tempfile.TemporaryDirectory(prefix="ekit-bench-map-") as tmp:
        counter = iter(range(10**9))
        for n in sizes.map_journal:
            written: dict[str, list[int]] = {"batched": [], "per item": []}

            def journaled(how: str, n: int = n, written: dict[str, list[int]] = written,
                          counter: Any = counter) -> Thunk:
                async def run() -> None:
                    path = Path(tmp) / f"map-{n}-{next(counter)}"
                    store = stores.JournalStore(path, durable=how == "batched")
                    await wl.ekit_map_run(n, wl.noop_factory, checkpoint_fn=store,
                                          max_concurrency=1 if how == "per item" else None)
                    store.close()
                    written[how].append(path.stat().st_size)
                    path.unlink()

                return run

            runners: Runners = {"ekit": partial(wl.ekit_map_run, n, wl.noop_factory),
                                "ekit+journal": journaled("batched"),
                                "ekit+journal(one save per item)": journaled("per item")}
            case = await time_case(f"journal {n}", n, runners, min(repeats, 3))
            for how, name in (("batched", "ekit+journal"),
                              ("per item", "ekit+journal(one save per item)")):
                case["runners"][name]["bytes_per_item"] = statistics.median(written[how]) / n
            cases.append(case)
    return cases


def _map_summary(cases: list[dict[str, Any]], sizes: Sizes) -> dict[str, Any]:
    by_label = {c["label"]: c for c in cases}
    first = by_label[str(sizes.map[0])]
    *_, mid, big = (by_label[str(n)]["runners"] for n in sizes.map)
    small_j, big_j = (by_label[f"journal {n}"]["runners"] for n in
                      (sizes.map_journal[0], sizes.map_journal[-1]))

    def growth(runner: str) -> float:
        return float(big[runner]["median_s"] / mid[runner]["median_s"])

    return {
        "map_over_fan_out": first["map_over_fan_out"],
        "growth": {r: growth(r) for r in ("ekit", "ekit[all]", "fan-out", "fan-out[all]")},
        "growth_linear": sizes.map[-1] / sizes.map[-2],
        "journal_bytes_per_item_growth": {
            r: big_j[r]["bytes_per_item"] / small_j[r]["bytes_per_item"]
            for r in ("ekit+journal", "ekit+journal(one save per item)")},
    }


# -- driver ---------------------------------------------------------------------

RUNS: dict[str, Callable[[Sizes, int], Awaitable[dict[str, Any]]]] = {
    "fan_out": fan_out,
    "fan_in": fan_in,
    "chain": chain,
    "layered": layered,
    "makespan": makespan,
    "persistence": persistence,
    "resume": resume,
    "map": map_,
}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


async def _warm_up() -> None:
    # Import the optional libraries and run their first graph before any
    # timing, so that no timed run pays for an import.
    graph = wl.chain(20)
    for library, run in (("executionkit", baselines.executionkit_run),
                         ("langgraph", baselines.langgraph_run)):
        if baselines.missing(library) is None:
            await run(graph, wl.noop_factory)


async def run_all(names: list[str], sizes: Sizes, repeats: int, quick: bool) -> dict[str, Any]:
    """Run the named workloads in order and return the whole result (targets included)."""
    result: dict[str, Any] = {
        "meta": {
            "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "repeats": repeats,
            "quick": quick,
            "sizes": asdict(sizes),
            "versions": {d: _version(d) for d in ("ekit", "executionkit", "langgraph")},
        },
        "workloads": {},
    }
    await _warm_up()
    for name in names:
        began = time.perf_counter()
        print(f"running {name} ...", file=sys.stderr, flush=True)
        entry = await RUNS[name](sizes, repeats)
        entry["wall_s"] = time.perf_counter() - began
        result["workloads"][name] = entry
    result["targets"] = report.targets(result)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse arguments, run, print the table, write the JSON; return the result."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and short sleeps: a smoke run of a few seconds")
    parser.add_argument("--only", default="",
                        help=f"comma-separated workloads to run, of: {', '.join(WORKLOADS)}")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs per runner and case (default 5; 2 with --quick)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON,
                        help=f"where to write the results (default {DEFAULT_JSON})")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(WORKLOADS)
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 5)
    if repeats < 1:
        parser.error("--repeats must be at least 1")
    sizes = QUICK if args.quick else FULL
    result = asyncio.run(run_all(names, sizes, repeats, args.quick))
    report.print_report(result)
    report.write_json(result, args.json)
    print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main()
