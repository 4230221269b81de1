"""Plant back, one at a time, the fixes of issue 42 (their ekit_core/ekit_runtime hunks
reversed), run the differential test against each, and print whether it caught it.

    PYTHONPATH=. python -m tests.semantics.plant [EXAMPLES]

It edits the working tree's ekit_core/ekit_runtime and restores them (``git checkout``)
after each plant: run it in a clean worktree, and nothing else beside it.
"""

from __future__ import annotations

import os
import subprocess
import sys

# (commit, issue 42 item, what the fix made right)
PLANTS = [
    ("6192204", "1", "a codec carries the questions into the checkpoint"),
    ("a40bf82", "2", "an output the store refuses spares its siblings"),
    ("dd1a430", "3, 14", "a bump keeps the skips a standing skip forces"),
    ("833aaa0", "4", "a reshaped step is outdated"),
    ("496b10b", "5, 16", "skips and mapped outputs checked on resume"),
    ("a4cd9af", "9", "a bump or rewind lets go of what was set aside"),
    ("69baf6f", "10", "a condition is asked again until it answers"),
    ("f3b6d59", "11", "changed work gets a new attempt number"),
    ("07aff01", "11", "... recorded or not, downstream too"),
    ("441448e", "15", "replay accepts a bumped mapped step's resume"),
    ("6fbc039", "15", "replay accepts a rewind"),
    ("ec14840", "18", "no StepStarted for an attempt its condition skips"),
    ("a27434b", "3 (class)", "skips forced by a changed shape decided again"),
    ("15bb4bc", "3 (class)", "conditions of items chained to a bumped map decided again"),
]


def _git(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", *args], input=stdin, capture_output=True, check=False)


def main() -> None:
    examples = sys.argv[1] if len(sys.argv) > 1 else "150"
    env = dict(os.environ, EKIT_MODEL_EXAMPLES=examples, EKIT_MODEL_SHRINK="0")
    for commit, item, what in PLANTS:
        diff = _git("show", commit, "--", "ekit_core", "ekit_runtime").stdout
        applied = _git("apply", "-R", stdin=diff)
        if applied.returncode != 0:
            print(f"{commit} item {item}: does not reverse onto today's code ({what})", flush=True)
            continue
        try:
            test = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                 "--hypothesis-seed=1", "tests/semantics/test_runtime_agrees_with_the_model.py"],
                env=env, capture_output=True, text=True, check=False)
            found = [line.strip() for line in test.stdout.splitlines()
                     if "Mismatch:" in line or "Error:" in line]
            verdict = "CAUGHT" if test.returncode else "not caught"
            print(f"{commit} item {item}: {verdict} ({what}) {found[:1]}", flush=True)
        finally:
            _git("checkout", "--", "ekit_core", "ekit_runtime")


if __name__ == "__main__":
    main()
