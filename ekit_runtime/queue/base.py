"""``RunQueue``: the one contract every run-queue backend keeps (SQLite, PostgreSQL), and what they share.

The caller's side submits, inspects, cancels and prunes runs; the worker's
side claims a run under a lease, saves checkpoints and renews the lease, and
finishes or releases the run. Every worker-side write takes the
:class:`~ekit_runtime.queue.records.Lease` it was granted and is refused with
:class:`~ekit_runtime.queue.records.LeaseLostError`, writing nothing, unless
that lease is still the run's live one: the check and the write are one
statement or one transaction. Which transitions are legal, and the claimable
and fencing conditions, are :mod:`ekit_runtime.queue.lifecycle`'s. The methods
are synchronous; the :class:`~ekit_runtime.queue.worker.Worker` calls them on
a thread of its own.

A backend subclasses :class:`RunQueue` and supplies the SQL of the abstract
methods. The checks here run before a statement is sent, so a bad argument or
an output that cannot be encoded is refused with a ``ValueError`` before the
database is touched; the rest turns the rows a statement read into records
(a checkpoint, the fleet's limits, a lease).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import re
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple, NoReturn, Self, TypeVar, cast

from ekit_core import TokenUsage, WorkflowCheckpoint
from ekit_core.human import Answer, Question
from ekit_core.human import answer as answer_checkpoint
from ekit_core.human import questions as pending_questions
from ekit_core.progress import run_progress
from ekit_core.report import recorded_graph
from ekit_core.rewind import rewind as rewind_checkpoint
from ekit_core.usage import NO_USAGE
from ekit_runtime.child_runs import ChildState, child_run_of
from ekit_runtime.queue.lifecycle import (
    ABANDONED,
    FINAL,
    HELD,
    IN_WINDOW,
    LEFT_WINDOW,
    LIVE,
    SLOT_HELD,
    abandoned_as,
    at_cap,
    at_start_rate,
    children_reason,
    follows,
    graph_change_allowed,
    held_status,
    join_status,
    reopen_refusal,
    slot_free,
    submitted_as,
    targets,
    usage_limited,
    usage_reason,
    usage_wait,
)
from ekit_runtime.queue.links import DESCENDANTS, FORGOTTEN_LINKS
from ekit_runtime.queue.options import check_run_options
from ekit_runtime.queue.records import (
    FINAL_STATUSES,
    InFlight,
    Lease,
    LeaseLostError,
    Limits,
    RunInfo,
    RunsPage,
    RunStateError,
    RunStatus,
    UnknownRunError,
    check_age,
    check_count,
    check_lease_seconds,
    check_priority,
    check_run_id,
    check_seconds,
    check_status,
    check_step_name,
    check_text,
    check_workflow_name,
)
from ekit_runtime.queue.streams import (
    KINDS,
    READ_LIMIT,
    Published,
    StreamEvent,
    StreamPage,
    StreamRows,
    check_cap,
    check_read,
    page_of,
)
from ekit_runtime.step import unstorable_resource
from ekit_runtime.stores.codec import Dumps, Loads, default_dumps, encode_text
from ekit_runtime.stores.errors import UnencodableError
from ekit_runtime.stores.rows import EncodedCheckpoint, decode_checkpoint, encode_checkpoint
from ekit_runtime.workflow import WorkflowResult

__all__ = [
    "Doing",
    "Ending",
    "More",
    "Prepared",
    "RunQueue",
    "Submission",
    "Writes",
    "Written",
    "check_one_per_run",
    "claim_limit",
    "finish_alone",
    "handed_over",
    "layout_before",
    "progress",
    "queued_reason",
    "save_alone",
    "schema_columns",
    "schema_problem",
]


class Submission:
    """A checked ``submit``: the run id (given or new), workflow, encoded context, priority, options."""

    __slots__ = ("context", "options", "priority", "run_id", "workflow")

    def __init__(
        self,
        workflow: object,
        context: Mapping[str, Any] | None,
        run_id: object,
        priority: object,
        dumps: Dumps,
        options: object = None,
    ) -> None:
        self.workflow = check_workflow_name(workflow)
        self.run_id = uuid.uuid4().hex if run_id is None else check_run_id(run_id)
        self.priority = check_priority(priority)
        self.options = default_dumps(check_run_options(options))
        ctx = {} if context is None else context
        if not isinstance(ctx, Mapping) or not all(isinstance(k, str) for k in ctx):
            raise ValueError("context must be a mapping with string keys or None")
        try:
            text = encode_text(dict(ctx), dumps, (), ctx)
        except UnencodableError as exc:
            if "context" in str(exc):
                raise
            # The codec's own words name "the checkpoint": it is the context being encoded here.
            raise UnencodableError(f"cannot encode the context: {exc}") from None
        self.context = _storable(text, "the encoded context")


Doing = Mapping[str, tuple[int, Mapping[str, tuple[float, int]]]]
"""What a worker runs now, as it announces it: ``run id -> (epoch, {name: (began, attempt)})``."""


def _doing_text(doing: Doing) -> str:
    """``doing`` as the JSON a worker's row holds (see :meth:`RunQueue.in_flight`)."""
    try:
        return default_dumps({
            check_run_id(run_id): [int(epoch), {str(n): [float(t), int(a)] for n, (t, a) in attempts.items()}]
            for run_id, (epoch, attempts) in doing.items()
        })
    except (TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"doing must map run ids to (epoch, {{name: (began, attempt)}}): {exc}") from None


def _storable(text: str, what: str, step: str | None = None) -> str:
    """``text`` unless it holds a NUL, which PostgreSQL text cannot (refused on SQLite too, alike)."""
    if "\x00" in text:
        raise UnencodableError(
            f"{what} holds a NUL character, which the queue cannot store; nothing was saved", step=step
        )
    return text


def _storable_output(step: str, text: str) -> None:
    """:func:`_storable` of a step's encoded output, its message made only to refuse (every save runs it)."""
    if "\x00" in text:
        _storable(text, f"the encoded output of step {step!r}", step)


def _storable_rows(encoded: EncodedCheckpoint) -> EncodedCheckpoint:
    """``encoded``, once every output and its header are known to be storable (else an error)."""
    for _kind, name, value in encoded.rows:
        _storable_output(name, value)
    header = encoded.header if encoded.header is not None else encoded.recount
    if header is not None:
        _storable(header, "the encoded checkpoint")
    return encoded


def _check_step_names(checkpoint: WorkflowCheckpoint) -> None:
    """Refuse a checkpoint naming a step the queue cannot store, naming that step."""
    if not isinstance(checkpoint, WorkflowCheckpoint):
        return  # encode_checkpoint says what it is instead
    graph = checkpoint.graph if checkpoint.graph is not None else {}
    _check_names({*checkpoint.outputs, *checkpoint.step_usage, *checkpoint.failures, *graph})


# Step names already found storable. The check depends on the name alone,
# and a fleet's saves repeat their workflows' names, so the usual save checks
# none. Bounded (a run's mapped items may each be a new name): emptied when
# full, and only names of up to _STORABLE_NAME_CHARS characters kept, so
# that it holds at most about a megabyte.
_STORABLE_NAMES: set[str] = set()
_STORABLE_NAMES_MAX = 8192
_STORABLE_NAME_CHARS = 100


def _check_names(names: Iterable[str]) -> None:
    known = _STORABLE_NAMES
    for name in names:
        if type(name) is str and name in known:  # (a str subclass could lie about equality)
            continue
        try:
            check_step_name(name)
        except ValueError as exc:
            raise UnencodableError(f"{exc}; nothing was saved", step=name) from None
        if type(name) is str and len(name) <= _STORABLE_NAME_CHARS:
            if len(known) >= _STORABLE_NAMES_MAX:
                known.clear()
            known.add(name)


def _step_list(steps: object, verb: str) -> list[str]:
    """``steps`` as a list of step names (one string is one name), refused before the database is touched."""
    if isinstance(steps, str):
        return [check_text(steps, "step name", limit=1000)]
    if isinstance(steps, bytes | bytearray) or not isinstance(steps, Iterable):
        raise ValueError(
            f"{verb}: steps must be a step name or an iterable of step names, got {type(steps).__name__}"
        )
    names = list(steps)
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"{verb}: steps must hold step names (strings), got {name!r:.100}")
        check_text(name, "step name", limit=1000)
    return list(dict.fromkeys(names))


def _error_text(error: object) -> str | None:
    """A run's error message as the queue can store it: a NUL or lone surrogate is escaped, not refused."""
    if error is None:
        return None
    if not isinstance(error, str):
        raise ValueError(f"error must be a string or None, got {type(error).__name__}")
    # A failed run's message comes from an exception: refusing it would leave the run unfinished.
    text = error.encode("utf-8", "backslashreplace").decode("utf-8")
    return text.replace("\x00", "\\x00")


def schema_columns(schema: str) -> dict[str, set[str]]:
    """Each table a ``CREATE TABLE`` of ``schema`` makes, and the names of its columns."""
    tables: dict[str, set[str]] = {}
    for match in re.finditer(
        r"CREATE TABLE IF NOT EXISTS (\w+) \((.*?)\)(?: WITHOUT ROWID| WITH \([^)]*\))?;", schema, re.S
    ):
        body = re.sub(r"PRIMARY KEY \([^)]*\)", "", match.group(2))
        tables[match.group(1)] = {p.split()[0] for p in body.split(",") if p.strip()}
    return tables


def schema_problem(expected: dict[str, set[str]], found: dict[str, set[str]]) -> str | None:
    """What keeps the tables ``found`` (table -> its columns) from being the queue's, or ``None``."""
    for table, columns in expected.items():
        missing = sorted(columns - found.get(table, set()))
        if missing:
            return (
                f"table {table} lacks column(s) {', '.join(missing)}: not a run-queue database "
                "(or one of another ekit version); use another database"
            )
    return None


def layout_before(
    expected: dict[str, set[str]], added: Mapping[str, Mapping[str, str]], new_tables: Sequence[str]
) -> dict[str, set[str]]:
    """The tables and columns of the previous release's layout: ``expected`` less what came after.

    ``added`` maps a table to the columns (name -> SQL type) this version
    added to it; ``new_tables`` are the tables it added whole. A database
    holding that layout is brought up to date on open, never one missing more.
    """
    return {
        table: columns - set(added.get(table, {}))
        for table, columns in expected.items()
        if table not in new_tables
    }


def progress(checkpoint: WorkflowCheckpoint) -> tuple[int, int | None]:
    """``(steps done, steps in all)`` of a checkpoint: :func:`ekit_core.progress.run_progress`'s
    ``done`` and ``total`` (the one definition: the worker's log and the printer agree with it)."""
    counted = run_progress(checkpoint)
    return counted.done, counted.total


def queued_reason(
    workflow: str,
    fingerprint: str | None,
    served: Mapping[str, set[str | None]],
    *,
    graph_change: bool = False,
) -> str | None:
    """Why a queued run waits, from what the live workers serve (workflow -> their fingerprints).

    ``graph_change``: the run's options allow any version of its workflow to resume it.
    """
    versions = served.get(workflow)
    if versions is None:
        return f"no worker has workflow {workflow}"
    if not graph_change and fingerprint is not None and fingerprint not in versions:
        return f"no worker has this version of workflow {workflow} (graph fingerprint {fingerprint[:19]})"
    return None


More = Callable[[int], Sequence[tuple[Lease, WorkflowCheckpoint]]]
"""``save_many``'s ``more``: called with how many saves may still join, returns those that do."""


def claim_limit(limit: object, name: str = "limit") -> int:
    """``claim_many``'s ``limit``: a whole number from 1 to 10,000 (a worker's free places,
    so a ``Worker``'s ``max_runs`` too, checked where it is given)."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 10_000:
        raise ValueError(f"{name} must be a whole number from 1 to 10000, got {limit!r:.80}")
    return limit


T = TypeVar("T")


def handed_over(
    rows: Sequence[T],
    grant: Callable[[T], Lease],
    give_back: Callable[[Sequence[T]], None],
) -> list[Lease]:
    """The leases of the runs one claim statement leased (``rows``), each made by ``grant``.

    The statement has committed every lease already: if making one fails (a
    run's stored context or checkpoint cannot be read, the session dropped
    while reading it), the runs from that one on are given back at once
    (``give_back``, best effort: else their leases run out), and the call ends
    with the leases made before it, or with the error if there are none, so
    that no committed lease is left to nobody.
    """
    leases: list[Lease] = []
    for i, row in enumerate(rows):
        try:
            leases.append(grant(row))
        except Exception:
            with contextlib.suppress(Exception):
                give_back(rows[i:])
            if not leases:
                raise
            break
    return leases


class Ending(NamedTuple):
    """A run's end as :meth:`RunQueue.write_many` takes it: what :meth:`RunQueue.finish` is given."""

    lease: Lease
    status: RunStatus
    error: str | None = None


