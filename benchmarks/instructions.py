"""Instructions per step under callgrind: the noise-free side of the benchmarks.

    python -m benchmarks.instructions [--quick] [--only W[,W]] [--runner R[,R]]
                                      [--repeat N] [--jobs N] [--fresh] [--json PATH]
                                      [--valgrind PATH] [--keep DIR] [--map-linearity]

Each figure is ``(I_big - I_small) / (n_big - n_small)``, where ``I`` is the number
of instructions ``valgrind --tool=callgrind`` counts (cache simulation off, its
default) for a process that runs one workload at one size with one runner
(:mod:`benchmarks.icount_child`): start-up and imports cancel out. No-op
``async def`` steps, ``checkpoint_fn=list.append``, default settings; each
process imports only the runner under test. The ``map`` workload (one root
returning ``n`` items, one step mapped over it) is counted per item, beside the
fan-out's per step; ``--map-linearity`` adds its 25k-50k and 50k-100k pairs (and the
fan-out's), minutes more under callgrind.

By default one valgrind process per runner (chains apart, and each
measurement of 20k steps or more apart, as ``--map-linearity`` makes) imports the
runner once and forks a child per measurement; callgrind zeroes each child's
counts as it starts (``--zero-before=PyOS_AfterFork_Child``), so a count is the
child's setup, run and exit, and start-up is paid (and translated by valgrind)
once, not per measurement. ``--fresh`` runs one whole process per measurement
instead (the same figures to within 0.1 %, several times slower).

Counts repeat exactly: ``PYTHONHASHSEED=0``, a fixed small environment,
address-space randomization off (``setarch -R``), ``gc.freeze()`` after the
imports and after the setup, and the measured code copied (so that edits made
in the checkout meanwhile change nothing) to a fixed path under the temporary
folder, byte-compiled before any count.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import icount_child as child

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "instructions.json"
WORKLOADS = ("chain", "fan_out", "fan_in", "resume", "map", "loop")
RUNNERS = ("floor", "executionkit", "ekit", "ekit[dependencies]", "setup")
# "setup" is the setup alone (the graph dict, reading the checkpoint text): it is
# counted in every other figure, which "net_per_step" in the JSON leaves out.
COPIED = ("ekit_core", "ekit_runtime", "benchmarks")
VALGRIND_ENV = "EKIT_VALGRIND"

Pair = tuple[int, int]


@dataclass(frozen=True)
class Sizes:
    """The (small, big) pairs of each workload; ``QUICK`` is the smoke-test version."""

    chain: tuple[Pair, ...] = ((1_000, 2_000), (4_000, 8_000))
    fan_out: tuple[Pair, ...] = ((2_000, 4_000),)
    fan_in: tuple[Pair, ...] = ((2_000, 4_000), (4_000, 8_000))
    resume: tuple[Pair, ...] = ((2_000, 4_000),)  # recorded steps; LEFT more to run
    map: tuple[Pair, ...] = ((2_000, 4_000),)  # items; the pair of fan_out's, to compare
    loop: tuple[Pair, ...] = ((1_000, 2_000),)  # iterations of one loop; a chain pair's
    # ExecutionKit's chain is quadratic (a 1k-2k pair is 11.6 G instructions, a third of
    # the whole run): it is measured on this pair instead of the first chain pair, and
    # not on the others. Its per-step figure grows with n: 6.9 M at 1k to 2k.
    executionkit_chain: Pair = (500, 1_000)


FULL = Sizes()
QUICK = Sizes(chain=((40, 80), (80, 160)), fan_out=((40, 80),), fan_in=((40, 80), (80, 160)),
              resume=((40, 80),), map=((40, 80),), loop=((40, 80),), executionkit_chain=(20, 40))
MAP_LINEARITY: tuple[Pair, ...] = ((25_000, 50_000), (50_000, 100_000))
"""The pairs ``--map-linearity`` adds to the map and to the fan-out (to compare): per
item from 50k to 100k items over per item from 25k to 50k. Not in the default run: a
100k process alone is about 10 G instructions, several minutes under callgrind."""
DESCRIPTION = {
    "chain": "a chain: each step depends on the one before",
    "fan_out": "one root, n children",
    "fan_in": "n independent parents, one join over all of them",
    "resume": f"per recorded step: json.loads + parse + resume of a chain checkpoint with n "
              f"steps recorded and {child.LEFT} left to run (workflow construction included)",
    "map": "per item: one root returning a list of n items, one step mapped over it "
           "(Step('m', fn, ('root',), map_over='root'))",
    "loop": "per iteration: one loop of n no-op iterations, the n-th returning Done "
            "(Step('agent', fn, repeat=Repeat(n + 1)))",
}


class NoValgrind(Exception):
    """valgrind cannot be run: the message says why and what to do."""


# -- running the children -------------------------------------------------------------


@dataclass
class Job:
    """One measurement: a runner, a workload, a size; its count once run."""

    runner: str
    workload: str
    n: int
    repeat: int
    checkpoint: Path | None = None
    count: int | None = None
    error: str | None = None
    wall_s: float = 0.0

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.runner, self.workload, self.n)

    @property
    def spec(self) -> str:
        tail = f":{self.checkpoint}" if self.checkpoint is not None else ""
        return f"{self.workload}:{self.n}{tail}"

    @property
    def tag(self) -> str:
        runner = self.runner.replace("[", "-").rstrip("]")
        return f"{runner}.{self.workload}.{self.n}.{self.repeat}"


def find_valgrind(name: str) -> str:
    """The path of the valgrind executable ``name``, or :class:`NoValgrind`."""
    path = shutil.which(name)
    if path is None:
        raise NoValgrind(
            f"valgrind not found ({name!r} is not an executable on PATH): install it "
            f"(Debian/Ubuntu: apt-get install valgrind) or pass --valgrind PATH "
            f"(or set {VALGRIND_ENV})")
    return path


def _valgrind_version(valgrind: str) -> str:
    try:
        out = subprocess.run([valgrind, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NoValgrind(f"valgrind at {valgrind!r} cannot be run: {exc}") from None
    if out.returncode != 0:
        raise NoValgrind(f"valgrind at {valgrind!r} failed: {out.stderr.strip()[:200]}")
    return out.stdout.strip()


def _no_aslr() -> list[str]:
    """The prefix that runs a command with address-space randomization off, if possible."""
    setarch = shutil.which("setarch")
    if setarch is None or sys.platform != "linux":
        return []
    probe = subprocess.run([setarch, platform.machine(), "-R", "true"], capture_output=True)
    return [setarch, platform.machine(), "-R"] if probe.returncode == 0 else []


def parse_total(text: str) -> int:
    """The total instruction count of a callgrind output file's text."""
    for prefix in ("summary:", "totals:"):
        for line in text.splitlines():
            if line.startswith(prefix):
                return int(line.split()[1])
    raise ValueError("no summary: or totals: line in the callgrind output")


