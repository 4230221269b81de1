"""The checkpoint: the durable projection of a run's state, and its parser.

This module owns the checkpoint format. ``WorkflowCheckpoint.to_dict`` writes
plain Python values; ``WorkflowCheckpoint.from_dict`` reads them back and is a
parser of untrusted input: whatever it is given, it returns a checkpoint or
raises :class:`CheckpointError` naming the field at fault. It never executes
anything it reads.

Format version 1 adds optional keys to the three that ExecutionKit wrote
(``step_index``, ``outputs``, ``cost``); a dict with only those three loads.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from itertools import islice
from types import MappingProxyType
from typing import Any, TypeAlias, cast

from ekit_core._frozen import twin
from ekit_core.code import CacheHit
from ekit_core.exchanges import HUMAN_FORMAT_VERSION, NO_EXCHANGES, Answer, Exchange, Question
from ekit_core.graph import GraphSpec
from ekit_core.graph_text import GraphTextError, check, read, spell
from ekit_core.ledger import Ledger
from ekit_core.numbers import check_number
from ekit_core.shapes import Shape, compacted_iteration, iteration_name
from ekit_core.usage import NO_USAGE, TokenUsage

__all__ = [
    "FORMAT_VERSION",
    "HUMAN_FORMAT_VERSION",
    "NEWEST_FORMAT_VERSION",
    "SHAPED_FORMAT_VERSION",
    "CheckpointDelta",
    "CheckpointError",
    "DriveRecord",
    "FailureRecord",
    "RecordedGraph",
    "UnsupportedFormatError",
    "WorkflowCheckpoint",
    "same_output",
]

FORMAT_VERSION = 1
"""The checkpoint format of a static graph's run: what most checkpoints are written in."""

SHAPED_FORMAT_VERSION = 2
"""The format of a checkpoint that records run-time shapes or skipped steps (every
format-1 checkpoint reads as it did)."""

NEWEST_FORMAT_VERSION = HUMAN_FORMAT_VERSION
"""The newest format this library reads: 3, a checkpoint that records questions
(``asked``, see :mod:`ekit_core.human`); written only then."""


class CheckpointError(ValueError):
    """A malformed checkpoint. ``field`` names the offending field (``'cost.llm_calls'``)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"checkpoint field {field!r}: {problem}")
        self.field = field
        self.problem = problem


class UnsupportedFormatError(CheckpointError):
    """The checkpoint was written in a format version newer than this library reads."""


@dataclass(frozen=True, slots=True)
class FailureRecord:
    """The latest failure of a step: exception type, message, failed attempts so far.

    ``began`` and ``ended`` say when that latest failed attempt ran (UTC epoch
    seconds), for a run that records durations; earlier failed attempts keep
    no times (the record stays one per step).
    """

    error_type: str
    message: str
    attempts: int = 1
    began: float | None = None
    ended: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the checkpoint (the times only when known)."""
        data: dict[str, Any] = {
            "error_type": self.error_type, "message": self.message, "attempts": self.attempts}
        if self.began is not None and self.ended is not None:
            data["began"], data["ended"] = self.began, self.ended
        return data


@dataclass(frozen=True, slots=True)
class DriveRecord:
    """One drive of a run: ``worker`` (who drove it, as it names itself) from ``began``.

    ``began`` is when that drive started, UTC epoch seconds, by the driver's
    clock. A run started with ``worker=`` (every run a queue's worker drives)
    appends one to the checkpoint's ``drives``: the attempts that began from
    then until the next drive's ``began`` ran there (one driver at a time:
    invariant 8).
    """

    worker: str
    began: float

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the checkpoint."""
        return {"worker": self.worker, "began": self.began}


NO_DRIVES: tuple[DriveRecord, ...] = ()


def storable_text(text: str) -> str:
    """``text`` with what no store can encode (lone surrogates) escaped as ``\\udcxx``.

    Failure records are text the library writes, so they must always reach
    storage: an ``OSError`` naming a file from ``os.listdir`` may carry a
    lone surrogate, which UTF-8 cannot hold.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def describe_error(error: BaseException) -> tuple[str, str]:
    """``(type name, message)`` of ``error`` as a failure record holds them: always storable.

    An exception whose ``__str__`` raises is described by its type alone.
    """
    try:
        message = str(error)
    except Exception as exc:
        message = f"<unprintable {type(error).__name__}: str() raised {type(exc).__name__}>"
    return storable_text(type(error).__qualname__), storable_text(message)


def _empty() -> MappingProxyType[str, Any]:
    return MappingProxyType({})


_NOTHING: MappingProxyType[str, str] = MappingProxyType({})
_NOTHING_REDONE: MappingProxyType[str, int] = MappingProxyType({})
_NO_HITS: MappingProxyType[str, CacheHit] = MappingProxyType({})
_NO_SHAPES: MappingProxyType[str, Shape] = MappingProxyType({})


class _Unset:
    """The type of ``_GRAPHS``: a fingerprint not given, to be read off the graph."""


_GRAPHS = _Unset()


@dataclass(frozen=True, slots=True)
class _CheckpointFields:
    """The fields of a :class:`WorkflowCheckpoint`, which see.

    A base of its own so that ``WorkflowCheckpoint`` can define, in its own
    body, the one field read through a property: ``fingerprint``, which a
    checkpoint the core makes leaves to be hashed when first read.
    """

    step_index: int
    outputs: MappingProxyType[str, Any]
    cost: TokenUsage = NO_USAGE
    context: MappingProxyType[str, Any] = field(default_factory=_empty)
    step_usage: MappingProxyType[str, TokenUsage] = field(default_factory=_empty)
    failures: MappingProxyType[str, FailureRecord] = field(default_factory=_empty)
    # Both left out of the repr: asyncio and loggers repr results in passing,
    # and a graph may have many thousands of steps.
    fingerprint: str | None = field(default=None, repr=False)
    # A plain mapping, or (read by from_dict, or made by the core) a
    # RecordedGraph: the graph as the two strings it is written as, decoded
    # when first read (see RecordedGraph).
    graph: Mapping[str, tuple[str, ...]] | None = field(default=None, repr=False)
    format_version: int = FORMAT_VERSION
    versions: MappingProxyType[str, str] = field(default_factory=_empty)
    # Steps (and items) skipped by a condition, with why; the run-time shapes
    # the graph declares (see ekit_core.shapes). Both empty for a static graph.
    skipped: MappingProxyType[str, str] = field(default_factory=_empty)
    shapes: MappingProxyType[str, Shape] = field(default_factory=_empty, repr=False)
    # Outputs set aside when the step an item maps over runs again (a rewind,
    # a changed version), with the items made from them: an item whose new
    # input is unchanged keeps its output (the early cutoff).
    superseded: MappingProxyType[str, Any] = field(default_factory=_empty, repr=False)
    # The questions steps asked a person, and the answers given (see
    # ekit_core.human): empty for a run that never asked.
    asked: MappingProxyType[str, tuple[Exchange, ...]] = field(default_factory=_empty)
    # Step (or item) -> the seconds the attempt whose output is recorded
    # took: sparse (only outputs the shell timed), see docs/checkpoint-format.md.
    # Read through a property: a checkpoint the core makes leaves it unset,
    # built from ``_times`` when first read.
    durations: Mapping[str, float] = field(default_factory=_empty, repr=False)
    # The ledgers behind ``outputs`` and ``step_usage`` when the core made this
    # checkpoint, so that deltas between checkpoints of one run cost O(delta):
    # set by of_ledgers. Two fields, not a tuple: one object fewer per
    # checkpoint kept alive.
    _outputs_ledger: Ledger[str, Any] | None = field(default=None, repr=False, compare=False)
    _usage_ledger: Ledger[str, TokenUsage] | None = field(default=None, repr=False, compare=False)
    # The run's timings when the core made this checkpoint (see Timings):
    # what ``durations`` is built from, and what deltas walk in O(delta).
    _times: Timings | None = field(default=None, repr=False, compare=False)
    # Step (or item) -> how many of its recorded outputs were let go of on
    # purpose (a rewind; a changed version, dependencies or shape): its
    # attempts count on past the ones that made them, so that an attempt's
    # key never names two pieces of work (see ekit_core.state.attempt_number).
    redone: MappingProxyType[str, int] = field(default_factory=_empty)
    # Step (or item) -> when the attempt whose output is recorded began (UTC
    # epoch seconds): beside ``durations``, for the outputs whose attempt the
    # shell said when it began. Read through a property, as ``durations``.
    began: Mapping[str, float] = field(default_factory=_empty, repr=False)
    # Loop (``repeat=``, ``keep_last=``) -> how many of its first iterations had
    # their outputs compacted: dropped from the checkpoint on purpose, counted here.
    # Empty unless a loop keeps its last iterations only.
    compacted: MappingProxyType[str, int] = field(default_factory=_empty)
    # Loop -> the most failed attempts any of its compacted iterations made: their
    # failure records, which counted them, go with their outputs, and a resume that
    # runs them again (the loop's work changed) numbers its attempts past these, so
    # that no attempt key names two pieces of work. Empty unless one had failed.
    compacted_retries: MappingProxyType[str, int] = field(default_factory=_empty)
    # Issue 45: step -> the fingerprint of the code that made its recorded
    # outputs (and its items'), for the steps whose workflow asked for
    # fingerprints; see ekit_core.code for what a resume does when it changed.
    code_fingerprints: MappingProxyType[str, str] = field(default_factory=_empty, repr=False)
    # Step (or item) -> the cache hit its recorded output came from (issue 45:
    # docs/cache.md), kept while that output stays recorded.
    cache_hits: MappingProxyType[str, CacheHit] = field(default_factory=_empty, repr=False)
    # Issue 47: the run's drives, oldest first, each a worker and when it began
    # (see DriveRecord): one entry per drive, none per step.
    drives: tuple[DriveRecord, ...] = field(default=NO_DRIVES, repr=False)
    # Issue 47: step (or item) -> the limits that held the attempt behind its
    # ``began`` before it began, each with the seconds it held it, in the order
    # they held it: sparse (only attempts a limit held), beside ``began``.
    # Read through a property, as ``began``: built from the run's timings.
    held: Mapping[str, Mapping[str, float]] = field(default_factory=_empty, repr=False)


