"""What one queued run costs, exactly: the worker's instructions and the server's CPU.

Part of ``python -m benchmarks.queue`` (``--cost-only`` runs this part alone).

- **The worker's instructions per run**: a worker process drains ``small``
  then, in a second process, ``big`` runs of a ``steps``-step chain of no-op
  steps (submitted beforehand by this process, outside the count), each
  process under ``valgrind --tool=callgrind`` as :mod:`benchmarks.instructions`
  runs its children (``PYTHONHASHSEED=0``, a fixed environment, address-space
  randomization off). ``(I_big - I_small) / (big - small)`` leaves out the
  start-up, the imports and the first claim: what is left is a run's claim,
  its step saves, its ending, its share of the worker's loop. The worker is
  made with its defaults (streams on, ``max_runs=4``), as users get it.
- **The same run in-process**: the chain run ``small`` and ``big`` times by
  ``Workflow.run(checkpoint_fn=SqliteStore(...))``, one store (one run id) a
  run, in one database file, measured the same way: the floor the issue
  judges the worker by (target: the worker at most 1.5x this).
- **The server's CPU per run** (PostgreSQL): the user and system time, from
  ``/proc``, of the server processes serving the benchmark's database (the
  worker's sessions, read by the worker just before it closes them), after a
  drain of ``small`` and one of ``big`` runs by one worker process at full
  speed (not under valgrind), the difference per run. Other databases'
  sessions (other test runs on a shared server) are not counted, nor are the
  server's own background processes (its WAL writer, checkpointer). Clock
  ticks are 10 ms: drains of hundreds of runs keep that below a few percent.

A worker's counts are not exact to the instruction as the in-process ones
are: its loop polls, and the runs a claim or a group commit takes together
depend on timing (two readings differ by about 1 %).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.instructions import _no_aslr, find_valgrind, parse_total

ROOT = Path(__file__).resolve().parent.parent
COMPILED = ("ekit_core", "ekit_runtime", "benchmarks")
TARGET = 1.5
"""The issue's target: a queued run's worker instructions at most this times the in-process run's."""


def chain(steps: int) -> Any:
    """A chain of ``steps`` no-op async steps (a ``Workflow``; imported here, as every
    ekit import of this module is, inside what a measured child runs)."""
    from ekit_runtime import Step, Workflow

    async def noop(ctx: dict[str, Any]) -> str:
        return "ok"

    return Workflow([Step(f"s{i}", noop, (f"s{i - 1}",) if i else ()) for i in range(steps)])


def _env() -> dict[str, str]:
    names = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")
    env = {name: os.environ[name] for name in names if name in os.environ}
    env["PYTHONHASHSEED"] = "0"
    env["PYTHONPATH"] = str(ROOT)
    if os.environ.get("EKIT_BENCH_NO_DURATIONS"):
        env["EKIT_BENCH_NO_DURATIONS"] = "1"
    return env


def worker_child(url: str, steps: int) -> None:
    """Drain the queue at ``url`` with one default worker (the process counted; with
    ``EKIT_BENCH_NO_DURATIONS`` set, one that records no step times)."""
    from ekit_runtime.queue import Worker, open_queue

    queue = open_queue(url)
    seen: dict[int, int] = {}
    if os.environ.get("EKIT_BENCH_SERVER_TICKS"):
        # The worker closes its loop session as it returns: its backend's time
        # is read just before, and every backend's again at the end.
        from ekit_runtime.queue.postgres_loop import LoopSession

        close = LoopSession.aclose

        async def aclose(self: LoopSession) -> None:
            seen.update(session_ticks(queue))
            await close(self)

        LoopSession.aclose = aclose  # type: ignore[method-assign]
    # --no-durations: a worker that records no step times, as the in-process run does not,
    # so that a count compares with those made before workers recorded them by default.
    defaults = {"durations": False} if os.environ.get("EKIT_BENCH_NO_DURATIONS") else None
    done = asyncio.run(Worker(queue, {"chain": chain(steps)}, defaults=defaults).run_until_idle())
    if os.environ.get("EKIT_BENCH_SERVER_TICKS"):
        seen.update(session_ticks(queue))
    queue.close()
    print(done, sum(seen.values()), flush=True)


def session_ticks(queue: Any) -> dict[int, int]:
    """pid -> CPU ticks of each server process serving ``queue``'s database (this machine's ``/proc``)."""
    name = queue.db.conn.execute("SELECT current_database()").fetchone()[0]
    found: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            words = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split()
            # A backend names itself "postgres: USER DATABASE HOST(PORT) STATE".
            if len(words) >= 3 and words[0] == "postgres:" and words[2] == name:
                found[int(entry)] = _ticks(int(entry))[0]
        except (OSError, ValueError, IndexError):
            continue
    return found


def local_child(path: str, runs: int, steps: int) -> None:
    """Run the chain ``runs`` times in-process, each saved by a ``SqliteStore`` in ``path``."""
    from ekit_runtime import SqliteStore

    workflow = chain(steps)

    async def main() -> None:
        for i in range(runs):
            with SqliteStore(path, run_id=f"r{i}") as store:
                await workflow.run(checkpoint_fn=store, run_id=f"r{i}")

    asyncio.run(main())
    print(runs, flush=True)


def _callgrind(args: list[str], valgrind: str) -> int:
    """Instructions of ``python -m benchmarks.queue ARGS`` under callgrind."""
    out_dir = Path(tempfile.mkdtemp(prefix="ekit-queue-icount-"))
    try:
        out = out_dir / "callgrind.out"
        cmd = [*_no_aslr(), valgrind, "--tool=callgrind", "-q", f"--callgrind-out-file={out}",
               sys.executable, "-m", "benchmarks.queue", *args]
        done = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: exit {done.returncode}: {done.stderr[-800:]}")
        return parse_total(out.read_text())
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def _submit(url: str, runs: int) -> None:
    from ekit_runtime.queue import open_queue

    queue = open_queue(url)
    for _ in range(runs):
        queue.submit("chain")
    queue.close()


