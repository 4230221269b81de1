"""While a run goes on, the wakeup fd makes any thread's signal wake its loop,
and others' signal handling keeps working: what a run changes it puts back.

The end-to-end Ctrl-C cases are in test_sigint_any_thread.py (real child
processes); these pin the rules for a user's own loop and wakeup fd, in
this process (pytest's main thread) with SIGUSR1.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from ekit_runtime import Step, Workflow
from tests.support.loop_asleep import wait_until_main_thread_sleeps_in_select

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

PATIENCE = 10.0  # what a step waits for, at most, before giving up


def _wakeup_fd() -> int:
    fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd)
    return fd


@pytest.fixture
def own_wakeup_fd() -> Iterator[int]:
    """A wakeup fd of the test's own, set before the run; put back to none after."""
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    before = signal.set_wakeup_fd(writer.fileno())
    try:
        yield writer.fileno()
    finally:
        signal.set_wakeup_fd(before)
        reader.close()
        writer.close()


def test_no_wakeup_fd_is_left_behind_by_a_run() -> None:
    seen: list[int] = []

    async def step(ctx: Any) -> None:
        seen.append(_wakeup_fd())  # on the loop, in the main thread

    assert _wakeup_fd() == -1
    Workflow([Step("a", step)]).run_sync()
    assert seen[0] != -1  # set while the run went on
    assert _wakeup_fd() == -1


def test_a_wakeup_fd_set_before_the_run_is_restored_after_it(own_wakeup_fd: int) -> None:
    during: list[int] = []

    async def step(ctx: Any) -> None:
        during.append(_wakeup_fd())

    Workflow([Step("a", step)]).run_sync()
    assert during[0] not in (-1, own_wakeup_fd)
    assert _wakeup_fd() == own_wakeup_fd


def test_a_wakeup_fd_set_during_the_run_stays_after_it() -> None:
    reader, writer = socket.socketpair()
    writer.setblocking(False)

    async def step(ctx: Any) -> None:
        signal.set_wakeup_fd(writer.fileno())

    try:
        Workflow([Step("a", step)]).run_sync()
        assert _wakeup_fd() == writer.fileno()
    finally:
        signal.set_wakeup_fd(-1)
        reader.close()
        writer.close()


def test_concurrent_runs_on_one_loop_restore_the_fd_when_the_last_ends() -> None:
    first_done = asyncio.Event()
    seen: dict[str, int] = {}

    async def main() -> None:
        async def short(ctx: Any) -> None:
            seen["short"] = _wakeup_fd()

        async def long(ctx: Any) -> None:
            await first_done.wait()
            seen["long, after the other ended"] = _wakeup_fd()

        slow = asyncio.create_task(Workflow([Step("long", long)]).run())
        await Workflow([Step("short", short)]).run()
        first_done.set()
        await slow

    asyncio.run(main())
    assert seen["short"] == seen["long, after the other ended"] != -1
    assert _wakeup_fd() == -1


def test_a_loops_own_signal_handler_still_fires_for_a_signal_on_a_step_thread() -> None:
    """loop.add_signal_handler reads signal numbers from its own wakeup fd: the
    run's wakeup fd passes them on, so the handler fires while a sync step's
    thread took the signal (and the loop would otherwise sleep)."""
    handled = threading.Event()

    def step(ctx: Any) -> str:
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
        return "handled" if handled.wait(PATIENCE) else "the loop's handler never ran"

    async def main() -> str:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, handled.set)
        try:
            result = await Workflow([Step("a", step)]).run()
        finally:
            loop.remove_signal_handler(signal.SIGUSR1)
        return str(result.outputs["a"])

    assert asyncio.run(main()) == "handled"