def check_one_per_run(
    saves: Sequence[tuple[Lease, WorkflowCheckpoint]], endings: Sequence[Ending] = ()
) -> None:
    """Refuse a :meth:`RunQueue.write_many` that holds two writes of one run (their order would matter)."""
    seen: set[str] = set()
    for i, item in enumerate(saves):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], Lease)):
            raise ValueError(f"saves[{i}] must be a (Lease, WorkflowCheckpoint) pair")
        run_id = item[0].run_id
        if run_id in seen:
            raise ValueError(f"saves holds two saves of run {run_id!r}; save the later in a call of its own")
        seen.add(run_id)
    for i, end in enumerate(endings):
        if not (isinstance(end, Ending) and isinstance(end.lease, Lease)):
            raise ValueError(f"endings[{i}] must be an Ending of a Lease")
        if end.lease.run_id in seen:
            raise ValueError(
                f"run {end.lease.run_id!r} has two writes in one call; end it in a call of its own"
            )
        seen.add(end.lease.run_id)


def save_alone(
    queue: RunQueue, lease: Lease, checkpoint: WorkflowCheckpoint, lease_seconds: float
) -> bool | Exception:
    """One save's outcome in ``save_many``'s terms: what ``queue.save`` returned, or what it raised.

    A function of the queue, not a method: ``RunQueue.save_many`` borrowed by
    a wrapper that delegates the rest (a test's fault injection) reaches the
    wrapper's own ``save``.
    """
    try:
        return queue.save(lease, checkpoint, lease_seconds)
    except Exception as exc:
        return exc


def finish_alone(queue: RunQueue, end: Ending) -> Exception | None:
    """One ending's outcome in ``write_many``'s terms: ``None`` once ended, or what ``finish`` raised."""
    try:
        queue.finish(end.lease, end.status, end.error)
    except Exception as exc:
        return exc
    return None


Prepared = tuple[Lease, WorkflowCheckpoint, EncodedCheckpoint, TokenUsage]
"""A save ready to be written: its lease, its checkpoint, its rows, the usage it adds to the window."""

Written = tuple[int, "Prepared | Ending"]
"""A write of a batch with its place among the batch's saves (or endings): what a statement writes."""


class Writes:
    """A worker's saves and endings on their way to one statement, and each one's outcome.

    Both backends' :meth:`RunQueue.write_many` (and the PostgreSQL worker's
    loop session) fill one: the endings are checked when it is made, the
    saves prepared (:meth:`take`) as they come, and each write is then told
    what the statement did (:meth:`told`) or, if the statement failed as a
    whole, made again alone (:meth:`failed`). ``saved`` and ``ended`` hold the
    outcomes in ``write_many``'s terms.
    """

    __slots__ = ("ended", "ends", "lease_seconds", "queue", "saved")

    def __init__(self, queue: RunQueue, endings: Sequence[Ending], lease_seconds: float) -> None:
        self.queue, self.lease_seconds = queue, lease_seconds
        self.saved: list[bool | Exception] = []
        self.ended: list[Exception | None] = [None] * len(endings)
        self.ends: list[Written] = []
        for j, end in enumerate(endings):
            try:
                self.ends.append((j, Ending(end.lease, end.status, queue._final(end.status, end.error))))
            except Exception as exc:  # (a status that is not final: this ending's alone)
                self.ended[j] = exc

    def take(self, saves: Iterable[tuple[Lease, WorkflowCheckpoint]], into: list[Written]) -> None:
        """Prepare ``saves`` into ``into``, each with its place in ``saved`` (an error: its outcome)."""
        saved, prepare = self.saved, self.queue._prepare_save
        for lease, checkpoint in saves:
            saved.append(False)  # (told once written)
            try:
                into.append((len(saved) - 1, (lease, checkpoint, *prepare(lease, checkpoint))))
            except Exception as exc:  # (an output that cannot be encoded: this save's alone)
                saved[-1] = exc

    def told(self, rows: Sequence[Written], said: Sequence[bool | None]) -> None:
        """The outcomes of a statement that was made: each row's cancel flag (an ending's
        ``False``) or ``None`` where its lease was no longer held (nothing written for it)."""
        queue, saved, ended = self.queue, self.saved, self.ended
        for (i, row), flag in zip(rows, said, strict=False):
            lease = row[0]
            if isinstance(row, Ending):
                queue._forget(lease.run_id)  # (ended, or another holder's now)
                if flag is None:
                    ended[i] = LeaseLostError(lease.run_id, lease.epoch)
            elif flag is None:
                queue._forget(lease.run_id)
                saved[i] = LeaseLostError(lease.run_id, lease.epoch)
            else:
                queue._remember(lease, row[1])
                saved[i] = flag

    def failed(self, rows: Sequence[Written], exc: Exception, transient: bool) -> None:
        """The outcomes of a statement that failed as a whole (it wrote nothing).

        ``transient`` (SQLite's lock held past the timeout, a full disk): each
        write alone would meet the same, so each gets its own copy of the
        error. Else perhaps one write's own (a value too big, a dropped
        session): made again alone, each raises its own error or goes through.
        """
        queue = self.queue
        for i, row in rows:
            if isinstance(row, Ending):
                self.ended[i] = copy.copy(exc) if transient else finish_alone(queue, row)
            else:
                self.saved[i] = copy.copy(exc) if transient else save_alone(
                    queue, row[0], row[1], self.lease_seconds)


# Statements written once (``:name``: see RunQueue._q).
_RENDERED: dict[tuple[type, str], str] = {}
_PLACEHOLDER = re.compile(r"(?<![:\w]):([a-z_]\w*)")
_SERVED = "SELECT workflows FROM ekit_queue_workers WHERE until > :now"
# (Two subqueries: SQLite reads a min() or a max() off the index only when it is the query's one aggregate.)
_STREAM_BOUNDS = (
    "SELECT (SELECT min(pos) FROM ekit_queue_stream WHERE run_id = :run_id), "
    "(SELECT coalesce(max(pos), 0) FROM ekit_queue_stream WHERE run_id = :run_id)"
)
_STREAM_PAGE = (
    "SELECT pos, kind, step, data, epoch, at FROM ekit_queue_stream "
    "WHERE run_id = :run_id AND pos > :after ORDER BY pos LIMIT :limit"
)
_SLOT_READ = (
    f"SELECT EXISTS (SELECT 1 FROM ekit_queue_runs WHERE {HELD}), "
    f"(SELECT count(*) FROM ekit_queue_slots AS s WHERE s.resource = :resource AND {SLOT_HELD}), "
    "(SELECT value FROM ekit_queue_config WHERE key = 'limits')"
)
_SLOT_SWEEP = f"DELETE FROM ekit_queue_slots AS s WHERE s.resource = :resource AND NOT {SLOT_HELD}"
_SLOT_TAKE = (
    "INSERT INTO ekit_queue_slots (resource, holder, run_id, epoch, at) "
    "VALUES (:resource, :holder, :run_id, :epoch, :now)"
)
_ANNOUNCE = (
    "INSERT INTO ekit_queue_workers (name, workflows, last_seen, until, doing) "
    "VALUES (:name, :workflows, :now, :now + :ttl, :doing) ON CONFLICT (name) DO UPDATE SET "
    "workflows = excluded.workflows, last_seen = excluded.last_seen, until = excluded.until, "
    "doing = excluded.doing"
)