def worker_instructions(fresh: Callable[[], Any], runs: tuple[int, int], steps: int, valgrind: str) -> float:
    """The worker's instructions per queued run: the difference of two drains under callgrind."""
    counts = []
    for n in runs:
        with fresh() as url:
            _submit(url, n)
            counts.append(_callgrind(["--cost-child", "worker", url, str(steps)], valgrind))
    return (counts[1] - counts[0]) / (runs[1] - runs[0])


def local_instructions(runs: tuple[int, int], steps: int, valgrind: str) -> float:
    """Instructions per in-process run saved by a ``SqliteStore``: the difference of two counts."""
    counts = []
    for n in runs:
        directory = tempfile.mkdtemp(prefix="ekit-queue-local-")
        try:
            path = os.path.join(directory, "local.db")
            counts.append(_callgrind(["--cost-child", "local", path, str(n), str(steps)], valgrind))
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    return (counts[1] - counts[0]) / (runs[1] - runs[0])


def _ticks(pid: int) -> tuple[int, int]:
    """(its own user+system ticks, its waited-for children's), from ``/proc/PID/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # After the command: state ppid ... utime(12) stime(13) cutime(14) cstime(15) (0-based from state).
    return int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])


def server_on_this_machine(url: str) -> bool:
    """Whether ``/proc`` shows the backend of a session of ``url``'s server."""
    from ekit_runtime.queue import open_queue

    queue = open_queue(url)
    try:
        pid = int(queue.db.conn.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[attr-defined]
    finally:
        queue.close()
    return Path(f"/proc/{pid}/stat").exists()


def server_ms(fresh: Callable[[], Any], runs: tuple[int, int], steps: int) -> float | None:
    """The PostgreSQL server's CPU milliseconds per queued run (``None``: not on this machine)."""
    per: list[float] = []
    for n in runs:
        with fresh() as url:
            if not server_on_this_machine(url):
                return None
            _submit(url, n)
            child = [sys.executable, "-m", "benchmarks.queue", "--cost-child", "worker", url, str(steps)]
            env = {**os.environ, "PYTHONPATH": str(ROOT), "EKIT_BENCH_SERVER_TICKS": "1"}
            out = subprocess.run(child, check=True, capture_output=True, cwd=ROOT, env=env, text=True)
            per.append(int(out.stdout.split()[1]) * 1000 / os.sysconf("SC_CLK_TCK"))
    return (per[1] - per[0]) / (runs[1] - runs[0])


def measure_cost(backends: dict[str, Callable[[], Any]], steps: int, quick: bool, log: Any) -> dict[str, Any]:
    """Every cost figure: per backend, the worker's instructions a run (and the server's CPU)."""
    valgrind = find_valgrind(os.environ.get("EKIT_VALGRIND", "valgrind"))
    # A process that byte-compiles what it imports counts the compiling: the
    # first of two would cost more than the second, whatever it runs.
    subprocess.run([sys.executable, "-m", "compileall", "-q", *(str(ROOT / p) for p in COMPILED)],
                   check=True, env=_env())
    icount_runs = (10, 30) if quick else (40, 120)
    server_runs = (50, 150) if quick else (200, 1000)
    local = local_instructions(icount_runs, steps, valgrind)
    result: dict[str, Any] = {"steps": steps, "icount_runs": list(icount_runs),
                              "local_sqlite_store_instructions_per_run": local}
    log({"cost": "in-process SqliteStore", "instructions_per_run": local})
    for backend, fresh in backends.items():
        worker = worker_instructions(fresh, icount_runs, steps, valgrind)
        row: dict[str, Any] = {"worker_instructions_per_run": worker, "worker_over_local": worker / local,
                               "target_met": worker / local <= TARGET}
        if backend == "postgres":
            row["server_runs"] = list(server_runs)
            row["server_cpu_ms_per_run"] = server_ms(fresh, server_runs, steps)
        result[backend] = row
        log({"cost": backend, **row})
    return result


def report_cost(cost: dict[str, Any]) -> str:
    """The cost figures as lines of text."""
    local = cost["local_sqlite_store_instructions_per_run"]
    lines = [f"a queued run of {cost['steps']} no-op steps (claim, saves, finish), instructions "
             f"((I at {cost['icount_runs'][1]} runs - I at {cost['icount_runs'][0]}) / difference):",
             f"  in-process, Workflow.run + SqliteStore: {local / 1e6:7.3f} M a run"]
    if os.environ.get("EKIT_BENCH_NO_DURATIONS"):
        lines[0] += " (--no-durations: the workers record no step times)"
    for backend in ("sqlite", "postgres"):
        if backend not in cost:
            continue
        row = cost[backend]
        line = (f"  {backend} worker: {row['worker_instructions_per_run'] / 1e6:7.3f} M a run, "
                f"{row['worker_over_local']:.2f}x in-process (target <= {TARGET}: "
                f"{'met' if row['target_met'] else 'NOT met'})")
        if row.get("server_cpu_ms_per_run") is not None:
            line += f"; server CPU {row['server_cpu_ms_per_run']:.3f} ms a run"
        lines.append(line)
    return "\n".join(lines)


def cost_child(argv: list[str]) -> None:
    """``--cost-child worker URL STEPS`` or ``--cost-child local PATH RUNS STEPS``."""
    if argv[0] == "worker":
        worker_child(argv[1], int(argv[2]))
    else:
        local_child(argv[1], int(argv[2]), int(argv[3]))