def test_a_python_handler_runs_promptly_for_a_signal_on_a_step_thread() -> None:
    """A handler installed with signal.signal (as asyncio.run's SIGINT one is)
    runs, and cancels the run, while the step whose thread took the signal
    works on: not only once the step returns and its result wakes the loop."""
    handled, step_ended = threading.Event(), threading.Event()
    seen: list[bool] = []

    def step(ctx: Any) -> None:
        wait_until_main_thread_sleeps_in_select()
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
        seen.append(handled.wait(PATIENCE))  # the handler ran while we worked
        step_ended.set()

    async def main() -> None:
        run = asyncio.create_task(Workflow([Step("a", step)]).run())

        def handler(*_: object) -> None:
            handled.set()
            run.cancel()

        before = signal.signal(signal.SIGUSR1, handler)
        try:
            with pytest.raises(asyncio.CancelledError):
                await run
        finally:
            signal.signal(signal.SIGUSR1, before)

    asyncio.run(main())
    assert step_ended.wait(PATIENCE)
    assert seen == [True]


def test_a_run_off_the_main_thread_leaves_the_wakeup_fd_alone(own_wakeup_fd: int) -> None:
    """Python lets only the main thread set a wakeup fd: a run on another
    thread sets none (and signals stay the main thread's business)."""
    running, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def step(ctx: Any) -> str:
        running.set()
        release.wait(PATIENCE)
        return "done"

    def in_thread() -> None:
        try:
            Workflow([Step("a", step)]).run_sync()
        except BaseException as exc:  # reported to the test below
            errors.append(exc)

    thread = threading.Thread(target=in_thread)
    thread.start()
    try:
        assert running.wait(PATIENCE)
        assert _wakeup_fd() == own_wakeup_fd  # read while that run is in flight
    finally:
        release.set()
        thread.join()
    assert errors == []
    assert _wakeup_fd() == own_wakeup_fd


def test_a_run_abandoned_on_a_closed_loop_gives_the_wakeup_fd_back_when_collected() -> None:
    """A loop closed mid-run never ends that run; once the run is collected
    (its coroutine closed) the wakeup fd it held is put back, so that the
    number, reused by a file, never gets signal bytes."""
    loop = asyncio.new_event_loop()
    started = asyncio.Event()

    async def forever(ctx: Any) -> None:
        started.set()
        await asyncio.Event().wait()

    task = loop.create_task(Workflow([Step("a", forever)]).run())
    loop.run_until_complete(started.wait())
    assert _wakeup_fd() != -1
    task.cancel()
    loop.run_until_complete(asyncio.sleep(0))  # the cancellation reaches the run ...
    loop.close()  # ... whose wind-down never gets the next turn
    del task, loop
    gc.collect()
    assert _wakeup_fd() == -1


def test_a_child_forked_by_a_step_does_not_signal_the_parents_loop() -> None:
    """A forked child inherits the parent's wakeup socket: a signal the child
    takes must not reach the parent's loop (whose handlers would then fire for
    a signal the parent never got)."""
    fired: list[str] = []

    def forks(ctx: Any) -> int:
        pid = os.fork()
        if pid == 0:  # the child: take a SIGUSR1, then go
            try:
                os.kill(os.getpid(), signal.SIGUSR1)
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        return status

    async def main() -> int:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, lambda: fired.append("parent's handler"))
        try:
            result = await Workflow([Step("forks", forks)]).run()
            for _ in range(20):  # turns enough for a byte in the socket to reach the handler
                await asyncio.sleep(0)
        finally:
            loop.remove_signal_handler(signal.SIGUSR1)
        return int(result.outputs["forks"])

    assert asyncio.run(main()) == 0
    assert fired == []


def test_a_previous_wakeup_fd_closed_during_the_run_leaves_none_set() -> None:
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    before = signal.set_wakeup_fd(writer.fileno())

    async def step(ctx: Any) -> None:
        writer.close()  # its owner is done with it, while the run goes on

    try:
        Workflow([Step("a", step)]).run_sync()
        assert _wakeup_fd() == -1  # not a closed (and soon reused) fd number
    finally:
        signal.set_wakeup_fd(before)
        reader.close()
