"""The files a store writes: atomic replacement, fsync, what tells one version of a file from another.

A store never writes its file in place: :func:`atomic_write` writes a
temporary file beside it and renames it over, so a crash leaves the old
file or the new one. What a store opens never blocks on a FIFO and is
refused unless it is a regular file; what it creates (a temporary file, a
lock file) is never opened through a symlink (:data:`SAFE_OPEN_FLAGS`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat

from ekit_runtime.stores.errors import CorruptStoreError

__all__ = [
    "SAFE_OPEN_FLAGS",
    "atomic_write",
    "check_store_path",
    "file_identity",
    "fsync_dir",
    "identity",
    "kind_of",
    "open_to_read",
    "read_file",
    "write_all",
]


def identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """``(device, inode, size, mtime in ns)``: what tells one version of a file from another.

    The inode alone is not enough: a file system may give a freed inode
    number to the next file created, and a replaced file can come back
    under the number it had.
    """
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def file_identity(path: str) -> tuple[int, int, int, int] | None:
    """:func:`identity` of the file at ``path`` (through symlinks), or ``None`` if there is none."""
    try:
        return identity(os.stat(path))
    except FileNotFoundError:
        return None


def fsync_dir(folder: str) -> None:
    """Make a rename in ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        # O_DIRECTORY and O_NONBLOCK: a FIFO put where the folder was is never waited on.
        flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC
        fd = os.open(folder, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        # Some file systems (and Windows) refuse fsync on a folder; the
        # rename itself is still atomic there.
        pass
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written (it may write fewer)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# Never through a symlink, never blocking on a FIFO or becoming a terminal's
# controlling process: the files a store opens are regular files or refused.
SAFE_OPEN_FLAGS = (
    _CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)
)
_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | SAFE_OPEN_FLAGS
_READ_FLAGS = os.O_RDONLY | (SAFE_OPEN_FLAGS & ~getattr(os, "O_NOFOLLOW", 0))


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words: ``"a directory"``, ``"a FIFO"``..."""
    for test, words in (
        (stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"), (stat.S_ISREG, "a regular file"),
    ):
        if test(mode):
            return words
    return "not a regular file"


def check_store_path(path: object, argument: str = "path") -> str:
    """``path`` as text, or a ``ValueError`` naming ``argument`` if no save could ever write it.

    Checked when a store is made, so that a typo fails before the first step
    runs rather than at its save: the folder (of the file a symlink points
    to) must exist, and the file, if there is one, must be a regular file (a
    directory cannot be replaced, and reading a FIFO would wait forever).
    Whether the folder is writable is the write lock's to find out (see
    :meth:`WriteLock.hold`): a store that only loads needs no write access.
    """
    try:
        text = os.fspath(path)  # type: ignore[call-overload]
    except TypeError:
        text = None
    if not isinstance(text, str):
        raise ValueError(f"{argument} must be a str or an os.PathLike of one, got {path!r}")
    target = os.path.realpath(text)
    folder = os.path.dirname(target)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        if not os.path.isdir(folder):
            raise ValueError(
                f"{argument} {text!r}: its folder {folder!r} does not exist (or is not a folder); "
                "create it before making the store, so that no step runs only for its save to fail"
            ) from None
        return text
    except OSError as exc:
        raise ValueError(f"{argument} {text!r} cannot be used: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(
            f"{argument} {text!r} is {kind_of(st.st_mode)}, not a store file; give the path of a "
            "file (which a save creates if it does not exist)"
        )
    return text


def open_to_read(path: str) -> int:
    """``path`` opened to read (through symlinks), or :class:`CorruptStoreError` if not a regular file.

    Raises ``FileNotFoundError`` when there is no file. Opened without
    blocking, so that a FIFO put in the store's place is refused, not waited on.
    """
    fd = os.open(path, _READ_FLAGS)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CorruptStoreError(path, f"is {kind_of(mode)}, not a store file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file(path: str) -> tuple[os.stat_result, bytes]:
    """The stat and content of the regular file at ``path`` (see :func:`open_to_read`)."""
    fd = open_to_read(path)
    with os.fdopen(fd, "rb") as f:
        return os.fstat(fd), f.read()


def _create_beside(target: str) -> tuple[int, str]:
    folder, name = os.path.split(target)
    for _ in range(100):
        tmp = os.path.join(folder, f".{name}.{secrets.token_hex(8)}.tmp")
        try:
            # 0o666 through the umask, as open() creates a file (mkstemp
            # would make it 0o600 whatever the umask says).
            return os.open(tmp, _TEMP_FLAGS, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{target}: no free temporary file name beside it")


def _keep_mode(fd: int, target: str) -> None:
    """Give the new file the permission bits of the one it replaces (a ``chmod`` survives saves)."""
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        return
    if hasattr(os, "fchmod"):
        os.fchmod(fd, mode)


def atomic_write(path: str, data: bytes, *, durable: bool) -> None:
    """Replace the file at ``path`` with ``data`` so that a crash leaves the old or the new file.

    Writes a temporary file beside the target, fsyncs it (``durable``),
    renames it over the target and fsyncs the folder. A symlink is followed:
    its target is replaced and the link stays a link. The file keeps the
    permission bits it had; a new one gets what the umask leaves of 0o666.
    A kill can leave the temporary ``.<name>.*.tmp`` behind; it is never read.
    Its name is random and it is created with ``O_EXCL | O_NOFOLLOW``: a
    name taken by anything (a link planted there included) is skipped.
    """
    target = os.path.realpath(path)
    folder = os.path.dirname(target)
    fd, tmp = _create_beside(target)
    try:
        try:
            _keep_mode(fd, target)
            write_all(fd, data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(folder)
