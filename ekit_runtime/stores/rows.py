"""A checkpoint as database rows: one header, one row per output, per-step usage and skip.

Shared by the stores and queue backends that keep checkpoints in SQL tables
(:class:`~ekit_runtime.stores.postgres.PostgresStore`, the run queues). A
save writes the header only when the run is new or changed shape, and
otherwise only the rows of the outputs that are new since the previous save,
so it costs O(that step's output). A store that can let go of rows (SQLite,
PostgreSQL: ``encode_checkpoint(..., compacting=True)``) also writes a
compacting loop's save (``keep_last``) as a delta: the rows of the
iterations it lets go of are deleted (``gone``) and the header, whose
``compacted`` counts changed, is written again (``recount``), so the run's
rows grow, and a save writes, by one iteration per iteration. A writer that
passes ``drive_rows=True`` (the run queues) appends each drive of the run that
began since the header was written as a row of kind ``"drive"`` (named by its
place among the run's drives, the record as JSON), so that the first save of a
drive (each claim of a queued run) is a delta too; the header keeps the drives
known when it was last written, and loading lays the rows over them by place.
Steps skipped by a condition are rows too
(kind ``"skip"``, the reason as JSON text), not part of the header: skips
grow during a run, and a save adds only the new ones. A step's duration (the
seconds its recorded output's attempt took) rides in its usage row, as
``"seconds"`` beside the three counts, so that the tables and a reader
that knows no durations are unchanged (that reader takes the counts and
ignores the rest), and when that attempt began (``"began"``, epoch
seconds) beside them, and the limits that held that attempt (``"held"``); a
step that spent nothing but was timed has a usage row
of zeros with its seconds, read back as no usage (usage is sparse).
:class:`OutputTexts` keeps each output's
first text (the mutation rule of docs/stores.md). Loading folds the rows back
and parses the result with :meth:`WorkflowCheckpoint.from_dict`, the
untrusted-input parser: nothing read is ever executed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from ekit_core import CheckpointDelta, DriveRecord, TokenUsage, WorkflowCheckpoint
from ekit_runtime.stores.base import require_checkpoint
from ekit_runtime.stores.codec import (
    Dumps,
    Loads,
    default_dumps,
    default_loads,
    encode_text,
    same_run,
    utf8_problem,
)
from ekit_runtime.stores.errors import CorruptStoreError, UnencodableError

__all__ = [
    "PG_KEY_BYTES",
    "EncodedCheckpoint",
    "OutputTexts",
    "Row",
    "decode_checkpoint",
    "encode_checkpoint",
    "pg_text_problem",
]

Row = tuple[str, str, str]
"""``(kind, name, value)``: kind is ``"output"``, ``"usage"``, ``"skip"`` or ``"drive"``, value is
encoded text."""

# SQL integers (SQLite INTEGER, PostgreSQL bigint) are signed 64-bit.
_INT64 = range(-(2**63), 2**63)

PG_KEY_BYTES = 1024
"""The most UTF-8 bytes of a run id or step name in PostgreSQL, where both are keys.

