"""Child process of the store crash tests (tests/stores/test_stores_crash.py) and writer tests.

``python crash_child.py KIND PATH START_LOG SEED [tear]`` loads the latest
checkpoint from a store of KIND at PATH, prints ``ready``, then resumes a
30-step workflow (chains and fan-outs) that saves through the store after
every group of completions. Each step appends its name to START_LOG when it
starts, so the parent can prove that no recorded step ever started again. The
parent kills this process with SIGKILL at a random moment; the outputs are
deterministic whatever the timing.

With ``tear`` (journal only) the child kills itself instead, with SIGKILL, in
the middle of one of its appends, after the store's own code has written part
of the line: a torn tail every time, where random kills only sometimes land
inside a write.

The writer tests (tests/stores/test_stores_writers.py) run it with a command
first, and drive it through its stdin and stdout, one line each way, so
that no test needs a sleep to order processes:

- ``python crash_child.py hold KIND PATH``: saves a checkpoint of one
  output (taking the store's write lock) and prints ``held``; then each
  stdin line ``save N`` saves N more checkpoints, one output each, and
  prints ``saved``; ``exit`` (or the end of stdin) closes the store.
- ``python crash_child.py write KIND PATH [RUN_ID]``: loads, saves one
  more output and prints ``saved``, or ``refused <message>`` when the save
  raises ``StoreLockedError``.
- ``python crash_child.py read KIND PATH``: loads over and over, printing
  ``reading`` after the first load, until its stdin ends; then prints a JSON
  summary: how many loads, the step indexes seen, and every error raised.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import signal
import sys
import threading
from types import MappingProxyType
from typing import Any

from ekit_runtime import (
    JournalStore,
    JsonFileStore,
    SqliteStore,
    Step,
    StoreLockedError,
    Workflow,
    WorkflowCheckpoint,
)

KINDS = ("json", "journal", "sqlite")
RUN_ID = "crash-run"

# name -> dependencies: a root, a fan-out of 6, a join, a chain, a fan-out of 8,
# a join, and a closing chain.
GRAPH: dict[str, tuple[str, ...]] = {"s00": ()}
GRAPH.update({f"s{i:02d}": ("s00",) for i in range(1, 7)})
GRAPH["s07"] = tuple(f"s{i:02d}" for i in range(1, 7))
GRAPH.update({f"s{i:02d}": (f"s{i - 1:02d}",) for i in range(8, 15)})
GRAPH.update({f"s{i:02d}": ("s14",) for i in range(15, 23)})
GRAPH["s23"] = tuple(f"s{i:02d}" for i in range(15, 23))
GRAPH.update({f"s{i:02d}": (f"s{i - 1:02d}",) for i in range(24, 30)})


def make_store(kind: str, path: str, run_id: str = RUN_ID) -> Any:
    """The store the crash test exercises, as the child and the parent both open it."""
    if kind == "json":
        return JsonFileStore(path)
    if kind == "journal":
        return JournalStore(path)
    if kind == "sqlite":
        return SqliteStore(path, run_id=run_id)
    raise ValueError(f"unknown store kind {kind!r}")


def output_of(name: str, dep_digests: list[str]) -> dict[str, Any]:
    """The deterministic output of step ``name`` given its dependencies' digests."""
    digest = hashlib.sha256((name + "|" + ",".join(dep_digests)).encode()).hexdigest()
    # Sizes vary from a few bytes to ~40 KB so that kills land inside long writes too.
    size = int(digest[:4], 16) % 4 * (int(name[1:]) % 5) * 700
    return {"step": name, "digest": digest, "text": "ü€𝄞 " * size + name}


def expected_outputs() -> dict[str, Any]:
    """Every step's output in an uninterrupted run."""
    outputs: dict[str, Any] = {}
    for name, deps in GRAPH.items():
        outputs[name] = output_of(name, [outputs[d]["digest"] for d in deps])
    return outputs


