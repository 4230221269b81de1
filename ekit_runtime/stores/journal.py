"""``JournalStore``: an append-only JSON-lines journal of checkpoint deltas.

This module owns the journal format. Every line is one JSON object,
``{"c":"<crc32 of the record, 8 hex digits>","r":<record>}``. The first
record is ``{"kind":"full", ...WorkflowCheckpoint.to_dict()...}``; each later
one is ``{"kind":"delta", ...}`` and holds only what changed since the line
before it: the new outputs and per-step usage in completion order, new or
changed failures (``failures``), failures that disappeared (``cleared``), the
new ``step_index`` and the usage added (``cost``). Folding the lines in order
gives the latest checkpoint.

A save therefore writes O(that step's output) bytes, whatever the length of
the run. A full record is only written (atomically, replacing the file) on
the first save of a store object that has not loaded the file, when a
checkpoint does not extend the previous one, on :meth:`JournalStore.compact`,
or every ``compact_after`` deltas.

A process killed mid-append leaves a last line that is a prefix of a record
line (``{"c":"`` ...) without its newline, or one whose checksum does not
match: :meth:`JournalStore.load` ignores it, reports its size in
``torn_tail``, and the next append cuts it off first. Anything else is
corruption, not a crash, and raises
:class:`~ekit_runtime.stores.CorruptStoreError` naming the line: a damaged
line before the last, a last line that does not start like a record, and a
damaged first line (it is only ever written whole, by an atomic replace, so
no crash can tear it; a damaged one means the file is not a journal). Lines
ending in ``\r\n`` (a journal converted to Windows line endings) are read as
if they ended in ``\n``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from types import MappingProxyType
from typing import Any

from ekit_core import CheckpointError, FailureRecord, TokenUsage, WorkflowCheckpoint
from ekit_runtime.stores._common import (
    CorruptStoreError,
    Dumps,
    Loads,
    atomic_write,
    default_dumps,
    encode,
    require_checkpoint,
    same_run,
    write_all,
)

__all__ = ["JournalStore"]

_HEAD = b'{"c":"'
_MID = b'","r":'
_TAIL = b"}\n"
_BODY_START = len(_HEAD) + 8 + len(_MID)
# What every line starts with; ``0`` marks the 8 hex digits of the checksum.
_FRAME_START = _HEAD + b"0" * 8 + _MID
_HEX = frozenset(b"0123456789abcdef")
# The keys of a delta record that have the shape of checkpoint fields.
_DELTA_FIELDS = ("step_index", "outputs", "cost", "step_usage", "failures")


def _frame(body: bytes) -> bytes:
    if b"\n" in body:
        raise ValueError("journal: dumps must produce a single line (no newline characters)")
    return b"%s%08x%s%s%s" % (_HEAD, zlib.crc32(body), _MID, body, _TAIL)


def _unframe(line: bytes) -> bytes | None:
    """The record bytes of one complete line, or ``None`` if the line is damaged."""
    if line.endswith(b"}\r\n"):
        # _frame always ends a line with "}\n", so this is a journal converted
        # to Windows line endings; the record and its checksum are unchanged.
        line = line[:-2] + b"\n"
    if (
        len(line) < _BODY_START + len(_TAIL)
        or not line.startswith(_HEAD)
        or not line.endswith(_TAIL)
        or line[_BODY_START - len(_MID) : _BODY_START] != _MID
    ):
        return None
    try:
        crc = int(line[len(_HEAD) : len(_HEAD) + 8], 16)
    except ValueError:
        return None
    body = line[_BODY_START : -len(_TAIL)]
    return body if zlib.crc32(body) == crc else None


def _starts_like_a_line(fragment: bytes) -> bool:
    """Whether ``fragment`` begins the way every journal line does (``{"c":"<8 hex>","r":``).

    Only such bytes can be an append that a crash cut short: appends write a
    line's bytes in order, so what reaches the file is a prefix of the line.
    """
    for i, byte in enumerate(fragment[:_BODY_START]):
        if len(_HEAD) <= i < len(_HEAD) + 8:
            if byte not in _HEX:
                return False
        elif byte != _FRAME_START[i]:
            return False
    return True


@dataclasses.dataclass(slots=True)
class _Fold:
    """The checkpoint a journal folds to, built up line by line from typed parts."""

    start: WorkflowCheckpoint
    step_index: int
    outputs: dict[str, Any]
    step_usage: dict[str, TokenUsage]
    failures: dict[str, FailureRecord]
    cost: TokenUsage

    @classmethod
    def of(cls, start: WorkflowCheckpoint) -> _Fold:
        return cls(
            start, start.step_index, dict(start.outputs), dict(start.step_usage),
            dict(start.failures), start.cost,
        )

    def checkpoint(self) -> WorkflowCheckpoint:
        # Every part was parsed by WorkflowCheckpoint.from_dict (the full
        # record, then each delta), so assembling them needs no second parse.
        return dataclasses.replace(
            self.start,
            step_index=self.step_index,
            outputs=MappingProxyType(self.outputs),
            cost=self.cost,
            step_usage=MappingProxyType(self.step_usage),
            failures=MappingProxyType(self.failures),
        )


class JournalStore:
    """Keep a run's checkpoints as an append-only journal of deltas (JSON lines).

    Use it as ``checkpoint_fn=store``; ``store.load()`` folds the journal into
    the latest checkpoint (``None`` when nothing was saved yet). Saving after
    every step costs O(that step's output). ``store.compact()`` rewrites the
    journal as one full record; ``compact_after=n`` does so on its own every
    ``n`` deltas.

    ``torn_tail`` is the number of bytes at the end of the file that the last
    :meth:`load` ignored because an append was cut off by a crash (``0`` when
    the journal was whole). Every line before it counts; the next save
    truncates them.

    ``dumps``/``loads`` replace the JSON codec; ``dumps`` must return one
    line. ``durable=False`` skips the fsyncs (still safe against a killed
    process, not against a power cut). Saves are synchronous. One writer
    per file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        dumps: Dumps | None = None,
        loads: Loads | None = None,
        durable: bool = True,
        compact_after: int | None = None,
    ) -> None:
        if compact_after is not None and (
            isinstance(compact_after, bool) or not isinstance(compact_after, int) or compact_after < 1
        ):
            raise ValueError(f"compact_after must be a positive int or None, got {compact_after!r}")
        self.path = os.fspath(path)
        self.dumps: Dumps = dumps if dumps is not None else default_dumps
        self.loads: Loads = loads if loads is not None else json.loads
        self.durable = durable
        self.compact_after = compact_after
        self.torn_tail = 0
        # What this object knows is on disk: the checkpoint the file folds to,
        # the file's length and identity, and how many deltas follow its full
        # record. ``_last is None`` means "unknown": the next save writes in full.
        self._last: WorkflowCheckpoint | None = None
        self._size = 0
        self._ino = -1
        self._deltas = 0

    # -- saving -------------------------------------------------------------

    def save(self, checkpoint: WorkflowCheckpoint) -> None:
        """Record ``checkpoint``: append what changed since the last save, or write it whole.

        Raises :class:`~ekit_runtime.stores.UnencodableError` (a ``ValueError``
        naming the step) before touching the file if an output cannot be encoded.
        """
        require_checkpoint(checkpoint)
        previous = self._last
        record = None
        if (
            previous is not None
            and (self.compact_after is None or self._deltas < self.compact_after)
            and same_run(checkpoint, previous)
        ):
            record = self._delta(previous, checkpoint)
        if record is None:
            self._write_full(checkpoint)
            return
        if not record:
            return  # nothing changed: the journal already folds to this checkpoint
        new_outputs = record.get("outputs", {})
        body = encode(record, self.dumps, new_outputs.items())
        if not self._append(_frame(body)):
            self._write_full(checkpoint)
            return
        self._last = checkpoint
        self._deltas += 1

    __call__ = save

    @staticmethod
    def _delta(previous: WorkflowCheckpoint, checkpoint: WorkflowCheckpoint) -> dict[str, Any] | None:
        """The delta record from ``previous`` to ``checkpoint``; ``None`` if it needs a full one."""
        delta = checkpoint.delta_since(previous)
        cost = delta.cost
        if (
            not delta.extends
            or delta.context_changed
            # Usage that went down cannot be a delta: a delta's counts are
            # parsed like a checkpoint's, which are never negative.
            or min(cost.input_tokens, cost.output_tokens, cost.llm_calls) < 0
        ):
            return None
        cleared = [k for k in previous.failures if k not in checkpoint.failures]
        if (
            not delta.outputs
            and not delta.step_usage
            and not delta.failures
            and not cleared
            and delta.cost.is_zero()
            and checkpoint.step_index == previous.step_index
        ):
            return {}
        record: dict[str, Any] = {
            "kind": "delta",
            "step_index": checkpoint.step_index,
            "outputs": dict(delta.outputs),
            "cost": delta.cost.to_dict(),
        }
        if delta.step_usage:
            record["step_usage"] = {k: u.to_dict() for k, u in delta.step_usage}
        if delta.failures:
            record["failures"] = {k: f.to_dict() for k, f in delta.failures.items()}
        if cleared:
            record["cleared"] = cleared
        return record

    def _write_full(self, checkpoint: WorkflowCheckpoint) -> None:
        record = {"kind": "full", **checkpoint.to_dict()}
        line = _frame(encode(record, self.dumps, checkpoint.outputs.items(), checkpoint.context))
        self._last = None
        atomic_write(self.path, line, durable=self.durable)
        self._known(checkpoint, len(line), deltas=0)

    def _known(self, checkpoint: WorkflowCheckpoint | None, size: int, *, deltas: int) -> None:
        self._last = checkpoint
        self._size = size
        self._deltas = deltas
        try:
            self._ino = os.stat(self.path).st_ino
        except OSError:
            self._last = None

    def _append(self, line: bytes) -> bool:
        """Append ``line`` after the known end; ``False`` if the file is not the one we know."""
        try:
            fd = os.open(self.path, os.O_WRONLY)
        except FileNotFoundError:
            self._last = None
            return False
        try:
            stat = os.fstat(fd)
            if stat.st_ino != self._ino or stat.st_size < self._size:
                # Deleted, replaced or cut short behind our back: what it
                # holds is unknown, so the caller rewrites it in full.
                self._last = None
                return False
            if stat.st_size != self._size:
                # Bytes of an append that a crash cut off: drop them, or the
                # new line would be glued to a fragment.
                os.ftruncate(fd, self._size)
            os.lseek(fd, self._size, os.SEEK_SET)
            write_all(fd, line)
            if self.durable:
                os.fsync(fd)
        except BaseException:
            # What is on disk is now uncertain: the next save starts afresh.
            self._last = None
            raise
        finally:
            os.close(fd)
        self._size += len(line)
        return True

    def compact(self) -> WorkflowCheckpoint | None:
        """Rewrite the journal as one full record of its latest checkpoint (atomically).

        Returns that checkpoint, or ``None`` when nothing was saved yet.
        """
        checkpoint = self.load()
        if checkpoint is not None:
            self._write_full(checkpoint)
        return checkpoint

    # -- loading ------------------------------------------------------------

    def load(self) -> WorkflowCheckpoint | None:
        """Fold the journal into its latest checkpoint; ``None`` if nothing was saved yet.

        Sets ``torn_tail``. Raises :class:`~ekit_runtime.stores.CorruptStoreError`
        (a ``ValueError``) naming the file and line for damage no crash can
        leave: a damaged first line (so a file that is not a journal is never
        mistaken for a torn one), a damaged line before the last, a last line
        that does not start like a record, or a record that does not fit the
        format.
        """
        self._last = None
        self.torn_tail = 0
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        folded: _Fold | None = None
        deltas = 0
        pos = 0
        number = 0
        while pos < len(raw):
            number += 1
            end = raw.find(b"\n", pos)
            line = raw[pos : len(raw) if end < 0 else end + 1]
            body = _unframe(line) if end >= 0 else None
            if body is None:
                self._check_torn(line, number, last=pos + len(line) == len(raw))
                self.torn_tail = len(line)
                break
            record = self._decode(body, number)
            if record.get("kind") == "full":
                folded = _Fold.of(self._start(record, number))
                deltas = 0
            elif record.get("kind") == "delta":
                if folded is None:
                    raise CorruptStoreError(self.path, "a delta record before any full one", number)
                self._fold(folded, record, number)
                deltas += 1
            else:
                raise CorruptStoreError(
                    self.path, f"record kind must be 'full' or 'delta', got {record.get('kind')!r}",
                    number,
                )
            pos += len(line)
        if folded is None:
            # Only an empty file folds to nothing: line 1 is a full record or an error.
            self._known(None, pos, deltas=0)
            return None
        checkpoint = folded.checkpoint()
        self._known(checkpoint, pos, deltas=deltas)
        return checkpoint

    def _check_torn(self, line: bytes, number: int, *, last: bool) -> None:
        """Raise unless the damaged ``line`` is what a crash mid-append can leave."""
        if number == 1:
            # The first line is only ever written by an atomic replace: no
            # crash tears it. Calling this a torn tail would let the next save
            # replace a file that is not a journal (a JsonFileStore file, say).
            hint = ""
            if line.lstrip().startswith(b"{") and not _starts_like_a_line(line):
                hint = " (it looks like a JSON document: a JsonFileStore file?)"
            raise CorruptStoreError(
                self.path,
                "not a JournalStore journal: the first line is not a whole journal record, "
                f"and no crash can damage it{hint}",
                number,
            )
        if not last:
            raise CorruptStoreError(
                self.path, "damaged line (bad checksum or framing) before the end", number
            )
        if not _starts_like_a_line(line) and line.strip(b"\0"):
            # An all-NUL tail is what some file systems show for an append a
            # power cut interrupted before its data reached the disk: a torn
            # append, not a foreign file (line 1 is checked above).
            raise CorruptStoreError(
                self.path,
                'the last line does not start like a journal record ({"c":"...), so it is '
                "not an append cut short by a crash",
                number,
            )

    def _decode(self, body: bytes, number: int) -> dict[str, Any]:
        try:
            record = self.loads(body.decode("utf-8"))
        except Exception as exc:
            raise CorruptStoreError(
                self.path, f"record does not decode ({type(exc).__name__}: {exc})", number
            ) from exc
        if not isinstance(record, dict):
            raise CorruptStoreError(
                self.path, f"record must be an object, got {type(record).__name__}", number
            )
        return record

    def _start(self, record: dict[str, Any], number: int) -> WorkflowCheckpoint:
        try:
            return WorkflowCheckpoint.from_dict({k: v for k, v in record.items() if k != "kind"})
        except ValueError as exc:
            raise CorruptStoreError(self.path, str(exc), number) from exc

    def _fold(self, folded: _Fold, record: dict[str, Any], number: int) -> None:
        def bad(problem: str) -> CorruptStoreError:
            return CorruptStoreError(self.path, f"delta record: {problem}", number)

        # A delta's fields have the shape of a checkpoint's (the counts of
        # ``cost`` are what was added), so the checkpoint parser validates
        # them, naming the field: one set of rules for full and delta records.
        try:
            part = WorkflowCheckpoint.from_dict({k: record[k] for k in _DELTA_FIELDS if k in record})
        except CheckpointError as exc:
            raise bad(str(exc)) from exc
        cleared = record.get("cleared", [])
        if not isinstance(cleared, list) or not all(isinstance(k, str) for k in cleared):
            raise bad("'cleared' must be a list of step names")
        for key, target, new in (
            ("outputs", folded.outputs, part.outputs),
            ("step_usage", folded.step_usage, part.step_usage),
        ):
            for name, value in new.items():
                if name in target:
                    raise bad(f"{key!r} records step {name!r} a second time")
                target[name] = value
        folded.failures.update(part.failures)
        for name in cleared:
            folded.failures.pop(name, None)
        folded.cost = folded.cost + part.cost
        folded.step_index = part.step_index

    def __repr__(self) -> str:
        return f"JournalStore({self.path!r})"