def _child_env() -> dict[str, str]:
    """A small fixed environment (its size and contents are part of every count)."""
    env = {name: os.environ[name] for name in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")
           if name in os.environ}
    env["PYTHONHASHSEED"] = "0"
    return env


@dataclass
class Driver:
    """One valgrind process: the runner imported once, then one child per job.

    Forked (the default): each job runs in a child forked after the imports, and
    callgrind zeroes the child's counts as it starts (``--zero-before`` on
    CPython's after-fork hook), so a job's count is its setup, its run and its
    exit. Fresh (``--fresh``): one whole process per job, start-up included.
    """

    runner: str
    jobs: list[Job]
    fresh: bool = False

    def cost(self) -> float:
        return 400e6 + sum(_cost(j) for j in self.jobs)  # start-up: about 0.4 G


def _cost(job: Job) -> float:
    """A rough guess at a job's instructions (from a full run), to start the longest
    drivers first."""
    if job.runner == "executionkit" and job.workload == "chain":
        return 100e3 * job.n + 2.25e3 * job.n ** 2
    per_step = {"floor": 100e3, "executionkit": 90e3, "setup": 3e3}.get(job.runner, 250e3)
    return per_step * job.n * (0.3 if job.workload == "resume" else 1.0)


def run_driver(driver: Driver, index: int, *, valgrind: str, prefix: list[str], src: Path,
               out_dir: Path, keep: Path | None) -> None:
    """Run ``driver`` under callgrind and store each job's count (or error) in it."""
    stem = out_dir / f"callgrind.d{index}"
    cmd = [*prefix, valgrind, "--tool=callgrind", "-q"]
    if driver.fresh:
        cmd.append(f"--callgrind-out-file={stem}")
        child_args = ["--no-fork", driver.runner, driver.jobs[0].spec]
    else:
        cmd += ["--zero-before=PyOS_AfterFork_Child", f"--callgrind-out-file={stem}.%p"]
        child_args = [driver.runner, *(j.spec for j in driver.jobs)]
    cmd += [sys.executable, "-m", "benchmarks.icount_child", *child_args]
    with tempfile.TemporaryFile("w+") as err:

        def stderr_tail() -> str:
            err.seek(0)
            lines = [ln for ln in err.read().splitlines() if not ln.startswith("==")]
            return " | ".join(lines[-3:])[:400]

        last = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=src, env=_child_env(), stdout=subprocess.PIPE,
                                stderr=err, text=True)
        assert proc.stdout is not None
        done = 0
        for done, line in enumerate(proc.stdout, 1):  # forked: "pid status spec" per child
            pid, status, _ = line.split(" ", 2)
            now = time.perf_counter()
            job = driver.jobs[done - 1]
            job.wall_s, last = now - last, now
            _collect(job, int(status), Path(f"{stem}.{pid}"), keep, stderr_tail)
        code = proc.wait()
        if driver.fresh:
            job = driver.jobs[0]
            job.wall_s = time.perf_counter() - last
            _collect(job, code, stem, keep, stderr_tail)
            done = 1
        for job in driver.jobs[done:]:
            job.error = f"valgrind process exit {code}: {stderr_tail()}"
            _progress(job)


