"""The write locks: one writer per store file (or per SQLite run), and lock files that are safe to take.

:class:`WriteLock` keeps "one writer per file, or per SQLite run" with an OS
lock that dies with its holder, so that a crashed writer never locks a run
for good; its lock file is only ever a regular file of this user's, never
opened through a link. :class:`ProcessLock` does the same for what only this
process can reach (an in-memory SQLite database).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import stat
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from ekit_runtime.stores.errors import StoreLockedError
from ekit_runtime.stores.files import SAFE_OPEN_FLAGS, kind_of, write_all

if sys.platform == "win32":
    import msvcrt
else:
    import fcntl

__all__ = [
    "ProcessLock",
    "WriteLock",
    "check_folder_writable",
    "holding",
]


if sys.platform == "win32":

    def _try_lock(fd: int) -> bool:
        os.lseek(fd, 0, os.SEEK_SET)
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True

else:

    def _try_lock(fd: int) -> bool:
        # flock, not fcntl/lockf: its lock belongs to this open file, so two
        # store objects of one process conflict too, and closing another
        # descriptor of the same file does not drop it.
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True


_LOCK_FLAGS = os.O_RDWR | SAFE_OPEN_FLAGS
# Why a lock file cannot be created that no retry cures: the folder is gone,
# is not a folder, or this user may not write it. (A full disk passes as is.)
_CANNOT_CREATE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS})
# How often a lock file may be replaced under us before we give up.
_LOCK_TRIES = 8
_LOST = (
    "this store lost its write lock (its lock file was removed or replaced while it held it), "
    "so another writer may have taken over: nothing was saved, and this store object will "
    "save nothing more. Open a new store and load() to go on"
)


def _busy_problem(lock_path: str, pid: int | None) -> str:
    if pid == os.getpid():
        holder = "held by another store object in this process"
    elif pid is not None:
        holder = f"held by process {pid}"
    else:
        holder = "held by another writer"
    return (
        f"another writer holds the write lock ({holder}; lock file {lock_path}); one writer at "
        "a time, so nothing was saved. To take over, close that store (store.close(), or leave "
        "its `with` block) or stop its process: the lock goes as soon as its holder closes, "
        "is garbage-collected, exits or dies (even by SIGKILL)"
    )


class _Unsafe(Exception):
    """The lock path names a file no store may write into (its ``args[0]`` says why)."""


def _unsafe(st: os.stat_result) -> str | None:
    """Why the file ``st`` describes (not followed) cannot be a lock file of ours; ``None`` if it can."""
    if not stat.S_ISREG(st.st_mode):
        return f"is {kind_of(st.st_mode)}"
    if st.st_nlink != 1:
        # Another name of some other file: writing our pid would change it.
        return f"has {st.st_nlink} hard links (it is another file too)"
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        return f"belongs to another user (uid {st.st_uid}), maybe left by a crashed run of theirs"
    return None


def _unsafe_problem(lock_path: str, why: str) -> str:
    return (
        f"the lock file {lock_path} {why}; a store only locks a regular file of its own, never "
        "through a link (which would make a save write into another file), so nothing was "
        "saved. If no ekit process is using this store, remove that file and try again"
    )


def _open_lock(path: str) -> tuple[int, bool] | None:
    """The lock file at ``path`` opened read-write, and whether it was created now; ``None``: try again.

    Creates it with ``O_EXCL``, which never follows a link; an existing one
    is looked at first (``lstat``, so a FIFO or device is never opened) and
    then opened without following links and checked to be the file looked
    at. Raises :class:`_Unsafe` for what cannot be our lock file. Those
    checks cannot be atomic (a hard link made and removed meanwhile shows
    one link in both ``stat`` calls), so an existing file is only ever
    locked, never written: see :meth:`WriteLock._acquire`.
    """
    try:
        return os.open(path, _LOCK_FLAGS | os.O_CREAT | os.O_EXCL, 0o666), True
    except FileExistsError:
        pass
    try:
        seen = os.lstat(path)
    except FileNotFoundError:
        return None  # its holder let go meanwhile
    why = _unsafe(seen)
    if why is not None:
        raise _Unsafe(why)
    try:
        fd = os.open(path, _LOCK_FLAGS)
    except OSError as exc:
        # Gone, or a link (ELOOP; EMLINK on BSD) put there since the lstat:
        # the next try looks again.
        if isinstance(exc, FileNotFoundError) or exc.errno in (errno.ELOOP, errno.EMLINK):
            return None
        raise
    st = os.fstat(fd)
    why = _unsafe(st)
    if why is not None or (st.st_dev, st.st_ino) != (seen.st_dev, seen.st_ino):
        os.close(fd)
        if why is not None:
            raise _Unsafe(why)
        return None
    return fd, False


def _holder(fd: int) -> int | None:
    """The pid a holder wrote into the lock file, if it can be read."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return int(os.read(fd, 64).split(b"\n", 1)[0])
    except (OSError, ValueError):
        return None