def build(log_fd: int, rng: random.Random) -> Workflow:
    """The workflow, logging each start to ``log_fd`` and sleeping a random instant."""

    def body(name: str, deps: tuple[str, ...]) -> Any:
        async def run(ctx: dict[str, Any]) -> dict[str, Any]:
            os.write(log_fd, f"{name}\n".encode())
            await asyncio.sleep(rng.random() * 0.003)
            return output_of(name, [ctx[d]["digest"] for d in deps])

        return run

    return Workflow(
        [
            Step(name, body(name, deps), deps, context="dependencies")
            for name, deps in GRAPH.items()
        ]
    )


def tear_an_append(rng: random.Random) -> None:
    """Make one of the next journal appends write part of its line, then SIGKILL this process.

    Wraps the ``write_all`` that ``JournalStore._append`` calls, so the bytes
    reach the file through the store's own code path (after it has cut off
    any earlier torn tail and positioned itself), exactly as a kill between
    two ``os.write`` calls of a long append would leave them.
    """
    from ekit_runtime.stores import journal

    real = journal.write_all
    countdown = rng.randint(1, 3)

    def write_part(fd: int, data: bytes) -> None:
        nonlocal countdown
        countdown -= 1
        if countdown:
            real(fd, data)
            return
        # Any strict prefix: from one byte of the frame to all but the newline.
        real(fd, data[: rng.randrange(1, len(data))])
        os.kill(os.getpid(), signal.SIGKILL)

    journal.write_all = write_part


def checkpoint_of(count: int) -> WorkflowCheckpoint:
    """The checkpoint of the writer tests with outputs ``w0000`` .. ``w<count-1>`` (~8 KB each)."""
    outputs = {f"w{i:04d}": {"i": i, "text": "ü€𝄞 " * 2000} for i in range(count)}
    return WorkflowCheckpoint(count, MappingProxyType(outputs))


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def hold(kind: str, path: str) -> int:
    """Take a store's write lock with a first save, then save more when told to."""
    store = make_store(kind, path)
    count = 1
    store(checkpoint_of(count))
    _say("held")
    for command in sys.stdin:
        if command.startswith("save "):
            for _ in range(int(command.split()[1])):
                count += 1
                store(checkpoint_of(count))
            _say("saved")
        else:
            break
    store.close()
    return 0


def write(kind: str, path: str, run_id: str = RUN_ID) -> int:
    """Load, then save one more output, as a second writer resuming the run would."""
    store = make_store(kind, path, run_id)
    loaded = store.load()
    try:
        store(checkpoint_of(1 if loaded is None else len(loaded.outputs) + 1))
    except StoreLockedError as exc:
        _say(f"refused {exc}")
    else:
        _say("saved")
    store.close()
    return 0


def read(kind: str, path: str) -> int:
    """Load until stdin ends; report the loads, the step indexes seen and any error."""
    store = make_store(kind, path)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    loads, seen, errors = 0, set(), []
    while not done.is_set():
        try:
            checkpoint = store.load()
        except Exception as exc:  # every error is the finding: report it, do not stop
            errors.append(f"{type(exc).__name__}: {exc}")
        else:
            seen.add(-1 if checkpoint is None else checkpoint.step_index)
        loads += 1
        if loads == 1:
            _say("reading")
    _say(json.dumps({"loads": loads, "seen": sorted(seen), "errors": errors}))
    return 0


def main(argv: list[str]) -> int:
    """Resume the run from the store, saving after every step (or run a writer-test command)."""
    commands = {"hold": hold, "write": write, "read": read}
    if argv and argv[0] in commands:
        return commands[argv[0]](*argv[1:])
    kind, path, log_path, seed, *flags = argv
    rng = random.Random(int(seed))
    if "tear" in flags:
        if kind != "journal":
            raise ValueError("tear needs the journal store")
        tear_an_append(rng)
    store = make_store(kind, path)
    checkpoint = store.load()
    log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    workflow = build(log_fd, rng)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    workflow.run_sync(checkpoint_fn=store, resume_from=checkpoint)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