A btree index entry holds at most 2704 bytes (8 KB pages), and the entries
table's key is (run id, kind, step name): two of these fit with room to spare.
"""


def pg_text_problem(text: str) -> str | None:
    """Why PostgreSQL cannot keep ``text`` as a key (run id, step name), or ``None`` if it can."""
    why = utf8_problem(text)
    if why is not None:
        return why
    if "\x00" in text:
        return f"it holds a NUL character (at {text.index(chr(0))}), which PostgreSQL text cannot"
    # Four bytes at most per character: short text needs no encoding to be measured.
    if len(text) * 4 > PG_KEY_BYTES and len(text.encode("utf-8")) > PG_KEY_BYTES:
        return (
            f"it is {len(text.encode('utf-8'))} bytes in UTF-8, over the {PG_KEY_BYTES} that a "
            "PostgreSQL key of the store may hold"
        )
    return None


def _check_pg(rows: list[Row], header: str | None) -> None:
    """Refuse, naming the step, a row PostgreSQL would reject (``psycopg.DataError`` mid-save)."""
    for kind, name, value in rows:
        why = pg_text_problem(name)
        if why is None and "\x00" in value:
            why = f"its encoded {kind} holds a NUL character, which PostgreSQL text cannot"
        if why is not None:
            raise UnencodableError(
                f"cannot store step {name!r} in PostgreSQL: {why}; nothing was saved", step=name
            )
    if header is not None and "\x00" in header:
        raise UnencodableError(
            "cannot store the checkpoint in PostgreSQL: its encoded context, graph or versions "
            "hold a NUL character, which PostgreSQL text cannot; nothing was saved"
        )


class EncodedCheckpoint(NamedTuple):
    """What one save writes.

    ``header`` is ``None`` for a delta (the stored header stands and ``rows``
    are only the new entries); otherwise the run is rewritten: ``header``
    replaces the stored one and ``rows`` are every entry. (A named tuple, not
    a frozen dataclass: every save of every store builds one, and a tuple is
    built in one step where a frozen dataclass sets each field through
    ``object.__setattr__``.)
    """

    header: str | None
    rows: list[Row]
    failures: str
    counts: tuple[int, int, int, int]
    # A compacting delta (only with ``compacting=True``): the steps whose
    # output and usage rows go before ``rows`` are added, and the header to
    # write in place of the stored one (its ``compacted`` counts grew).
    gone: tuple[str, ...] = ()
    recount: str | None = None

    @property
    def full(self) -> bool:
        """Whether this save replaces the stored run rather than adding to it."""
        return self.header is not None


class OutputTexts:
    """The text each step's output was first stored as, reused while saves hand the same object.

    The library never copies outputs, so a step may mutate an earlier
    step's output after it was saved; the rule (docs/stores.md) is that what
    is stored for a step never changes. A store that keeps one of these
    encodes an output once, when it first saves (or loads) it, and every
    later row of that step, a full rewrite included, carries that text.
    """

    __slots__ = ("_texts",)

    def __init__(self) -> None:
        self._texts: dict[str, tuple[Any, str]] = {}

    def rows(
        self,
        outputs: Iterable[tuple[str, Any]],
        usage: Iterable[tuple[str, TokenUsage]],
        dumps: Dumps,
        *,
        every: bool = False,
        durations: Iterable[tuple[str, float]] = (),
        began: Iterable[tuple[str, float]] = (),
        held: Iterable[tuple[str, Any]] = (),
    ) -> list[Row]:
        """The rows of these outputs, usage, durations and began times (each in the usage
        row of its step: see the module); ``every=True``: they are all the run's outputs."""
        old = self._texts
        texts = {} if every else old
        rows: list[Row] = []
        for name, value in outputs:
            entry = old.get(name)
            if entry is None or entry[0] is not value:
                entry = (value, encode_text(value, dumps, ((name, value),)))
            texts[name] = entry
            rows.append(("output", name, entry[1]))
        seconds = dict(durations) if durations else None
        if not seconds:
            rows += [("usage", k, default_dumps(u.to_dict())) for k, u in usage]
        else:
            moments = dict(began) if began else {}
            holds = dict(held) if held else {}
            for k, u in usage:
                spent: dict[str, Any] = u.to_dict()
                if k in seconds:
                    spent["seconds"] = seconds.pop(k)
                    if k in moments:
                        spent["began"] = moments[k]
                    if k in holds:
                        spent["held"] = dict(holds[k])
                rows.append(("usage", k, default_dumps(spent)))
            for k, d in seconds.items():
                timed: dict[str, Any] = {**_NO_COUNTS, "seconds": d}
                if k in moments:
                    timed["began"] = moments[k]
                if k in holds:
                    timed["held"] = dict(holds[k])
                rows.append(("usage", k, default_dumps(timed)))
        self._texts = texts
        return rows

    def seed(self, outputs: dict[str, Any], texts: dict[str, str]) -> None:
        """Remember loaded ``outputs`` as stored in ``texts``: later rows of theirs reuse it."""
        self._texts = {name: (value, texts[name]) for name, value in outputs.items()}

    def forget(self, names: Iterable[str]) -> None:
        """Let go of the texts of these steps (compacted iterations: their rows are gone)."""
        texts = self._texts
        for name in names:
            texts.pop(name, None)

    def clear(self) -> None:
        """Forget every text (nothing is stored, or what is stored is unknown)."""
        self._texts = {}