def _collect(job: Job, status: int, out: Path, keep: Path | None,
             stderr_tail: Callable[[], str]) -> None:
    """Read ``job``'s count from its callgrind file ``out`` (then move or delete it)."""
    if status != 0:
        job.error = f"exit {status}: {stderr_tail()}"
    else:
        try:
            job.count = parse_total(out.read_text())
        except (OSError, ValueError) as exc:
            job.error = f"no count: {exc}"
    if out.exists():
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            shutil.move(out, keep / f"callgrind.{job.tag}")
        else:
            out.unlink()
    _progress(job)


def _progress(job: Job) -> None:
    what = f"{job.count:,}" if job.count is not None else job.error
    print(f"  {job.runner} {job.workload} {job.n} #{job.repeat}: {what} ({job.wall_s:.0f} s)",
          file=sys.stderr, flush=True)


# -- the copy of the code ------------------------------------------------------------


def snapshot(dest: Path) -> str:
    """Copy the measured packages into ``dest``, byte-compile them; their digest."""
    digest = hashlib.sha256()
    for package in COPIED:
        shutil.copytree(ROOT / package, dest / package,
                        ignore=shutil.ignore_patterns("__pycache__", "results", "*.pyc"))
        for path in sorted((dest / package).rglob("*.py")):
            digest.update(str(path.relative_to(dest)).encode() + b"\0" + path.read_bytes())
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(dest)], check=True,
                   capture_output=True)
    return digest.hexdigest()[:16]


def write_checkpoints(src: Path, runners: list[str], recorded: set[int],
                      folder: Path) -> dict[tuple[str, int], Path | str]:
    """The checkpoint file for each runner and size (or the error making it), written
    natively by the copied child code: ekit's from a real run, the others' by hand."""
    files: dict[tuple[str, int], Path | str] = {}
    for runner in runners:
        for n in sorted(recorded):
            path = folder / f"checkpoint.{runner.replace('[', '-').rstrip(']')}.{n:08d}.json"
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.icount_child", "--write-checkpoint", runner,
                 str(n), str(path)], cwd=src, env=_child_env(), capture_output=True, text=True)
            files[(runner, n)] = path if proc.returncode == 0 else (
                f"checkpoint not written: {proc.stderr.strip().splitlines()[-1:]}")
    return files


# -- the plan and the figures --------------------------------------------------------


def installed(library: str) -> bool:
    """Whether ``library`` can be imported here (ExecutionKit is an optional baseline)."""
    return importlib.util.find_spec(library) is not None