class RunQueue(ABC):
    """What a worker and a caller need from a queue backend (see the module docstring).

    The abstract methods are each backend's; the rest is bookkeeping they
    share: codec, lock, and the last save of each lease.

    ``_saved`` maps a run id to the epoch this object holds it at, the
    checkpoint it last stored (so that the next save writes only a delta) and
    the usage already counted in the fleet's window for it.
    """

    def __init__(self, *, dumps: Dumps | None, loads: Loads | None) -> None:
        self.dumps: Dumps = dumps if dumps is not None else default_dumps
        self.loads: Loads = loads if loads is not None else json.loads
        self._lock = threading.RLock()
        # What a save and a batch of writes hold (PostgreSQL: its connection's lock).
        self._write_lock: Any = self._lock
        self._saved: dict[str, tuple[int, WorkflowCheckpoint | None, TokenUsage]] = {}

    def _submission(
        self,
        workflow: object,
        context: Mapping[str, Any] | None,
        run_id: object,
        priority: object,
        options: object = None,
    ) -> Submission:
        return Submission(workflow, context, run_id, priority, self.dumps, options)

    def _previous(self, lease: Lease) -> WorkflowCheckpoint | None:
        """The checkpoint this object last stored under ``lease`` (else the one it was granted with)."""
        entry = self._saved.get(lease.run_id)
        return entry[1] if entry is not None and entry[0] == lease.epoch else lease.checkpoint

    def _counted(self, lease: Lease) -> TokenUsage:
        """The run's usage already in the fleet's window, as far as this object knows."""
        entry = self._saved.get(lease.run_id)
        if entry is not None and entry[0] == lease.epoch:
            return entry[2]
        return lease.checkpoint.cost if lease.checkpoint is not None else NO_USAGE

    def _encode(self, lease: Lease, checkpoint: WorkflowCheckpoint) -> EncodedCheckpoint:
        """The rows a save under ``lease`` writes: a delta on what this lease stored last."""
        if not isinstance(lease, Lease):
            raise ValueError(f"lease must be a Lease, got {type(lease).__name__}")
        previous = self._previous(lease)
        if previous is None:
            _check_step_names(checkpoint)
        # Compacting: a loop that lets go of old iterations (keep_last) saves a delta that
        # deletes their rows (``gone``) and writes the header again (``recount``), not the run.
        # Drive rows: the first save after a claim appends the new drive as a row of its own.
        encoded = encode_checkpoint(checkpoint, previous, self.dumps, compacting=True, drive_rows=True)
        if previous is not None:
            if encoded.full:
                _check_step_names(checkpoint)
            else:
                # A delta: the names stored before were checked when they were
                # written, so only the new ones are (O(the step), not O(the run)).
                _check_names(name for _kind, name, _value in encoded.rows)
                if checkpoint.failures:
                    _check_names(checkpoint.failures)
        return _storable_rows(encoded)

    def _prepare_save(
        self, lease: Lease, checkpoint: WorkflowCheckpoint
    ) -> tuple[EncodedCheckpoint, TokenUsage]:
        """The rows a save writes and the usage it adds to the fleet's rate window."""
        encoded = self._encode(lease, checkpoint)
        counted = self._counted(lease)
        cost = checkpoint.cost
        added = NO_USAGE if cost is counted or cost == counted else cost - counted
        # What is stored is unknown until the write commits: if it fails (a
        # dropped session, a full disk), the next save is in full. The usage
        # counted stays, so a retried save does not count the whole run again.
        self._saved[lease.run_id] = (lease.epoch, None, counted)
        return encoded, added

    def _remember(self, lease: Lease, checkpoint: WorkflowCheckpoint | None) -> None:
        cost = checkpoint.cost if checkpoint is not None else NO_USAGE
        self._saved[lease.run_id] = (lease.epoch, checkpoint, cost)

    def _forget(self, run_id: str) -> None:
        self._saved.pop(run_id, None)

    def _lost(self, lease: Lease) -> NoReturn:
        """A fenced write matched no row: forget the lease's last save and refuse."""
        self._forget(lease.run_id)
        raise LeaseLostError(lease.run_id, lease.epoch)

    def _granted(
        self,
        run_id: str,
        epoch: int,
        workflow: str,
        context: str,
        checkpoint: WorkflowCheckpoint | None,
        until: float,
        options: str = "{}",
        limits: Limits | None = None,
    ) -> Lease:
        """The lease a claim read, remembered as holding ``checkpoint``."""
        lease = Lease(
            run_id, epoch, workflow, self._context(context), checkpoint, until,
            options=self._options(options), limits=limits,
        )
        self._remember(lease, checkpoint)
        return lease

    # -- what RunInfo reads besides the run's own columns (options, progress, cost, reason)

    @staticmethod
    def _options(text: str | None) -> MappingProxyType[str, Any]:
        """Stored run options, checked again (a row edited by hand is refused, naming the option)."""
        data = json.loads(text) if text else {}
        return MappingProxyType(check_run_options(data, "the stored options"))

    def _run_info(self, row: Sequence[Any], served: Mapping[str, set[str | None]]) -> RunInfo:
        """A :class:`RunInfo` from a row of the backend's ``_INFO`` columns and what live workers serve."""
        (run_id, workflow, status, priority, epoch, owner, until, cancel, error, created, updated, fp,
         options, done, total, input_tokens, output_tokens, calls, reason) = row
        if status == "queued":
            reason = queued_reason(workflow, fp, served, graph_change=graph_change_allowed(options))
        elif status in FINAL_STATUSES:
            reason = None
        return RunInfo(
            run_id, workflow, status, priority, epoch, owner, until, bool(cancel), error, created,
            updated, fp, self._options(options), done, total,
            TokenUsage(input_tokens, output_tokens, calls), reason,
        )

    def _served(self, rows: Sequence[Sequence[Any]]) -> dict[str, set[str | None]]:
        """``workflow -> fingerprints`` from the live workers' rows (each a JSON map of the two)."""
        served: dict[str, set[str | None]] = {}
        for (text,) in rows:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                for name, fp in json.loads(text).items():
                    served.setdefault(name, set()).add(fp)
        return served

    @staticmethod
    def _presence(
        worker: object, workflows: Mapping[str, str | None], seconds: float, doing: Doing | None = None
    ) -> tuple[str, str, float, str | None]:
        """A checked :meth:`announce`: the worker's name, its workflows and what it runs as JSON, how long."""
        names = RunQueue._workflows(workflows)
        return (
            RunQueue._worker_name(worker),
            default_dumps(dict(names)),
            check_seconds(seconds, "seconds"),
            None if not doing else _doing_text(doing),
        )

    def in_flight(self, run_id: str) -> dict[str, InFlight]:
        """The attempts of ``run_id`` that a live worker said it runs now: name -> :class:`InFlight`.

        Read from the workers' announcements (at most a second old), only
        those made under the run's current lease: empty for a run that is not
        running, and for a step held back before its work began (a limit, a
        resource's slot). For people watching (the dashboard), never for
        recovery: the lease is what says who drives a run. An unknown run is
        an :class:`UnknownRunError`, as for :meth:`status`.
        """
        info = self.status(run_id)
        if info.status != "running":
            return {}
        found: dict[str, InFlight] = {}
        for worker, text in self._doing_rows():
            # Advisory and written by other processes: a row that does not parse is passed over.
            with contextlib.suppress(ValueError, TypeError, AttributeError, IndexError):
                epoch, attempts = json.loads(text).get(run_id, (None, {}))
                if epoch != info.epoch:
                    continue
                for name, (since, attempt) in attempts.items():
                    found[name] = InFlight(str(name), int(attempt), str(worker), float(since))
        return found

    @staticmethod
    def _reason_text(reason: object) -> str | None:
        return None if reason is None else check_text(reason, "reason", limit=500)

    def _decode_run(
        self,
        row: Sequence[Any] | None,
        run_id: str,
        entries: Callable[[], list[tuple[str, str, str]]],
        where: str,
        *,
        missing_ok: bool,
    ) -> WorkflowCheckpoint | None:
        """The checkpoint of a run row (header, four counts, failures) and its ``entries()``."""
        if row is None:
            if missing_ok:
                return None
            raise UnknownRunError(run_id)
        if row[0] is None:
            return None
        return decode_checkpoint(row[0], tuple(row[1:5]), row[5], entries(), self.loads, where)

    def result(self, run_id: str) -> WorkflowResult | None:
        """The outputs and cost of a finished run; ``None`` until it has finished.

        A failed or cancelled run has no result: its :meth:`status` says why.
        """
        info = self.status(run_id)
        checkpoint = self.checkpoint(run_id) if info.status == "finished" else None
        if checkpoint is None:
            return None
        return WorkflowResult(checkpoint.outputs, checkpoint.cost, checkpoint)

    @staticmethod
    def _limits_text(limits: Limits) -> str:
        """``limits`` as stored in the config row (refused unless a :class:`Limits`)."""
        if not isinstance(limits, Limits):
            raise ValueError(f"limits must be a Limits, got {type(limits).__name__}")
        return default_dumps(limits.to_dict())

    def _limits_from(self, row: Sequence[Any] | None) -> Limits:
        return Limits() if row is None else Limits.from_dict(self.loads(row[0]))

    @staticmethod
    def _final(status: RunStatus, error: str | None) -> str | None:
        """``error`` as stored, once ``status`` is one the table lets a holder's ``finish`` write."""
        allowed = targets("finish", "running")
        if status not in allowed:
            names = ", ".join(s for s in ("finished", "failed", "cancelled") if s in allowed)
            raise ValueError(f"status must be one of {names}; got {status!r}")
        return _error_text(error)

    @staticmethod
    def _worker_name(worker: object) -> str:
        return check_text(str(worker), "worker", limit=200)

    @staticmethod
    def _uses(added: TokenUsage) -> bool:
        """Whether a save adds calls or tokens to the fleet's usage window."""
        # (Identity first: a save of a step that reported no usage adds NO_USAGE.)
        return added is not NO_USAGE and (added.llm_calls > 0 or added.total_tokens > 0)

    # -- a person's verbs: reopen a run (retry, rewind), or copy it (fork) ---

    def retry(self, run_id: str) -> RunInfo:
        """Queue a failed or cancelled run again, from its last checkpoint; return its record.

        The run resumes where it stopped: what finished stays finished, and
        attempt numbers carry on (the checkpoint records the failed attempts,
        so a failed step's next attempt is one more than its last). The error
        and the cancel flag are cleared and the epoch goes up by one, fencing
        out any worker that still believes it holds the run. A run that is
        queued, running or finished is refused with :class:`RunStateError`
        (a ``ValueError``) naming the run and its status; nothing is written.
        """
        return self._reopen(check_run_id(run_id), "retry", None)[0]

    def rewind(self, run_id: str, steps: str | Iterable[str]) -> WorkflowCheckpoint:
        """Drop the outputs of ``steps`` and everything downstream from the run's checkpoint, in place.

        The rule is :func:`ekit_core.rewind`'s (``ekit rewind``'s), on the
        graph the checkpoint records; ``steps`` is one step name or several
        (items of a mapped step as ``step[key]``). The run goes back to
        ``queued`` with its epoch + 1, its error and cancel flag cleared, and
        the next worker to claim it runs exactly those steps and their
        dependents. Any run no live lease holds is rewound (queued, finished,
        failed, cancelled, or running with an expired lease); a run a worker
        is driving is refused (:class:`RunStateError`: cancel it first), and
        so is a write that meets a claim or another person's write made since
        this call read the run: one transaction, fenced on the epoch it read.
        Returns the checkpoint as now stored. An unknown step is a
        ``ValueError`` naming it; nothing is written.
        """
        rid = check_run_id(run_id)
        names = _step_list(steps, "rewind")
        if not names:
            raise ValueError("rewind: steps must name at least one step")

        def rewound(status: str, checkpoint: WorkflowCheckpoint | None) -> WorkflowCheckpoint:
            return self._rewound(rid, status, checkpoint, names, "rewind")

        checkpoint = self._reopen(rid, "rewind", rewound)[1]
        assert checkpoint is not None
        return checkpoint

    def fork(
        self,
        run_id: str,
        steps: str | Iterable[str] = (),
        *,
        new_run_id: str | None = None,
        priority: int | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> str:
        """Queue a copy of the run under a new id, its checkpoint rewound at ``steps``; return the new id.

        The copy has the source's workflow, context, run options (or
        ``options``, checked as :meth:`submit` checks them: ``{}`` for none,
        such as a copy without the source's ``only`` that runs the rest) and
        priority (or ``priority``) and its latest checkpoint, without the
        outputs of ``steps`` and of everything downstream of them (none
        given: all of it); it is ``queued`` at epoch 0. The source is only
        read, whatever its status. ``new_run_id`` defaults to a new random
        id; one the queue already has is a ``ValueError`` (nothing is written).
        """
        source = check_run_id(run_id)
        new = uuid.uuid4().hex if new_run_id is None else check_run_id(new_run_id, "new_run_id")
        level = None if priority is None else check_priority(priority)
        names = _step_list(steps, "fork")
        stored = None if options is None else default_dumps(check_run_options(options))

        def copied(status: str, checkpoint: WorkflowCheckpoint | None) -> WorkflowCheckpoint | None:
            if not names:
                return checkpoint
            rewound = self._rewound(source, status, checkpoint, names, "fork")
            assert checkpoint is not None  # (_rewound refuses a run without one)
            # A copy under a new id: its keys are its own already, so it counts as the source did.
            return dataclasses.replace(rewound, redone=checkpoint.redone)

        self._fork(source, new, level, copied, stored)
        return new

    # -- a person's answers to a run that waits (status ``waiting``) --------

    def questions(self, run_id: str) -> Mapping[str, Question]:
        """The questions the run's steps wait on, step (or item ``step[key]``) -> question.

        Empty when none waits. Read from its latest checkpoint (the run's
        ``RunInfo.reason`` names the step without decoding it).
        """
        checkpoint = self.checkpoint(run_id)
        return MappingProxyType({}) if checkpoint is None else pending_questions(checkpoint)

    def answer(self, run_id: str, step: str, value: Any, *, by: str | None = None) -> RunInfo:
        """Answer the question ``step`` of a waiting run asked with ``value``; return its record.

        One transaction: the answer is recorded in the run's checkpoint (with
        ``by``, who answered, and the time; audit shows them), and the run is
        queued again (epoch + 1), so the next worker to claim it resumes it
        and the step's ``ask`` returns ``value``. Refused, writing nothing,
        with :class:`RunStateError` (a ``ValueError`` naming the run and the
        step): the run is not waiting, ``step`` has no question pending, the
        question is an approval (:meth:`approve`, :meth:`deny`), or someone
        answered (or cancelled, or rewound it) since this call read it: of
        two people answering at once, exactly one wins. ``value`` must be
        what the queue's ``dumps`` encodes (JSON by default).
        """
        return self._answer(run_id, step, "answer", lambda who, at: Answer(value, by=who, at=at), by, value)

    def approve(self, run_id: str, step: str, *, by: str | None = None) -> RunInfo:
        """Approve the approval ``step`` of a waiting run asked for; see :meth:`answer`.

        The resumed step's ``approve(...)`` returns and the step goes on.
        """
        return self._answer(run_id, step, "approve", lambda who, at: Answer.approve(by=who, at=at), by)

    def deny(self, run_id: str, step: str, reason: str = "", *, by: str | None = None) -> RunInfo:
        """Deny the approval ``step`` of a waiting run asked for, saying why; see :meth:`answer`.

        The next worker to claim the run ends it at once: ``failed``, its
        error ``ApprovalDenied: step 'S' was denied approval: REASON``; the
        step never runs (rewind it to ask again).
        """
        why = "" if reason == "" else check_text(reason, "reason", limit=2000)
        return self._answer(run_id, step, "deny", lambda who, at: Answer.deny(why, by=who, at=at), by)

    def _answer(
        self,
        run_id: str,
        step: str,
        verb: str,
        make: Callable[[str, float], Answer],
        by: str | None,
        value: Any = None,
    ) -> RunInfo:
        rid = check_run_id(run_id)
        name = check_step_name(step)
        who = "" if by is None else check_text(by, "by", limit=200)
        if verb == "answer":
            try:
                text = encode_text(value, self.dumps, ())
            except UnencodableError as exc:
                message = f"cannot encode the answer to step {name!r}: {exc}"
                raise UnencodableError(message, step=name) from None
            _storable(text, f"the encoded answer to step {name!r}", name)
        given = make(who, time.time())

        def answered(status: str, checkpoint: WorkflowCheckpoint | None) -> WorkflowCheckpoint:
            if checkpoint is None:
                problem = "it has no checkpoint: no question to answer"
                raise RunStateError(rid, status, verb, problem, step=name)
            asked = pending_questions(checkpoint).get(name)
            child = None if asked is None else child_run_of(asked.details)
            if child is not None:
                problem = f"step {name!r} waits for its child run {child!r}, not for a person"
                raise RunStateError(rid, status, verb, problem, step=name)
            try:
                return answer_checkpoint(checkpoint, name, given)
            except ValueError as exc:
                raise RunStateError(rid, status, verb, str(exc), step=name) from None

        return self._reopen(rid, verb, answered, step=name)[0]

    def _rewound(
        self, run_id: str, status: str, checkpoint: WorkflowCheckpoint | None, names: list[str], verb: str
    ) -> WorkflowCheckpoint:
        """``checkpoint`` rewound at ``names`` on the graph it records, or refused naming the run."""
        if checkpoint is None:
            problem = f"it is {status} and has no checkpoint yet: no step to rewind"
            raise RunStateError(run_id, status, verb, problem)
        try:
            graph = recorded_graph(checkpoint)
        except ValueError as exc:
            problem = f"its checkpoint records no usable graph ({exc})"
            raise RunStateError(run_id, status, verb, problem) from None
        try:
            return rewind_checkpoint(graph, checkpoint, names)
        except ValueError as exc:
            raise ValueError(f"cannot {verb} run {run_id!r}: {exc}") from None

    @staticmethod
    def _refuse_reopening(
        run_id: str, verb: str, status: str, lease_live: bool, step: str | None = None
    ) -> None:
        """Raise :class:`RunStateError` unless ``verb`` may reopen a run in ``status`` (lifecycle's rule)."""
        problem = reopen_refusal(verb, status, lease_live)
        if problem is not None:
            raise RunStateError(run_id, status, verb, problem, step=step)

    @staticmethod
    def _changed(run_id: str, status: str, verb: str, step: str | None = None) -> NoReturn:
        """A person's write met a claim or another write made since its read: refused."""
        raise RunStateError(
            run_id,
            status,
            verb,
            "it changed while this call read it (a worker claimed it, or someone else retried, "
            "rewound, answered or cancelled it); nothing was written: read its status and try again",
            step=step,
        )

    @staticmethod
    def _park_reason(reason: object) -> str:
        """A park's reason as stored: text, cut to the 500 characters a reason holds."""
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"reason must be a non-empty string, got {reason!r:.100}")
        text = reason if len(reason) <= 500 else reason[:497] + "..."
        return check_text(text.replace("\x00", "\\x00"), "reason", limit=500)

    def _fork_row(self, copy: WorkflowCheckpoint | None) -> tuple[EncodedCheckpoint | None, list[Any]]:
        """A fork's encoded checkpoint, and its header, fingerprint, four counts, failures and
        progress (steps done, in all) columns."""
        if copy is None:
            return None, [None, None, 0, 0, 0, 0, "{}", 0, None]
        enc = self._encode_whole(copy)
        return enc, [enc.header, copy.fingerprint, *enc.counts, enc.failures, *progress(copy)]

    @staticmethod
    def _taken(new_run_id: str) -> ValueError:
        return ValueError(f"new_run_id {new_run_id!r} is a run the queue already has; fork under another id")

    def _encode_whole(self, checkpoint: WorkflowCheckpoint) -> EncodedCheckpoint:
        """The rows of ``checkpoint`` written in full (a rewind, a fork), checked as a save checks them."""
        _check_step_names(checkpoint)
        encoded = encode_checkpoint(checkpoint, None, self.dumps)
        return _storable_rows(encoded)

    def _reopen(
        self,
        run_id: str,
        verb: str,
        change: Callable[[str, WorkflowCheckpoint | None], WorkflowCheckpoint] | None,
        *,
        step: str | None = None,
    ) -> tuple[RunInfo, WorkflowCheckpoint | None]:
        """Reopen the run in one transaction (``step``: the step a refusal names): read its
        status, epoch and lease; refuse what :meth:`_refuse_reopening` refuses; with ``change``,
        write ``change(status, checkpoint)`` in full; queue it at epoch + 1 (error, cancel
        flag, reason and lease cleared) under :data:`~ekit_runtime.queue.lifecycle.UNCHANGED`,
        else :meth:`_changed`. Returns the
        run's record after the write and the checkpoint written (``None`` without ``change``)."""

        def body(tx: Any) -> tuple[RunInfo, WorkflowCheckpoint | None]:
            found = self._reopen_read(tx, run_id)
            if found is None:
                raise UnknownRunError(run_id)
            status, epoch, lease_live = found
            self._refuse_reopening(run_id, verb, status, lease_live, step)
            if verb == "retry":
                self._retry_children(tx, run_id)
            written = None if change is None else change(status, self._load(tx, run_id, missing_ok=False))
            info = self._reopen_write(tx, run_id, epoch, written)
            if info is None:
                self._changed(run_id, status, verb, step)
            return info, written

        reopened = self._transaction(body)
        self._forget(run_id)
        return reopened

    def _retry_children(self, tx: Any, run_id: str) -> None:
        """Queue again, with the run a ``retry`` reopens, each of its child runs (and theirs) that
        failed or was cancelled: its parent's step waits for it again, and no step it recorded
        runs again. Those still going, or finished, are left as they are."""
        for child, _depth in tx.execute(self._q(DESCENDANTS), {"run_id": run_id}).fetchall():
            found = self._reopen_read(tx, child)
            if found is None or reopen_refusal("retry", found[0], found[2]) is not None:
                continue
            if self._reopen_write(tx, child, found[1], None) is None:
                self._changed(child, found[0], "retry")

    @abstractmethod
    def _load(self, tx: Any, run_id: str, *, missing_ok: bool) -> WorkflowCheckpoint | None:
        """The run's checkpoint as stored, read in ``tx``."""

    def _reopen_read(self, tx: Any, run_id: str) -> tuple[RunStatus, int, bool] | None:
        """The run's status, epoch and whether its lease is live (``None``: no such run)."""
        sql = self._q(f"SELECT status, epoch, {LIVE} FROM ekit_queue_runs WHERE run_id = :run_id")
        row = tx.execute(sql, {"run_id": run_id, "now": time.time()}).fetchone()
        return None if row is None else (row[0], int(row[1]), bool(row[2]))

    @abstractmethod
    def _reopen_write(
        self, tx: Any, run_id: str, epoch: int, written: WorkflowCheckpoint | None
    ) -> RunInfo | None:
        """Queue the run at ``epoch + 1`` if it still has ``epoch`` and no live lease (``UNCHANGED``),
        with ``written`` stored in full if given; its record after, or ``None`` (nothing written)."""

    def _fork(
        self,
        source: str,
        new_run_id: str,
        priority: int | None,
        change: Callable[[str, WorkflowCheckpoint | None], WorkflowCheckpoint | None],
        options: str | None = None,
    ) -> None:
        """In one transaction: read ``source`` and its checkpoint, and insert ``new_run_id`` (queued,
        epoch 0) with its workflow, context, options (or ``options``, stored text), priority
        (or ``priority``) and ``change(status, checkpoint)``; a ``ValueError`` if ``new_run_id`` exists."""

        def body(tx: Any) -> None:
            status = self._fork_read(tx, source, new_run_id)
            if status is None:
                raise UnknownRunError(source)
            enc, columns = self._fork_row(change(status, self._load(tx, source, missing_ok=False)))
            if not self._fork_write(tx, source, new_run_id, priority, options, enc, columns):
                raise self._taken(new_run_id)

        self._transaction(body)

    def _fork_read(self, tx: Any, source: str, new_run_id: str) -> RunStatus | None:
        """The source run's status (``None``: no such run); a taken ``new_run_id`` is told here,
        before the change is made (:meth:`_taken`)."""
        sql = self._q("SELECT status FROM ekit_queue_runs WHERE run_id = :run_id")
        row = tx.execute(sql, {"run_id": source}).fetchone()
        if row is None:
            return None
        if tx.execute(sql, {"run_id": new_run_id}).fetchone() is not None:
            raise self._taken(new_run_id)
        return cast(RunStatus, row[0])

    @abstractmethod
    def _fork_write(
        self,
        tx: Any,
        source: str,
        new_run_id: str,
        priority: int | None,
        options: str | None,
        enc: EncodedCheckpoint | None,
        columns: list[Any],
    ) -> bool:
        """Insert the fork's row, copied from ``source`` (``columns``: :meth:`_fork_row`'s), and its
        entries; ``False`` (nothing written) if ``new_run_id`` is taken."""

    # The contract: what each backend supplies.

    backend: str
    """The backend's name: ``"sqlite"`` or ``"postgres"``."""

    save_renews: float = 1.0
    """How much of the lease a made save leaves ahead, as a share of ``lease_seconds``.

    PostgreSQL renews the whole lease with every save (1.0). SQLite's usual
    save renews it only when less than half is left (0.5), so that it need
    not write the run's row (decision 015); a worker renews every heartbeat
    regardless. A caller driving a lease by hand renews it with :meth:`renew`.
    """

    def submit(
        self,
        workflow: str,
        context: Mapping[str, Any] | None = None,
        *,
        run_id: str | None = None,
        priority: int = 0,
        options: Mapping[str, Any] | None = None,
    ) -> str:
        """Queue a run of ``workflow`` and return its run id.

        With ``run_id`` the call is idempotent: submitting an id that is
        already queued (a retried submit) changes nothing and returns it; a
        different ``workflow`` for that id is a ``ValueError``. Higher
        ``priority`` runs are claimed first, then the oldest. ``options`` are
        the run's plain-data run options (:data:`~ekit_runtime.queue.options.RUN_OPTIONS`),
        stored with it and applied by the worker that drives it. The new run's
        status is the lifecycle table's (its ``submit`` row).
        """
        sub = self._submission(workflow, context, run_id, priority, options)
        status = submitted_as()
        stored_sql = self._q("SELECT workflow FROM ekit_queue_runs WHERE run_id = :run_id")

        def body(tx: Any) -> str:
            self._submit_write(tx, sub, status)
            stored = tx.execute(stored_sql, {"run_id": sub.run_id}).fetchone()[0]
            if stored != sub.workflow:
                raise ValueError(
                    f"run_id {sub.run_id!r} was already submitted for workflow {stored!r}, "
                    f"not {sub.workflow!r}"
                )
            return sub.run_id

        return self._transaction(body)

    @abstractmethod
    def _submit_write(self, tx: Any, sub: Submission, status: RunStatus) -> None:
        """Insert the run of ``sub`` in ``status`` unless its run id exists (then nothing)."""

    def status(self, run_id: str) -> RunInfo:
        """The run's record; :class:`UnknownRunError` (a ``LookupError``) if there is none."""
        check_run_id(run_id)
        where, args = "WHERE run_id = :run_id", {"run_id": run_id}
        rows, served = self._snapshot(lambda tx: self._infos(tx, where, args))
        if not rows:
            raise UnknownRunError(run_id)
        return self._run_info(rows[0], served)

    def runs(self, status: RunStatus | None = None) -> list[RunInfo]:
        """Every run, or those with ``status``, in submission order."""
        check_status(status)
        where = "WHERE status = :status" if status is not None else ""
        rows, served = self._snapshot(lambda tx: self._infos(tx, where, {"status": status}))
        return [self._run_info(r, served) for r in rows]

    def _infos(
        self, tx: Any, where: str, args: dict[str, Any]
    ) -> tuple[list[Any], dict[str, set[str | None]]]:
        """The rows of the runs ``where`` picks, in submission order, and what the live workers serve."""
        rows = tx.execute(self._q(self._info_sql(where)), args).fetchall()
        return rows, self._served(tx.execute(self._q(_SERVED), {"now": time.time()}).fetchall())

    @abstractmethod
    def _info_sql(self, where: str, order: str = "ASC", tail: str = "") -> str:
        """The SELECT of :meth:`_run_info`'s columns of the runs ``where`` picks, in ``seq`` ``order``
        (``tail``: what follows the order, a LIMIT)."""

    def checkpoint(self, run_id: str) -> WorkflowCheckpoint | None:
        """The run's latest saved checkpoint (one snapshot), ``None`` before its first save."""
        check_run_id(run_id)
        return self._snapshot(lambda tx: self._load(tx, run_id, missing_ok=False))

    # -- the verbs, each once: read the run, ask the lifecycle table, write ----
    #
    # A backend gives each verb its statements and its transaction (the
    # methods below the verb); what follows what is the table's
    # (ekit_runtime.queue.lifecycle), decided here for both.

    def cancel(self, run_id: str) -> bool:
        """Ask for the run to stop; ``False`` if it had already ended.

        A queued or waiting run (or one whose lease expired) is cancelled at
        once; a running one is flagged, and its worker stops it at its next
        heartbeat or save, saving a final checkpoint first. The run's child
        runs (and theirs) are cancelled alike, in the same transaction, even
        when the run itself had ended.
        """
        check_run_id(run_id)

        def body(tx: Any) -> bool:
            # Its child runs first, deepest first (their rows are locked before their parents',
            # as a child's end locks them): each by its own row of the table.
            for child, _depth in tx.execute(self._q(DESCENDANTS), {"run_id": run_id}).fetchall():
                below = self._cancel_read(tx, child)
                row = None if below is None else follows("cancel", *below)
                if below is not None and row is not None:
                    self._cancel_write(tx, child, None if row.target == below[0] else row.target)
            found = self._cancel_read(tx, run_id)
            if found is None:
                raise UnknownRunError(run_id)
            row = follows("cancel", *found)
            if row is None:
                return False  # (no row: a final run, already ended)
            self._cancel_write(tx, run_id, None if row.target == found[0] else row.target)
            return True

        return self._transaction(body)

    @abstractmethod
    def _transaction(self, body: Callable[[Any], T]) -> T:
        """``body(tx)`` in one write transaction of the backend (``tx``: its connection)."""

    # -- the dialect: what each backend supplies to the statements written here once
    #
    # A statement is written once with ``:name`` placeholders (the lifecycle's
    # own pieces, HELD and the like, are written so too), rendered by the
    # backend's :meth:`_placeholder` (a parameter, or for ``:now`` PostgreSQL's
    # clock) and run with a mapping of arguments.

    _fold: str = ""
    """SQL a write that takes a run out of ``running`` adds to its ``SET`` (SQLite folds the
    counts of its newest entry into the run's row; PostgreSQL keeps them there)."""

    _for_update: str = ""

    _join_lock: str = ""
    """A statement a ``join`` runs after locking its run's row, before reading the children: the
    lock a child's end takes before waking its parent (PostgreSQL; SQLite's write lock orders them)."""
    """The clause that locks a row read for the transaction (``""`` where a write lock is held)."""

    @abstractmethod
    def _placeholder(self, name: str) -> str:
        """The backend's SQL for the placeholder ``:name`` of a statement written once."""

    def _q(self, template: str) -> str:
        """``template`` in the backend's SQL (each ``:name`` by :meth:`_placeholder`), rendered once."""
        key = (type(self), template)
        found = _RENDERED.get(key)
        if found is None:
            text = template.replace(":since", "(:now - :window)")  # (a rate window's start)
            found = _RENDERED[key] = _PLACEHOLDER.sub(lambda m: self._placeholder(m.group(1)), text)
        return found

    @abstractmethod
    def _snapshot(self, body: Callable[[Any], T]) -> T:
        """``body(tx)`` in one read-only transaction: every statement sees one snapshot."""

    @abstractmethod
    def _read(self, body: Callable[[Any], T]) -> T:
        """``body(tx)``'s reads, the cheapest way the backend has (one statement needs no snapshot)."""

    @abstractmethod
    def _run(self, body: Callable[[Any], T]) -> T:
        """``body(tx)``'s writes, the cheapest way the backend has (SQLite: one transaction, one
        commit; PostgreSQL: each statement its own)."""

    @abstractmethod
    def _fenced_row(self, tx: Any, sql: str, args: Mapping[str, Any]) -> bool | None:
        """Run the fenced ``UPDATE`` ``sql``: the run's cancel flag, or ``None`` if it matched no row."""

    def _slot_lock(self, tx: Any, resource: str) -> None:  # noqa: B027 (SQLite's: none)
        """Serialise the takers of ``resource`` to the end of ``tx`` (SQLite's write lock does)."""

    def _held_write(self, lease: Lease, sets: str, **args: Any) -> bool:
        """``UPDATE ... SET sets`` of the run under ``lease``, fenced (``lifecycle.HELD``), in one
        statement; the run's cancel flag, or :class:`LeaseLostError` (nothing written)."""
        if not isinstance(lease, Lease):
            raise ValueError(f"lease must be a Lease, got {type(lease).__name__}")
        sql = self._q(f"UPDATE ekit_queue_runs SET {sets} WHERE {HELD}")

        def body(tx: Any) -> bool | None:
            return self._fenced_row(tx, sql, {**args, "run_id": lease.run_id, "epoch": lease.epoch,
                                               "now": time.time()})

        cancel = self._run(body)
        if cancel is None:
            self._lost(lease)
        return cancel

    def _cancel_read(self, tx: Any, run_id: str) -> tuple[str, bool] | None:
        """The run's status and whether its lease is live, its row locked for ``tx`` (``None``: no run)."""
        sql = self._q(f"SELECT status, {LIVE} FROM ekit_queue_runs WHERE run_id = :run_id{self._for_update}")
        row = tx.execute(sql, {"run_id": run_id, "now": time.time()}).fetchone()
        return None if row is None else (row[0], bool(row[1]))

    def _cancel_write(self, tx: Any, run_id: str, target: str | None) -> None:
        """Flag the run's cancel (``target`` ``None``), or end it in ``target``: epoch + 1, no lease,
        flag set."""
        if target is None:
            sql = "UPDATE ekit_queue_runs SET cancel_requested = TRUE WHERE run_id = :run_id"
        else:
            sql = ("UPDATE ekit_queue_runs SET status = :status, epoch = epoch + 1, lease_until = NULL, "
                   f"cancel_requested = TRUE, updated_at = :now{self._fold} WHERE run_id = :run_id")
        tx.execute(self._q(sql), {"run_id": run_id, "status": target, "now": time.time()})

    def prune(self, older_than: float) -> int:
        """Delete finished, failed and cancelled runs last updated over ``older_than`` s ago; how many.

        A child run (``Child(wf, queued=True)``) is kept while its parent is, and pruned with it.
        """
        age = check_age(older_than)

        def body(tx: Any) -> int:
            # A child is kept while its parent is; each round takes the children of the runs the
            # round before took (as old as asked), so a family goes together.
            pruned = more = self._prune_write(tx, age)
            while more:
                more = self._prune_write(tx, age)
                pruned += more
            tx.execute(FORGOTTEN_LINKS)
            return pruned

        return self._transaction(body)

    @abstractmethod
    def _prune_write(self, tx: Any, age: float) -> int:
        """Delete the final runs (:data:`~ekit_runtime.queue.lifecycle.FINAL`) last updated over
        ``age`` seconds ago, with their entries and stream; how many runs."""

    def limits(self) -> Limits:
        """The fleet's limits as stored in the database."""
        return self._read(self._read_limits)

    def set_limits(self, limits: Limits) -> None:
        """Store ``limits`` for every worker of this queue (they apply at the next claim)."""
        text = self._limits_text(limits)
        sql = self._q("INSERT INTO ekit_queue_config (key, value) VALUES ('limits', :value) "
                      "ON CONFLICT (key) DO UPDATE SET value = excluded.value")
        self._run(lambda tx: tx.execute(sql, {"value": text}))

    def _read_limits(self, tx: Any, *, lock: bool = False) -> Limits:
        return self._read_limits_text(tx, lock=lock)[1]

    def _read_limits_text(self, tx: Any, *, lock: bool = False) -> tuple[str | None, Limits]:
        """The fleet's limits as stored (the text, ``None`` if none is) and as read (``lock``:
        the row locked for the transaction, where the backend has row locks)."""
        sql = "SELECT value FROM ekit_queue_config WHERE key = 'limits'" + (self._for_update if lock else "")
        row = tx.execute(sql).fetchone()
        return (None if row is None else row[0]), self._limits_from(row)

    def claim(self, worker: str, workflows: Mapping[str, str | None], lease_seconds: float) -> Lease | None:
        """Lease the next claimable run of one of ``workflows``, or ``None``.

        ``workflows`` maps each workflow name the worker can drive to its
        graph fingerprint; a run whose saved checkpoint has another
        fingerprint is left for a worker that has that version. Claimable:
        queued, or running with an expired lease. Each claim increments the
        run's epoch. ``None`` also when the fleet is at a limit.

        While the fleet has no limit a claim counts (:attr:`_quick`, as the
        last claim in full read them), a claim is one statement; otherwise,
        or when that statement leases nothing (nothing to claim, or the
        limits changed), a claim in full says which.
        """
        names = self._workflows(workflows)
        seconds = self._lease_seconds(lease_seconds)
        who = self._worker_name(worker)
        with self._lock:
            quick = self._quick
            if quick is not None:
                rows = self._quick_claim(who, names, seconds, quick, 1)
                if rows:
                    return self._granted_quick(rows[0], quick[1])
            return self._claim_in_full(who, names, seconds)

    _quick: tuple[str | None, Limits] | None = None
    """The limits' text and value as the last claim in full read them, while no limit a claim
    counts is set (``None``: every claim is in full)."""

    @abstractmethod
    def _quick_claim(
        self, worker: str, names: list[tuple[str, str | None]], seconds: float,
        quick: tuple[str | None, Limits], limit: int,
    ) -> list[tuple[Any, ...]]:
        """Lease up to ``limit`` runs in one statement, guarded by ``quick``'s limits text; their
        rows in claim order (each for :meth:`_granted_quick`)."""

    @abstractmethod
    def _granted_quick(self, row: tuple[Any, ...], limits: Limits) -> Lease:
        """The lease of a row :meth:`_quick_claim` leased, with the run's checkpoint."""

    @abstractmethod
    def _claim_in_full(
        self, worker: str, names: list[tuple[str, str | None]], seconds: float
    ) -> Lease | None:
        """A claim in one transaction: the sweep, the limits, the pick and lease, the checkpoint;
        it sets :attr:`_quick` from the limits it read."""

    # -- a claim in full's statements (the pick and the lease are each backend's) --

    def _sweep_abandoned(self, tx: Any) -> None:
        """End the runs whose lease expired after a cancel was asked (a claim's row for them: they
        are not resumed, so that no worker starts paid work on a run someone cancelled)."""
        sql = self._q(
            "UPDATE ekit_queue_runs SET status = :status, epoch = epoch + 1, lease_until = NULL, "
            f"updated_at = :now{self._fold} WHERE {ABANDONED}"
        )
        tx.execute(sql, {"status": abandoned_as(), "now": time.time()})

    def _trim_usage(self, tx: Any, window: float) -> None:
        """Delete the usage entries that left the fleet's rate window."""
        sql = self._q(f"DELETE FROM ekit_queue_usage WHERE {LEFT_WINDOW}")
        tx.execute(sql, {"now": time.time(), "window": window})

    def _below_limits(self, tx: Any, limits: Limits) -> bool:
        """Whether one more lease keeps the fleet within its cap and its start rate.

        Starts are recorded (:meth:`_count_start`, their window trimmed here)
        only while the fleet has a start rate: without one, a claim neither
        writes nor scans that table.
        """
        args = {"now": time.time(), "window": limits.window}
        if limits.max_in_flight is not None:
            live = self._q(f"SELECT count(*) FROM ekit_queue_runs WHERE {LIVE}")
            (leases,) = tx.execute(live, args).fetchone()
            if at_cap(limits, leases):
                return False
        if limits.runs_per_minute is not None:
            tx.execute(self._q(f"DELETE FROM ekit_queue_starts WHERE {LEFT_WINDOW}"), args)
            count = self._q(f"SELECT count(*) FROM ekit_queue_starts WHERE {IN_WINDOW}")
            (started,) = tx.execute(count, args).fetchone()
            if at_start_rate(limits, started):
                return False
        return True

    def _count_start(self, tx: Any) -> None:
        """Record a lease granted in the start-rate window."""
        tx.execute(self._q("INSERT INTO ekit_queue_starts (at) VALUES (:now)"), {"now": time.time()})

    def _give_back(self, leased: Sequence[tuple[Any, ...]]) -> None:
        """Release runs a claim leased but could not hand over (their rows: run id, epoch first)."""
        sql = self._q(
            f"UPDATE ekit_queue_runs SET status = {held_status('release')}, lease_until = NULL, "
            f"owner = NULL, updated_at = :now{self._fold} "
            "WHERE run_id = :run_id AND epoch = :epoch AND status = 'running'"
        )

        def body(tx: Any) -> None:
            now = time.time()
            for row in leased:
                tx.execute(sql, {"run_id": row[0], "epoch": row[1], "now": now})

        self._run(body)

    def claim_many(
        self, worker: str, workflows: Mapping[str, str | None], lease_seconds: float, limit: int
    ) -> list[Lease]:
        """Lease up to ``limit`` claimable runs at once, as that many calls of :meth:`claim` would.

        The runs are those the claims would take, in claim order; fewer (or
        none) when fewer are claimable or the fleet reaches a limit. This one
        claims one by one, each with ``self.claim`` (so a wrapper that borrows
        it reaches its own ``claim``); the backends lease them at once
        (:meth:`_claim_many_at_once`). A claim that fails after others were
        granted ends the call with those (the next call meets the error
        again), so that no granted lease is dropped.
        """
        limit = claim_limit(limit)
        leases: list[Lease] = []
        while len(leases) < limit:
            try:
                lease = self.claim(worker, workflows, lease_seconds)
            except Exception:
                if not leases:
                    raise
                break
            if lease is None:
                break
            leases.append(lease)
        return leases

    def _claim_many_at_once(
        self, worker: str, workflows: Mapping[str, str | None], lease_seconds: float, limit: int
    ) -> list[Lease]:
        """Lease up to ``limit`` claimable runs, as that many calls of :meth:`claim` would.

        While the fleet has no limit a claim counts, one statement leases them
        all (one commit: a worker with several free places fills them in one
        go); otherwise, or when it leases nothing, they are claimed one by
        one (:meth:`RunQueue.claim_many`). A backend's ``claim_many``.
        """
        limit = claim_limit(limit)
        quick = self._quick
        if limit > 1 and quick is not None:
            names = self._workflows(workflows)
            seconds = self._lease_seconds(lease_seconds)
            who = self._worker_name(worker)
            with self._lock:
                rows = self._quick_claim(who, names, seconds, quick, limit)
                if rows:
                    return handed_over(rows, lambda row: self._granted_quick(row, quick[1]), self._give_back)
            # Nothing to claim, or the limits changed: the claims in full say which.
        return RunQueue.claim_many(self, worker, workflows, lease_seconds, limit)

    def renew(self, lease: Lease, lease_seconds: float) -> bool:
        """Extend ``lease`` by ``lease_seconds`` from now; return whether a cancel was asked.

        Raises :class:`LeaseLostError` if the lease expired or was taken over.
        (``updated_at`` too: a save need not write the run's row, so this
        keeps a running run's no older than a heartbeat.)
        """
        seconds = self._lease_seconds(lease_seconds)
        return self._held_write(lease, "lease_until = :now + :seconds, updated_at = :now", seconds=seconds)

    def save(self, lease: Lease, checkpoint: WorkflowCheckpoint, lease_seconds: float) -> bool:
        """Store ``checkpoint`` under ``lease``, leaving at least :attr:`save_renews` of
        ``lease_seconds`` ahead; return whether a cancel was asked.

        Fenced: the check of the lease and the rows it guards commit together
        or not at all. Raises :class:`LeaseLostError`, writing nothing, if the
        lease is no longer held; ``UnencodableError`` (a ``ValueError``)
        before anything is sent for an output that cannot be encoded. What is
        written is a delta on this lease's last save where it can be
        (:meth:`_encode`); the statements are the backend's (:meth:`_save_one`).
        """
        seconds = self._lease_seconds(lease_seconds)
        with self._write_lock:
            encoded, added = self._prepare_save(lease, checkpoint)
            cancel = self._save_one(lease, checkpoint, encoded, added, seconds)
            self._remember(lease, checkpoint)
            return cancel

    @abstractmethod
    def _save_one(
        self, lease: Lease, checkpoint: WorkflowCheckpoint, enc: EncodedCheckpoint, added: TokenUsage,
        seconds: float,
    ) -> bool:
        """Write one prepared save, fenced, renewing the lease to ``seconds`` from now (or, where
        :attr:`save_renews` says less, as the backend's usual save does); the cancel flag, or
        :meth:`_lost` (nothing written)."""

    def save_many(
        self,
        saves: Sequence[tuple[Lease, WorkflowCheckpoint]],
        lease_seconds: float,
        more: More | None = None,
    ) -> list[bool | Exception]:
        """Store several runs' checkpoints, each as :meth:`save` would; each one's outcome in order.

        An outcome is what that ``save`` would have returned (whether a cancel
        was asked) or the exception it would have raised, its own instance:
        a refused lease refuses its save alone. A backend that can commits
        them together, in one statement and one wait for the disk (the
        worker's group commit); this one saves them one by one. At most one
        save per run: a run's later checkpoint goes in the next call.

        ``more(limit)``, if given, is a source of further saves (at most
        ``limit``) that a backend may ask for while it waits for its turn to
        write; their outcomes follow those of ``saves``, in the order handed
        over. This one never asks.
        """
        check_one_per_run(saves)
        self._lease_seconds(lease_seconds)  # (a bad argument is raised, not one outcome per save)
        return [save_alone(self, lease, checkpoint, lease_seconds) for lease, checkpoint in saves]

    def write_many(
        self,
        saves: Sequence[tuple[Lease, WorkflowCheckpoint]],
        endings: Sequence[Ending],
        lease_seconds: float,
        more: More | None = None,
    ) -> tuple[list[bool | Exception], list[Exception | None]]:
        """:meth:`save_many` of ``saves`` and :meth:`finish` of each of ``endings``, in one commit if it can.

        Returns the saves' outcomes (as ``save_many``'s, those ``more`` handed
        over included) and each ending's: ``None`` once the run is ended, or
        the exception ``finish`` would have raised (:class:`LeaseLostError`
        for a lease no longer held), its own instance. At most one write per
        run. A worker's runs that end while others save are thus ended in the
        commit of those saves (see :mod:`ekit_runtime.queue.group_commit`);
        this one saves as ``save_many`` does, then ends the runs one by one.
        """
        check_one_per_run(saves, endings)
        self._lease_seconds(lease_seconds)
        saved = self.save_many(saves, lease_seconds, more)
        return saved, [finish_alone(self, end) for end in endings]

    # -- a worker's batch of writes, one statement where the backend can (its group commit)
    #
    # ``save_many`` and ``write_many`` above make each write alone (a wrapper that
    # borrows them reaches its own ``save`` and ``finish``); a backend takes these
    # (``write_many = RunQueue._write_many_at_once``), which hand the batch to its
    # :meth:`_write_batch` whenever :meth:`_batches` says one statement pays.

    def _batches(self, writes: int) -> bool:
        """Whether ``writes`` writes go as one statement (else each alone)."""
        return False

    def _write_batch(
        self, writes: Writes, saves: Sequence[tuple[Lease, WorkflowCheckpoint]], more: More | None,
        seconds: float,
    ) -> None:
        """Write ``saves`` (prepared into ``writes`` by :meth:`Writes.take`) and ``writes.ends``,
        telling ``writes`` each one's outcome; ``more`` may be asked for saves to join."""
        raise NotImplementedError

    def _save_many_at_once(
        self,
        saves: Sequence[tuple[Lease, WorkflowCheckpoint]],
        lease_seconds: float,
        more: More | None = None,
    ) -> list[bool | Exception]:
        """:meth:`save_many` in one statement: :meth:`write_many` with no endings."""
        check_one_per_run(saves)
        if not self._batches(len(saves)):
            return RunQueue.save_many(self, saves, lease_seconds, more)
        return self.write_many(saves, (), lease_seconds, more)[0]

    def _write_many_at_once(
        self,
        saves: Sequence[tuple[Lease, WorkflowCheckpoint]],
        endings: Sequence[Ending],
        lease_seconds: float,
        more: More | None = None,
    ) -> tuple[list[bool | Exception], list[Exception | None]]:
        """:meth:`write_many` as one statement: one commit, one wait for the disk for all.

        Each write is fenced on its own, as in :meth:`save` and :meth:`finish`:
        a lease that is no longer held refuses its write alone (its outcome is
        :class:`LeaseLostError`, nothing written for it). A statement that
        fails as a whole writes nothing, and each write gets an outcome of its
        own (:meth:`Writes.failed`).
        """
        check_one_per_run(saves, endings)
        seconds = self._lease_seconds(lease_seconds)
        if not self._batches(len(saves) + len(endings)):
            return RunQueue.write_many(self, saves, endings, lease_seconds, more)
        writes = Writes(self, endings, lease_seconds)
        with self._write_lock:
            self._write_batch(writes, saves, more, seconds)
        return writes.saved, writes.ended

    def finish(self, lease: Lease, status: RunStatus, error: str | None = None) -> None:
        """End the run under ``lease`` as ``finished``, ``failed`` or ``cancelled`` (a status the
        lifecycle table lets a holder's finish write); :class:`LeaseLostError` if the lease is
        no longer held."""
        text = self._final(status, error)
        self._held_write(
            lease, f"status = :status, error = :error, lease_until = NULL, updated_at = :now{self._fold}",
            status=status, error=text,
        )
        self._forget(lease.run_id)

    def release(self, lease: Lease) -> bool:
        """Give the run back to the queue (a worker shutting down); ``False`` if the lease was already lost.

        A run whose cancel was asked meanwhile is ended ``cancelled`` instead
        (:data:`~ekit_runtime.queue.lifecycle.RELEASED_AS`).
        """
        sets = f"status = {held_status('release')}, lease_until = NULL, owner = NULL, updated_at = :now"
        try:
            self._held_write(lease, sets + self._fold)
        except LeaseLostError:
            return False
        finally:
            self._forget(lease.run_id)
        return True

    def acquire_slot(self, lease: Lease, resource: str, holder: str) -> bool:
        """Take a slot of ``resource`` for ``holder`` (an attempt's key) under ``lease``: was one free?

        One serialised step per resource: the slots of ``resource`` still
        held are counted (a slot is held while the lease it was taken under
        is live: :func:`~ekit_runtime.queue.lifecycle.slot_held`) and a slot
        is taken only below the resource's cap in ``Limits.resources`` (or
        always, if it has none). Fenced: :class:`LeaseLostError`, taking
        nothing, unless ``lease`` is live. ``False`` leaves nothing behind;
        the caller asks again later. The count and the insert are serialised
        by :meth:`_slot_lock` within one transaction.
        """
        resource, holder = self._slot(lease, resource, holder)

        def body(tx: Any) -> bool:
            self._slot_lock(tx, resource)
            # A statement after the lock: it sees every slot committed before.
            args = {"run_id": lease.run_id, "epoch": lease.epoch, "resource": resource, "holder": holder,
                    "now": time.time()}
            fenced, held, limits = tx.execute(self._q(_SLOT_READ), args).fetchone()
            if not fenced:
                self._lost(lease)
            caps = self._limits_from(None if limits is None else (limits,)).resources
            if not slot_free(caps.get(resource), held):
                return False
            tx.execute(self._q(_SLOT_SWEEP), args)
            tx.execute(self._q(_SLOT_TAKE), args)
            return True

        return self._transaction(body)

    def release_slot(self, lease: Lease, resource: str, holder: str) -> None:
        """Give back the slot ``holder`` took of ``resource`` under ``lease`` (nothing if it has none).

        Not fenced: a slot whose lease was lost stopped counting already, and
        deleting it is always safe.
        """
        resource, holder = self._slot(lease, resource, holder)
        sql = self._q("DELETE FROM ekit_queue_slots WHERE resource = :resource AND holder = :holder "
                      "AND epoch = :epoch")
        self._run(lambda tx: tx.execute(sql, {"resource": resource, "holder": holder, "epoch": lease.epoch}))

    def slots_held(self) -> dict[str, int]:
        """``resource -> slots held now`` across the fleet, for each resource with one held."""
        sql = self._q(f"SELECT s.resource, count(*) FROM ekit_queue_slots AS s WHERE {SLOT_HELD} "
                      "GROUP BY s.resource ORDER BY s.resource")
        rows = self._read(lambda tx: tx.execute(sql, {"now": time.time()}).fetchall())
        return {name: int(count) for name, count in rows}

    def park(self, lease: Lease, reason: str) -> None:
        """Park the run under ``lease``: it waits for a person (``waiting``), holding no lease.

        Its lease and owner are cleared and ``reason`` recorded (``waiting for
        an answer to step 'S'``); no claim takes it until a person answers,
        approves or denies. A run whose cancel was asked meanwhile is ended
        ``cancelled`` instead. Fenced like any holder's write:
        :class:`LeaseLostError`, writing nothing, unless the lease is live.
        """
        text = self._park_reason(reason)
        sets = (f"status = {held_status('park')}, lease_until = NULL, owner = NULL, reason = :reason, "
                "updated_at = :now")
        try:
            self._held_write(lease, sets + self._fold, reason=text)
        finally:
            self._forget(lease.run_id)

    # -- children: a step's child as a run of its own (lifecycle's CHILDREN; queue.links) --

    def spawn(
        self,
        lease: Lease,
        workflow: str,
        context: Mapping[str, Any] | None = None,
        *,
        run_id: str,
        step: str,
        options: Mapping[str, Any] | None = None,
    ) -> bool:
        """Submit ``run_id``, a run of ``workflow``, as the child of the run under ``lease`` (for its
        step ``step``); whether it was new.

        One transaction, fenced by the parent's lease (:class:`LeaseLostError`,
        nothing written, unless it is live): the child is queued at the
        parent's priority and linked to it. An id that exists already as
        this parent's child changes nothing (a worker that died after the
        submit and before saving submits it again); one that exists and is
        not is a ``ValueError``.
        """
        sub = self._submission(workflow, context, run_id, 0, options)
        name = check_step_name(step)
        status = submitted_as()
        held = self._q(f"SELECT priority FROM ekit_queue_runs WHERE {HELD}{self._for_update}")
        linked = self._q("SELECT parent FROM ekit_queue_children WHERE child = :child")
        exists = self._q("SELECT 1 FROM ekit_queue_runs WHERE run_id = :child")
        link = self._q(
            "INSERT INTO ekit_queue_children (child, parent, step) VALUES (:child, :parent, :step)"
        )

        def body(tx: Any) -> bool:
            args = {"run_id": lease.run_id, "epoch": lease.epoch, "now": time.time(), "child": sub.run_id,
                    "parent": lease.run_id, "step": name}
            row = tx.execute(held, args).fetchone()
            if row is None:
                self._lost(lease)
            if tx.execute(exists, args).fetchone() is not None:
                parent = tx.execute(linked, args).fetchone()
                if parent is None or parent[0] != lease.run_id:
                    raise ValueError(f"run id {sub.run_id!r} is a run the queue has, not a child of run "
                                     f"{lease.run_id!r}: its step {name!r} cannot submit it")
                return False
            sub.priority = int(row[0])
            self._submit_write(tx, sub, status)
            tx.execute(link, args)
            return True

        return self._transaction(body)

    def join(self, lease: Lease, children: Sequence[str]) -> RunStatus:
        """Park the run under ``lease`` until one of ``children`` (its child runs it waits for) ends.

        One transaction: the run's row is locked (fenced: :class:`LeaseLostError`,
        nothing written, unless the lease is live), then the children are
        read. The status written is the table's ``join`` row
        (:func:`~ekit_runtime.queue.lifecycle.join_status`): ``cancelled`` if a
        cancel was asked, ``queued`` if they all ended already, or one of them
        failed or was cancelled (any worker resumes it), else ``waiting`` with no
        lease, no owner and a reason naming the children; the last child's end
        (or a child's failure) queues it then. A linked child not ended that
        ``children`` does not name (its item was dropped) is unlinked and
        cancelled first. Returns the status written.
        """
        ids = [check_run_id(c, "children") for c in children]
        if not ids:
            raise ValueError("join: children must name at least one child run")
        reason = self._park_reason(children_reason(ids))
        marks = ", ".join(f":c{i}" for i in range(len(ids)))
        lock = self._q(f"SELECT cancel_requested FROM ekit_queue_runs WHERE {HELD}{self._for_update}")
        ended = self._q(f"SELECT count(*), coalesce(sum(CASE WHEN status = 'finished' THEN 0 ELSE 1 END), 0) "
                        f"FROM ekit_queue_runs WHERE run_id IN ({marks}) AND {FINAL}")
        write = self._q(
            "UPDATE ekit_queue_runs SET status = :status, lease_until = NULL, owner = NULL, "
            f"reason = :reason, updated_at = :now{self._fold} WHERE {HELD}"
        )

        def body(tx: Any) -> RunStatus:
            args: dict[str, Any] = {"run_id": lease.run_id, "epoch": lease.epoch, "now": time.time(),
                                    **{f"c{i}": c for i, c in enumerate(ids)}}
            row = tx.execute(lock, args).fetchone()
            if row is None:
                self._lost(lease)
            if self._join_lock:
                tx.execute(self._q(self._join_lock), args)
            self._close_dropped(tx, lease.run_id, ids)
            # A statement after the lock: it sees every child's end committed before it.
            count, unfinished = tx.execute(ended, args).fetchone()
            # (the wake's rule: all of them ended, or one failed or was cancelled)
            target = join_status(bool(row[0]), int(count) == len(set(ids)) or int(unfinished) > 0)
            args.update(status=target, reason=reason if target == "waiting" else None)
            if self._fenced_row(tx, write, args) is None:
                self._lost(lease)
            return target

        try:
            return self._transaction(body)
        finally:
            self._forget(lease.run_id)

    def _close_dropped(self, tx: Any, parent: str, waited: Sequence[str]) -> None:
        """Unlink and cancel ``parent``'s children not yet ended that it no longer waits for
        (``waited``: those it does), in ``tx``: a rewind or resume dropped their items, so they
        stop holding its wake, whose rule is then the join's (decision 022)."""
        marks = ", ".join(f":c{i}" for i in range(len(waited)))
        args: dict[str, Any] = {"parent": parent, **{f"c{i}": c for i, c in enumerate(waited)}}
        going = tx.execute(self._q(
            "SELECT l.child FROM ekit_queue_children l JOIN ekit_queue_runs c ON c.run_id = l.child "
            f"WHERE l.parent = :parent AND l.child NOT IN ({marks}) "
            f"AND NOT {FINAL.replace('status', 'c.status')}"
        ), args).fetchall()
        # The child's row is skipped if a write holds it (its end, a save): waiting for it could
        # deadlock with its end's wake, which waits for the join's lock this holds. Unlinked, a
        # child that goes on wakes no one.
        read = self._q(f"SELECT status, {LIVE} FROM ekit_queue_runs WHERE run_id = :run_id"
                       + (f"{self._for_update} SKIP LOCKED" if self._for_update else ""))
        unlink = self._q("DELETE FROM ekit_queue_children WHERE child = :run_id")
        for (child,) in going:
            tx.execute(unlink, {"run_id": child})
            row = tx.execute(read, {"run_id": child, "now": time.time()}).fetchone()
            if row is not None and row[0] not in FINAL_STATUSES:
                self._cancel_write(tx, child, None if row[1] else "cancelled")

    def child_statuses(self, run_ids: Sequence[str]) -> dict[str, RunStatus]:
        """``run id -> status`` of each of ``run_ids`` the queue has (one read)."""
        rows = self._pairs_of("SELECT run_id, status FROM ekit_queue_runs WHERE run_id", run_ids)
        return {str(r): cast(RunStatus, st) for r, st in rows}

    def _pairs_of(self, select: str, run_ids: Sequence[str]) -> list[Any]:
        """The rows of ``select`` (ending in the run id column it filters on) for ``run_ids``
        (each checked), in one read; none for none."""
        ids = [check_run_id(r, "run_ids") for r in run_ids]
        if not ids:
            return []
        marks = ", ".join(f":c{i}" for i in range(len(ids)))
        sql, args = self._q(f"{select} IN ({marks})"), {f"c{i}": c for i, c in enumerate(ids)}
        return list(self._read(lambda tx: tx.execute(sql, args).fetchall()))

    def child_state(self, run_id: str, output: str) -> ChildState | None:
        """The child run ``run_id`` as its parent's step reads it (``output``: its step whose output
        the parent hands on, read once it finished), or ``None`` if there is no such run."""
        rid = check_run_id(run_id)
        sql = self._q("SELECT status, error FROM ekit_queue_runs WHERE run_id = :run_id")

        def body(tx: Any) -> ChildState | None:
            row = tx.execute(sql, {"run_id": rid}).fetchone()
            if row is None:
                return None
            status, error = row
            if status not in FINAL_STATUSES:
                return ChildState(status, error, None, NO_USAGE)
            checkpoint = self._load(tx, rid, missing_ok=True)
            if checkpoint is None:
                return ChildState(status, error, None, NO_USAGE)
            if status == "finished" and output not in checkpoint.outputs:
                error = f"it finished without an output for its step {output!r}"
                return ChildState("failed", error, None, checkpoint.cost)
            return ChildState(status, error, checkpoint.outputs.get(output), checkpoint.cost)

        return self._snapshot(body)

    def family(self, run_id: str) -> tuple[str | None, list[tuple[str, str]]]:
        """The run's parent run (``None``: it is no child) and its child runs, as
        ``(child run id, the parent's step)`` in step order."""
        rid = check_run_id(run_id)
        up = self._q("SELECT parent FROM ekit_queue_children WHERE child = :run_id")
        down = self._q(
            "SELECT child, step FROM ekit_queue_children WHERE parent = :run_id ORDER BY step, child"
        )

        def body(tx: Any) -> tuple[str | None, list[tuple[str, str]]]:
            parent = tx.execute(up, {"run_id": rid}).fetchone()
            children = tx.execute(down, {"run_id": rid}).fetchall()
            return (None if parent is None else str(parent[0])), [(str(c), str(s)) for c, s in children]

        return self._snapshot(body)

    def parents(self, run_ids: Sequence[str]) -> dict[str, str]:
        """``child run id -> its parent's`` for each of ``run_ids`` that is a child run (one read)."""
        rows = self._pairs_of("SELECT child, parent FROM ekit_queue_children WHERE child", run_ids)
        return {str(c): str(p) for c, p in rows}

    def usage_wait(self) -> float:
        """Seconds before the fleet's call and token limits let a step start (0: go)."""
        return self.usage_hold()[0]

    def set_reason(self, lease: Lease, reason: str | None) -> None:
        """Record why the run under ``lease`` waits (``None``: it goes on); fenced like a save."""
        self._held_write(lease, "reason = :reason", reason=self._reason_text(reason))

    def announce(
        self, worker: str, workflows: Mapping[str, str | None], seconds: float, doing: Doing | None = None
    ) -> None:
        """Record that ``worker`` serves ``workflows`` (name -> fingerprint) for ``seconds`` more.

        ``doing`` is what it runs now, ``run id -> (epoch, {name: (began, attempt)})``,
        read back by :meth:`in_flight`. Workers gone for a day are forgotten:
        the table stays as small as the fleet.
        """
        name, served, ttl, doing_text = self._presence(worker, workflows, seconds, doing)
        upsert = self._q(_ANNOUNCE)
        sweep = self._q("DELETE FROM ekit_queue_workers WHERE until < :now - 86400")

        def body(tx: Any) -> None:
            args = {"name": name, "workflows": served, "ttl": ttl, "doing": doing_text, "now": time.time()}
            tx.execute(upsert, args)
            tx.execute(sweep, args)

        self._run(body)

    def _doing_rows(self) -> list[tuple[str, str]]:
        """``(worker, doing as JSON)`` of each live worker that announced attempts in flight."""
        sql = self._q("SELECT name, doing FROM ekit_queue_workers WHERE until > :now AND doing IS NOT NULL")
        rows = self._read(lambda tx: tx.execute(sql, {"now": time.time()}).fetchall())
        return [(str(name), str(text)) for name, text in rows]

    def retire(self, worker: str) -> None:
        """Forget a worker's :meth:`announce` (it stopped): its workflows are no longer served by it."""
        name = self._worker_name(worker)
        sql = self._q("DELETE FROM ekit_queue_workers WHERE name = :name")
        self._run(lambda tx: tx.execute(sql, {"name": name}))

    def usage_hold(self) -> tuple[float, str | None]:
        """:meth:`usage_wait` and the reason for it: ``"rate limit llm_calls_per_minute"`` or ``None``."""
        sql = self._q("SELECT coalesce(sum(llm_calls), 0), coalesce(sum(tokens), 0), min(at), :now "
                      "FROM ekit_queue_usage WHERE at > :now - :window")

        def body(tx: Any) -> tuple[float, str | None]:
            limits = self._read_limits(tx)
            if not usage_limited(limits):
                return 0.0, None
            args = {"window": limits.window, "now": time.time()}
            calls, tokens, oldest, now = tx.execute(sql, args).fetchone()
            wait = usage_wait(limits, calls, tokens, oldest, now)
            return wait, usage_reason(limits, calls, tokens) if wait > 0 else None

        return self._read(body)

    @abstractmethod
    def close(self) -> None:
        """Close the connection."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _slot(lease: Lease, resource: object, holder: object) -> tuple[str, str]:
        """``(resource, holder)`` of a slot, checked (a ``ValueError`` naming what is wrong)."""
        if not isinstance(lease, Lease):
            raise ValueError(f"lease must be a Lease, got {type(lease).__name__}")
        why = unstorable_resource(resource)
        if why is not None:
            raise ValueError(f"resource {why}")
        return cast(str, resource), check_text(holder, "holder", limit=4000)

    @staticmethod
    def _lease_seconds(value: object) -> float:
        return check_lease_seconds(value)

    def _context(self, text: str) -> MappingProxyType[str, Any]:
        data = self.loads(text)
        if not isinstance(data, dict):
            raise ValueError("stored context is not an object")
        return MappingProxyType(data)

    @staticmethod
    def _workflows(workflows: Mapping[str, str | None]) -> list[tuple[str, str | None]]:
        if not isinstance(workflows, Mapping) or not workflows:
            raise ValueError("workflows must be a non-empty mapping of workflow name to graph fingerprint")
        checked = []
        for name, fp in workflows.items():
            fingerprint = None if fp is None else check_text(fp, f"fingerprint of {name!r}", limit=200)
            checked.append((check_workflow_name(name), fingerprint))
        return checked

    # -- a run's live stream (ekit_runtime.queue.streams) ----------------------

    def publish_many(
        self, batches: Sequence[tuple[Lease, Sequence[Published]]], cap: int
    ) -> list[int | Exception]:
        """Append each run's events to its stream, fenced by its lease, in one transaction.

        For each ``(lease, events)`` in order: the stream's newest offset once
        they are appended, or :class:`LeaseLostError` (its own instance,
        nothing written for that run) if the lease is no longer held. Each
        stream then keeps its newest ``cap`` events. The worker's publisher
        calls this (:mod:`ekit_runtime.queue.publisher`); a backend without
        streams raises ``NotImplementedError``.
        """
        raise NotImplementedError(f"{type(self).__name__} keeps no run streams")

    def _publish_many_at_once(
        self, batches: Sequence[tuple[Lease, Sequence[Published]]], cap: int
    ) -> list[int | Exception]:
        """:meth:`publish_many` of a backend that keeps streams: the batches checked, the runs
        appended in run id order (:meth:`_publish`: two publishers never wait for each other in
        a cycle), each run's outcome in the order given."""
        given = self._publishable(batches, cap)
        if not given:
            return []
        done = self._publish(sorted(given, key=lambda b: b[0].run_id), cap)
        return [done[lease.run_id] for lease, _events in given]

    def _publish(self, batches: list[tuple[Lease, list[Published]]], cap: int) -> dict[str, int | Exception]:
        """Append each run's events under its fence in one transaction that need not wait for the
        disk, each stream then cut to its newest ``cap``: run id -> newest offset, or
        :class:`LeaseLostError` (nothing written for that run)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no run streams")

    def _stream_rows(self, run_id: str, after: int, limit: int) -> StreamRows:
        """The run's state and up to ``limit`` stream rows after ``after``, in one snapshot;
        :class:`UnknownRunError` if there is no such run."""
        args = {"run_id": run_id, "after": after, "limit": limit}

        def body(tx: Any) -> StreamRows:
            run = self._q("SELECT status, error, epoch FROM ekit_queue_runs WHERE run_id = :run_id")
            row = tx.execute(run, args).fetchone()
            if row is None:
                raise UnknownRunError(run_id)
            first, last = tx.execute(self._q(_STREAM_BOUNDS), args).fetchone()
            rows = tx.execute(self._q(_STREAM_PAGE), args).fetchall()
            return StreamRows(row[0], row[1], int(row[2]), None if first is None else int(first), int(last),
                              [(int(p), k, st, d, int(e), float(a)) for p, k, st, d, e, a in rows])

        return self._snapshot(body)

    @staticmethod
    def _publishable(
        batches: Sequence[tuple[Lease, Sequence[Published]]], cap: object
    ) -> list[tuple[Lease, list[Published]]]:
        """``publish_many``'s arguments, checked (``ValueError`` naming what is wrong), empties left out."""
        check_cap(cap)
        checked: list[tuple[Lease, list[Published]]] = []
        seen: set[str] = set()
        for i, item in enumerate(batches):
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], Lease)):
                raise ValueError(f"batches[{i}] must be a (Lease, events) pair")
            lease, events = item[0], list(item[1])
            if lease.run_id in seen:
                raise ValueError(f"batches holds run {lease.run_id!r} twice; join its events")
            seen.add(lease.run_id)
            for event in events:
                if not isinstance(event, Published) or event.kind not in KINDS:
                    raise ValueError(f"batches[{i}] holds {event!r:.80}, not a Published event of known kind")
                _storable(event.data, f"the data of a {event.kind} event")
                if event.step is not None:
                    check_text(event.step, "step", limit=4000)
            if events:
                checked.append((lease, events))
        return checked

    def read_stream(self, run_id: str, after: int = 0, limit: int = READ_LIMIT) -> StreamPage:
        """One read of ``run_id``'s stream: up to ``limit`` events after offset ``after``, never waiting.

        See :mod:`ekit_runtime.queue.streams` for the ``gap`` and ``end``
        events a read may add. Refused with a ``ValueError`` before the
        database is read: a run id no run can have, an ``after`` that is not
        a whole number from 0, a ``limit`` not from 1 to 1000; after it, an
        ``after`` past the stream's last offset (no reader can have seen
        it). An unknown run is an :class:`UnknownRunError` (a ``LookupError``).
        """
        run_id, after, limit = check_read(run_id, after, limit)
        return page_of(run_id, after, limit, self._stream_rows(run_id, after, limit))

    def stream(
        self, run_id: str, after: int = 0, *, follow: bool = True, poll: float = 0.05
    ) -> Iterator[StreamEvent]:
        """The events of ``run_id``'s stream from offset ``after + 1``, in order; blocking.

        With ``follow`` (the default) it waits for more until the run ends,
        polling every ``poll`` seconds, slower while nothing comes (up to 10
        times ``poll``), and its last event is ``end``. ``follow=False``
        yields what is stored now and returns. To resume after a
        disconnect, call it again with the offset of the last event seen.
        """
        wait = check_seconds(poll, "poll")
        page = self.read_stream(run_id, after)  # (the arguments are checked now, not at the first next())
        return self._follow(run_id, page, follow, wait)

    def _follow(self, run_id: str, page: StreamPage, follow: bool, poll: float) -> Iterator[StreamEvent]:
        nap = poll
        while True:
            yield from page.events
            if page.ended or (not follow and len(page.events) < READ_LIMIT):
                return
            if page.events:
                nap = poll
            else:
                time.sleep(nap)
                nap = min(nap * 2, poll * 10)
            page = self.read_stream(run_id, page.next_after)

    async def astream(
        self, run_id: str, after: int = 0, *, follow: bool = True, poll: float = 0.05
    ) -> AsyncIterator[StreamEvent]:
        """:meth:`stream` as an async iterator: each read runs in a thread, each wait is the loop's."""
        wait = check_seconds(poll, "poll")
        check_read(run_id, after)
        nap, next_after = wait, after
        while True:
            page = await asyncio.to_thread(self.read_stream, run_id, next_after)
            for event in page.events:
                yield event
            if page.ended or (not follow and len(page.events) < READ_LIMIT):
                return
            if page.events:
                nap = wait
            else:
                await asyncio.sleep(nap)
                nap = min(nap * 2, wait * 10)
            next_after = page.next_after

    # -- one page of runs, filtered and counted (the dashboard's runs page) -----

    def runs_page(
        self,
        status: RunStatus | None = None,
        *,
        workflow: str | None = None,
        limit: int | None = None,
        offset: int = 0,
        newest_first: bool = False,
    ) -> RunsPage:
        """One page of the runs of ``status`` and ``workflow`` (``None``: any), and how many match in all.

        The runs are in submission order (``newest_first=True``: the reverse),
        ``offset`` of them skipped, at most ``limit`` (``None``: every one
        after the offset). ``total`` counts every run the filters match, read
        in the same snapshot as the page. An offset past the end is an empty
        page (``total`` still counts them). One read-only snapshot: a
        ``count(*)``, then the page (``ORDER BY seq LIMIT ... OFFSET ...``),
        then the live workers for the queued runs' reasons; the database
        filters, counts and cuts, so a page costs its own rows, not the queue's.

        Bad arguments are a ``ValueError`` naming the argument, before the
        database is read: a status not in ``STATUSES``, a workflow name no run
        can have (empty, over 200 characters, a NUL), a ``limit`` or
        ``offset`` that is not a whole number from 0.
        """
        status, workflow, limit, offset = self._page_args(status, workflow, limit, offset, newest_first)
        where, args = self._page_filter(status, workflow)
        walk, _ = self._page_filter(status, workflow, self._status_walk)
        order = "DESC" if newest_first else "ASC"
        cut = "LIMIT CAST(:limit AS bigint) OFFSET CAST(:offset AS bigint)"
        page = self._q(self._info_sql(walk, order, cut))
        count = self._q(f"SELECT count(*) FROM ekit_queue_runs {where}")

        def body(tx: Any) -> tuple[int, list[Any], list[Any]]:
            total = int(tx.execute(count, args).fetchone()[0])
            if offset >= total or limit == 0:
                return total, [], []
            more = {"limit": self._no_limit if limit is None else limit, "offset": offset}
            rows = tx.execute(page, {**args, **more}).fetchall()
            return total, rows, tx.execute(self._q(_SERVED), {"now": time.time()}).fetchall()

        total, rows, workers = self._snapshot(body)
        served = self._served(workers)
        return RunsPage([self._run_info(r, served) for r in rows], total)

    _status_walk = "status"
    """How a page compares the status (SQLite: ``+status``, so that its planner walks the runs in
    order rather than sort every run of that status off the claim index, per page)."""

    _no_limit: int | None = None
    """The LIMIT that is none."""

    _code_points = ""
    """What makes ``ORDER BY`` of text the code points' order (PostgreSQL: ``COLLATE "C"``)."""

    def workflow_names(self) -> list[str]:
        """The workflow of every run the queue holds, each once, in code point order (``SELECT DISTINCT``)."""
        sql = f"SELECT DISTINCT workflow{self._code_points} AS w FROM ekit_queue_runs ORDER BY w"
        return [name for (name,) in self._read(lambda tx: tx.execute(sql).fetchall())]

    @staticmethod
    def _page_args(
        status: object, workflow: object, limit: object, offset: object, newest_first: object
    ) -> tuple[RunStatus | None, str | None, int | None, int]:
        """:meth:`runs_page`'s arguments, checked (a ``ValueError`` naming the one that is wrong)."""
        checked = check_status(status)
        name = None if workflow is None else check_workflow_name(workflow)
        if not isinstance(newest_first, bool):
            raise ValueError(f"newest_first must be True or False, got {newest_first!r}")
        most = None if limit is None else check_count(limit, "limit")
        return checked, name, most, check_count(offset, "offset")

    @staticmethod
    def _page_filter(
        status: str | None, workflow: str | None, status_term: str = "status"
    ) -> tuple[str, dict[str, str]]:
        """``WHERE ...`` (or ``""``) matching ``status`` and ``workflow`` and its arguments;
        ``status_term`` is what the status is compared as (see :attr:`_status_walk`)."""
        terms = [(column, name, value) for column, name, value in
                 ((status_term, "status", status), ("workflow", "workflow", workflow)) if value is not None]
        if not terms:
            return "", {}
        where = "WHERE " + " AND ".join(f"{column} = :{name}" for column, name, _ in terms)
        return where, {name: value for _, name, value in terms}