_STORED_FINGERPRINT: Any = vars(_CheckpointFields)["fingerprint"]  # the slot under the property
_STORED_DURATIONS: Any = vars(_CheckpointFields)["durations"]
_STORED_BEGAN: Any = vars(_CheckpointFields)["began"]
_STORED_CODE: Any = vars(_CheckpointFields)["code_fingerprints"]
_STORED_HITS: Any = vars(_CheckpointFields)["cache_hits"]
_STORED_RETRIES: Any = vars(_CheckpointFields)["compacted_retries"]
_STORED_DRIVES: Any = vars(_CheckpointFields)["drives"]
_STORED_HELD: Any = vars(_CheckpointFields)["held"]

Timings: TypeAlias = (
    "tuple[str, float, Timings] | tuple[str, float, Timings, float] "
    "| tuple[str, float, Timings, float, Mapping[str, float]] | Mapping[str, float] | None")
"""A run's durations as the core records them, one tuple per timed success.

``(name, seconds, before)``, or ``(name, seconds, before, began)`` when the
shell said when the attempt began (the checkpoint's ``began``), or
``(name, seconds, before, began, held)`` when a limit held the attempt before
it began (the checkpoint's ``held``: limit -> seconds), ``before``
the timings up to then, down to the
mapping the run started from (the recorded durations of a resume), or
``None`` when it started from none (a fresh run: the tuples then hold no
container, and the collector stops tracking them). Why not
a :class:`~ekit_core.ledger.Ledger`, as outputs are: a tuple is one object
built by one bytecode, where ``with_item`` is a method call (about 4k
instructions a step, measured: 3 % of a chain step); and tuples are
persistent, so branches of a run share them with nothing to claim. The
cost moves to the readers: ``WorkflowCheckpoint.durations`` is built when
first read (O(timed steps), once per checkpoint: what writing it out
costs anyway) and a delta walks back to the previous checkpoint's
timings (O(new)). Seconds are rounded to microseconds as they are read.
"""


