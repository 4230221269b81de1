"""Wait until a process's main thread sleeps in its event loop's selector (Linux).

A signal that another thread takes is lost on a main thread asleep in
``epoll_wait`` with no wakeup fd, but handled at once by a main thread still
running bytecode. Tests of the first case wait for that sleep before they
signal, so that they test it every time, not only when the race goes their
way. Where ``/proc`` does not say (not Linux), this returns at once.
"""

from __future__ import annotations

import os
import time

_SELECTOR_WAITS = ("do_epoll_wait", "do_select", "do_sys_poll", "ep_poll")


def wait_until_main_thread_sleeps_in_select(pid: int | None = None, timeout: float = 10.0) -> None:
    """Return once the main thread of ``pid`` (default: this process) waits in the selector."""
    pid = os.getpid() if pid is None else pid
    wchan = f"/proc/{pid}/task/{pid}/wchan"  # the main thread's id is the pid
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(wchan) as file:
                where = file.read().strip()
        except OSError:
            return  # no /proc here (or the process is gone): nothing to wait for
        if where in _SELECTOR_WAITS or where == "0":  # "0": wchan hidden, cannot tell
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid}'s main thread never slept in its loop (it is in {where})")
        time.sleep(0.001)  # polling a condition, with a deadline
