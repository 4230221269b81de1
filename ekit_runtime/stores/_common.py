"""What every store shares: the codec, its errors, first encodings, atomic files and write locks.

Encoding happens in one place so that every store fails the same way on an
output it cannot write: a :class:`UnencodableError` naming the step, raised
before a single byte reaches storage. :class:`OutputEncodings` keeps the
mutation rule of docs/stores.md (what is stored for a step never changes);
:class:`WriteLock` keeps "one writer per file, or per SQLite run" with an OS
lock that dies with its holder, so that a crashed writer never locks a run
for good.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import math
import os
import secrets
import stat
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NoReturn, Self, TypeAlias

from ekit_core import WorkflowCheckpoint

if sys.platform == "win32":
    import msvcrt
else:
    import fcntl

__all__ = [
    "CorruptStoreError",
    "Dumps",
    "Loads",
    "OutputEncodings",
    "ProcessLock",
    "Store",
    "StoreLockedError",
    "UnencodableError",
    "WriteLock",
    "atomic_write",
    "check_folder_writable",
    "check_run_id",
    "check_store_path",
    "check_text",
    "codec",
    "default_dumps",
    "default_loads",
    "encode",
    "encode_text",
    "file_identity",
    "fsync_dir",
    "holding",
    "identity",
    "kind_of",
    "open_to_read",
    "read_file",
    "require_checkpoint",
    "same_run",
    "utf8_problem",
    "write_all",
]

Dumps: TypeAlias = Callable[[Any], str]
"""Turns plain data (dicts, lists, str, numbers, outputs) into text."""

Loads: TypeAlias = Callable[[str], Any]
"""The inverse of a :data:`Dumps`: text back into plain data."""


class UnencodableError(ValueError):
    """A value the store's ``dumps`` cannot encode; nothing was written.

    ``step`` names the step whose output is at fault (``None`` when the
    culprit is a context key or the checkpoint as a whole, which the message
    then names).
    """

    def __init__(self, message: str, step: str | None = None) -> None:
        super().__init__(message)
        self.step = step


class CorruptStoreError(ValueError):
    """Stored data that is damaged beyond what a crash can leave behind.

    ``path`` is the file or database and ``line`` the 1-based journal line at
    fault (``None`` when the damage is not tied to a line).
    """

    def __init__(self, path: str, problem: str, line: int | None = None) -> None:
        where = f"{path}, line {line}" if line is not None else path
        super().__init__(f"{where}: {problem}")
        self.path = path
        self.line = line


class StoreLockedError(ValueError):
    """Another writer has this store's file (or SQLite run): the save was refused, nothing written.

    Raised when another store object, in this process or another, holds the
    write lock; when this store lost its lock (its lock file was removed or
    replaced while held); and when what is stored changed since this store
    last read or wrote it, because another writer saved in between. Also
    when the store cannot take a write lock at all: its lock file is not a
    regular file of this user's (a symlink, a FIFO, a directory, a device, a
    file with other hard links, another user's file), which is never opened
    through a link nor written, or its folder is not writable by this user.
    ``path`` is the file or database, ``run_id`` the SQLite run (``None``
    for a file store), ``lock_path`` the lock file and ``pid`` the process
    holding it, when known. To take over deliberately, close the other store
    (or end its process), then ``load()`` and save again.
    """

    def __init__(
        self,
        path: str,
        problem: str,
        *,
        run_id: str | None = None,
        lock_path: str | None = None,
        pid: int | None = None,
    ) -> None:
        where = path if run_id is None else f"{path}, run {run_id!r}"
        super().__init__(f"{where}: {problem}")
        self.path = path
        self.run_id = run_id
        self.lock_path = lock_path
        self.pid = pid


# -- the codec -------------------------------------------------------------------


def default_dumps(data: Any) -> str:
    """Compact, strict JSON on one line: utf-8 text kept as is, NaN and infinities refused."""
    return json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class _NonFinite(ValueError):
    pass


def _refuse_constant(name: str) -> NoReturn:
    raise _NonFinite(name)


def default_loads(text: str) -> Any:
    """Strict JSON, the inverse of :func:`default_dumps`: NaN and infinities are refused here too.

    ``json.loads`` reads ``NaN`` and ``Infinity``, which :func:`default_dumps`
    never writes; reading them would make a resume fail later, at a save,
    blaming an old output. The ``ValueError`` says where the value sits.
    """
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except _NonFinite as exc:
        where = _nonfinite_at(json.loads(text))
        raise ValueError(
            f"{exc.args[0]} at {where}: JSON has no NaN or infinities, and no store writes them"
        ) from None


def _nonfinite_at(data: Any) -> str:
    """Where the first NaN or infinity in ``data`` is, as subscripts (``['outputs']['a'][0]``)."""
    # A stack, not recursion: stored data may nest deeper than the recursion limit.
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return where or "the top level"
        if isinstance(value, dict):
            stack.extend((v, f"{where}[{k!r}]") for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(value))))
    return "an unknown place"


def _dump(value: Any, dumps: Dumps) -> str:
    text = dumps(value)
    if not isinstance(text, str):
        raise TypeError(f"dumps must return str, got {type(text).__name__}")
    return text


def _to_bytes(value: Any, dumps: Dumps) -> bytes:
    # A lone surrogate passes json.dumps(ensure_ascii=False) and only fails here.
    return _dump(value, dumps).encode("utf-8")


def _to_text(value: Any, dumps: Dumps) -> str:
    text = _dump(value, dumps)
    # Encoded only to fail now on a lone surrogate, before anything is
    # written, rather than inside a SQLite transaction.
    text.encode("utf-8")
    return text


def encode(
    record: Any,
    dumps: Dumps,
    outputs: Iterable[tuple[str, Any]],
    context: Mapping[str, Any] | None = None,
) -> bytes:
    """``dumps(record)`` as utf-8, or :class:`UnencodableError` naming the culprit.

    ``outputs`` and ``context`` are what ``record`` holds; they are only
    walked when encoding fails, to say which step (or context key) is at fault.
    """
    try:
        return _to_bytes(record, dumps)
    except Exception as exc:
        _blame(exc, dumps, outputs, context)


def encode_text(
    record: Any,
    dumps: Dumps,
    outputs: Iterable[tuple[str, Any]],
    context: Mapping[str, Any] | None = None,
) -> str:
    """Like :func:`encode`, for a store that keeps text: ``dumps(record)``, checked to be utf-8-safe."""
    try:
        return _to_text(record, dumps)
    except Exception as exc:
        _blame(exc, dumps, outputs, context)


def _output_error(name: str, exc: Exception) -> UnencodableError:
    return UnencodableError(
        f"cannot encode the output of step {name!r}: {type(exc).__name__}: {exc}; "
        "nothing was saved (pass dumps=/loads= to store rich types)",
        step=name,
    )


def _blame(
    cause: Exception,
    dumps: Dumps,
    outputs: Iterable[tuple[str, Any]],
    context: Mapping[str, Any] | None,
) -> NoReturn:
    """Raise the :class:`UnencodableError` naming the first output or context key at fault."""
    for name, value in outputs:
        try:
            _to_bytes(value, dumps)
        except Exception as exc:
            raise _output_error(name, exc) from exc
    for key, value in (context or {}).items():
        try:
            _to_bytes(value, dumps)
        except Exception as exc:
            raise UnencodableError(
                f"cannot encode context key {key!r}: {type(exc).__name__}: {exc}; "
                "nothing was saved"
            ) from exc
    raise UnencodableError(
        f"cannot encode the checkpoint: {type(cause).__name__}: {cause}; nothing was saved"
    ) from cause


# (the output object, b'"<step>":' + its encoding, where the encoding starts)
_Entry: TypeAlias = tuple[Any, bytes, int]
_Chosen: TypeAlias = list[tuple[str, _Entry]]


class OutputEncodings:
    """The first encoding of each step's output, reused for as long as saves hand the same object.

    The library never copies outputs, so a step may mutate an earlier
    step's output after it was saved. The rule (docs/stores.md): a store
    encodes each output once, the first time it saves or loads it, and
    every later write of that step, a full rewrite included, uses that
    encoding, so what is stored for a step never changes. An output is
    "the same" while it is the same object (or, within one run, the same
    by :meth:`WorkflowCheckpoint.delta_since`); another object under that
    name (another run, a hand-made checkpoint) is encoded afresh.

    With the default codec a document is spliced from the cached
    fragments, so re-saving old outputs costs a copy, not an encoding.
    Another codec's text cannot be spliced: old outputs are then decoded
    from their first encoding and encoded again with the document.
    """

    __slots__ = ("_chosen", "_dumps", "_entries", "_fresh", "_json", "_loads", "_prev", "_usage")

    def __init__(self, dumps: Dumps, loads: Loads) -> None:
        self._dumps = dumps
        self._loads = loads
        self._json = dumps is default_dumps
        self._entries: dict[str, _Entry] = {}
        # Names encoded by the last members() call: their objects are the
        # ones just encoded, so the slow path need not decode them back.
        self._fresh: set[str] = set()
        # The last checkpoint document_of() wrote, with its outputs' entries
        # and usage members in order: the next one of the run adds a delta.
        self._prev: WorkflowCheckpoint | None = None
        self._chosen: _Chosen = []
        self._usage: list[bytes] = []

    def members(self, outputs: Iterable[tuple[str, Any]], *, every: bool = False) -> _Chosen:
        """``(step, entry)`` for each ``(step, output)``: the cached entry, or a new encoding.

        Raises :class:`UnencodableError` naming the step for an output that
        cannot be encoded. ``every=True`` says that ``outputs`` are all of a
        checkpoint's: entries of other steps are forgotten.
        """
        old = self._entries
        entries = {} if every else old
        chosen: _Chosen = []
        fresh: set[str] = set()
        for name, value in outputs:
            entry = old.get(name)
            if entry is None or entry[0] is not value:
                entry = self._encode(name, value)
                fresh.add(name)
            entries[name] = entry
            chosen.append((name, entry))
        self._entries = entries
        self._fresh = fresh
        return chosen

    def seed(self, outputs: Mapping[str, Any]) -> None:
        """Remember ``outputs`` (just loaded) as stored: their encoding is what later writes use."""
        entries: dict[str, _Entry] = {}
        for name, value in outputs.items():
            with contextlib.suppress(UnencodableError):
                # A loads may build what its dumps cannot write; saving it will say so.
                entries[name] = self._encode(name, value)
        self._entries = entries
        self._prev = None

    def check(self, checkpoint: WorkflowCheckpoint) -> None:
        """Raise the :class:`UnencodableError` a save of ``checkpoint`` would, writing nothing.

        Encodes every field but the per-step ones, and each output not
        encoded yet (those loaded are), which the next save then reuses:
        what a run starts from is checked before its first step.
        """
        check_text(checkpoint)
        encode(checkpoint.to_dict(per_step=False), self._dumps, (), checkpoint.context)
        self.members(checkpoint.outputs.items())

    def document_of(self, checkpoint: WorkflowCheckpoint, head: Mapping[str, Any]) -> bytes:
        """``{**head, **checkpoint.to_dict()}`` encoded, each output from its first encoding.

        Within one run only the outputs and usage new since the last call are
        looked up (``delta_since``); the rest is spliced from that call's.
        """
        prev = self._prev
        delta = checkpoint.delta_since(prev) if prev is not None and same_run(checkpoint, prev) else None
        if delta is not None and delta.extends:
            chosen = self._chosen + self.members(delta.outputs)
            new_usage = delta.step_usage
            usage = self._usage
        else:
            chosen = self.members(checkpoint.outputs.items(), every=True)
            new_usage = tuple(checkpoint.step_usage.items())
            usage = []
        if self._json:
            usage = usage + [
                _to_bytes(name, default_dumps) + b":" + _to_bytes(u.to_dict(), default_dumps)
                for name, u in new_usage
            ]
        self._prev, self._chosen, self._usage = checkpoint, chosen, usage
        # to_dict of the checkpoint without its per-step parts: every other
        # field, in order, as the core defines them (cheap, whatever the
        # run's length: the graph's two strings are spelt once per graph).
        record = {**head, **checkpoint.to_dict(per_step=False)}
        if not self._json:
            record["step_usage"] = {k: u.to_dict() for k, u in checkpoint.step_usage.items()}
        return self.document(record, chosen, checkpoint.context, usage)

    def document(
        self,
        record: Mapping[str, Any],
        chosen: _Chosen,
        context: Mapping[str, Any] | None,
        usage: list[bytes] | None = None,
    ) -> bytes:
        """``dumps(record)`` as utf-8, ``record["outputs"]`` replaced by the ``chosen`` encodings.

        ``usage``, when given, replaces ``record["step_usage"]`` the same way
        (members ``"<step>":{...}``, default codec only).
        """
        if not self._json:
            data = dict(record)
            data["outputs"] = {
                name: entry[0] if name in self._fresh else self._decoded(name, entry)
                for name, entry in chosen
            }
            return encode(data, self._dumps, (), context)
        # default_dumps has no spaces, so this is byte for byte default_dumps(record).
        parts = []
        for key, value in record.items():
            head = _to_bytes(key, default_dumps) + b":"
            if key == "outputs":
                parts.append(head + b"{" + b",".join(entry[1] for _, entry in chosen) + b"}")
            elif key == "step_usage" and usage is not None:
                parts.append(head + b"{" + b",".join(usage) + b"}")
            else:
                parts.append(head + encode(value, self._dumps, (), context))
        return b"{" + b",".join(parts) + b"}"

    def _encode(self, name: str, value: Any) -> _Entry:
        try:
            head = _to_bytes(name, default_dumps) + b":"
            body = _to_bytes(value, self._dumps)
        except Exception as exc:
            raise _output_error(name, exc) from exc
        return (value, head + body, len(head))

    def _decoded(self, name: str, entry: _Entry) -> Any:
        try:
            return self._loads(entry[1][entry[2] :].decode("utf-8"))
        except Exception as exc:
            raise UnencodableError(
                f"cannot write the output of step {name!r} again: loads cannot read what dumps "
                f"made of it ({type(exc).__name__}: {exc}); nothing was saved",
                step=name,
            ) from exc


def same_run(checkpoint: WorkflowCheckpoint, previous: WorkflowCheckpoint) -> bool:
    """Whether ``checkpoint`` may be stored as a delta on ``previous``: same run, same format.

    A different fingerprint, format version or graph means another run (or
    another version of the workflow), which the stores write in full.
    """
    return (
        checkpoint.fingerprint == previous.fingerprint
        and checkpoint.format_version == previous.format_version
        # Checkpoints of one run share the graph object: skip the deep comparison.
        and (checkpoint.graph is previous.graph or checkpoint.graph == previous.graph)
    )


# -- files -----------------------------------------------------------------------


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
_SAFE = (
    _CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)
)
_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _SAFE
_READ_FLAGS = os.O_RDONLY | (_SAFE & ~getattr(os, "O_NOFOLLOW", 0))


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


# -- write locks -----------------------------------------------------------------

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


_LOCK_FLAGS = os.O_RDWR | _SAFE
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


def utf8_problem(text: str) -> str | None:
    """Why UTF-8 (every store's text) cannot hold ``text``, or ``None`` if it can."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"it holds {text[exc.start:exc.end]!r} at {exc.start}, which UTF-8 cannot encode"
    return None


def check_text(
    checkpoint: WorkflowCheckpoint, name_problem: Callable[[str], str | None] = utf8_problem
) -> None:
    """Refuse a step name, version tag or context key of ``checkpoint`` that no save could write.

    Raises :class:`UnencodableError` naming the step (or the context key)
    for text UTF-8 cannot hold, and for a step name that ``name_problem``
    finds fault with (a database may have stricter rules for its keys).
    Stores run it on the checkpoint a run starts from (see ``prepare_run``),
    so that a name they could never write fails before the first step, not
    at its save; it costs O(steps), whatever the outputs.
    """
    graph = checkpoint.graph
    names = graph.keys() if graph is not None else checkpoint.outputs.keys()
    checks: list[tuple[str, Callable[[str], str | None], str, str | None]] = [
        (n, name_problem, f"the name of step {n!r}", n) for n in names
    ]
    checks += [
        (tag, utf8_problem, f"the version tag of step {n!r}", n) for n, tag in checkpoint.versions.items()
    ]
    checks += [(key, utf8_problem, f"context key {key!r}", None) for key in checkpoint.context]
    for text, problem, what, step in checks:
        why = problem(text) if isinstance(text, str) else None
        if why is not None:
            raise UnencodableError(f"cannot store {what}: {why}; nothing was saved", step=step)


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


def require_checkpoint(checkpoint: object) -> None:
    """Refuse anything but a :class:`WorkflowCheckpoint` with a ``ValueError``."""
    if not isinstance(checkpoint, WorkflowCheckpoint):
        raise ValueError(f"checkpoint must be a WorkflowCheckpoint, got {type(checkpoint).__name__}")


def codec(dumps: Dumps | None, loads: Loads | None) -> tuple[Dumps, Loads]:
    """A store's ``(dumps, loads)``: the ones given, else the strict JSON pair (no NaN either way).

    Refuses one that is not callable with a ``ValueError`` naming it, when
    the store is made rather than at its first save.
    """
    for name, fn in (("dumps", dumps), ("loads", loads)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} must be a callable or None, got {type(fn).__name__}")
    return (
        dumps if dumps is not None else default_dumps,
        loads if loads is not None else default_loads,
    )


def check_run_id(run_id: object) -> str:
    """``run_id`` if it is non-empty text UTF-8 can hold, else a ``ValueError`` saying why.

    SQL text (SQLite, PostgreSQL) is UTF-8: a run id with a lone surrogate
    could be neither saved nor found, so it is refused when the store is made.
    """
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")
    try:
        run_id.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"run_id must be encodable as UTF-8, got {run_id!r}") from None
    return run_id


class Store:
    """What every store shares beyond its codec: ``with store:`` closes it at the block's end."""

    __slots__ = ()

    def close(self) -> None:
        """Let go of what the store holds (its write lock, its connection)."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