class WorkflowCheckpoint(_CheckpointFields):
    """What a run has finished so far, as an immutable value.

    ``step_index`` is the number of completed steps; ``outputs`` maps each
    completed step to its output; ``cost`` is the usage accumulated so far.
    The other fields are optional: the initial ``context`` of the run,
    per-step usage, the latest failure of steps that failed (a failure is
    not an output: such a step runs again on resume), the ``graph`` the run
    was made of (step -> dependencies) with its ``fingerprint``, the
    ``format_version``, and the ``versions`` that steps declared (a tag the
    user bumps when a step's code changes: a recorded output whose tag
    differs runs again on resume). A run with run-time shapes also records
    the ``shapes`` its graph declares and the steps (and items) it
    ``skipped``, with why; the outputs of a mapped step's items are recorded
    under their names, ``step[key]``, beside the step's own (collected)
    output. Such a checkpoint has format ``SHAPED_FORMAT_VERSION``. A run
    whose steps asked a person records in ``asked`` each such step's
    questions and the answers given so far (:class:`~ekit_core.exchanges.Exchange`
    values, in the order asked); such a checkpoint has format
    ``HUMAN_FORMAT_VERSION``. ``durations`` maps a recorded step (or item)
    to the seconds the attempt that made its output took, for the outputs
    the shell timed (a mapped step's collected output has none: it never
    ran); a rewound or outdated step loses its entry with its output.
    ``began`` maps the same outputs to when that attempt began (UTC epoch
    seconds), where the shell said so.
    """

    __slots__ = ()

    @property
    def fingerprint(self) -> str | None:
        """The fingerprint of the graph the checkpoint was recorded from (``None``: no claim).

        A checkpoint the core makes leaves it unset: its graph's, hashed once
        per graph when first read, so that a run whose checkpoints are never
        written out, or a resume that compares graphs, hashes nothing.
        """
        try:
            fingerprint: str | _Unset | None = _STORED_FINGERPRINT.__get__(self, WorkflowCheckpoint)
        except AttributeError:  # (built by __init__ without one)
            fingerprint = _GRAPHS
        # The core's checkpoints hold _GRAPHS (see fast_checkpoint):
        # read once per save, so no exception is raised and caught for them.
        if isinstance(fingerprint, _Unset):
            graph = self.graph
            fingerprint = graph.fingerprint if type(graph) is RecordedGraph else None
            _STORED_FINGERPRINT.__set__(self, fingerprint)
        return fingerprint

    @fingerprint.setter
    def fingerprint(self, value: str | None) -> None:
        # Only __init__ gets here (through object.__setattr__): the value is frozen.
        _STORED_FINGERPRINT.__set__(self, value)

    @property
    def durations(self) -> Mapping[str, float]:
        """Recorded step (or item) -> seconds its output's attempt took (see the class).

        A checkpoint the core makes leaves it unset: built from the run's
        timings when first read (see :data:`Timings`), so that a run whose
        checkpoints are never written out builds none.
        """
        try:
            table: Mapping[str, float] = _STORED_DURATIONS.__get__(self, WorkflowCheckpoint)
        except AttributeError:
            table = _timed(self._times)
            _STORED_DURATIONS.__set__(self, table)
        return table

    @durations.setter
    def durations(self, value: Mapping[str, float]) -> None:
        # Only __init__ gets here (through object.__setattr__): the value is frozen.
        _STORED_DURATIONS.__set__(self, value)

    @property
    def began(self) -> Mapping[str, float]:
        """Recorded step (or item) -> when its output's attempt began, UTC epoch seconds.

        Built from the run's timings when first read, as :attr:`durations` is.
        """
        try:
            table: Mapping[str, float] = _STORED_BEGAN.__get__(self, WorkflowCheckpoint)
        except AttributeError:
            table = _begun(self._times)
            _STORED_BEGAN.__set__(self, table)
        return table

    @began.setter
    def began(self, value: Mapping[str, float]) -> None:
        _STORED_BEGAN.__set__(self, value)

    @property
    def held(self) -> Mapping[str, Mapping[str, float]]:
        """Recorded step (or item) -> the limits that held its output's attempt before it began,
        each with the seconds it held it (``{"max_concurrency": 1.5}``), in the order they held it.

        Only attempts a limit held have an entry (see docs/checkpoint-format.md); built
        from the run's timings when first read, as :attr:`began` is.
        """
        try:
            table: Mapping[str, Mapping[str, float]] = _STORED_HELD.__get__(self, WorkflowCheckpoint)
        except AttributeError:
            table = _held_table(self._times)
            _STORED_HELD.__set__(self, table)
        return table

    @held.setter
    def held(self, value: Mapping[str, Mapping[str, float]]) -> None:
        _STORED_HELD.__set__(self, value)

    @classmethod
    def of_ledgers(
        cls, outputs: Ledger[str, Any], step_usage: Ledger[str, TokenUsage], *,
        step_index: int, cost: TokenUsage, context: MappingProxyType[str, Any],
        failures: MappingProxyType[str, FailureRecord],
        graph: Mapping[str, tuple[str, ...]] | None, versions: MappingProxyType[str, str],
        fingerprint: str | _Unset | None = _GRAPHS, format_version: int | None = None,
        skipped: MappingProxyType[str, str] = _NOTHING,
        shapes: MappingProxyType[str, Shape] = _NO_SHAPES,
        superseded: MappingProxyType[str, Any] = _NOTHING,
        asked: MappingProxyType[str, tuple[Exchange, ...]] = NO_EXCHANGES,
        durations: Timings | None = None,
        redone: MappingProxyType[str, int] = _NOTHING_REDONE,
        began: Mapping[str, float] | None = None,
        compacted: MappingProxyType[str, int] = _NOTHING_REDONE,
        code_fingerprints: MappingProxyType[str, str] = _NOTHING,
        cache_hits: MappingProxyType[str, CacheHit] = _NO_HITS,
        compacted_retries: MappingProxyType[str, int] = _NOTHING_REDONE,
        drives: tuple[DriveRecord, ...] = NO_DRIVES,
        held: Mapping[str, Mapping[str, float]] | None = None,
    ) -> WorkflowCheckpoint:
        """The checkpoint whose outputs and usage are those of two append-only ledgers
        (and whose ``durations`` those ``durations`` timings hold, a mapping or the core's;
        ``began``, when given, is the checkpoint's, else read off those timings).

        What the core and the journal store make once per step: O(1) (the
        ledgers are shared, not copied, and nothing is checked), and the
        deltas between two such checkpoints of one run cost O(what changed).
        Without a ``fingerprint``, ``graph`` is a :class:`RecordedGraph` of a
        graph spec, whose fingerprint is the checkpoint's, hashed when first read.
        Built without ``__init__``, which costs more than twice as much, by
        :func:`fast_checkpoint` (see :mod:`ekit_core._frozen`).
        """
        if format_version is None:  # a new format only where a checkpoint needs one
            format_version = (HUMAN_FORMAT_VERSION if asked else
                              SHAPED_FORMAT_VERSION if skipped or shapes else FORMAT_VERSION)
        cp = fast_checkpoint(
            outputs, step_usage, durations,
            step_index=step_index, cost=cost, context=context,
            failures=failures, graph=graph, versions=versions, fingerprint=fingerprint,
            format_version=format_version, kind=cls, skipped=skipped, shapes=shapes,
            superseded=superseded, asked=asked, redone=redone, compacted=compacted,
        )
        with_tables(cp, code_fingerprints, cache_hits, drives)
        with_retries(cp, compacted_retries)
        if began is not None:
            _STORED_BEGAN.__set__(cp, began)
        if held is not None:
            _STORED_HELD.__set__(cp, held)
        return cp

    def _records_graph(self, spec: GraphSpec) -> bool:
        """Whether the recorded graph is ``spec``'s (same steps, in the same
        order, with the same dependencies), compared without decoding it."""
        if (spec.shapes or self.shapes) and self.shapes != spec.shapes:
            return False  # the same steps, shaped otherwise: another graph
        graph = self.graph
        if type(graph) is RecordedGraph:
            return graph.is_of(spec)
        deps = spec.deps
        return graph is not None and (graph is deps or graph == deps)

    @property
    def _graph_texts(self) -> tuple[str, str] | None:
        """The recorded graph's two strings, when it is kept as such."""
        graph = self.graph
        return graph.texts if type(graph) is RecordedGraph else None

    def check_graph(self) -> None:
        """Decode the recorded graph now if ``from_dict`` kept it as read:
        texts naming a step twice raise :class:`CheckpointError` here.

        Loaders call it so that the fault is told where the checkpoint was
        read; a resume into another graph calls it before it trusts the
        fingerprint. A no-op once the graph is decoded or matched.
        """
        graph = self.graph
        if type(graph) is RecordedGraph:
            graph.decoded()

    def _recorded_texts(self) -> tuple[str, str] | None:
        """The recorded graph as ``to_dict`` writes it: as read, or spelt."""
        graph = self.graph
        if graph is None:
            return None
        if type(graph) is RecordedGraph:
            return graph.texts  # spelt once per graph, however many checkpoints
        return spell(tuple(graph), graph)

    def delta_since(self, previous: WorkflowCheckpoint | None) -> CheckpointDelta:
        """What this checkpoint adds to ``previous``, an earlier checkpoint of the same run.

        Costs O(what changed) when both came from one run of the core, O(outputs)
        otherwise. ``extends`` is false when ``previous`` is not a prefix of this
        checkpoint (another run, an output that changed, a skip that is gone or
        whose reason changed, other shapes, other versions, other outputs set
        aside); the delta then holds everything.
        Outputs (and context values) are compared with :func:`same_output`, so
        a NaN output, or one read back from a file as a fresh but equal
        object, is not a change.

        A new drive of the run is a change like any other of its tables (the
        delta holds everything): see :meth:`delta_driving` for a writer that
        stores each drive as an entry of its own.
        """
        if previous is None:
            return _full_delta(self, extends=True)
        grown = _grown(self, previous)
        if grown is not None:
            return grown
        return _delta_in_general(self, previous, drive_rows=False)

    def delta_driving(self, previous: WorkflowCheckpoint | None) -> CheckpointDelta:
        """:meth:`delta_since`, for a writer that stores each drive as an entry of its own: a
        checkpoint whose ``drives`` extend ``previous``'s (a new drive of the run began)
        still extends it, the new drives in the delta's ``drives``."""
        if previous is None:
            return _full_delta(self, extends=True)
        grown = _grown(self, previous)
        if grown is not None:
            return grown
        return _delta_in_general(self, previous, drive_rows=True)

    def delta_compacting(
        self, previous: WorkflowCheckpoint | None, *, drive_rows: bool = False
    ) -> CheckpointDelta:
        """:meth:`delta_since`, for a writer that can let go of entries: a checkpoint whose
        loops compacted more iterations (``keep_last``) than ``previous`` counts still
        extends it. The delta's ``compacted`` then holds each such loop's new count, and
        a writer applying it first lets go of those iterations' outputs, usage, durations
        and began times (their failure records go as any cleared failure). Otherwise (the
        counts do not only grow, or a compacted iteration's question goes) it is
        :meth:`delta_since`'s. O(outputs) when it compacts; ``delta_since``'s cost else.
        ``drive_rows=True``: :meth:`delta_driving`'s instead.
        """
        since = WorkflowCheckpoint.delta_driving if drive_rows else WorkflowCheckpoint.delta_since
        delta = since(self, previous)
        if (delta.extends or previous is None or self.compacted is previous.compacted
                or self.compacted == previous.compacted):
            return delta
        base = _compacted_base(self, previous)
        if base is None:
            return delta
        inner = since(self, base)
        if not inner.extends:
            return delta
        before = previous.compacted
        return replace(inner, compacted=MappingProxyType(
            {loop: n for loop, n in self.compacted.items() if before.get(loop, 0) != n}))

    def to_dict(self, *, per_step: bool = True) -> dict[str, Any]:
        """Plain Python values only: dicts, str, int and the outputs as given.

        ``json.dumps(cp.to_dict())`` works whenever the outputs and context are
        JSON-safe. The graph is written as ``graph_steps`` and ``graph_needs``
        (see docs/checkpoint-format.md). ``per_step=False`` leaves ``outputs``
        and ``step_usage`` empty and ``durations`` out, for a writer that
        encodes those itself, entry by entry (the stores do), so that the
        rest costs the same however many steps are recorded. ``durations``
        is written only when it has entries (and needs no new format: a
        reader that does not know it ignores it).
        """
        data: dict[str, Any] = {
            "format_version": self.format_version,
            "step_index": self.step_index,
            "outputs": dict(self.outputs) if per_step else {},
            "cost": self.cost.to_dict(),
            "context": dict(self.context),
            "step_usage": {k: u.to_dict() for k, u in self.step_usage.items()} if per_step else {},
            "failures": {k: f.to_dict() for k, f in self.failures.items()},
        }
        if self.fingerprint is not None:
            data["fingerprint"] = self.fingerprint
        texts = self._recorded_texts()
        if texts is not None:
            data["graph_steps"], data["graph_needs"] = texts
        if self.versions:
            data["versions"] = dict(self.versions)
        if self.skipped:
            data["skipped"] = dict(self.skipped)
        if self.shapes:
            data["shapes"] = {k: s.to_dict() for k, s in self.shapes.items()}
        if self.superseded:
            data["superseded"] = dict(self.superseded)
        if self.asked:
            data["asked"] = {k: [e.to_dict() for e in ex] for k, ex in self.asked.items()}
        if self.redone:
            data["redone"] = dict(self.redone)
        data.update((key, dict(table)) for key, table in (
            ("compacted", self.compacted), ("compacted_retries", self.compacted_retries)) if table)
        _tables_into(self, data)
        if per_step and has_durations(self):
            data["durations"] = dict(self.durations)
            if self.began:
                data["began"] = dict(self.began)
            if self.held:
                data["held"] = {k: dict(h) for k, h in self.held.items()}
        return data

    @classmethod
    def from_dict(cls, data: object) -> WorkflowCheckpoint:
        """Parse a checkpoint from plain data (for example ``json.loads`` output).

        Raises :class:`CheckpointError` (a ``ValueError``) naming the field for
        any missing key, wrong type, negative count, or ``bool`` where an int
        belongs; :class:`UnsupportedFormatError` for a newer format version.
        """
        if not isinstance(data, dict):
            raise CheckpointError("<checkpoint>", f"must be a dict, got {type(data).__name__}")
        version = _format_version(data)
        fingerprint = data.get("fingerprint")
        if fingerprint is not None:
            if not isinstance(fingerprint, str):
                raise CheckpointError(
                    "fingerprint", f"must be a string, got {type(fingerprint).__name__}"
                )
            fingerprint = _plain(fingerprint)
        texts, graph = _recorded_graph(data)
        step_usage = _table(data.get("step_usage", {}), "step_usage")
        failures = _table(data.get("failures", {}), "failures")
        versions = _table(data.get("versions", {}), "versions")
        for name, tag in versions.items():
            if not isinstance(tag, str):
                raise CheckpointError(f"versions.{name}", f"must be a string, got {type(tag).__name__}")
        skipped, shapes = _skipped_and_shapes(data)
        outputs = _table(data["outputs"], "outputs")
        return cls(
            step_index=_count(data["step_index"], "step_index"),
            outputs=MappingProxyType(outputs),
            cost=_usage(data["cost"], "cost"),
            context=MappingProxyType(_table(data.get("context", {}), "context")),
            step_usage=MappingProxyType(
                {k: _step_usage(v, k) for k, v in step_usage.items()}
            ),
            failures=MappingProxyType(
                {k: _failure(v, f"failures.{k}") for k, v in failures.items()}
            ),
            fingerprint=fingerprint,
            graph=graph if texts is None else RecordedGraph(texts, graph),
            format_version=version,
            versions=MappingProxyType(versions),
            skipped=MappingProxyType(skipped),
            shapes=MappingProxyType(shapes),
            superseded=MappingProxyType(_table(data.get("superseded", {}), "superseded")),
            asked=_asked(data.get("asked")),
            durations=check_durations(data.get("durations")),
            redone=_redone(data.get("redone", {})), **_loop_tables(data),
            began=check_began(data.get("began")),
            **_issue_45_tables(data),
        )