def measured_pair(runner: str, workload: str, index: int, sizes: Sizes) -> Pair | str:
    """The sizes ``runner`` is measured at for ``workload``'s pair ``index``, or a note
    saying why it is not measured there."""
    pair: Pair = getattr(sizes, workload)[index]
    if workload in ("map", "loop") and runner not in child.MAPPED:
        return f"no run-time {workload}"
    if runner == "executionkit":
        if not installed("executionkit"):
            return "executionkit not installed (pip install executionkit==0.4.0)"
        if workload == "chain":
            return sizes.executionkit_chain if index == 0 else (
                "not measured: quadratic, minutes per run under callgrind")
    return pair


def plan(workloads: list[str], runners: list[str], sizes: Sizes, repeat: int) -> list[Job]:
    """Every measurement to make: each size of each pair, ``repeat`` times, in order."""
    keys: list[tuple[str, str, int]] = []
    for runner in runners:
        for workload in workloads:
            for index in range(len(getattr(sizes, workload))):
                pair = measured_pair(runner, workload, index, sizes)
                if not isinstance(pair, str):
                    keys += [(runner, workload, n) for n in pair
                             if (runner, workload, n) not in keys]
    return [Job(r, w, n, i) for r, w, n in keys for i in range(repeat)]


def drivers(jobs: list[Job], *, fresh: bool) -> list[Driver]:
    """The valgrind processes to run, the longest first: forked, one per runner for
    its chains and one for the rest; fresh, one per job."""
    if fresh:
        out = [Driver(j.runner, [j], fresh=True) for j in jobs]
    else:
        # A big map (--map-linearity) is minutes under callgrind: a process of its own.
        groups: dict[tuple[str, str], list[Job]] = {}
        for job in jobs:
            apart = "chain" if job.workload == "chain" else (
                f"{job.workload}{job.n}" if job.n >= 20_000 else "")
            groups.setdefault((job.runner, apart), []).append(job)
        out = [Driver(runner, group) for (runner, _), group in groups.items()]
    return sorted(out, key=Driver.cost, reverse=True)


def _pair_label(workload: str, pair: Pair) -> str:
    def k(n: int) -> str:
        return f"{n // 1000}k" if n % 1000 == 0 else str(n)

    unit = {"fan_out": "children", "fan_in": "parents", "resume": "recorded steps",
            "map": "items", "loop": "iterations"}.get(
        workload, "steps")
    return f"{k(pair[0])} to {k(pair[1])} {unit}"


def figures(jobs: list[Job], workloads: list[str], runners: list[str],
            sizes: Sizes) -> dict[str, Any]:
    """Per workload and pair: each runner's per-step figure, its counts and ratios."""
    by_key: dict[tuple[str, str, int], list[Job]] = {}
    for job in jobs:
        by_key.setdefault(job.key, []).append(job)
    out: dict[str, Any] = {}
    for workload in workloads:
        pairs = []
        for index, pair in enumerate(getattr(sizes, workload)):
            cells: dict[str, Any] = {}
            for runner in runners:
                at = measured_pair(runner, workload, index, sizes)
                if isinstance(at, str):
                    cells[runner] = {"skipped": at}
                    continue
                cells[runner] = _cell([by_key.get((runner, workload, n), []) for n in at], at)
                if at != pair:
                    cells[runner]["measured_at"] = _pair_label(workload, at)
            setup = cells.get("setup", {}).get("per_step")
            for runner, cell in cells.items():
                if runner == "setup" or "per_step" not in cell:
                    continue
                for base in ("floor", "executionkit"):
                    b = cells.get(base, {}).get("per_step")
                    if b:
                        cell[f"vs_{base}"] = cell["per_step"] / b
                if setup is not None and "measured_at" not in cell:
                    cell["net_per_step"] = cell["per_step"] - setup
            pairs.append({"label": _pair_label(workload, pair), "small": pair[0],
                          "big": pair[1], "runners": cells})
        out[workload] = {"description": DESCRIPTION[workload], "pairs": pairs}
    return out


def _cell(runs: list[list[Job]], pair: Pair) -> dict[str, Any]:
    errors = [j.error for js in runs for j in js if j.error]
    if errors or not all(runs):
        return {"error": errors[0] if errors else "not run"}
    counts = [[j.count for j in js if j.count is not None] for js in runs]
    small, big = (statistics.median(c) for c in counts)
    spread = max(max(c) - min(c) for c in counts)
    return {"per_step": (big - small) / (pair[1] - pair[0]), "counts_small": counts[0],
            "counts_big": counts[1], "spread": spread,
            "wall_s": [round(sum(j.wall_s for j in js) / len(js), 1) for js in runs]}