def _names(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (itself, not a link to it)."""
    try:
        on_disk = os.lstat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (on_disk.st_dev, on_disk.st_ino) == (mine.st_dev, mine.st_ino)


def _let_go(fd: int, path: str, file: tuple[int, int], pid: int) -> None:
    if os.getpid() == pid:
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) == file:
                # Removed while still locked: whoever opened it meanwhile
                # sees, once it has the lock, that the path names another
                # file now, and starts again (see WriteLock._acquire).
                os.unlink(path)
    # Closing drops the lock. A forked child only closes its copy, which
    # leaves the parent's lock alone (flock(LOCK_UN) would drop it for both).
    with contextlib.suppress(OSError):
        os.close(fd)


class WriteLock:
    """The right to write one store file, or one SQLite run: an OS lock on a lock file.

    :meth:`hold` takes it (``flock``; ``msvcrt.locking`` on Windows) on the
    file ``lock_path()`` names, or raises :class:`StoreLockedError` when
    another store object holds it, in this process or another. The OS drops
    the lock when its holder calls :meth:`release`, is garbage-collected,
    exits or is killed, even by SIGKILL, so a crashed writer never locks a
    run for good. Released normally, the lock file is removed; after a
    crash it stays, naming the dead writer's pid, and the next writer
    removes it (under its lock) and creates its own. ``lock_path`` is
    called once, at the first :meth:`hold` (a store resolves symlinks then).

    Anyone who can write the folder can predict the lock file's name, so
    it is created with ``O_EXCL`` and opened with ``O_NOFOLLOW``, and only a
    regular file of this user's with no other hard link is ever locked or
    written: anything else there (a symlink, a FIFO, a directory, a
    device, another user's file) is refused with :class:`StoreLockedError`
    naming it and left untouched. Those checks race with whoever renames
    links into place, so the pid is only ever written into a file this
    store created (``O_EXCL``): an existing one is locked, never written.
    """

    def __init__(self, path: str, lock_path: Callable[[], str], *, run_id: str | None = None) -> None:
        self.path = path
        self.run_id = run_id
        self.lock_path: str | None = None
        self._make_path = lock_path
        self._fd: int | None = None
        self._pid = 0
        self._file = (0, 0)
        self._lost = False
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock, in this process."""
        return self._fd is not None and self._pid == os.getpid()

    def hold(self) -> None:
        """Take the lock unless it is held; raise :class:`StoreLockedError` if another writer has it.

        Called before every write, it also checks that a held lock is still
        the one at the lock file's path: if that file was removed or
        replaced, another writer may hold a new lock, so this store is
        refused now and at every later save.
        """
        if self._lost:
            raise self.error(_LOST)
        if self._fd is not None:
            if self._pid != os.getpid():
                # A forked child shares its parent's lock, not its right to write.
                self.release()
            elif self._still_named():
                return
            else:
                self._lost = True
                self.release()
                raise self.error(_LOST)
        self._acquire()

    def release(self) -> None:
        """Let go of the lock and remove its lock file; a later :meth:`hold` takes it again."""
        if self._finalizer is not None:
            self._finalizer()
        self._finalizer = None
        self._fd = None

    def _acquire(self) -> None:
        if self.lock_path is None:
            self.lock_path = self._make_path()
        path = self.lock_path
        collected = False
        for _ in range(_LOCK_TRIES):
            opened = self._open(path)
            if opened is None:
                continue
            fd, created = opened
            try:
                locked = _try_lock(fd)
                if locked and _names(path, fd):
                    if created or sys.platform == "win32":
                        self._own(fd, path)
                        return
                    # A lock file left by a writer that died. It passed the
                    # checks, but the name may have been another file's for a
                    # moment: never write into it. Removed under its lock (as a
                    # holder's release does), a fresh one is created next try.
                    self._remove_stale(path)
                pid = None if locked else _holder(fd)
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
            if locked:
                continue  # the holder removed the file as it let go: lock the new one
            if collected:
                raise self.error(_busy_problem(path, pid), pid)
            # A store object nobody references any more keeps its lock until
            # the garbage collector frees it (a reference cycle, a traceback
            # a failed run left): collect once before refusing.
            gc.collect()
            collected = True
        raise self.error(_busy_problem(path, None))

    def _open(self, path: str) -> tuple[int, bool] | None:
        try:
            return _open_lock(path)
        except _Unsafe as exc:
            raise self.error(_unsafe_problem(path, exc.args[0])) from None
        except OSError as exc:
            if exc.errno not in _CANNOT_CREATE:
                raise
            raise self._cannot_create(path, exc) from exc

    def _remove_stale(self, path: str) -> None:
        try:
            os.unlink(path)
        except (FileNotFoundError, IsADirectoryError):
            pass  # gone, or something else put there meanwhile: the next try looks at it
        except OSError as exc:
            if exc.errno not in _CANNOT_CREATE:
                raise
            raise self.error(_folder_problem(os.path.dirname(path))) from exc

    def _cannot_create(self, path: str, exc: OSError) -> StoreLockedError:
        return self.error(
            f"cannot create the lock file {path} ({type(exc).__name__}: {exc.strerror}): the "
            "folder must exist and be writable by this user; nothing was saved"
        )

    def _own(self, fd: int, path: str) -> None:
        st = os.fstat(fd)
        pid = os.getpid()
        # The pid is for the error message of the next writer that is refused.
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        write_all(fd, b"%d\n" % pid)
        self._fd, self._pid, self._file = fd, pid, (st.st_dev, st.st_ino)
        self._finalizer = weakref.finalize(self, _let_go, fd, path, self._file, pid)

    def _still_named(self) -> bool:
        assert self.lock_path is not None
        try:
            st = os.lstat(self.lock_path)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self._file

    def error(self, problem: str, pid: int | None = None) -> StoreLockedError:
        """A :class:`StoreLockedError` for this lock's store, saying ``problem``."""
        return StoreLockedError(
            self.path, problem, run_id=self.run_id, lock_path=self.lock_path, pid=pid
        )


# Re-entrant: a finalizer run by the garbage collector may release a key
# while this thread is inside ProcessLock.hold.
_IN_PROCESS_GUARD = threading.RLock()
_IN_PROCESS: set[str] = set()


def _drop_key(key: str) -> None:
    with _IN_PROCESS_GUARD:
        _IN_PROCESS.discard(key)


class ProcessLock:
    """A :class:`WriteLock` for what only this process can reach: an in-memory SQLite database.

    No file to lock, and no other process to keep out, so a set of held
    ``key``s does. Same interface and errors as :class:`WriteLock`.
    """

    def __init__(self, path: str, key: str, *, run_id: str | None = None) -> None:
        self.path = path
        self.run_id = run_id
        self.lock_path: str | None = None
        self._key = key
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._finalizer is not None and self._finalizer.alive

    def hold(self) -> None:
        """Take the lock unless it is held; raise :class:`StoreLockedError` if another object has it."""
        if self.held:
            return
        for collect in (True, False):
            with _IN_PROCESS_GUARD:
                if self._key not in _IN_PROCESS:
                    _IN_PROCESS.add(self._key)
                    self._finalizer = weakref.finalize(self, _drop_key, self._key)
                    return
            if collect:
                gc.collect()  # as WriteLock does: an unreachable store must not count
        raise StoreLockedError(
            self.path,
            "another store object in this process holds the write lock; one writer at a time, "
            "so nothing was saved. To take over, close that store (store.close(), or leave its "
            "`with` block)",
            run_id=self.run_id,
            pid=os.getpid(),
        )

    def release(self) -> None:
        """Let go of the lock; a later :meth:`hold` takes it again."""
        if self._finalizer is not None:
            self._finalizer()
        self._finalizer = None


@contextlib.contextmanager
def holding(lock: WriteLock | ProcessLock) -> Iterator[None]:
    """Hold ``lock`` through the block; if the block raises, let go of the lock it took.

    For ``prepare_run``: a store that refuses a run keeps no lock it did not
    have, so that another store object (``load()``ed afresh) can run next.
    """
    had = lock.held
    lock.hold()
    try:
        yield
    except BaseException:
        if not had:
            lock.release()
        raise


def check_folder_writable(path: str, lock: WriteLock) -> None:
    """Refuse with :class:`StoreLockedError` a store whose saves could not create files beside ``path``."""
    folder = os.path.dirname(os.path.realpath(path))
    effective = os.access in os.supports_effective_ids
    if not os.access(folder, os.W_OK | os.X_OK, effective_ids=effective):
        raise lock.error(_folder_problem(folder))


def _folder_problem(folder: str) -> str:
    return (
        f"this user cannot create files in the folder {folder}, which every save does (a "
        "temporary file renamed over the store's); nothing was saved"
    )
