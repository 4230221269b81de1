"""Child process of tests/stores/test_a_killed_compacting_loop_resumes_from_its_store.py.

``python -m tests.support.compacting_kill_child KIND WHERE RUN_ID START_LOG SEED [tear]``
loads the latest checkpoint from a store of KIND (``sqlite`` or ``postgres``:
WHERE is a path or a DSN), prints ``ready`` and resumes a workflow whose
step ``agent`` loops ``ITERATIONS`` times keeping the last ``KEEP``
iterations, so that every save from the third iteration on compacts one. Each
iteration appends its name to START_LOG when it starts, and each checkpoint
is appended to ``START_LOG.saves`` (see :func:`line_of`) before it is saved,
so the parent can tell that what it loads is one the run saved. The parent
kills the process with SIGKILL at a random moment.

With ``tear`` (SQLite) the process kills itself inside one of its compacting
saves, after the store has deleted the rows of the iteration let go of,
written the header and inserted the new rows, before the transaction
commits: the half-written save the store must not let anyone read.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
from typing import Any

from ekit_runtime import Done, Repeat, SqliteStore, Step, Workflow, WorkflowCheckpoint

ITERATIONS = 30
KEEP = 2


def output_of(number: int) -> dict[str, Any]:
    """Iteration ``number``'s output: its number and some text, so that saves take a while."""
    return {"n": number, "text": "ü€𝄞 " * (200 * (number % 4))}


def line_of(checkpoint: WorkflowCheckpoint) -> str:
    """``checkpoint`` as one line of text, the same for equal checkpoints."""
    return json.dumps(checkpoint.to_dict(), sort_keys=True)


def make_store(kind: str, where: str, run_id: str) -> Any:
    """The store the test exercises, as the child and the parent both open it."""
    if kind == "sqlite":
        return SqliteStore(where, run_id=run_id)
    if kind == "postgres":
        from ekit_runtime import PostgresStore
        return PostgresStore(where, run_id=run_id)
    raise ValueError(f"unknown store kind {kind!r}")


def workflow(log_fd: int, rng: random.Random) -> Workflow:
    """Step ``a``, then ``agent`` looping until iteration ITERATIONS, logging each start."""
    async def agent(ctx: Any) -> Any:
        number = ctx["agent"].number
        os.write(log_fd, f"agent#{number}\n".encode())
        await asyncio.sleep(rng.random() * 0.003)
        return Done(output_of(number)) if number == ITERATIONS else output_of(number)

    return Workflow([Step("a", lambda ctx: "start"),
                     Step("agent", agent, ("a",), repeat=Repeat(2 * ITERATIONS, keep_last=KEEP))])


def tear_a_compacting_save(rng: random.Random) -> None:
    """SIGKILL this process inside one of its next compacting saves, before it commits."""
    real = SqliteStore._write
    countdown = rng.randint(1, 4)

    def write_then_die(self: SqliteStore, encoded: Any) -> int:
        nonlocal countdown
        saves = real(self, encoded)
        if encoded.gone:
            countdown -= 1
            if not countdown:
                os.kill(os.getpid(), signal.SIGKILL)
        return saves

    SqliteStore._write = write_then_die  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    """Resume the run from the store, saving after every iteration."""
    kind, where, run_id, log_path, seed, *flags = argv
    rng = random.Random(int(seed))
    if "tear" in flags:
        tear_a_compacting_save(rng)
    store = make_store(kind, where, run_id)
    checkpoint = store.load()
    log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    saves_fd = os.open(log_path + ".saves", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def save(cp: WorkflowCheckpoint) -> None:
        os.write(saves_fd, (line_of(cp) + "\n").encode())
        store.save(cp)

    workflow(log_fd, rng).run_sync(checkpoint_fn=save, resume_from=checkpoint)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