def _per_step(result: dict[str, Any], workload: str, index: int, runner: str) -> float | None:
    pairs = result.get(workload, {}).get("pairs", [])
    if index >= len(pairs):
        return None
    value = pairs[index]["runners"].get(runner, {}).get("per_step")
    return float(value) if value is not None else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def linearity(result: dict[str, Any], runners: list[str]) -> list[dict[str, Any]]:
    """Per-step figure of the biggest pair over the one before, for chain, fan-in, and
    map and fan-out (whose pairs past the first are there only with ``--map-linearity``)."""
    out = []
    for workload in ("chain", "fan_in", "map", "fan_out"):
        pairs = result.get(workload, {}).get("pairs", [])
        if len(pairs) < 2:
            continue
        big, small = len(pairs) - 1, len(pairs) - 2
        for runner in runners:
            if runner == "setup":
                continue
            ratio = _ratio(_per_step(result, workload, big, runner),
                           _per_step(result, workload, small, runner))
            if ratio is not None:
                out.append({"workload": workload, "runner": runner, "ratio": ratio,
                            "of": f"{pairs[big]['label']} / {pairs[small]['label']}"})
    return out


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 12's targets, in the default context mode (``ekit``), with the
    ``context="dependencies"`` figure alongside for information."""
    out = []

    def add(name: str, limit: float, figure: Any, note: str = "") -> None:
        fig = {mode: figure(mode) for mode in ("ekit", "ekit[dependencies]")}
        main = fig["ekit"]
        out.append({"target": name, "limit": limit, "figure": main,
                    "figure_dependencies": fig["ekit[dependencies]"],
                    "met": None if main is None else main <= limit, "note": note})

    for i, pair in enumerate(result.get("chain", {}).get("pairs", [])):
        add(f"chain {pair['label']}: ekit / floor", 1.5,
            lambda m, i=i: _ratio(_per_step(result, "chain", i, m),
                                  _per_step(result, "chain", i, "floor")), "aim 1.25x")
    for workload in ("chain", "fan_in", "map"):
        pairs = result.get(workload, {}).get("pairs", [])
        if len(pairs) >= 2:
            big, small = len(pairs) - 1, len(pairs) - 2
            add(f"linear {workload}: per step {pairs[big]['label']} / {pairs[small]['label']}",
                1.15, lambda m, w=workload, b=big, s=small: _ratio(
                    _per_step(result, w, b, m), _per_step(result, w, s, m)))
    if result.get("fan_out", {}).get("pairs"):
        add("fan-out: ekit / ExecutionKit", 1.0,
            lambda m: _ratio(_per_step(result, "fan_out", 0, m),
                             _per_step(result, "fan_out", 0, "executionkit")))
        add("fan-out (aim): ekit / floor", 1.25,
            lambda m: _ratio(_per_step(result, "fan_out", 0, m),
                             _per_step(result, "fan_out", 0, "floor")), "the issue's aim")
    if result.get("resume", {}).get("pairs"):
        add("resume per recorded step: ekit / ExecutionKit", 1.0,
            lambda m: _ratio(_per_step(result, "resume", 0, m),
                             _per_step(result, "resume", 0, "executionkit")))
    if result.get("map", {}).get("pairs") and result.get("fan_out", {}).get("pairs"):
        add("map per item / fan-out per step", 1.15,
            lambda m: _ratio(_per_step(result, "map", 0, m),
                             _per_step(result, "fan_out", 0, m)), "issue 25")
    if result.get("loop", {}).get("pairs") and result.get("chain", {}).get("pairs"):
        add("loop per iteration / chain per step", 1.15,
            lambda m: _ratio(_per_step(result, "loop", 0, m),
                             _per_step(result, "chain", 0, m)), "issue 44")
    return out


# -- the report ----------------------------------------------------------------------


def _k(value: float | None) -> str:
    return "-" if value is None else f"{value / 1000:,.1f}k"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def print_report(result: dict[str, Any]) -> None:
    """The tables, linearity ratios and targets, as text."""
    meta = result["meta"]
    print(f"instructions per step, (I_big - I_small) / (n_big - n_small), whole processes "
          f"under callgrind ({meta['valgrind']}, Python {meta['python']})")
    for workload, entry in result["workloads"].items():
        for pair in entry["pairs"]:
            print(f"\n{workload}, {pair['label']}: {entry['description']}")
            repeated = meta["repeat"] > 1
            rows = [("runner", "per step", "net of setup", "/ floor", "/ ExecutionKit",
                     "spread" if repeated else "", "note")]
            for runner, cell in pair["runners"].items():
                if "per_step" not in cell:
                    rows.append((runner, "-", "", "", "", "", cell.get("skipped")
                                 or cell.get("error", "")))
                    continue
                at = cell.get("measured_at")
                note = (f"measured at {at} (quadratic: per step grows with n)" if at else
                        "the setup alone, counted in every figure" if runner == "setup"
                        else "")
                rows.append((runner, _k(cell["per_step"]), _k(cell.get("net_per_step")),
                             _x(cell.get("vs_floor")), _x(cell.get("vs_executionkit")),
                             str(cell["spread"]) if repeated else "", note))
            widths = [max(len(r[i]) for r in rows) for i in range(6)]
            for row in rows:
                cols = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in
                                                    zip(row[1:6], widths[1:], strict=True)]
                print(("  " + "  ".join(cols)).rstrip() + ("  " + row[6] if row[6] else ""))
    if result["linearity"]:
        print("\nlinearity (per step, bigger pair / smaller pair; linear = 1.00x):")
        for line in result["linearity"]:
            print(f"  {line['workload']:7} {line['runner']:19} {_x(line['ratio'])}  ({line['of']})")
    print("\ntargets (default context mode; context='dependencies' in brackets):")
    for t in result["targets"]:
        verdict = {True: "MET", False: "NOT MET", None: "n/a"}[t["met"]]
        note = f"; {t['note']}" if t["note"] else ""
        print(f"  [{verdict:7}] {t['target']}: {_x(t['figure'])} "
              f"[{_x(t['figure_dependencies'])}] (target <= {t['limit']}x{note})")
    if meta["repeat"] > 1:
        print(f"\nrepeatability: the largest spread between the {meta['repeat']} counts of "
              f"one measurement is {meta['largest_spread']} instructions")
    print(f"\nwall time {meta['wall_s']:.0f} s, {meta['valgrind_processes']} valgrind "
          f"processes, {meta['jobs']} at a time; code measured: {meta['git']}, sources "
          f"{meta['source_digest']}")


# -- the command ---------------------------------------------------------------------


def _names(value: str, allowed: tuple[str, ...], what: str,
           parser: argparse.ArgumentParser) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown:
        parser.error(f"unknown {what} {unknown}; choose from {', '.join(allowed)}")
    return names


def _checkpoint_runner(runner: str) -> str:
    """Whose checkpoint format ``runner`` reads: the setup alone reads ExecutionKit's."""
    return "executionkit" if runner in ("floor", "setup") else runner