class RecordedGraph(Mapping[str, tuple[str, ...]]):
    """A recorded graph (step -> dependencies) kept as the two strings it is written as.

    ``texts`` are ``graph_steps`` and ``graph_needs`` (see
    :mod:`ekit_core.graph_text`). A resume compares them with its own
    graph's (:meth:`is_of`) and most never decode them; reading the mapping
    decodes them once (texts naming a step twice raise :class:`CheckpointError`
    then). ``spec``, when known, is a graph whose texts these are. Equal to
    any mapping with the same items.
    """

    __slots__ = ("_deps", "_spec", "_texts")

    def __init__(
        self, texts: tuple[str, str] | None, deps: Mapping[str, tuple[str, ...]] | None = None,
        spec: GraphSpec | None = None,
    ) -> None:
        self._texts = texts  # None only when spec is given: its texts, spelt when first asked
        # The decoded mapping, if known: decoded, or a graph whose texts equal these.
        self._deps = deps
        self._spec = spec

    @classmethod
    def of(cls, spec: GraphSpec) -> RecordedGraph:
        """``spec``'s graph as a checkpoint records it: spelt only when written out."""
        return cls(None, spec.deps, spec)

    @property
    def texts(self) -> tuple[str, str]:
        """``graph_steps`` and ``graph_needs``."""
        texts = self._texts
        if texts is None:
            texts = self._texts = cast(GraphSpec, self._spec).texts
        return texts

    @property
    def fingerprint(self) -> str | None:
        """The fingerprint of the graph spec these texts are of, if known (hashed once per graph)."""
        spec = self._spec
        return None if spec is None else spec.fingerprint

    def is_of(self, spec: GraphSpec) -> bool:
        """Whether these are ``spec``'s texts; on a match the mapping is ``spec.deps``."""
        deps = spec.deps
        if self._deps is deps:
            return True
        if self._spec is spec or self.texts == spec.texts:
            self._deps = deps  # the same value, already built
            return True
        return False

    def decoded(self) -> Mapping[str, tuple[str, ...]]:
        """The mapping the texts spell, decoded on first call."""
        deps = self._deps
        if deps is None:
            deps = self._deps = MappingProxyType(_decoded(*cast(tuple[str, str], self._texts)))
        return deps

    def __getitem__(self, name: str) -> tuple[str, ...]:
        return self.decoded()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.decoded())

    def __len__(self) -> int:
        return len(self.decoded())

    def __repr__(self) -> str:
        return f"RecordedGraph({dict(self.decoded())!r})"


@dataclass(frozen=True, slots=True)
class CheckpointDelta:
    """What a checkpoint adds to an earlier one: see :meth:`WorkflowCheckpoint.delta_since`.

    ``outputs``, ``step_usage`` and ``durations`` list the new entries in completion order;
    ``failures`` the records that are new or changed; ``cost`` the usage
    added; ``context_changed`` whether the run's context differs;
    ``skipped`` the skips that are new (skips only grow within a run), with
    their reasons, in the order they were recorded; ``asked_changed``
    whether the questions and answers (``asked``) differ: a step asked, or a
    person answered (rare: a store writes the checkpoint in full then, as
    for a changed context); ``compacted`` (only from
    :meth:`WorkflowCheckpoint.delta_compacting`) the loops whose compacted
    count grew, with the new count: a writer lets go of their iterations up
    to it before it adds the new entries; ``drives`` (only with
    ``drive_rows=True``) the drives that began since, oldest first.
    """

    extends: bool
    outputs: tuple[tuple[str, Any], ...]
    step_usage: tuple[tuple[str, TokenUsage], ...]
    failures: MappingProxyType[str, FailureRecord]
    cost: TokenUsage
    context_changed: bool
    skipped: MappingProxyType[str, str] = field(default_factory=_empty)
    asked_changed: bool = False
    durations: tuple[tuple[str, float], ...] = ()
    # When the new durations' attempts began (a subset of their names).
    began: tuple[tuple[str, float], ...] = ()
    compacted: MappingProxyType[str, int] = field(default_factory=_empty)
    # The limits that held the new durations' attempts (a subset of their names).
    held: tuple[tuple[str, Mapping[str, float]], ...] = ()
    # The drives that began since (only with ``drive_rows=True``), oldest first.
    drives: tuple[DriveRecord, ...] = NO_DRIVES


# -- built fast (see ekit_core._frozen): once per checkpoint, once per save ------------

_CheckpointTwin = twin(WorkflowCheckpoint)
_DeltaTwin = twin(CheckpointDelta)


def fast_checkpoint(
    outputs: Ledger[str, Any], step_usage: Ledger[str, TokenUsage], times: Timings,
    # Before the "*": a positional default is filled from a tuple, a
    # keyword-only one looked up in a dict (on every call, once per step);
    # and a shaped run's checkpoint (each item, each iteration) passes these
    # positionally: a keyword is matched by name against every parameter.
    asked: MappingProxyType[str, Any] = _NOTHING,
    compacted: MappingProxyType[str, int] = _NOTHING_REDONE,
    skipped: MappingProxyType[str, str] = _NOTHING,
    shapes: MappingProxyType[str, Shape] = _NO_SHAPES,
    superseded: MappingProxyType[str, Any] = _NOTHING,
    format_version: int = FORMAT_VERSION, *,
    step_index: int, cost: TokenUsage, context: MappingProxyType[str, Any],
    failures: MappingProxyType[str, FailureRecord],
    graph: Mapping[str, tuple[str, ...]] | None, versions: MappingProxyType[str, str],
    fingerprint: str | _Unset | None = _GRAPHS,
    kind: type[WorkflowCheckpoint] = WorkflowCheckpoint,
    redone: MappingProxyType[str, int] = _NOTHING_REDONE,
) -> WorkflowCheckpoint:
    """:meth:`WorkflowCheckpoint.of_ledgers`, which see, built through a twin.

    Without a ``fingerprint`` the field holds ``_GRAPHS``, for the checkpoint's
    ``fingerprint`` property to read off ``graph`` when first asked; ``kind``
    is the class ``of_ledgers`` was called on.
    """
    cp = _CheckpointTwin()
    cp.step_index, cp.outputs, cp.cost = step_index, MappingProxyType(outputs), cost
    cp.context, cp.step_usage = context, MappingProxyType(step_usage)
    cp.failures, cp.graph = failures, graph
    cp.fingerprint = fingerprint
    cp.format_version, cp.versions = format_version, versions
    cp.skipped, cp.shapes, cp.superseded, cp.redone, cp.compacted = (
        skipped, shapes, superseded, redone, compacted)
    cp.compacted_retries = _NOTHING_REDONE  # (set by with_retries where a loop's has any)
    # (issue 45's tables: empty here, set by with_tables where a run has them; no
    # keyword of their own, whose default is a dict lookup on every call)
    cp.code_fingerprints = cp.cache_hits = _NOTHING
    cp.drives = NO_DRIVES
    # (durations left unset: built from the timings when first read)
    cp.asked, cp._times = asked, times
    cp._outputs_ledger, cp._usage_ledger = outputs, step_usage
    cp.__class__ = kind
    made: WorkflowCheckpoint = cp  # (not typing.cast: a Python call per value built; see _frozen)
    return made


