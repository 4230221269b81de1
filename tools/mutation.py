"""Mutation testing of the core and the stores: ``python -m tools.mutation`` (docs/testing.md).

Copies the checkout (tracked and untracked-but-not-ignored files, so uncommitted
work is included; ``--rev REV`` takes a commit instead) into a fresh temporary
directory, runs mutmut there with ``[tool.mutmut]`` from pyproject.toml, then
prints the score and every mutant that no test killed, each with its diff.

    python -m tools.mutation                          # everything configured
    python -m tools.mutation 'ekit_core.ledger.*'     # only some mutants (globs)
    python -m tools.mutation --keep                   # keep the copy for `mutmut browse`

Needs ``pip install -e '.[test,dev,mutation]'``. Not run in CI.

Survivors listed in tools/mutation_equivalent.txt (name and a hash of the diff,
with the reason) are reported as equivalent; a listed mutant whose diff changed
is reported as a survivor again, so the list cannot excuse a different mutation.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT_FILE = ROOT / "tools" / "mutation_equivalent.txt"
DETECTED = {"killed", "timeout", "segfault", "caught by type check"}
UNDETECTED = {"survived", "no tests"}


def copy_checkout(destination: Path, rev: str | None) -> None:
    """The files a fresh clone would have (or ``rev``'s tree), plus uncommitted work."""
    if rev is not None:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(destination, filter="data")
        return
    if not (ROOT / ".git").exists():  # an unpacked archive: everything but caches and venvs
        shutil.copytree(ROOT, destination, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".venv*", ".ci-venv", ".ci-demo-venv", "mutants", "__pycache__", ".*_cache", ".hypothesis"
        ))
        return
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True, capture_output=True, text=True,
    ).stdout
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the work tree is left out
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def mutmut_command() -> str:
    found = shutil.which("mutmut", path=str(Path(sys.executable).parent)) or shutil.which("mutmut")
    if found is None:
        sys.exit("mutmut is not installed: pip install -e '.[test,dev,mutation]'")
    return found


def run_mutmut(workdir: Path, args: list[str], log: Path) -> None:
    """Run ``mutmut run`` in ``workdir``, its output to ``log``, a progress line every 30 s."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [mutmut_command(), "run", *args], cwd=workdir, stdout=out, stderr=subprocess.STDOUT, env=env
        )
        while process.poll() is None:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                print("  ", last_progress(log), flush=True)
    if process.returncode != 0:
        print(log.read_text(encoding="utf-8", errors="replace")[-6000:])
        sys.exit(f"mutmut run failed (exit {process.returncode}); the whole log is {log}")


def last_progress(log: Path) -> str:
    """mutmut redraws one status line with carriage returns; the latest one."""
    with log.open("rb") as f:
        f.seek(max(0, log.stat().st_size - 400))
        tail = f.read().decode("utf-8", errors="replace")
    lines = [line.strip() for line in tail.replace("\r", "\n").split("\n") if line.strip()]
    return lines[-1] if lines else "(starting)"


def results(workdir: Path) -> dict[str, str]:
    listed = subprocess.run(
        [mutmut_command(), "results", "--all", "true"],
        cwd=workdir, check=True, capture_output=True, text=True,
    ).stdout
    found = {}
    for line in listed.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep:
            found[name] = status
    return found


def diff_of(workdir: Path, name: str) -> str:
    shown = subprocess.run(
        [mutmut_command(), "show", name], cwd=workdir, check=True, capture_output=True, text=True
    ).stdout
    return shown.split("\n", 1)[1] if "\n" in shown else shown


def diff_hash(diff: str) -> str:
    """The changed lines only, so a mutant keeps its hash when the file shifts."""
    changed = [
        line.strip() for line in diff.splitlines()
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    return hashlib.sha256("\n".join(changed).encode()).hexdigest()[:10]


def equivalents() -> dict[tuple[str, str], str]:
    """``name hash  reason`` lines from tools/mutation_equivalent.txt; # starts a comment line."""
    if not EQUIVALENT_FILE.exists():
        return {}
    listed = {}
    for line in EQUIVALENT_FILE.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, digest, reason = [*line.split(maxsplit=2), "", ""][:3]
            listed[(name, digest)] = reason
    return listed


def report(workdir: Path) -> int:
    """Print the score and every mutant no test killed; the number of unexplained survivors."""
    status_by_name = results(workdir)
    counts = Counter(status_by_name.values())
    print("\nmutants:", ", ".join(f"{n} {status}" for status, n in sorted(counts.items())))
    known = equivalents()
    survivors, excused = [], []
    for name, status in sorted(status_by_name.items()):
        if status in DETECTED or status == "not checked":  # not checked: outside the globs asked for
            continue
        diff = diff_of(workdir, name) if status != "no tests" else ""
        reason = known.get((name, diff_hash(diff))) if status == "survived" else None
        (excused if reason is not None else survivors).append((name, status, diff, reason))
    detected = sum(counts[s] for s in DETECTED)
    scored = detected + sum(counts[s] for s in UNDETECTED)
    if scored:
        print(f"score: {detected}/{scored} = {100 * detected / scored:.1f}% killed", end="")
        if excused:
            print(f"; {100 * detected / (scored - len(excused)):.1f}% without the "
                  f"{len(excused)} listed as equivalent", end="")
        print()
    for name, _, _, reason in excused:
        print(f"  equivalent: {name}  ({reason})")
    print(f"\n{len(survivors)} mutants to look at (survived, no tests, suspicious, interrupted):")
    for name, status, diff, _ in survivors:
        print(f"\n## {name}: {status}  [{diff_hash(diff)}]")
        if diff:
            print(diff.rstrip())
    return len(survivors)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.mutation", description=__doc__.split("\n")[0])
    parser.add_argument("mutants", nargs="*", help="mutant name globs, e.g. 'ekit_core.ledger.*'")
    parser.add_argument("--rev", help="test this commit's tree instead of the work tree")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy and print its path")
    parser.add_argument("--max-children", type=int, help="parallel mutants (default: one per CPU)")
    options = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="ekit-mutation-"))
    started = time.monotonic()
    try:
        copy_checkout(workdir, options.rev)
        print(f"mutmut runs in {workdir} (log: {workdir / 'mutmut.log'})", flush=True)
        args = [*(["--max-children", str(options.max_children)] if options.max_children else []),
                *options.mutants]
        run_mutmut(workdir, args, workdir / "mutmut.log")
        report(workdir)
        print(f"\ntook {(time.monotonic() - started) / 60:.1f} min")
    finally:
        if options.keep:
            print(f"kept {workdir}: cd there and run `mutmut show NAME` or `mutmut browse`")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