@contextlib.contextmanager
def _workdir() -> Iterator[Path]:
    """A fresh folder at a fixed path (so the children's paths, which are strings they
    hash and look up, are the same in every run), one run at a time."""
    base = Path(tempfile.gettempdir()) / "ekit-icount"
    base.mkdir(exist_ok=True)
    with open(base / "lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("waiting for another benchmarks.instructions run to end ...",
                  file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        work = base / "run"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        try:
            yield work
        finally:
            shutil.rmtree(work, ignore_errors=True)


def measure(workloads: list[str], runners: list[str], sizes: Sizes, *, repeat: int,
            jobs: int, valgrind: str, keep: Path | None, fresh: bool = False) -> dict[str, Any]:
    """Run every measurement under callgrind and return the whole result."""
    began = time.perf_counter()
    version = _valgrind_version(valgrind)
    prefix = _no_aslr()
    with _workdir() as tmp:
        src = Path(tmp) / "src"
        digest = snapshot(src)
        todo = plan(workloads, runners, sizes, repeat)
        recorded = {j.n for j in todo if j.workload == "resume"}
        formats = sorted({_checkpoint_runner(j.runner) for j in todo if j.workload == "resume"})
        files = write_checkpoints(src, formats, recorded, Path(tmp))
        for job in todo:
            if job.workload == "resume":
                made = files[(_checkpoint_runner(job.runner), job.n)]
                if isinstance(made, str):
                    job.error = made
                else:
                    job.checkpoint = made
        plan_ = drivers([j for j in todo if j.error is None], fresh=fresh)
        print(f"{len(todo)} measurements in {len(plan_)} valgrind processes, {jobs} at a "
              f"time ...", file=sys.stderr, flush=True)

        def one(item: tuple[int, Driver]) -> None:
            run_driver(item[1], item[0], valgrind=valgrind, prefix=prefix, src=src,
                       out_dir=Path(tmp), keep=keep)

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(one, enumerate(plan_)))
    table = figures(todo, workloads, runners, sizes)
    spreads = [cell.get("spread", 0) for entry in table.values() for pair in entry["pairs"]
               for cell in pair["runners"].values()]
    return {
        "meta": {
            "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "valgrind": version,
            "mode": "fresh processes" if fresh else "children forked after the imports",
            "aslr_off": bool(prefix),
            "pythonhashseed": 0,
            "source_digest": digest,
            "git": _git(),
            "sizes": asdict(sizes),
            "left_on_resume": child.LEFT,
            "repeat": repeat,
            "jobs": jobs,
            "valgrind_processes": len(plan_),
            "largest_spread": max(spreads, default=0),
            "wall_s": time.perf_counter() - began,
            "versions": {"executionkit": _version("executionkit")},
        },
        "workloads": table,
        "linearity": linearity(table, runners),
        "targets": targets(table),
        "measurements": [{"runner": j.runner, "workload": j.workload, "n": j.n,
                          "repeat": j.repeat, "instructions": j.count, "error": j.error,
                          "wall_s": round(j.wall_s, 2)} for j in todo],
    }