def fast_delta(
    outputs: tuple[tuple[str, Any], ...], step_usage: tuple[tuple[str, TokenUsage], ...],
    cost: TokenUsage, durations: tuple[tuple[str, float], ...],
    began: tuple[tuple[str, float], ...] = (),
    held: tuple[tuple[str, Mapping[str, float]], ...] = (),
) -> CheckpointDelta:
    """The delta of the usual save: ``CheckpointDelta(True, outputs, step_usage, no failures,
    cost, False, no skips, False, durations)`` (a prefix extended, nothing else changed)."""
    value = _DeltaTwin()
    value.extends = True
    value.outputs = outputs
    value.step_usage = step_usage
    value.failures = _NO_FAILURES
    value.cost = cost
    value.context_changed = False
    value.skipped = _NOTHING
    value.asked_changed = False
    value.durations = durations
    value.began = began
    value.compacted = _NOTHING_REDONE
    value.held = held
    value.drives = NO_DRIVES
    value.__class__ = CheckpointDelta
    made: CheckpointDelta = value  # (not typing.cast: a Python call per value built; see _frozen)
    return made


def same_output(a: object, b: object) -> bool:
    """Whether two recorded values are the same output: identical, equal, or stored alike.

    Identity comes first because ``==`` need not be reflexive: ``nan == nan``
    is false, so a NaN output compared with itself would look changed. Then
    equality (an ``==`` that raises or gives no plain truth value, as an
    array's does, counts as not equal). Last, two values whose canonical JSON
    encodings agree are the same: a checkpoint read back from a file holds a
    fresh ``nan``, and a tuple comes back as a list; neither is a change. A
    value JSON cannot encode is compared by identity and equality only.
    """
    if a is b:
        return True
    try:
        if bool(a == b):
            return True
    except Exception:  # an output's __eq__ or __bool__ is arbitrary code
        pass
    mine = _encoded(a)
    return mine is not None and mine == _encoded(b)


