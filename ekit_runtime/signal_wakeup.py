"""A signal wakes the run's event loop, whichever thread the kernel gives it to.

CPython runs a Python signal handler (``asyncio.run``'s SIGINT handler that
cancels the run, a user's own) in the main thread only, the next time that
thread executes bytecode. A process-wide signal, though, goes to any thread
that does not block it: a sync step's worker thread, a thread the step
started, a client library's thread. The C-level handler then only marks the
signal pending, and a main thread asleep in the event loop's selector with
nothing else due never wakes: the run is never cancelled, no final
checkpoint is saved, the process never exits.

The C-level handler also writes the signal's number to the wakeup fd
(``signal.set_wakeup_fd``), from whichever thread it runs in. So while a run
is going on the main thread, the wakeup fd is a socket that the run's loop
reads: the loop wakes, the main thread runs the Python handler, and the run
ends as it does when the main thread itself took the signal. Python signal
handlers are never touched.

What it changes it puts back, and it leaves others' signal handling working:

- A wakeup fd that was set before (``loop.add_signal_handler`` sets the
  loop's own; the loop reads the numbers written there to call its
  handlers) still receives every signal number: the reader forwards them.
- When the last run on the loop ends, the previous wakeup fd is restored,
  unless somebody set another one during the run: theirs stays.
- The socket's reader stays registered on the loop (registering it costs
  ten times what setting the fd does, at every run); the socket is closed
  when the loop is collected.
- A child forked meanwhile (by a step) shares the socket: its wakeup fd is
  unset, so that its signals never reach the parent's loop.

Off the main thread nothing is done: Python lets only the main thread set a
wakeup fd, and runs signal handlers there only, so a signal is the main
thread's business (a run on another thread is not interrupted by one). A
loop that cannot watch a socket (Windows' proactor loop, which sets a
wakeup fd of its own) is left as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
import weakref

__all__ = ["SignalWakeup", "hold", "release"]


class SignalWakeup:
    """The wakeup socket of one event loop, and the runs holding it as the wakeup fd."""

    __slots__ = ("_reader", "_writer", "fd", "holders", "previous", "reader_fd")

    def __init__(self) -> None:
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)  # the C handler must never block on it
        self.fd = self._writer.fileno()
        self.reader_fd = self._reader.fileno()
        self.holders = 0
        self.previous = -1  # the wakeup fd before the first holder set this one

    def drain(self) -> None:
        """Read what the signal handler wrote (it woke the loop) and pass it on."""
        try:
            data = self._reader.recv(4096)
        except OSError:  # nothing left to read
            return
        previous = self.previous
        if data and previous != -1 and self.holders:
            with contextlib.suppress(OSError):  # the other owner's buffer is full, or it is gone
                os.write(previous, data)

    def close(self) -> None:
        """Close both ends of the socket (the loop is gone)."""
        self._reader.close()
        self._writer.close()


# One per loop that ran a run on the main thread; None for a loop that cannot watch one.
_WAKEUPS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, SignalWakeup | None] = (
    weakref.WeakKeyDictionary()
)


def _wakeup_of(loop: asyncio.AbstractEventLoop) -> SignalWakeup | None:
    try:
        return _WAKEUPS[loop]
    except KeyError:
        pass
    except TypeError:  # a loop that takes no weak reference: left as it is
        return None
    made = SignalWakeup()
    try:
        loop.add_reader(made.reader_fd, made.drain)
    except (NotImplementedError, RuntimeError):  # a loop that cannot watch a socket
        made.close()
        _WAKEUPS[loop] = None
        return None
    weakref.finalize(loop, made.close)
    _WAKEUPS[loop] = made
    return made


def _after_fork_in_child() -> None:
    """A forked child shares the parent's sockets: its signals must not reach the parent's loop.

    (A step that forks: ``multiprocessing`` with the fork start method.) The
    child's wakeup fd, if it is one of ours, is unset, and the child starts
    afresh with none of the parent's loops.
    """
    ours = {w.fd for w in _WAKEUPS.values() if w is not None}
    _WAKEUPS.clear()
    with contextlib.suppress(ValueError, OSError):
        current = signal.set_wakeup_fd(-1)
        if current not in ours:
            signal.set_wakeup_fd(current)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def hold(loop: asyncio.AbstractEventLoop) -> SignalWakeup | None:
    """Make signals wake ``loop`` until :func:`release`; ``None`` when they cannot be made to.

    Called by each run as it begins, on the loop's thread.
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    wakeup = _wakeup_of(loop)
    if wakeup is None:
        return None
    if wakeup.holders == 0:
        try:
            previous = signal.set_wakeup_fd(wakeup.fd, warn_on_full_buffer=False)
        except (ValueError, OSError):  # not the main interpreter, or no signals there
            return None
        # Ours already (put back by the end of a run that had found ours):
        # forwarding to ourselves would never stop.
        wakeup.previous = -1 if previous == wakeup.fd else previous
    wakeup.holders += 1
    return wakeup


def release(wakeup: SignalWakeup | None) -> None:
    """End one run's hold; the last one restores the wakeup fd found by the first."""
    if wakeup is None:
        return
    wakeup.holders -= 1
    if wakeup.holders:
        return
    previous, wakeup.previous = wakeup.previous, -1
    if threading.current_thread() is not threading.main_thread():
        return  # a run collected by the garbage collector on another thread: nothing is settable
    try:
        current = signal.set_wakeup_fd(previous)
    except (ValueError, OSError):  # the previous fd was closed (or made blocking) meanwhile
        current = signal.set_wakeup_fd(-1)
    if current != wakeup.fd:
        # Somebody set their own during the run (loop.add_signal_handler does):
        # theirs stays, and a hold that found ours passes signals to ours' predecessor.
        signal.set_wakeup_fd(current)
        for other in list(_WAKEUPS.values()):
            if other is not None and other.holders and other.previous == wakeup.fd:
                other.previous = previous