_NO_COUNTS = {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0}


def _header(checkpoint: WorkflowCheckpoint, dumps: Dumps) -> str:
    meta = checkpoint.to_dict(per_step=False)
    for key in ("outputs", "step_usage", "failures", "cost", "step_index"):
        del meta[key]
    meta.pop("skipped", None)  # rows of their own: see _skip_rows
    return encode_text(meta, dumps, (), checkpoint.context)


def _counts(checkpoint: WorkflowCheckpoint, engine: str) -> tuple[int, int, int, int]:
    cost = checkpoint.cost
    counts = (checkpoint.step_index, cost.input_tokens, cost.output_tokens, cost.llm_calls)
    # Every save runs this: one test for the four, and the culprit looked for
    # only when it fails. (Anything but an int is refused before it is
    # compared: a value's comparisons are arbitrary code.)
    a, b, c, d = counts
    fits = (
        isinstance(a, int) and isinstance(b, int) and isinstance(c, int) and isinstance(d, int)
        and min(counts) >= _INT64.start and max(counts) < _INT64.stop
    )
    if not fits:
        names = ("step_index", "cost.input_tokens", "cost.output_tokens", "cost.llm_calls")
        for name, value in zip(names, counts, strict=True):
            if not isinstance(value, int):
                problem = "not an integer"
            elif not _INT64.start <= value < _INT64.stop:
                problem = f"{engine} integers are 64-bit"
            else:
                continue
            raise UnencodableError(f"cannot store {name} = {value!r:.100}: {problem}; nothing was saved")
    return counts


def _drive_rows(drives: Iterable[DriveRecord], first: int) -> list[Row]:
    """One row per drive that began, named by its place among the run's drives (from ``first``)."""
    return [("drive", str(place), default_dumps(d.to_dict())) for place, d in enumerate(drives, first)]


def _skip_rows(skipped: Iterable[tuple[str, str]]) -> list[Row]:
    """One row per skip: a save adds the new ones only, as it does outputs."""
    return [("skip", name, default_dumps(why)) for name, why in skipped]