def _encoded(value: object) -> str | None:
    try:
        return json.dumps(value, sort_keys=True, allow_nan=True, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        # Not JSON (a custom object, a circular or too deep structure, keys
        # that cannot be sorted): no encoding to compare.
        return None


def _equal(a: object, b: object) -> bool:
    return a == b


def _holds(
    mine: Mapping[str, Any], theirs: Mapping[str, Any], same: Callable[[Any, Any], bool]
) -> bool:
    """Does ``mine`` hold every entry of ``theirs``, each the same by ``same``?"""
    return all(key in mine and same(mine[key], value) for key, value in theirs.items())


def _compacted_base(cp: WorkflowCheckpoint, previous: WorkflowCheckpoint) -> WorkflowCheckpoint | None:
    """``previous`` as a writer holds it once it let go of the iterations ``cp`` newly counts as
    compacted, with ``cp``'s counts; ``None`` when a count does not only grow, or a
    question of one of those iterations goes with it (written in full, as any change of
    the questions is). (A save whose ``compacted_retries`` grew, rare, does not extend it:
    ``delta_since`` of the result compares them.)"""
    now, before = cp.compacted, previous.compacted
    if any(loop not in now or now[loop] < n for loop, n in before.items()):
        return None
    gone = {iteration_name(loop, k) for loop, n in now.items()
            for k in range(before.get(loop, 0) + 1, n + 1)}
    if any(s.child is not None and s.repeat is not None for s in cp.shapes.values()):
        # (a body's steps, and the items of its maps, go with their loop's iterations)
        gone.update(name for name in previous.outputs
                    if compacted_iteration(name, now, cp.shapes) is not None)
    if not gone.isdisjoint(previous.asked):
        return None

    def kept(table: Mapping[str, Any]) -> MappingProxyType[str, Any]:
        return MappingProxyType({k: v for k, v in table.items() if k not in gone})

    return replace(previous, outputs=kept(previous.outputs), step_usage=kept(previous.step_usage),
                   durations=kept(previous.durations), began=kept(previous.began),
                   held=kept(previous.held), failures=kept(previous.failures), compacted=now)


def _full_delta(cp: WorkflowCheckpoint, *, extends: bool) -> CheckpointDelta:
    return CheckpointDelta(
        extends=extends,
        outputs=tuple(cp.outputs.items()),
        step_usage=tuple(cp.step_usage.items()),
        failures=cp.failures,
        cost=cp.cost,
        context_changed=bool(cp.context),
        skipped=cp.skipped,
        asked_changed=bool(cp.asked),
        durations=tuple(cp.durations.items()) if has_durations(cp) else (),
        began=tuple(cp.began.items()) if has_durations(cp) else (),
        held=tuple(cp.held.items()) if has_durations(cp) else (),
    )


def _delta_in_general(
    cp: WorkflowCheckpoint, previous: WorkflowCheckpoint, *, drive_rows: bool
) -> CheckpointDelta:
    """:meth:`WorkflowCheckpoint.delta_since` (``drive_rows``: ``delta_driving``) where the
    usual save's fast path (:func:`_grown`) cannot decide: O(outputs)."""
    entries = _new_entries(cp, previous)
    if entries is None:
        return _full_delta(cp, extends=False)
    one_run, new_outputs, new_usage = entries
    new_durations = _new_durations(cp, previous)
    skipped = _new_skips(cp.skipped, previous.skipped, one_run=one_run)
    drives = _new_drives(cp.drives, previous.drives) if drive_rows else NO_DRIVES
    if skipped is None or new_durations is None or not _same_shapes(cp.shapes, previous.shapes) or (
            cp.superseded is not previous.superseded and cp.superseded != previous.superseded
    ) or not _same_tables(cp, previous, drives=not drive_rows) or drives is None:
        # (Versions change only when a resume bumps a tag: a store then writes them in full.)
        # (Outputs set aside only change when an expansion lets them go: rarely.)
        return _full_delta(cp, extends=False)
    failures = {
        k: f for k, f in cp.failures.items() if previous.failures.get(k) != f
    }
    return CheckpointDelta(
        extends=True,
        outputs=tuple(new_outputs),
        step_usage=tuple(new_usage),
        durations=new_durations,
        began=_new_began(cp, new_durations) if new_durations else (),
        held=_new_held(cp, new_durations) if new_durations else (),
        failures=MappingProxyType(failures),
        cost=cp.cost - previous.cost,
        context_changed=cp.context is not previous.context
        and not (
            len(cp.context) == len(previous.context)
            and _holds(cp.context, previous.context, same_output)
        ),
        skipped=skipped,
        asked_changed=cp.asked is not previous.asked and cp.asked != previous.asked,
        drives=drives,
    )


def _grown(cp: WorkflowCheckpoint, previous: WorkflowCheckpoint) -> CheckpointDelta | None:
    """The delta of the usual save, or ``None`` when the general comparison must decide.

    The usual save is of the next checkpoint of one run of the core: it shares
    every mapping with the one before (the core copies a mapping only to
    change it) and appends to the ledgers they share. Identity says so in
    O(1), and the delta is the ledgers' new entries. This runs once per save
    of every store and of the queue, so its constant matters: it answers what
    the general path would, without its comparisons and calls.
    """
    mine, theirs = cp._outputs_ledger, previous._outputs_ledger
    my_usage, their_usage = cp._usage_ledger, previous._usage_ledger
    if (
        mine is None or theirs is None or my_usage is None or their_usage is None
        or cp.failures is not previous.failures or cp.skipped is not previous.skipped
        or cp.context is not previous.context or cp.asked is not previous.asked
        or cp.shapes is not previous.shapes or cp.superseded is not previous.superseded
        or cp.versions is not previous.versions or cp.redone is not previous.redone
        or cp.compacted is not previous.compacted or cp.compacted_retries is not previous.compacted_retries
        or cp.code_fingerprints is not previous.code_fingerprints or cp.cache_hits is not previous.cache_hits
        or cp.drives is not previous.drives
    ):
        return None
    # None: not one storage, or an earlier state of the run (not a prefix).
    outputs = mine.added_since(theirs)
    usage = my_usage.added_since(their_usage)
    if outputs is None or usage is None:
        return None
    durations = () if cp._times is previous._times else _new_durations(cp, previous)
    if durations is None:
        return None
    cost = cp.cost
    # (A step that reported no usage leaves the run's cost object as it was.)
    added = NO_USAGE if cost is previous.cost else cost - previous.cost
    if not durations:
        return fast_delta(outputs, usage, added, durations)
    return fast_delta(outputs, usage, added, durations, _new_began(cp, durations),
                      _new_held(cp, durations))


_NO_FAILURES: MappingProxyType[str, FailureRecord] = MappingProxyType({})


def _new_entries(cp: WorkflowCheckpoint, previous: WorkflowCheckpoint) -> tuple[
    bool, Iterable[tuple[str, Any]], Iterable[tuple[str, TokenUsage]]
] | None:
    """Whether both are of one run of the core, and the outputs and usage ``cp`` adds
    to ``previous``; ``None`` when one of ``previous``' is missing or changed."""
    mine, theirs = cp._outputs_ledger, previous._outputs_ledger
    my_usage, their_usage = cp._usage_ledger, previous._usage_ledger
    if (
        mine is not None
        and theirs is not None
        and my_usage is not None
        and their_usage is not None
        and mine.extends(theirs)
        and my_usage.extends(their_usage)
    ):
        return True, mine.items_from(len(theirs)), my_usage.items_from(len(their_usage))
    if _holds(cp.outputs, previous.outputs, same_output) and _holds(
        cp.step_usage, previous.step_usage, _equal
    ):
        # The ledgers are only a fast path: ledgers of two runs (a resume
        # from a checkpoint read back from a file, say) hold equal outputs
        # as distinct objects, and a NaN among them is not == to itself.
        return (
            False,
            [(k, v) for k, v in cp.outputs.items() if k not in previous.outputs],
            [(k, v) for k, v in cp.step_usage.items() if k not in previous.step_usage],
        )
    return None


_NO_TIMES: Mapping[str, float] = MappingProxyType({})


def _micro(seconds: float) -> float:
    """``seconds`` in whole microseconds: ``k / 1e6`` is the float that prints as k
    microseconds, so files stay short ("1.2e-05", not 17 digits)."""
    return round(seconds * 1e6) / 1e6


def _timed(times: Timings | None) -> Mapping[str, float]:
    """The durations mapping of the core's timings (see :data:`Timings`), in recorded order."""
    new = []
    while type(times) is tuple:
        new.append(times)
        times = times[2]
    base = _NO_TIMES if times is None else cast("Mapping[str, float]", times)
    if not new:
        return base
    table = dict(base)
    for node in reversed(new):
        table[node[0]] = _micro(node[1])
    return MappingProxyType(table)


def _begun(times: Timings | None) -> Mapping[str, float]:
    """The ``began`` mapping of the core's timings: the four-field tuples' (see :data:`Timings`).

    A resume puts the began times it read back on top of the mapping it starts
    from (see ``ekit_core.transitions``), so the walk ends at the mapping.
    """
    new = []
    while type(times) is tuple:
        if len(times) >= 4:
            new.append(times)
        times = times[2]
    if not new:
        return _NO_TIMES
    return MappingProxyType({node[0]: _micro(node[3]) for node in reversed(new)})


_NO_HOLDS: Mapping[str, Mapping[str, float]] = MappingProxyType({})


def _held_table(times: Timings | None) -> Mapping[str, Mapping[str, float]]:
    """The ``held`` mapping of the core's timings: the five-field tuples' (see :data:`Timings`).

    A resume puts the holds it read back into five-field tuples over the mapping it
    starts from, as it does the began times, so the walk ends at the mapping."""
    new = []
    while type(times) is tuple:
        if len(times) == 5:
            new.append(times)
        times = times[2]
    if not new:
        return _NO_HOLDS
    return MappingProxyType({node[0]: _held_seconds(node[4]) for node in reversed(new)})


def _held_seconds(held: Mapping[str, float]) -> Mapping[str, float]:
    """One attempt's holds, each in whole microseconds (as durations are)."""
    return MappingProxyType({limit: _micro(s) for limit, s in held.items()})


def _new_held(cp: WorkflowCheckpoint, durations: tuple[tuple[str, float], ...]
              ) -> tuple[tuple[str, Mapping[str, float]], ...]:
    """The holds of the attempts behind ``durations`` (new in ``cp``), where a limit held one.

    O(new) for the core's checkpoints, as :func:`_new_began` is; else read from ``cp.held``."""
    times, wanted = cp._times, len(durations)
    walked: list[str] = []
    found: list[tuple[str, Mapping[str, float]]] = []
    while type(times) is tuple and len(walked) < wanted:
        walked.append(times[0])
        if len(times) == 5:
            found.append((times[0], _held_seconds(times[4])))
        times = times[2]
    if len(walked) == wanted and set(walked) == {k for k, _ in durations}:
        found.reverse()
        return tuple(found)
    held = cp.held
    if not held:
        return ()
    return tuple((k, held[k]) for k, _ in durations if k in held)


def _new_began(cp: WorkflowCheckpoint, durations: tuple[tuple[str, float], ...]
               ) -> tuple[tuple[str, float], ...]:
    """The began times of the attempts behind ``durations`` (new in ``cp``), where known.

    O(new) for the core's checkpoints, whose newest timings are those durations;
    else read from the checkpoint's ``began`` mapping."""
    times, wanted = cp._times, len(durations)
    walked: list[str] = []
    found: list[tuple[str, float]] = []
    while type(times) is tuple and len(walked) < wanted:
        walked.append(times[0])
        if len(times) >= 4:
            found.append((times[0], _micro(times[3])))
        times = times[2]
    if len(walked) == wanted and set(walked) == {k for k, _ in durations}:
        found.reverse()
        return tuple(found)
    began = cp.began
    return tuple((k, began[k]) for k, _ in durations if k in began)


def given_began(cp: WorkflowCheckpoint) -> Mapping[str, float] | None:
    """``cp.began`` when it was given (or read already), ``None`` when it is to be read
    off the timings: what a copy made by ``of_ledgers`` over the same timings passes on."""
    try:
        table: Mapping[str, float] = _STORED_BEGAN.__get__(cp, WorkflowCheckpoint)
    except AttributeError:
        return None
    return table


def given_held(cp: WorkflowCheckpoint) -> Mapping[str, Mapping[str, float]] | None:
    """``cp.held`` when it was given (or read already), ``None`` when it is to be read off
    the timings: what a copy made by ``of_ledgers`` passes on (see :func:`given_began`)."""
    try:
        table: Mapping[str, Mapping[str, float]] = _STORED_HELD.__get__(cp, WorkflowCheckpoint)
    except AttributeError:
        return None
    return table


def has_durations(cp: WorkflowCheckpoint) -> bool:
    """Whether ``cp`` records any duration, told without building its mapping."""
    try:
        table = _STORED_DURATIONS.__get__(cp, WorkflowCheckpoint)
    except AttributeError:
        times = cp._times
        return type(times) is tuple or bool(times)
    return bool(table)


def _new_durations(cp: WorkflowCheckpoint, previous: WorkflowCheckpoint
                   ) -> tuple[tuple[str, float], ...] | None:
    """The durations ``cp`` adds to ``previous``, oldest first; ``None`` when one of
    ``previous``' is gone or changed. O(new) for two checkpoints of one run of the core."""
    mine, theirs = cp._times, previous._times
    if mine is not None and theirs is not None:
        new = []
        node: Timings = mine
        while node is not theirs and type(node) is tuple:
            new.append(node)
            node = node[2]
        if node is theirs:
            return tuple((node[0], _micro(node[1])) for node in reversed(new))
        if type(mine) is Ledger and type(theirs) is Ledger and mine.extends(theirs):
            return tuple(mine.items_from(len(theirs)))  # (a journal's history)
    if not has_durations(previous):
        return tuple(cp.durations.items()) if has_durations(cp) else ()
    now = cp.durations
    if not _holds(now, previous.durations, _equal):
        return None
    return tuple((k, v) for k, v in now.items() if k not in previous.durations)


def _new_skips(
    mine: MappingProxyType[str, str], theirs: MappingProxyType[str, str], *, one_run: bool
) -> MappingProxyType[str, str] | None:
    """The skips ``mine`` adds to ``theirs``, or ``None`` when one of theirs is gone or changed.

    Skips only grow within a run: the core copies the mapping and adds to
    it (insertion order kept), and checkpoints between two skips share one
    mapping. So identity says "none new" in O(1), and within ``one_run``
    (the ledgers say so) the new skips are the last ones, read from the end
    in O(new): the entry before them must be ``theirs``' last. That trusts
    the run never to drop or change a skip, as the ledgers' fast path
    trusts it never to change an output. Otherwise every skip is compared.
    """
    if mine is theirs:
        return _NOTHING
    added = len(mine) - len(theirs)
    if added < 0:
        return None
    if one_run:
        tail = list(islice(reversed(mine), added + 1))[::-1]
        if not theirs:
            return MappingProxyType({k: mine[k] for k in tail})
        last = next(reversed(theirs))
        if tail[0] == last and mine[last] == theirs[last]:
            return MappingProxyType({k: mine[k] for k in tail[1:]})
        # Not a run's growth after all (a hand-made checkpoint): compare all.
    if any(mine.get(k) != why for k, why in theirs.items()):
        return None
    return MappingProxyType({k: why for k, why in mine.items() if k not in theirs})


def _same_shapes(mine: Mapping[str, Shape], theirs: Mapping[str, Shape]) -> bool:
    """Shapes are fixed per graph: checkpoints of one run share the mapping."""
    return mine is theirs or mine == theirs


def _skipped_and_shapes(data: dict[Any, Any]) -> tuple[dict[str, str], dict[str, Shape]]:
    """The ``skipped`` and ``shapes`` fields of ``data``, checked (empty when absent)."""
    skipped = _table(data.get("skipped", {}), "skipped")
    for name, why in skipped.items():
        if not isinstance(why, str):
            raise CheckpointError(f"skipped.{name}", f"must be a string, got {type(why).__name__}")
    shapes = {}
    for name, shape in _table(data.get("shapes", {}), "shapes").items():
        try:
            shapes[name] = Shape.from_dict(shape, f"shapes.{name}")
        except ValueError as exc:
            raise CheckpointError(f"shapes.{name}", str(exc)) from None
    return skipped, shapes


def _format_version(data: dict[Any, Any]) -> int:
    """The format version of ``data``, one this library reads, its three keys present."""
    version = _count(data.get("format_version", FORMAT_VERSION), "format_version")
    if version > NEWEST_FORMAT_VERSION:
        raise UnsupportedFormatError(
            "format_version",
            f"version {version} was written by a newer ekit; this one reads up to "
            f"{NEWEST_FORMAT_VERSION}",
        )
    if version < 1:
        raise CheckpointError("format_version", f"must be at least 1, got {version}")
    for key in ("step_index", "outputs", "cost"):
        if key not in data:
            raise CheckpointError(key, "missing")
    return version


def with_tables(cp: WorkflowCheckpoint, code_fingerprints: Mapping[str, str],
                cache_hits: Mapping[str, CacheHit] = _NO_HITS,
                drives: tuple[DriveRecord, ...] = NO_DRIVES) -> WorkflowCheckpoint:
    """``cp``, just made by :func:`fast_checkpoint` and not yet handed out, with issue 45's
    tables (``code_fingerprints``, ``cache_hits``) and issue 47's ``drives`` set where
    non-empty: O(1)."""
    if code_fingerprints:
        _STORED_CODE.__set__(cp, code_fingerprints)
    if cache_hits:
        _STORED_HITS.__set__(cp, cache_hits)
    if drives:
        _STORED_DRIVES.__set__(cp, drives)
    return cp


def with_retries(cp: WorkflowCheckpoint, retries: MappingProxyType[str, int]) -> WorkflowCheckpoint:
    """``cp``, just made by :func:`fast_checkpoint` and not yet handed out, with its
    ``compacted_retries`` (when non-empty): O(1)."""
    if retries:
        _STORED_RETRIES.__set__(cp, retries)
    return cp


def _tables_into(cp: WorkflowCheckpoint, data: dict[str, Any]) -> None:
    """Write issue 45's tables and issue 47's ``drives`` into ``data`` (``to_dict``), where non-empty."""
    if cp.code_fingerprints:
        data["code_fingerprints"] = dict(cp.code_fingerprints)
    if cp.cache_hits:
        data["cache_hits"] = {k: h.to_dict() for k, h in cp.cache_hits.items()}
    if cp.drives:
        data["drives"] = [d.to_dict() for d in cp.drives]


def _same_tables(cp: WorkflowCheckpoint, previous: WorkflowCheckpoint, *, drives: bool = True) -> bool:
    """Whether the tables a run changes only when it starts (versions, redone, ``drives`` unless
    told not to compare them) or rarely (a loop's compacted count, code fingerprints, cache hits)
    are the same in both checkpoints (shared, or equal)."""
    return all(a is b or a == b for a, b in (
        (cp.versions, previous.versions), (cp.redone, previous.redone),
        (cp.compacted, previous.compacted), (cp.compacted_retries, previous.compacted_retries),
        (cp.code_fingerprints, previous.code_fingerprints), (cp.cache_hits, previous.cache_hits),
        (cp.drives, previous.drives) if drives else (None, None)))


def _new_drives(
    now: tuple[DriveRecord, ...], before: tuple[DriveRecord, ...]
) -> tuple[DriveRecord, ...] | None:
    """The drives ``now`` appends to ``before``; ``None`` unless ``before`` is a prefix of it."""
    if now is before:
        return NO_DRIVES
    if len(now) < len(before) or now[:len(before)] != before:
        return None
    return now[len(before):]


def _issue_45_tables(data: dict[Any, Any]) -> dict[str, Any]:
    """``code_fingerprints`` and ``cache_hits`` as read from ``data`` (see docs/cache.md), and
    issue 47's ``drives`` and ``held``."""
    return {"code_fingerprints": _code_fingerprints(data.get("code_fingerprints", {})),
            "cache_hits": _cache_hits(data.get("cache_hits", {})),
            "drives": _drives(data.get("drives", [])), "held": check_held(data.get("held"))}


def _drives(value: object) -> tuple[DriveRecord, ...]:
    """The ``drives`` field: a list of ``{"worker": str, "began": epoch seconds}``, oldest first."""
    if not isinstance(value, list):
        raise CheckpointError("drives", f"must be a list, got {type(value).__name__}")
    found = []
    for i, entry in enumerate(value):
        table = _table(entry, f"drives.{i}")
        worker = table.get("worker")
        if not isinstance(worker, str) or not worker:
            raise CheckpointError(f"drives.{i}.worker", f"must be a non-empty string, got {worker!r:.80}")
        found.append(DriveRecord(worker, _moment(table.get("began"), f"drives.{i}.began")))
    return tuple(found)


def _code_fingerprints(value: object) -> MappingProxyType[str, str]:
    """The ``code_fingerprints`` field: step name -> the fingerprint of the code that made its outputs."""
    table = _table(value, "code_fingerprints")
    for name, print_ in table.items():
        if not isinstance(print_, str) or not print_:
            raise CheckpointError(f"code_fingerprints.{name}",
                                  f"must be a non-empty string, got {print_!r:.80}")
    return MappingProxyType(table)


def _cache_hits(value: object) -> MappingProxyType[str, CacheHit]:
    """The ``cache_hits`` field: step (or item) -> ``{"key": ..., "saved": usage}``."""
    hits = {}
    for name, hit in _table(value, "cache_hits").items():
        where = f"cache_hits.{name}"
        table = _table(hit, where)
        key = table.get("key")
        if not isinstance(key, str) or not key:
            raise CheckpointError(f"{where}.key", f"must be a non-empty string, got {key!r:.80}")
        hits[name] = CacheHit(key, _usage(table.get("saved", NO_USAGE.to_dict()), f"{where}.saved"))
    return MappingProxyType(hits)


def _redone(value: object) -> MappingProxyType[str, int]:
    """The ``redone`` field: step (or item) name -> a count (see WorkflowCheckpoint.redone)."""
    return MappingProxyType({k: _count(n, f"redone.{k}") for k, n in _table(value, "redone").items()})


def _counts(value: object, name: str) -> MappingProxyType[str, int]:
    """A table of counts (``name``: the field, for the error)."""
    return MappingProxyType({k: _count(n, f"{name}.{k}") for k, n in _table(value, name).items()})


def _loop_tables(data: dict[Any, Any]) -> dict[str, Any]:
    """``compacted`` and ``compacted_retries`` as read from ``data`` (loops' counts)."""
    return {"compacted": _compacted(data.get("compacted", {})),
            "compacted_retries": _counts(data.get("compacted_retries", {}), "compacted_retries")}


def _compacted(value: object) -> MappingProxyType[str, int]:
    """The ``compacted`` field: loop name -> how many of its first iterations were compacted."""
    return MappingProxyType({k: _count(n, f"compacted.{k}") for k, n in _table(value, "compacted").items()})


def _count(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(name, f"must be a non-negative int, got {type(value).__name__}")
    if value < 0:
        raise CheckpointError(name, f"must be a non-negative int, got {value}")
    return value


def _table(value: object, name: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise CheckpointError(name, f"must be a dict, got {type(value).__name__}")
    if not _all_str(value):
        for key in value:
            if not isinstance(key, str):
                raise CheckpointError(name, f"keys must be strings, got {type(key).__name__} {key!r}")
    return dict(value)


def _all_str(items: Iterable[object]) -> bool:
    """Is every item a ``str``? One C loop: a resume checks a key per recorded step."""
    try:
        "".join(items)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def _names(value: object, name: str) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        raise CheckpointError(name, f"must be a list of step names, got {type(value).__name__}")
    for item in value:
        if not isinstance(item, str):
            raise CheckpointError(name, f"must hold step names, got {type(item).__name__}")
        if not item:
            raise CheckpointError(name, "holds an empty step name")
    return tuple(value)


def _recorded_graph(
    data: Mapping[str, Any],
) -> tuple[tuple[str, str] | None, MappingProxyType[str, tuple[str, ...]] | None]:
    """The recorded graph of ``data``: its texts (``graph_steps`` and
    ``graph_needs``) if it has them, and the mapping when decoded now.

    Texts are checked by C loops (see :func:`ekit_core.graph_text.check`) and
    decoded when first read; texts with an escape, rare, are decoded (and so
    checked in full) at once. ``graph``, the mapping that files written
    before the texts hold, is read as it is.
    """
    steps, needs, graph = data.get("graph_steps"), data.get("graph_needs"), data.get("graph")
    if steps is None and needs is None:
        if graph is None:
            return None, None
        table = _table(graph, "graph")
        if "" in table:
            raise CheckpointError("graph", "holds an empty step name")
        return None, MappingProxyType({k: _names(v, f"graph.{k}") for k, v in table.items()})
    if graph is not None:
        raise CheckpointError("graph", "given beside graph_steps and graph_needs: record one graph")
    texts = (_text(steps, "graph_steps"), _text(needs, "graph_needs"))
    if "\\" in texts[0] or "\\" in texts[1]:
        return texts, MappingProxyType(_decoded(*texts))
    try:
        check(*texts)
    except GraphTextError as err:
        raise CheckpointError(err.field, err.problem) from None
    return texts, None


def _text(value: object, name: str) -> str:
    if value is None:
        raise CheckpointError(name, "missing: graph_steps and graph_needs come together")
    if not isinstance(value, str):
        raise CheckpointError(name, f"must be a string, got {type(value).__name__}")
    return _plain(value)


def _plain(text: str) -> str:
    """``text`` as a plain ``str``: a subclass's own ``==`` or ``count`` must not
    decide whether a recorded graph is the resuming one."""
    return text if type(text) is str else str.__add__("", text)


def _decoded(steps: str, needs: str) -> dict[str, tuple[str, ...]]:
    try:
        return read(steps, needs)
    except GraphTextError as err:
        raise CheckpointError(err.field, err.problem) from None


_LARGEST = sys.float_info.max  # (an int past it, 10**400, is no float: compared, never converted)
_SECONDS_TYPES = frozenset({float, int})


def check_durations(value: object) -> MappingProxyType[str, float]:
    """The ``durations`` field: step (or item) -> seconds, each a finite number >= 0.

    A resume reads one per recorded step, so the common case (every value a
    float) is checked by C loops: the types as one set, the range by ``min``
    and ``sum`` (a NaN or an infinity makes the sum not less than infinity).
    Anything else is checked entry by entry, to name the one at fault. The
    names are checked by a resume, which knows the graph (see
    :func:`ekit_core.transitions.initial_state`).
    """
    if value is None:
        return _empty()
    table = _table(value, "durations")
    values = table.values()
    if not table or (
        set(map(type, values)) <= _SECONDS_TYPES
        and min(values) >= 0
        and sum(values) <= _LARGEST
        and "" not in table
    ):
        return MappingProxyType(table)
    for name, seconds in table.items():
        where = f"durations.{name}"
        if not name:
            raise CheckpointError("durations", "holds an empty step name")
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise CheckpointError(where, f"must be a number of seconds, got {type(seconds).__name__}")
        if not 0 <= seconds <= _LARGEST:
            raise CheckpointError(where, f"must be a finite number of seconds >= 0, got {seconds!r}")
    # Each entry is fine, their sum is not finite: only near the largest float.
    raise CheckpointError("durations", "the seconds add up to more than a float holds")


def _step_usage(value: object, step: str) -> TokenUsage:
    return _plain_usage(value) or _usage(value, f"step_usage.{step}")


def _plain_usage(value: object) -> TokenUsage | None:
    """The shape every writer produces, checked in one pass (a resume reads one per step)."""
    if type(value) is dict and len(value) == 3:
        a, b, c = value.get("input_tokens"), value.get("output_tokens"), value.get("llm_calls")
        if type(a) is int and type(b) is int and type(c) is int and a >= 0 and b >= 0 and c >= 0:
            return TokenUsage(a, b, c) if a or b or c else NO_USAGE
    return None


def _usage(value: object, name: str) -> TokenUsage:
    table = _table(value, name)
    counts = []
    for key in ("input_tokens", "output_tokens", "llm_calls"):
        if key not in table:
            raise CheckpointError(f"{name}.{key}", "missing")
        counts.append(_count(table[key], f"{name}.{key}"))
    return TokenUsage(*counts)


def _failure(value: object, name: str) -> FailureRecord:
    table = _table(value, name)
    texts = []
    for key in ("error_type", "message"):
        text = table.get(key)
        if not isinstance(text, str):
            raise CheckpointError(f"{name}.{key}", f"must be a string, got {type(text).__name__}")
        texts.append(storable_text(text))
    attempts = _count(table.get("attempts", 1), f"{name}.attempts")
    if attempts < 1:
        raise CheckpointError(f"{name}.attempts", "must be at least 1")
    if "began" not in table and "ended" not in table:
        return FailureRecord(texts[0], texts[1], attempts)
    began = _moment(table.get("began"), f"{name}.began")
    ended = _moment(table.get("ended"), f"{name}.ended")
    if ended < began:
        raise CheckpointError(f"{name}.ended", f"is before {name}.began")
    return FailureRecord(texts[0], texts[1], attempts, began, ended)


_LATEST = 2.0**53 / 1e6
"""Epoch seconds a recorded time stays below (the year 2255): its microseconds a float holds."""


def _moment(value: object, where: str) -> float:
    """A recorded moment, UTC epoch seconds: a finite number from 0 below :data:`_LATEST`."""
    try:
        return check_number(value, where, high=_LATEST, unit=" of epoch seconds")
    except ValueError as err:
        raise CheckpointError(where, str(err).removeprefix(where + " ")) from None


def check_began(value: object) -> MappingProxyType[str, float]:
    """The ``began`` field: step (or item) -> UTC epoch seconds, each a finite number >= 0.

    (One without a duration beside it is read and unused: a resume keeps those
    of its recorded, timed outputs.)"""
    if value is None:
        return _empty()
    table = _table(value, "began")
    for name, moment in table.items():
        if not name:
            raise CheckpointError("began", "holds an empty step name")
        _moment(moment, f"began.{name}")
    return MappingProxyType({k: float(v) for k, v in table.items()})


HOLD_NAME_LIMIT = 200
"""The longest limit name (in characters) a ``held`` entry may carry."""


def check_held(value: object) -> MappingProxyType[str, Mapping[str, float]]:
    """The ``held`` field: step (or item) -> limit name -> seconds it held the attempt.

    Each limit a non-empty string of at most :data:`HOLD_NAME_LIMIT` characters
    (``max_concurrency``, ``resource:gpu``, ...), each hold a finite number of
    seconds >= 0; a step with no limit is refused, naming ``held.<step>``."""
    if value is None:
        return _empty()
    found: dict[str, Mapping[str, float]] = {}
    for name, limits in _table(value, "held").items():
        if not name:
            raise CheckpointError("held", "holds an empty step name")
        where = f"held.{name}"
        table = _table(limits, where)
        if not table:
            raise CheckpointError(where, "names no limit")
        for limit, seconds in table.items():
            if not limit or len(limit) > HOLD_NAME_LIMIT:
                raise CheckpointError(where, f"names a limit of {len(limit)} characters "
                                             f"(1 to {HOLD_NAME_LIMIT})")
            try:
                check_number(seconds, f"{where}.{limit}", high=_LATEST)
            except ValueError as err:
                raise CheckpointError(f"{where}.{limit}",
                                      str(err).removeprefix(f"{where}.{limit} ")) from None
        found[name] = MappingProxyType({k: float(v) for k, v in table.items()})
    return MappingProxyType(found)


def _asked(value: object) -> MappingProxyType[str, tuple[Exchange, ...]]:
    """The ``asked`` field: step -> its questions in order, each answered but maybe the last."""
    if value is None:
        return NO_EXCHANGES
    asked: dict[str, tuple[Exchange, ...]] = {}
    for name, exchanges in _table(value, "asked").items():
        where = f"asked.{name}"
        if not name:
            raise CheckpointError("asked", "holds an empty step name")
        if not isinstance(exchanges, list | tuple) or not exchanges:
            raise CheckpointError(where, "must be a non-empty list of questions")
        parsed = []
        for i, item in enumerate(exchanges):
            exchange = _exchange(item, f"{where}[{i}]")
            if i < len(exchanges) - 1:
                if exchange.answer is None:
                    raise CheckpointError(f"{where}[{i}]", "is unanswered, yet a later question follows")
                if exchange.answer.approved is False:
                    raise CheckpointError(f"{where}[{i}]", "is a denial, yet a later question follows")
            parsed.append(exchange)
        asked[name] = tuple(parsed)
    return MappingProxyType(asked)


def _exchange(value: object, where: str) -> Exchange:
    """One recorded question (and its answer, if given), checked."""
    table = _table(value, where)
    unknown = sorted(k for k in table if k not in ("kind", "prompt", "details", "answer"))
    if unknown:
        raise CheckpointError(f"{where}.{unknown[0]}", "is no field of a question")
    kind, prompt = table.get("kind"), table.get("prompt")
    if kind not in ("value", "approval"):
        raise CheckpointError(f"{where}.kind", f"must be 'value' or 'approval', got {kind!r}")
    if not isinstance(prompt, str):
        raise CheckpointError(f"{where}.prompt", f"must be a string, got {type(prompt).__name__}")
    question = Question(kind, storable_text(prompt), table.get("details"))
    given = table.get("answer")
    if given is None:
        return Exchange(question)
    try:
        answer = Answer.from_dict(_table(given, f"{where}.answer"))
    except CheckpointError:
        raise
    except ValueError as exc:
        raise CheckpointError(f"{where}.answer", str(exc)) from None
    if kind == "approval" and answer.approved is None:
        raise CheckpointError(f"{where}.answer.approved", "missing: an approval is approved or denied")
    if kind == "value" and answer.approved is not None:
        raise CheckpointError(f"{where}.answer.approved", "given for a value question")
    return Exchange(question, answer)
