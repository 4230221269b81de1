"""``JournalStore``: an append-only JSON-lines journal of checkpoint deltas.

This module owns the journal format. Every line is one JSON object,
``{"c":"<crc32 of the record, 8 hex digits>","r":<record>}``. The first
record is ``{"kind":"full", ...WorkflowCheckpoint.to_dict()...}``; each later
one is ``{"kind":"delta", ...}`` and holds only what changed since the line
before it: the new outputs and per-step usage in completion order, the seconds the
new outputs' attempts took (``durations``, only for those of the new
outputs; a journal written before durations has none), new or
changed failures (``failures``), failures that disappeared (``cleared``), the
new ``step_index``, the usage added (``cost``) and the steps newly skipped by
a condition, with why (``skipped``; a journal written before run-time shapes
has none), and the loops whose ``keep_last`` let go of older iterations, with
their new counts (``compacted``: the fold lets go of those iterations'
entries first; see ``WorkflowCheckpoint.delta_compacting``). Folding the
lines in order gives the latest checkpoint.

A save therefore writes O(that step's output) bytes, whatever the length of
the run. A checkpoint that does not extend the previous one (a question or
an answer, a bumped version, another context or graph) is appended as a
full record, which the fold starts again from: the lines before it stay, so
:meth:`JournalStore.history` still holds every earlier checkpoint. The file
is only rewritten (atomically, as one full record) on the first save of a
store object that has not loaded it, on :meth:`JournalStore.compact`, or
once ``compact_after`` deltas follow the last full record.

A process killed mid-append leaves a last line that is a prefix of a record
line (``{"c":"`` ...) without its newline, or one whose checksum does not
match: :meth:`JournalStore.load` ignores it, reports its size in
``torn_tail``, and the next append cuts it off first. Only such bytes are
ever cut: whole lines that this store did not write (another writer's)
make the save refuse with :class:`~ekit_runtime.stores.StoreLockedError`
instead, though the write lock (``<file>.lock``, see
:class:`~ekit_runtime.stores.locks.WriteLock`) already keeps a second
writer out. Anything else is
corruption, not a crash, and raises
:class:`~ekit_runtime.stores.CorruptStoreError` naming the line: a damaged
line before the last, a last line that does not start like a record, and a
damaged first line (it is only ever written whole, by an atomic replace, so
no crash can tear it; a damaged one means the file is not a journal). Lines
ending in ``\r\n`` (a journal converted to Windows line endings) are read as
if they ended in ``\n``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
import zlib
from collections.abc import Iterator, Mapping, Sequence
from itertools import islice
from types import MappingProxyType
from typing import Any, TypeAlias

from ekit_core import CheckpointError, FailureRecord, TokenUsage, WorkflowCheckpoint
from ekit_core.ledger import Ledger
from ekit_core.shapes import compacted_iteration, iteration_name
from ekit_runtime.stores.base import require_checkpoint
from ekit_runtime.stores.codec import Dumps, Loads, OutputEncodings, codec, same_run
from ekit_runtime.stores.errors import CorruptStoreError, StoreLockedError
from ekit_runtime.stores.files import atomic_write, check_store_path, kind_of, read_file, write_all
from ekit_runtime.stores.locks import WriteLock, check_folder_writable, holding

__all__ = ["JournalStore"]

_HEAD = b'{"c":"'
_MID = b'","r":'
_TAIL = b"}\n"
_BODY_START = len(_HEAD) + 8 + len(_MID)
# What every line starts with; ``0`` marks the 8 hex digits of the checksum.
_FRAME_START = _HEAD + b"0" * 8 + _MID
_HEX = frozenset(b"0123456789abcdef")
# The keys of a delta record that have the shape of checkpoint fields.
_DELTA_FIELDS = ("step_index", "outputs", "cost", "step_usage", "failures", "skipped", "durations",
                 "began", "held")
# Sentinel inodes: the file's content is unknown to this store / there was no file.
_UNKNOWN = -1
_ABSENT = -2
# Appends open the journal through a symlink (a symlinked store file is the
# user's), never blocking on what is not a regular file; what was opened is
# then checked to be the very file this store wrote (device and inode).
_APPEND_FLAGS = (
    os.O_RDWR | getattr(os, "O_BINARY", 0) | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
)
# A delta record (its "outputs" a placeholder) and the new outputs it carries.
_Record: TypeAlias = tuple[dict[str, Any], Sequence[tuple[str, Any]]]


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


def _is_torn(tail: bytes) -> bool:
    """Whether ``tail``, the bytes after the last whole line, is what a crash mid-append leaves.

    That is part of one line: a prefix of a record line without its newline
    (or a line whose checksum does not match), or NUL bytes where a power
    cut left the file extended but unwritten; the same rule as
    :meth:`JournalStore.load`. Whole, valid lines are some writer's records
    and must never be cut off.
    """
    end = tail.find(b"\n")
    if end >= 0 and (end != len(tail) - 1 or _unframe(tail) is not None):
        return False
    return _starts_like_a_line(tail) or not tail.strip(b"\0")


def _read_at(fd: int, offset: int, size: int) -> bytes:
    os.lseek(fd, offset, os.SEEK_SET)
    chunks = []
    while size > 0:
        chunk = os.read(fd, size)
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


@dataclasses.dataclass(slots=True)
class _Fold:
    """The checkpoint a journal folds to, built up line by line from typed parts."""

    start: WorkflowCheckpoint
    step_index: int
    outputs: dict[str, Any]
    step_usage: dict[str, TokenUsage]
    failures: dict[str, FailureRecord]
    cost: TokenUsage
    skipped: dict[str, str]
    durations: dict[str, float]
    began: dict[str, float]
    compacted: dict[str, int]
    held: dict[str, Mapping[str, float]]

    @classmethod
    def of(cls, start: WorkflowCheckpoint) -> _Fold:
        return cls(
            start, start.step_index, dict(start.outputs), dict(start.step_usage),
            dict(start.failures), start.cost, dict(start.skipped), dict(start.durations),
            dict(start.began), dict(start.compacted), dict(start.held),
        )

    def let_go(self, counts: Mapping[str, int]) -> None:
        """A loop compacted its iterations up to ``counts[loop]`` (``keep_last``): their
        entries go (a delta's ``compacted``), O(iterations let go of)."""
        shapes = self.start.shapes
        for loop, upto in counts.items():
            shape = shapes.get(loop)
            if shape is not None and shape.child is not None:  # a loop body: its steps' too
                self._let_go_of_body(loop, upto)
            elif not loop.endswith("[]"):  # (a body map's items: counted, let go with its loop)
                for k in range(self.compacted.get(loop, 0) + 1, upto + 1):
                    name = iteration_name(loop, k)
                    for table in (self.outputs, self.step_usage, self.durations, self.began,
                                  self.held):
                        table.pop(name, None)
            self.compacted[loop] = upto

    def _let_go_of_body(self, loop: str, upto: int) -> None:
        """:meth:`let_go` of a loop whose body is a child: every body step's iterations up to
        ``upto`` and the items of its maps (O(entries): their names are not all known)."""
        shapes, counts = self.start.shapes, {loop: upto}
        for table in (self.outputs, self.step_usage, self.durations, self.began, self.held):
            for name in [n for n in table if compacted_iteration(n, counts, shapes) is not None]:
                del table[name]

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
            skipped=MappingProxyType(self.skipped),
            durations=MappingProxyType(self.durations),
            began=MappingProxyType(self.began),
            held=MappingProxyType(self.held),
            compacted=MappingProxyType(self.compacted) if self.compacted else self.start.compacted,
        )


