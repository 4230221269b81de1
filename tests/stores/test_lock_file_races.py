"""No race at the lock path makes a save write into another file.

A hostile process that can write the store's folder renames hard links
and symlinks to a victim file of the user's onto ``cp.json.lock`` as fast
as it can, while runs take and release the lock. The checks a
store makes of an existing lock file (a regular file, one link, ours, the
same file after opening) cannot be atomic: ``stat`` shows a hard link that
is being replaced as the only link. So the pid is written only into a
lock file the store created: whatever the interleaving, the victim keeps
its bytes, and two store objects racing for the lock never both hold it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX links"),
    pytest.mark.timeout(60),
]

VICTIM = b"the user's own file, which no save may touch\n"
ATTACK_SECONDS = 3.0

ATTACKER = r"""
import os, sys
folder, victim, lock = sys.argv[1], sys.argv[2], sys.argv[3]
n = 0
print("attacking", flush=True)
stop = os.path.join(folder, "stop")
while n % 512 or not os.path.exists(stop):
    tmp = os.path.join(folder, f"t{n}")
    (os.symlink if n % 2 else os.link)(victim, tmp)
    try:
        # (Renaming a link onto a link of the same file does nothing: tmp then stays.)
        os.rename(tmp, lock)
    except OSError:
        pass
    n += 1
"""


WRITER = r"""
import os, sys, time
from ekit_runtime import JsonFileStore, Step, StoreLockedError, Workflow
path, victim, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
with open(victim, "rb") as f:
    original = f.read()
saved = []
Workflow([Step("a", lambda ctx: "A")]).run_sync(checkpoint_fn=saved.append)
runs = 0
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    store = JsonFileStore(path, durable=False)
    try:
        store.prepare_run(saved[-1])  # takes the lock, as a run's start does
    except StoreLockedError:
        pass  # a link at the lock path, or the other writer holds it
    finally:
        store.close()
    runs += 1
    if runs % 64 == 0:
        with open(victim, "rb") as f:
            if f.read() != original:
                break
print(runs, flush=True)
"""


ROOT = Path(__file__).resolve().parents[2]


def _spawn(script: str, folder: Path, *args: object) -> subprocess.Popen[bytes]:
    """``script`` in a process working in ``folder``: names relative to it are one
    lookup long, which makes the race windows as wide as a real attacker's."""
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    return subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)], stdout=subprocess.PIPE, cwd=folder, env=env
    )


def test_a_hostile_rename_race_at_the_lock_path_never_writes_into_the_victim(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM)
    attacker = _spawn(ATTACKER, tmp_path, ".", "victim", "cp.json.lock")
    try:
        assert attacker.stdout is not None
        assert attacker.stdout.readline() == b"attacking\n"
        writers = [_spawn(WRITER, tmp_path, "cp.json", "victim", ATTACK_SECONDS) for _ in range(2)]
        runs = [int(w.communicate(timeout=50)[0]) for w in writers]
    finally:
        (tmp_path / "stop").touch()
        attacker.wait(timeout=30)
    assert victim.read_bytes() == VICTIM, runs
    assert min(runs) > 100  # the race was really run


RACER = r"""
import os, sys, time
from ekit_runtime import JsonFileStore, StoreLockedError
folder, path, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
inside = os.path.join(folder, "inside")
held = 0
print("racing", flush=True)
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    store = JsonFileStore(path)
    try:
        store._lock.hold()
    except StoreLockedError:
        store.close()
        continue
    held += 1
    try:
        fd = os.open(inside, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        print("two holders at once", flush=True)
        sys.exit(3)
    os.close(fd)
    os.unlink(inside)
    store.close()
print(held, flush=True)
"""


def test_writers_racing_for_the_lock_and_a_stale_lock_file_never_both_hold_it(tmp_path: Path) -> None:
    """Four processes take and release the lock in a loop, starting from a lock
    file a dead writer left: each holds it alone (a file only a holder creates
    is never found there twice at once)."""
    path = tmp_path / "cp.json"
    Path(f"{path}.lock").write_bytes(b"999999999\n")  # left by a writer that died
    racers = [_spawn(RACER, tmp_path, tmp_path, path, 1.5) for _ in range(4)]
    outputs = [r.communicate(timeout=50)[0].decode().split() for r in racers]
    assert [r.returncode for r in racers] == [0] * 4, outputs
    assert sum(int(out[-1]) for out in outputs) > 0