def encode_checkpoint(
    checkpoint: WorkflowCheckpoint,
    previous: WorkflowCheckpoint | None,
    dumps: Dumps,
    texts: OutputTexts | None = None,
    *,
    engine: str = "SQL",
    compacting: bool = False,
    drive_rows: bool = False,
) -> EncodedCheckpoint:
    """Encode ``checkpoint`` as a delta on ``previous`` (the stored one) when it extends it.

    ``previous=None`` (unknown or nothing stored) gives a full rewrite.
    ``texts``, when given, supplies (and learns) each output's first text;
    ``engine`` names the database in the error for a count beyond 64 bits;
    ``"PostgreSQL"`` also refuses the step names and text that PostgreSQL
    cannot hold (see :func:`pg_text_problem`). ``compacting=True`` (a
    writer that applies ``gone`` and ``recount``) makes a save whose loops
    compacted more iterations a delta too (see
    :meth:`WorkflowCheckpoint.delta_compacting`); without it such a save is
    a full rewrite, as a writer that ignores those fields needs.
    ``drive_rows=True`` (a writer whose rows may be of kind ``"drive"``)
    makes a save whose run began a new drive a delta too, the new drives
    its rows (see the module). Raises
    :class:`UnencodableError` naming the step before anything is written.
    """
    require_checkpoint(checkpoint)
    if texts is None:
        texts = OutputTexts()  # nothing to reuse: every output is encoded now
    failures = (
        encode_text({k: f.to_dict() for k, f in checkpoint.failures.items()}, default_dumps, ())
        if checkpoint.failures
        else "{}"  # (most saves: nothing has failed)
    )
    counts = _counts(checkpoint, engine)
    if previous is not None and same_run(checkpoint, previous):
        delta = _delta(checkpoint, previous, compacting, drive_rows)
        if delta.extends and not delta.context_changed and not delta.asked_changed and (
                # A duration goes in its step's usage row, written with its output.
                not delta.durations or {k for k, _ in delta.durations} <= {k for k, _ in delta.outputs}):
            rows = texts.rows(delta.outputs, delta.step_usage, dumps, durations=delta.durations,
                              began=delta.began, held=delta.held)
            if delta.skipped:
                rows += _skip_rows(delta.skipped.items())
            if delta.drives:
                rows += _drive_rows(delta.drives, len(previous.drives))
            if delta.compacted:
                return _compacting(checkpoint, previous, rows, failures, counts, dumps, texts, engine)
            if engine == "PostgreSQL":
                _check_pg(rows, None)
            return EncodedCheckpoint(None, rows, failures, counts)
    rows = texts.rows(checkpoint.outputs.items(), checkpoint.step_usage.items(), dumps, every=True,
                      durations=checkpoint.durations.items(), began=checkpoint.began.items(),
                      held=checkpoint.held.items())
    rows += _skip_rows(checkpoint.skipped.items())
    header = _header(checkpoint, dumps)
    if engine == "PostgreSQL":
        _check_pg(rows, header)
    return EncodedCheckpoint(header, rows, failures, counts)


def _delta(
    checkpoint: WorkflowCheckpoint, previous: WorkflowCheckpoint, compacting: bool, drive_rows: bool
) -> CheckpointDelta:
    """The delta :func:`encode_checkpoint` writes, as its writer can apply it."""
    # (Each save runs this: the usual one, whose loops compacted nothing more and whose
    # drive is the one before, takes delta_since's fast path with no keyword to pass.)
    if compacting and checkpoint.compacted is not previous.compacted:
        return checkpoint.delta_compacting(previous, drive_rows=drive_rows)
    if drive_rows and checkpoint.drives is not previous.drives:
        return checkpoint.delta_driving(previous)
    return checkpoint.delta_since(previous)


def _compacting(
    checkpoint: WorkflowCheckpoint,
    previous: WorkflowCheckpoint,
    rows: list[Row],
    failures: str,
    counts: tuple[int, int, int, int],
    dumps: Dumps,
    texts: OutputTexts,
    engine: str,
) -> EncodedCheckpoint:
    """The delta of a save whose loops compacted more iterations: the rows of the entries it
    let go of go (an extending delta drops nothing else: a loop's iterations, a body's
    steps, their map items), and the header is written again (it holds the counts).
    O(what ``previous`` records), as ``delta_compacting`` is when it compacts."""
    gone = tuple(dict.fromkeys(
        n for table, now in ((previous.outputs, checkpoint.outputs),
                             (previous.step_usage, checkpoint.step_usage),
                             (previous.durations, checkpoint.durations))
        for n in table if n not in now))
    header = _header(checkpoint, dumps)
    if engine == "PostgreSQL":
        _check_pg(rows, header)
    texts.forget(gone)
    return EncodedCheckpoint(None, rows, failures, counts, gone, header)


def _decode(text: str, loads: Loads, where: str, what: str) -> Any:
    try:
        return loads(text)
    except Exception as exc:
        raise CorruptStoreError(where, f"{what} does not decode ({type(exc).__name__}: {exc})") from exc