class JournalStore:
    """Keep a run's checkpoints as an append-only journal of deltas (JSON lines).

    Use it as ``checkpoint_fn=store``; ``store.load()`` folds the journal into
    the latest checkpoint (``None`` when nothing was saved yet). Saving after
    every step costs O(that step's output); every save is an append (a
    question, an answer or a bumped version appends a full record), so
    :meth:`history` keeps every checkpoint. ``store.compact()`` rewrites the
    journal as one full record; ``compact_after=n`` does so on its own every
    ``n`` deltas.

    ``torn_tail`` is the number of bytes at the end of the file that the last
    :meth:`load` ignored because an append was cut off by a crash (``0`` when
    the journal was whole). Every line before it counts; the next save
    truncates them.

    One writer per file, enforced: the first save (or :meth:`compact`) takes
    a lock on ``<file>.lock``, held until :meth:`close` (or the end of a
    ``with`` block, or of the process); a second writer is refused with
    :class:`~ekit_runtime.stores.StoreLockedError`, and so is a save after
    another writer changed the journal this store had loaded or saved.
    :meth:`load` never needs the lock.

    ``dumps``/``loads`` replace the JSON codec; ``dumps`` must return one
    line. ``durable=False`` skips the fsyncs (still safe against a killed
    process, not against a power cut). Saves are synchronous.

    A ``ValueError`` naming ``path`` when the store is made if no save could
    write it (its folder is missing, or it is a directory, a FIFO...); a
    symlink at ``path`` is followed. Under :meth:`Workflow.run
    <ekit_runtime.Workflow.run>` the rest is checked before the first step
    (:meth:`prepare_run`).
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
        self.path = check_store_path(path)
        self.dumps, self.loads = codec(dumps, loads)
        self.durable = durable
        self.compact_after = compact_after
        self.torn_tail = 0
        self._encodings = OutputEncodings(self.dumps, self.loads)
        # Beside the symlink's target; the lambda must not hold ``self``, or
        # only the cycle collector could free the store and drop its lock.
        where = self.path
        self._lock = WriteLock(where, lambda: os.path.realpath(where) + ".lock")
        # What this object knows is on disk: the checkpoint the file folds to
        # (``None``: no checkpoint, or unknown), the file's length and inode
        # (``_UNKNOWN``: the next save writes it whole, ``_ABSENT``: there was
        # none) with its device, and how many deltas follow its full record.
        self._last: WorkflowCheckpoint | None = None
        self._size = 0
        self._ino = _UNKNOWN
        self._dev = 0
        self._deltas = 0

    # -- saving -------------------------------------------------------------

    def save(self, checkpoint: WorkflowCheckpoint) -> None:
        """Record ``checkpoint``: append what changed since the last save, or write it whole.

        Raises :class:`~ekit_runtime.stores.UnencodableError` (a ``ValueError``
        naming the step) if an output cannot be encoded, and
        :class:`~ekit_runtime.stores.StoreLockedError` if another writer holds
        the journal or changed it since this store last read or wrote it;
        either way before touching the file.
        """
        require_checkpoint(checkpoint)
        self._lock.hold()
        opened = self._open_known()
        if opened is None or self._last is None or self._compacting():
            if opened is not None:
                os.close(opened[0])
            self._write_full(checkpoint)
            return
        try:
            line, full = self._next_line(checkpoint)
            if not line:
                return  # nothing changed: the journal already folds to this checkpoint
            self._append(opened[0], opened[1], line)
        finally:
            os.close(opened[0])
        # A full record starts the count of deltas again, as load() counts them.
        self._deltas = 0 if full else self._deltas + 1
        self._last = checkpoint

    __call__ = save

    def prepare_run(self, checkpoint: WorkflowCheckpoint) -> None:
        """Refuse now, before any step runs, a run whose saves this store would refuse.

        :meth:`Workflow.run <ekit_runtime.Workflow.run>` calls it with the
        checkpoint the run starts from. It takes the write lock (kept until
        :meth:`close`; a refusal keeps none it took), and raises
        :class:`~ekit_runtime.stores.StoreLockedError`
        if another writer holds it, its lock file is not a regular file of
        this user's, the folder is not writable, or another writer changed
        the journal since this store loaded it;
        :class:`~ekit_runtime.stores.UnencodableError` if a step name, version
        tag, context value or recorded output cannot be encoded. Writes
        nothing but the lock file.
        """
        require_checkpoint(checkpoint)
        self._encodings.check(checkpoint)
        with holding(self._lock):
            check_folder_writable(self.path, self._lock)
            opened = self._open_known()
            if opened is not None:
                os.close(opened[0])

    def _compacting(self) -> bool:
        """Whether the next save rewrites the journal as one record (``compact_after``)."""
        return self.compact_after is not None and self._deltas >= self.compact_after

    def _next_line(self, checkpoint: WorkflowCheckpoint) -> tuple[bytes, bool]:
        """The line to append for ``checkpoint`` (empty: no change), and whether it is a full record.

        A delta when it can be one.
        A checkpoint that does not extend the last one (a question or an
        answer, a bumped version, another context, format or graph) is
        appended whole: rewriting the file would lose the run's history.
        """
        previous = self._last
        assert previous is not None
        step = self._delta(previous, checkpoint) if same_run(checkpoint, previous) else None
        if step is None:
            return _frame(self._encodings.document_of(checkpoint, {"kind": "full"})), True
        record, new_outputs = step
        if not record:
            return b"", False
        chosen = self._encodings.members(new_outputs)
        return _frame(self._encodings.document(record, chosen, None)), False

    @staticmethod
    def _delta(previous: WorkflowCheckpoint, checkpoint: WorkflowCheckpoint) -> _Record | None:
        """The delta record from ``previous`` to ``checkpoint`` and its new outputs.

        ``None`` if it needs a full record; an empty record if nothing changed.
        ``record["outputs"]`` is a placeholder for the encodings of the new outputs.
        """
        delta = checkpoint.delta_compacting(previous)  # (keep_last: a loop lets go of entries)
        cost = delta.cost
        if (
            not delta.extends
            or delta.context_changed
            or delta.asked_changed  # questions and answers: rare, written in full
            # Usage that went down cannot be a delta: a delta's counts are
            # parsed like a checkpoint's, which are never negative.
            or min(cost.input_tokens, cost.output_tokens, cost.llm_calls) < 0
        ):
            return None
        new_durations = delta.durations
        if new_durations and not {k for k, _ in new_durations} <= {k for k, _ in delta.outputs}:
            # A delta's durations are parsed beside its outputs, each of an
            # output it records: one of an earlier output (never in a run) is
            # written in full.
            return None
        cleared = [k for k in previous.failures if k not in checkpoint.failures]
        if (
            not delta.outputs
            and not delta.step_usage
            and not delta.failures
            and not cleared
            and not delta.skipped
            and not new_durations
            and not delta.compacted
            and delta.cost.is_zero()
            and checkpoint.step_index == previous.step_index
        ):
            return {}, ()
        record: dict[str, Any] = {
            "kind": "delta",
            "step_index": checkpoint.step_index,
            "outputs": None,
            "cost": delta.cost.to_dict(),
        }
        if delta.step_usage:
            record["step_usage"] = {k: u.to_dict() for k, u in delta.step_usage}
        if delta.failures:
            record["failures"] = {k: f.to_dict() for k, f in delta.failures.items()}
        if cleared:
            record["cleared"] = cleared
        if delta.skipped:
            record["skipped"] = dict(delta.skipped)
        if delta.compacted:
            record["compacted"] = dict(delta.compacted)
        if new_durations:
            record["durations"] = dict(new_durations)
            if delta.began:
                record["began"] = dict(delta.began)
            if delta.held:
                record["held"] = {k: dict(h) for k, h in delta.held}
        return record, delta.outputs

    def _open_known(self) -> tuple[int, int] | None:
        """The journal opened to append after what this store knows it holds, and its size.

        ``None`` when the file must be written whole: its content is unknown
        to this store, or it is gone, empty or cut short (nothing of anyone
        else's to keep). Raises :class:`StoreLockedError`, without writing,
        when another writer changed it since this store read or wrote it:
        replaced it, or appended whole lines (which a truncation would cut).
        """
        if self._ino == _UNKNOWN:
            return None
        try:
            fd = os.open(self.path, _APPEND_FLAGS)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptStoreError(self.path, f"is {kind_of(st.st_mode)}, not a journal")
            same = (st.st_dev, st.st_ino) == (self._dev, self._ino)
            if st.st_size == 0 or (same and st.st_size < self._size):
                os.close(fd)
                return None
            if not same or (
                st.st_size > self._size
                and not _is_torn(_read_at(fd, self._size, st.st_size - self._size))
            ):
                raise self._changed()
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        return fd, st.st_size

    def _changed(self) -> StoreLockedError:
        return StoreLockedError(
            self.path,
            "the journal changed since this store last read or wrote it (another writer saved "
            "in between); nothing was saved, and none of its lines were cut. load() again to "
            "continue from what is stored",
        )

    def _write_full(self, checkpoint: WorkflowCheckpoint) -> None:
        line = _frame(self._encodings.document_of(checkpoint, {"kind": "full"}))
        self._forget()
        atomic_write(self.path, line, durable=self.durable)
        try:
            st = os.stat(self.path)
        except OSError:
            return
        self._known(checkpoint, len(line), st, deltas=0)

    def _known(
        self, checkpoint: WorkflowCheckpoint | None, size: int, st: os.stat_result | int, *, deltas: int
    ) -> None:
        self._last = checkpoint
        self._size = size
        self._dev, self._ino = (0, st) if isinstance(st, int) else (st.st_dev, st.st_ino)
        self._deltas = deltas

    def _forget(self) -> None:
        """What is on disk is uncertain: the next save writes the journal whole."""
        self._last = None
        self._ino = _UNKNOWN

    def _append(self, fd: int, size: int, line: bytes) -> None:
        """Append ``line`` after the known end of the journal open as ``fd`` (``size`` bytes long)."""
        try:
            if size != self._size:
                # _open_known found there only part of one line, an append a
                # crash cut short: drop it, or the new line would be glued to it.
                os.ftruncate(fd, self._size)
            os.lseek(fd, self._size, os.SEEK_SET)
            write_all(fd, line)
            if self.durable:
                os.fsync(fd)
        except BaseException:
            # Cut off what this append wrote, so that the journal is what this
            # store knows it holds and the next save appends after it: forgotten,
            # the next save (a run's wind-down) would rewrite it, history lost.
            try:
                os.ftruncate(fd, self._size)
            except OSError:
                self._forget()
            raise
        self._size += len(line)

    def compact(self) -> WorkflowCheckpoint | None:
        """Rewrite the journal as one full record of its latest checkpoint (atomically).

        Returns that checkpoint, or ``None`` when nothing was saved yet. Takes
        the write lock, like a save.
        """
        self._lock.hold()
        checkpoint = self.load()
        if checkpoint is not None:
            self._write_full(checkpoint)
        return checkpoint

    def close(self) -> None:
        """Release the write lock (if this store took it); a later save takes it again."""
        self._lock.release()

    def __enter__(self) -> JournalStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- loading ------------------------------------------------------------

    def load(self) -> WorkflowCheckpoint | None:
        """Fold the journal into its latest checkpoint; ``None`` if nothing was saved yet.

        Sets ``torn_tail``. Raises :class:`~ekit_runtime.stores.CorruptStoreError`
        (a ``ValueError``) naming the file and line for damage no crash can
        leave: a damaged first line (so a file that is not a journal is never
        mistaken for a torn one), a damaged line before the last, a last line
        that does not start like a record, or a record that does not fit the
        format (NaN and infinities included, with the default codec). Takes
        no lock.
        """
        self._forget()
        self.torn_tail = 0
        try:
            st, raw = read_file(self.path)
        except FileNotFoundError:
            self._known(None, 0, _ABSENT, deltas=0)
            return None
        folded, deltas, end = self._fold_lines(raw)
        if folded is None:
            # Only an empty file folds to nothing: line 1 is a full record or an error.
            self._known(None, end, st, deltas=0)
            return None
        checkpoint = folded.checkpoint()
        self._encodings.seed(checkpoint.outputs)
        self._known(checkpoint, end, st, deltas=deltas)
        return checkpoint

    def _fold_lines(self, raw: bytes) -> tuple[_Fold | None, int, int]:
        """Fold the journal's bytes: the fold, the deltas after its full record, where whole lines end."""
        folded: _Fold | None = None
        deltas = 0
        pos = 0
        for number, record, end in self._records(raw):
            if record is None:
                self.torn_tail = end - pos
                break
            if record["kind"] == "full":
                folded = _Fold.of(self._start(record, number))
                deltas = 0
            else:
                if folded is None:
                    raise CorruptStoreError(self.path, "a delta record before any full one", number)
                self._fold(folded, record, number)
                deltas += 1
            pos = end
        return folded, deltas, pos

    def _records(self, raw: bytes) -> Iterator[tuple[int, dict[str, Any] | None, int]]:
        """Each line's ``(number, record, where it ends)``, the one walk every reader shares.

        A damaged last line that a crash mid-append can leave ends the walk
        with ``record`` set to ``None``; any other damage, and a record of
        neither kind, raises :class:`~ekit_runtime.stores.CorruptStoreError`.
        """
        pos, number = 0, 0
        while pos < len(raw):
            number += 1
            end = raw.find(b"\n", pos)
            line = raw[pos : len(raw) if end < 0 else end + 1]
            body = _unframe(line) if end >= 0 else None
            if body is None:
                self._check_torn(line, number, last=pos + len(line) == len(raw))
                yield number, None, pos + len(line)
                return
            record = self._decode(body, number)
            kind = record.get("kind")
            if kind not in ("full", "delta"):
                raise CorruptStoreError(
                    self.path, f"record kind must be 'full' or 'delta', got {kind!r}", number
                )
            pos += len(line)
            yield number, record, pos

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
            start = WorkflowCheckpoint.from_dict({k: v for k, v in record.items() if k != "kind"})
            # Decoded here, where a fault (a step named twice) is told with its
            # line: every checkpoint folded from this record reads it.
            start.check_graph()
        except ValueError as exc:
            raise CorruptStoreError(self.path, str(exc), number) from exc
        return start

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
        compacted = record.get("compacted", {})
        if not isinstance(compacted, dict) or not all(
                isinstance(k, str) and type(n) is int and n >= folded.compacted.get(k, 0)
                for k, n in compacted.items()):
            raise bad("'compacted' must map loops to counts that only grow")
        if compacted:  # (before the new entries: none of them is let go of)
            folded.let_go(compacted)
        tables: tuple[tuple[str, dict[str, Any], Mapping[str, Any]], ...] = (
            ("outputs", folded.outputs, part.outputs),
            ("step_usage", folded.step_usage, part.step_usage),
            ("durations", folded.durations, part.durations),
            ("began", folded.began, part.began),
            ("held", folded.held, part.held),
        )
        for key, target, new in tables:
            for name, value in new.items():
                if name in target:
                    raise bad(f"{key!r} records step {name!r} a second time")
                target[name] = value
        for name, why in part.skipped.items():
            if name in folded.skipped:
                raise bad(f"'skipped' records step {name!r} a second time")
            folded.skipped[name] = why
        folded.failures.update(part.failures)
        for name in cleared:
            folded.failures.pop(name, None)
        folded.cost = folded.cost + part.cost
        folded.step_index = part.step_index

    def __repr__(self) -> str:
        return f"JournalStore({self.path!r})"

    # -- reading the whole history -------------------------------------------

    def history(self) -> Iterator[WorkflowCheckpoint]:
        """Every checkpoint the journal holds, oldest first: each line folded with those before it.

        The first line is the checkpoint of the journal's full record; each
        delta line gives the next one, as :meth:`load` would have returned
        after that save. (A full rewrite, :meth:`compact` included, starts
        the journal again: the history begins at its full record.) The last
        checkpoint is the one :meth:`load` returns; a torn last line is
        skipped, as there, and damage raises the same
        :class:`~ekit_runtime.stores.CorruptStoreError`. Checkpoints share
        their outputs (``delta_since`` between consecutive ones costs
        O(what changed)), so reading a history of n saves costs O(its size).
        Takes no lock and changes nothing this store knows; a missing file
        has no history.
        """
        try:
            _, raw = read_file(self.path)
        except FileNotFoundError:
            return
        history: _History | None = None
        for number, record, _ in self._records(raw):
            if record is None:
                return
            if record["kind"] == "full":
                history = _History(_Fold.of(self._start(record, number)))
            elif history is None:
                raise CorruptStoreError(self.path, "a delta record before any full one", number)
            else:
                self._fold(history.fold, record, number)
            yield history.checkpoint()


class _History:
    """A journal's fold, and persistent copies of its outputs and usage for every checkpoint on the way.

    :meth:`JournalStore._fold` grows plain dicts in place; each checkpoint
    of a history needs its own view, which the ledgers give in O(1) per
    new entry instead of a copy per line.
    """

    __slots__ = ("began", "compacted", "durations", "fold", "held", "outputs", "skipped", "usage")

    def __init__(self, fold: _Fold) -> None:
        self.fold = fold
        self.outputs: Ledger[str, Any] = Ledger(fold.outputs.items())
        self.usage: Ledger[str, TokenUsage] = Ledger(fold.step_usage.items())
        self.durations: Ledger[str, float] = Ledger(fold.durations.items())
        self.began: Ledger[str, float] = Ledger(fold.began.items())
        self.held: Ledger[str, Mapping[str, float]] = Ledger(fold.held.items())
        self.skipped = fold.start.skipped
        self.compacted = fold.start.compacted

    def checkpoint(self) -> WorkflowCheckpoint:
        fold = self.fold
        if fold.compacted != self.compacted:  # a line let go of entries: the views start again
            self.compacted = MappingProxyType(dict(fold.compacted))
            self.outputs, self.usage = Ledger(fold.outputs.items()), Ledger(fold.step_usage.items())
            self.durations, self.began = Ledger(fold.durations.items()), Ledger(fold.began.items())
            self.held = Ledger(fold.held.items())
        # Entries only ever follow those before them (a delta that records a
        # step twice is refused), so the new ones are the last of each dict.
        for table, attr in ((fold.outputs, "outputs"), (fold.step_usage, "usage"),
                            (fold.durations, "durations"), (fold.began, "began"), (fold.held, "held")):
            ledger = getattr(self, attr)
            added = len(table) - len(ledger)
            if added:
                for key, value in list(islice(reversed(table.items()), added))[::-1]:
                    ledger = ledger.with_item(key, value)
                setattr(self, attr, ledger)
        if len(fold.skipped) != len(self.skipped):
            # Skips only grow: a new mapping only when a line adds some, shared
            # by the checkpoints until the next (as the core's are).
            self.skipped = MappingProxyType(dict(fold.skipped))
        return WorkflowCheckpoint.of_ledgers(
            self.outputs,
            self.usage,
            step_index=fold.step_index,
            cost=fold.cost,
            context=fold.start.context,
            failures=MappingProxyType(dict(fold.failures)),
            fingerprint=fold.start.fingerprint,
            graph=fold.start.graph,
            format_version=fold.start.format_version,
            versions=fold.start.versions,
            skipped=self.skipped,
            shapes=fold.start.shapes,
            superseded=fold.start.superseded,
            asked=fold.start.asked,
            durations=self.durations,
            redone=fold.start.redone,
            compacted=self.compacted,
            began=self.began,
            held=self.held,
            code_fingerprints=fold.start.code_fingerprints,
            cache_hits=fold.start.cache_hits,
            compacted_retries=fold.start.compacted_retries,
            drives=fold.start.drives,
        )
