"""Instructions per cache hit beside instructions per recorded step skipped on resume (issue 45).

    python -m benchmarks.cache_hits [--sizes N1,N2] [--valgrind PATH]

Two workloads on a chain of no-op ``async def`` steps, ``checkpoint_fn=list.append``,
each counted under callgrind as a whole process at two sizes, per step
``(I_big - I_small) / (n_big - n_small)`` (start-up and imports cancel out), with
the harness's fixed environment (:mod:`benchmarks.instructions`):

- ``resume``: the chain resumed from the JSON text of a checkpoint recording every
  step (what a recorded step costs a resume: parse, and skip);
- ``hit``: the chain with ``cache=True`` on every step, run with a ``SqliteCache``
  that a run before (outside the count) filled: every step is a hit.

Issue 45 asks that a hit cost no more than 1.5x a recorded step skipped on resume;
the report prints the ratio and whether it is met.

``--later`` adds a third workload, beside the ratio: a fan-out whose root is not
cached (it runs) and whose ``n`` cached branches all hit, so that every hit is
found by an attempt during the run, the branches' attempts looked up together
(:mod:`ekit_runtime.cache.together`), not as the run starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.instructions import _child_env, _no_aslr, find_valgrind, parse_total

ROOT = Path(__file__).resolve().parent.parent
TARGET = 1.5


async def _noop(context: Any) -> int:
    return 1


def _chain(n: int, cache: bool) -> Any:
    from ekit_runtime import Step, Workflow

    return Workflow([Step(f"s{i}", _noop, (f"s{i - 1}",) if i else (), cache=cache) for i in range(n)])


def _fan_out(n: int) -> Any:
    from ekit_runtime import Step, Workflow

    return Workflow([Step("root", _noop), *(Step(f"b{i}", _noop, ("root",), cache=True) for i in range(n))])


def prepare(mode: str, n: int, where: Path) -> None:
    """Outside the count: the checkpoint text to resume, or the filled cache."""
    from ekit_runtime import SqliteCache

    if mode == "resume":
        saved: list[Any] = []
        asyncio.run(_chain(n, False).run(checkpoint_fn=saved.append))
        where.write_text(json.dumps(saved[-1].to_dict()))
    else:
        with SqliteCache(where) as cache:
            asyncio.run((_fan_out(n) if mode == "later" else _chain(n, True)).run(cache=cache))


def measured(mode: str, n: int, where: Path) -> None:
    """What is counted: the resume of the recorded chain, or the run whose every step hits."""
    import gc

    from ekit_runtime import SqliteCache

    # As benchmarks.instructions does: what the imports made is not traversed by every
    # collection, so that whether a full one falls in the bigger run or not (which a new
    # module anywhere can change) does not move the figure by 3k a step.
    gc.freeze()

    saved: list[Any] = []
    if mode == "resume":
        result = asyncio.run(_chain(n, False).run(resume_from=json.loads(where.read_text()),
                                                  checkpoint_fn=saved.append))
    else:
        with SqliteCache(where) as cache:
            flow = _fan_out(n) if mode == "later" else _chain(n, True)
            result = asyncio.run(flow.run(cache=cache, checkpoint_fn=saved.append))
        assert result.checkpoint is not None and len(result.checkpoint.cache_hits) == n
    assert len(result.outputs) == n + (mode == "later")


def count(valgrind: str, mode: str, n: int, folder: Path) -> int:
    where = folder / f"{mode}.{n}.{'json' if mode == 'resume' else 'db'}"
    env = _child_env()
    subprocess.run([sys.executable, "-m", "benchmarks.cache_hits", "--child", "prepare", mode, str(n),
                    str(where)], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, check=True)
    out = folder / f"callgrind.{mode}.{n}"
    subprocess.run([*_no_aslr(), valgrind, "--tool=callgrind", "-q", f"--callgrind-out-file={out}",
                    sys.executable, "-m", "benchmarks.cache_hits", "--child", "measure", mode, str(n),
                    str(where)], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, check=True)
    return parse_total(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cache_hits")
    parser.add_argument("--sizes", default="100,200", help="the two chain lengths (default 100,200)")
    parser.add_argument("--valgrind", default="valgrind")
    parser.add_argument("--later", action="store_true",
                        help="also count hits found by attempts during the run (a fan-out)")
    parser.add_argument("--child", nargs=4, metavar=("WHAT", "MODE", "N", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        what, mode, n, path = args.child
        (prepare if what == "prepare" else measured)(mode, int(n), Path(path))
        return 0
    small, big = (int(s) for s in args.sizes.split(","))
    valgrind = find_valgrind(args.valgrind)
    per: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("resume", "hit"):
            a, b = count(valgrind, mode, small, Path(tmp)), count(valgrind, mode, big, Path(tmp))
            per[mode] = (b - a) / (big - small)
            print(f"  {mode:6}  {small}: {a:,}  {big}: {b:,}  per step: {per[mode] / 1e3:,.1f}k")
        if args.later:
            a, b = count(valgrind, "later", small, Path(tmp)), count(valgrind, "later", big, Path(tmp))
            per["later"] = (b - a) / (big - small)
            print(f"  later   {small}: {a:,}  {big}: {b:,}  per step: {per['later'] / 1e3:,.1f}k")
    ratio = per["hit"] / per["resume"]
    verdict = "MET" if ratio <= TARGET else "NOT MET"
    print(f"a hit / a recorded step skipped on resume: {ratio:.1f}x (target <= {TARGET}x): {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