def _lay_drives(data: dict[str, Any], drives: dict[int, Any], where: str) -> None:
    """Put the drive rows (place -> drive) after the drives the header knew, in place."""
    # The header holds the drives known when it was written; the rows, those begun since.
    known = data.get("drives", [])
    laid = dict(enumerate(known)) if isinstance(known, list) else {}
    laid.update(drives)
    if sorted(laid) != list(range(len(laid))):
        raise CorruptStoreError(where, f"the run's drives are not numbered 0 to {len(laid) - 1}")
    data["drives"] = [laid[place] for place in range(len(laid))]


def _header_data(
    header: str, counts: tuple[int, int, int, int], failures: str, loads: Loads, where: str
) -> dict[str, Any]:
    """The checkpoint's fields stored outside its rows: the header, the counts and the failures."""
    data = _decode(header, loads, where, "header")
    if not isinstance(data, dict):
        raise CorruptStoreError(where, "header is not an object")
    step_index, i, o, calls = counts
    data["step_index"] = step_index
    data["cost"] = {"input_tokens": i, "output_tokens": o, "llm_calls": calls}
    data["failures"] = _decode(failures, default_loads, where, "failures")
    return data


def decode_checkpoint(
    header: str,
    counts: tuple[int, int, int, int],
    failures: str,
    entries: Iterable[tuple[str, str, str]],
    loads: Loads,
    where: str,
    texts: OutputTexts | None = None,
) -> WorkflowCheckpoint:
    """The checkpoint stored as these rows (``entries`` in insertion order).

    ``texts``, when given, is seeded with each output's stored text, which
    the store's later saves reuse. Failures and usage are library-written
    JSON, read with :func:`default_loads` (no NaN or infinities).

    Raises :class:`CorruptStoreError` for text that does not decode and :class:`~ekit_core.
    CheckpointError` for data that is no checkpoint (both ``ValueError``), naming ``where``.
    """
    data = _header_data(header, counts, failures, loads, where)
    outputs: dict[str, Any] = {}
    usage: dict[str, Any] = {}
    timed: dict[str, dict[str, Any]] = {"durations": {}, "began": {}, "held": {}}
    skipped: dict[str, Any] = {}
    drives: dict[int, Any] = {}
    stored: dict[str, str] = {}
    for kind, name, value in entries:
        if kind == "output":
            outputs[name] = _decode(value, loads, where, f"output of step {name!r}")
            stored[name] = value
        elif kind == "skip":
            skipped[name] = _decode(value, default_loads, where, f"skip of step {name!r}")
        elif kind == "drive":
            if not name.isdigit():
                raise CorruptStoreError(where, f"drive row {name!r:.80} is not named by a place")
            drives[int(name)] = _decode(value, default_loads, where, f"drive {name}")
        else:
            spent = _decode(value, default_loads, where, f"usage of step {name!r}")
            if type(spent) is dict and "seconds" in spent:  # its duration: see the module
                timed["durations"][name] = spent.pop("seconds")
                for key in ("began", "held"):  # (when its attempt began; the limits that held it)
                    timed[key].update({name: spent.pop(key)} if key in spent else ())
                if spent == _NO_COUNTS:
                    continue  # timed, spent nothing: no usage entry
            usage[name] = spent
    data["outputs"], data["step_usage"] = outputs, usage
    data.update((k, table) for k, table in timed.items() if table)
    if drives:
        _lay_drives(data, drives, where)
    if skipped:
        # (A header may hold skips too: what this module wrote before they were rows.)
        written = data.get("skipped", {})
        data["skipped"] = {**written, **skipped} if isinstance(written, dict) else written
    try:
        checkpoint = WorkflowCheckpoint.from_dict(data)
    except ValueError as exc:
        exc.add_note(f"while loading {where}")
        raise
    if texts is not None:
        texts.seed(dict(checkpoint.outputs), stored)
    return checkpoint