def _git() -> str | None:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                             capture_output=True, text=True, timeout=10)
    except OSError:
        return None
    return out.stdout.strip() or None


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, measure, print, write the JSON; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.instructions",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes: a smoke run (start-up still dominates)")
    parser.add_argument("--only", default="",
                        help=f"comma-separated workloads, of: {', '.join(WORKLOADS)}")
    parser.add_argument("--runner", default="",
                        help=f"comma-separated runners, of: {', '.join(RUNNERS)} (default: all)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="count each process this many times, to check repeatability")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="processes under callgrind at once (default: the CPU count)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON,
                        help=f"where to write the results (default {DEFAULT_JSON})")
    parser.add_argument("--valgrind", default=os.environ.get(VALGRIND_ENV, "valgrind"),
                        help=f"the valgrind executable (default: ${VALGRIND_ENV} or valgrind)")
    parser.add_argument("--fresh", action="store_true",
                        help="one whole valgrind process per measurement (start-up included; "
                        "slower) instead of children forked after the imports")
    parser.add_argument("--map-linearity", action="store_true",
                        help="measure the map and the fan-out also at 25k to 50k and 50k "
                        "to 100k items (many minutes more; the linearity target of issue 25)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep the callgrind output files in this folder "
                        "(for callgrind_annotate)")
    args = parser.parse_args(argv)
    workloads = _names(args.only, WORKLOADS, "workload", parser) or list(WORKLOADS)
    runners = _names(args.runner, RUNNERS, "runner", parser) or list(RUNNERS)
    if args.repeat < 1 or args.jobs < 1:
        parser.error("--repeat and --jobs must be at least 1")
    sizes = QUICK if args.quick else FULL
    if args.map_linearity:
        sizes = replace(sizes, map=sizes.map + MAP_LINEARITY,
                        fan_out=sizes.fan_out + MAP_LINEARITY)
    try:
        valgrind = find_valgrind(args.valgrind)
        result = measure(workloads, runners, sizes, repeat=args.repeat,
                         jobs=args.jobs, valgrind=valgrind, keep=args.keep,
                         fresh=args.fresh)
    except NoValgrind as exc:
        print(f"benchmarks.instructions: {exc}", file=sys.stderr)
        return 2
    result["meta"]["quick"] = args.quick
    print_report(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    failed = [m for m in result["measurements"] if m["error"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
