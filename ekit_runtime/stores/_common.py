"""What every store shares: the codec, its error messages, atomic file writes, and "same run".

Encoding happens in one place so that every store fails the same way on an
output it cannot write: a :class:`UnencodableError` naming the step, raised
before a single byte reaches storage.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn, TypeAlias

from ekit_core import WorkflowCheckpoint

__all__ = [
    "CorruptStoreError",
    "Dumps",
    "Loads",
    "UnencodableError",
    "atomic_write",
    "default_dumps",
    "encode",
    "encode_text",
    "fsync_dir",
    "require_checkpoint",
    "same_run",
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


def default_dumps(data: Any) -> str:
    """Compact, strict JSON on one line: utf-8 text kept as is, NaN and infinities refused."""
    return json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


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
            raise UnencodableError(
                f"cannot encode the output of step {name!r}: {type(exc).__name__}: {exc}; "
                "nothing was saved (pass dumps=/loads= to store rich types)",
                step=name,
            ) from exc
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


def fsync_dir(folder: str) -> None:
    """Make a rename in ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
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


def atomic_write(path: str, data: bytes, *, durable: bool) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves the old or the new file.

    Writes a temporary file in the same folder, fsyncs it (``durable``),
    renames it over ``path`` and fsyncs the folder. A kill can leave the
    temporary ``.<name>.*.tmp`` behind; it is never read.
    """
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        try:
            write_all(fd, data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(folder)


def require_checkpoint(checkpoint: object) -> None:
    """Refuse anything but a :class:`WorkflowCheckpoint` with a ``ValueError``."""
    if not isinstance(checkpoint, WorkflowCheckpoint):
        raise ValueError(f"checkpoint must be a WorkflowCheckpoint, got {type(checkpoint).__name__}")
