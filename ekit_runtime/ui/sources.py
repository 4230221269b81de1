"""What the dashboard shows, read from a run queue or from one store file.

:class:`QueueSource` reads a queue (a page of runs at a time with
``queue.runs_page()``, filtered and counted by the queue; ``queue.checkpoint``)
and can act on it; :class:`FileSource` reads one store file with the readers
``ekit audit`` uses (:func:`ekit_runtime.sources.read_checkpoints`), again
on every request, so the page follows a run that is writing it. Both
give a :class:`RunView`: a run's checkpoint, its audit and the state of
each step, in plain values the pages render.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from ekit_core import GraphSpec, WorkflowCheckpoint, audit, changed_since_recorded
from ekit_core.audit import AuditReport, StepAudit
from ekit_core.human import Question, questions
from ekit_core.progress import Progress, items_progress, run_progress
from ekit_core.report import graph_of, recorded_graph
from ekit_core.usage import NO_USAGE
from ekit_runtime.queue import STATUSES, InFlight, RunInfo, RunQueue, RunStatus
from ekit_runtime.sources import read_checkpoints

__all__ = [
    "CHART_RUNS", "WAITING_SHOWN", "FileSource", "QueueSource", "RunView", "RunsView", "Source", "Waiting",
    "step_states", "view_progress",
]

CHART_RUNS = 1000
"""How many of the newest runs the runs page's chart draws (a page reads these, not every run)."""

WAITING_SHOWN = 10
"""How many of the runs waiting for a person the runs page shows first, with their questions."""


@dataclass(frozen=True, slots=True)
class RunView:
    """One run as its page shows it.

    ``info`` is the queue's record (``None`` for a store file);
    ``checkpoint`` the latest one saved (``None`` before the first save);
    ``report`` its audit and ``graph`` the graph drawn (``None`` when there
    is no checkpoint, or ``problem`` says why the audit could not be made);
    ``timeline`` the checkpoints of a journal, oldest first (empty otherwise);
    ``in_flight`` the attempts a live worker says it runs now (a queue's
    running run only, see ``RunQueue.in_flight``); ``changed`` each recorded
    step whose version or code changed since, and how
    (:func:`~ekit_core.changed_since_recorded`), ``None`` when the dashboard
    does not know the run's workflow (so cannot compare).
    """

    run_id: str
    status: str
    info: RunInfo | None
    checkpoint: WorkflowCheckpoint | None
    report: AuditReport | None
    graph: GraphSpec | None
    questions: Mapping[str, Question]
    problem: str | None = None
    timeline: tuple[WorkflowCheckpoint, ...] = ()
    states: dict[str, str] = field(default_factory=dict)
    items: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    in_flight: Mapping[str, InFlight] = field(default_factory=dict)
    changed: Mapping[str, str] | None = None


@dataclass(frozen=True, slots=True)
class Waiting:
    """A run waiting for a person, as the runs page shows it: its record and the questions pending."""

    info: RunInfo
    questions: Mapping[str, Question]


@dataclass(frozen=True, slots=True)
class RunsView:
    """One reading of the runs page, everything it shows.

    ``shown`` is the page of runs (filtered, newest first) and ``total`` how
    many match; ``waiting`` the runs waiting for a person (oldest first, at
    most :data:`WAITING_SHOWN`) of ``waiting_total``; ``recent`` the newest
    runs of the whole queue (at most :data:`CHART_RUNS`, newest first, the
    chart's) of ``fleet_total``.
    """

    shown: tuple[RunInfo, ...]
    total: int
    waiting: tuple[Waiting, ...] = ()
    waiting_total: int = 0
    recent: tuple[RunInfo, ...] = ()
    fleet_total: int = 0


def view_progress(view: RunView) -> tuple[int, int | None]:
    """``(steps done, steps in all)`` of a run read from a file, counted as the queue counts a
    run (:func:`ekit_core.progress.run_progress`: a mapped step's items count); a checkpoint
    that records no graph, by the states of the steps of the graph given."""
    cp = view.checkpoint
    if cp is not None and cp.graph is not None:
        counted = run_progress(cp)
        return counted.done, counted.total
    done = sum(1 for state in view.states.values() if state in ("recorded", "skipped"))
    return done, None if view.graph is None else len(view.graph.names)


def step_states(
    report: AuditReport,
    graph: GraphSpec,
    status: str,
    in_flight: Collection[str] = (),
    counted: Mapping[str, Progress] | None = None,
) -> tuple[dict[str, str], dict[str, tuple[int, int | None]]]:
    """Each step's state (``recorded``, ``running``, ``ready``, ``failed``, ``waiting``,
    ``skipped``, ``not-started``) and, for a mapped step, its items (done, total or ``None``).

    ``counted``: each mapped step's items as :func:`ekit_core.progress.items_progress`
    counts the checkpoint; then an item's "done" is its output recorded (a skip is
    not work done), and a mapped step whose items were all skipped is ``skipped``.

    ``running`` is a step of a running run with an attempt in ``in_flight``
    (what its worker says it runs now; for a mapped step, an item's);
    ``ready`` one whose inputs are recorded that nothing runs yet: about to
    start, or held back by a limit (its run's reason says which).
    """
    rows: dict[str, StepAudit] = {}
    by_step: dict[str, list[StepAudit]] = {}
    for step_row in report.steps:
        if step_row.item_of is None:
            rows[step_row.name] = step_row
        else:
            by_step.setdefault(step_row.item_of, []).append(step_row)
    states: dict[str, str] = {}
    items: dict[str, tuple[int, int | None]] = {}
    running = status == "running"
    flying = {name.partition("[")[0] for name in in_flight}  # an item's name is step[key]
    for name in graph.names:
        row: StepAudit | None = rows.get(name)
        its = by_step.get(name, [])
        if its:
            items[name] = (sum(1 for r in its if r.action == "skip"), len(its))
        elif row is not None and row.reason == "mapped":
            items[name] = (row.items_recorded, row.items)
        states[name] = _state(row, its, running, name in flying)
        mine = None if counted is None else counted.get(name)
        if mine is not None:
            items[name] = (mine.recorded, mine.total)
            if mine.total and mine.skipped == mine.total and states[name] == "recorded":
                states[name] = "skipped"  # (its collected output holds nothing: no work was done)
    return states, items


def _state(row: StepAudit | None, its: Sequence[StepAudit], running: bool, flying: bool) -> str:
    if row is None:
        return "not-started"
    if row.reason in ("recorded", "outdated"):  # (outdated: recorded, though a resume redoes it)
        return "recorded"
    if row.reason == "skipped":
        return "skipped"
    if row.action == "wait" or any(r.action == "wait" for r in its):
        return "waiting"
    if row.reason == "failed" or any(r.reason == "failed" for r in its):
        return "failed"
    if running and flying:
        return "running"
    ready = row.reason == "ready" or any(r.reason == "ready" for r in its)
    if running and ready:
        return "ready"
    return "not-started"


def _view(
    run_id: str,
    status: str,
    info: RunInfo | None,
    checkpoint: WorkflowCheckpoint | None,
    given: GraphSpec | None,
    versions: Mapping[str, str] | None = None,
    timeline: tuple[WorkflowCheckpoint, ...] = (),
    in_flight: Mapping[str, InFlight] | None = None,
    workflow: object | None = None,
) -> RunView:
    if checkpoint is None:
        return RunView(run_id, status, info, None, None, given, {}, "no checkpoint saved yet",
                       timeline)
    changed = None
    subject: object | None = given
    try:
        if workflow is not None:
            changed = changed_since_recorded(workflow, checkpoint, versions=versions)
            # Audited as the workflow (its code's fingerprints too: what a resume by it does)
            # where its graph is the one given, or the one recorded.
            if given is not None or graph_of(workflow).fingerprint in (checkpoint.fingerprint, None):
                subject = workflow
        graph = graph_of(subject) if subject is not None else recorded_graph(checkpoint)
        report = audit(subject, checkpoint, versions=versions)
    except ValueError as exc:
        return RunView(run_id, status, info, checkpoint, None, None, questions(checkpoint),
                       f"cannot audit the checkpoint: {exc}", timeline)
    # A worker's announcement can be a second older than the checkpoint read:
    # what the checkpoint records is no longer in flight in this reading.
    flying = {name: f for name, f in (in_flight or {}).items() if name not in checkpoint.outputs}
    states, items = step_states(report, graph, status, flying, items_progress(graph, checkpoint))
    return RunView(run_id, status, info, checkpoint, report, graph, questions(checkpoint), None,
                   timeline, states, items, flying, changed)


class Source:
    """Where the dashboard reads runs from (see :class:`QueueSource`, :class:`FileSource`)."""

    label: str = ""
    can_act: bool = False

    def runs(self) -> list[RunInfo]:
        """Every run, newest first."""
        raise NotImplementedError

    def page(self, status: str, workflow: str, limit: int, offset: int) -> tuple[list[RunInfo], int]:
        """One page of the runs, newest first, and how many match in all.

        The runs of ``status`` and ``workflow`` (``""``: any), ``offset`` of
        them skipped and at most ``limit``. This default filters :meth:`runs`
        in Python (a store file has one run).
        """
        found = [r for r in self.runs()
                 if (not status or r.status == status) and (not workflow or r.workflow == workflow)]
        return found[offset:offset + limit], len(found)

    def workflows(self) -> list[str]:
        """The workflow names the filter offers (none by default)."""
        return []

    def overview(self, status: str, workflow: str, limit: int, offset: int) -> RunsView:
        """Everything the runs page shows, from one reading: :meth:`page`'s runs and count,
        the runs waiting for a person and the newest runs the chart draws.

        This default reads :meth:`runs` once (a store file has one run).
        """
        everyone = self.runs()
        found = [r for r in everyone
                 if (not status or r.status == status) and (not workflow or r.workflow == workflow)]
        waiting = [Waiting(r, self._questions(r)) for r in reversed(everyone) if r.status == "waiting"]
        return RunsView(tuple(found[offset:offset + limit]), len(found), tuple(waiting[:WAITING_SHOWN]),
                        len(waiting), tuple(everyone[:CHART_RUNS]), len(everyone))

    def _questions(self, info: RunInfo) -> Mapping[str, Question]:
        return {}

    def view(self, run_id: str) -> RunView | None:
        """The run's page data; ``None`` when there is no such run."""
        raise NotImplementedError


class QueueSource(Source):
    """A run queue: every run it holds; actions go to its ``cancel``, ``retry``, ``answer`` ...

    Calls are serialised with a lock: the server answers requests on threads.
    ``workflows`` (``ekit ui --workflows``, as a worker's registry: name ->
    workflow), when given, is what a run of a registered workflow is
    compared with (:attr:`RunView.changed`) and audited as.
    """

    can_act = True

    def __init__(self, queue: RunQueue, label: str, workflows: Mapping[str, object] | None = None) -> None:
        self.queue = queue
        self.label = label
        self.registry = workflows
        self._lock = threading.Lock()
        # The questions of the runs the runs page shows waiting, by run, with the record they were read
        # under: a waiting run's checkpoint does not change until its record does (an answer, a rewind).
        self._asked_of: dict[str, tuple[RunInfo, Mapping[str, Question]]] = {}

    def runs(self) -> list[RunInfo]:
        """Every run, newest first."""
        with self._lock:
            found = self.queue.runs()
        found.reverse()
        return found

    def page(self, status: str, workflow: str, limit: int, offset: int) -> tuple[list[RunInfo], int]:
        """One page, newest first, filtered, cut and counted by the queue (:meth:`RunQueue.runs_page`)."""
        if status and status not in STATUSES:
            return [], 0  # "incomplete" is a store file's: no queue run has it
        with self._lock:
            found = self.queue.runs_page(status or None, workflow=workflow or None,
                                         limit=limit, offset=offset, newest_first=True)
        return found.runs, found.total

    def workflows(self) -> list[str]:
        """Every workflow the queue's runs are of (``SELECT DISTINCT``, not every run)."""
        with self._lock:
            return self.queue.workflow_names()

    def overview(self, status: str, workflow: str, limit: int, offset: int, tries: int = 5) -> RunsView:
        """The runs page's reading: the page, the waiting runs and the chart's runs, as of one moment.

        Each is its own snapshot of the queue (the page and the chart's runs
        are cut in SQL: a page never reads every run), so the records are
        read again after the questions: when both reads agree, no run that
        the page shows changed between them, and the page's numbers are of
        one moment. A queue that changed between every one of ``tries``
        such reads is shown as its last reading.
        """
        # "incomplete" is a store file's status: no queue run has it (None: the page matches none).
        wanted: str | None = None if status and status not in STATUSES else status
        with self._lock:
            records = self._records(wanted, workflow, limit, offset)
            for _ in range(max(1, tries)):
                asked = {r.run_id: self._asked(r) for r in records[2]}
                again = self._records(wanted, workflow, limit, offset)
                if again == records:
                    break
                records = again
            else:  # (the questions of the last reading, read after it)
                asked = {r.run_id: self._asked(r) for r in records[2]}
            self._asked_of = {r.run_id: (r, asked[r.run_id]) for r in records[2]}
        page, total, waiting, waiting_total, recent, fleet = records
        shown = tuple(Waiting(r, asked[r.run_id]) for r in waiting)
        return RunsView(page, total, shown, waiting_total, recent, fleet)

    def _asked(self, info: RunInfo) -> Mapping[str, Question]:
        known = self._asked_of.get(info.run_id)
        if known is not None and known[0] == info:
            return known[1]  # (its checkpoint is not read again on every poll)
        try:
            return self.queue.questions(info.run_id)
        except (LookupError, ValueError):  # pruned since, or a checkpoint that does not decode
            return {}

    def _records(self, status: str | None, workflow: str, limit: int, offset: int) -> tuple[
            tuple[RunInfo, ...], int, tuple[RunInfo, ...], int, tuple[RunInfo, ...], int]:
        q = self.queue
        if status is None:
            page: tuple[RunInfo, ...] = ()
            total = 0
        else:
            found = q.runs_page(cast(RunStatus, status) or None, workflow=workflow or None, limit=limit,
                                offset=offset, newest_first=True)
            page, total = tuple(found.runs), found.total
        waiting = q.runs_page("waiting", limit=WAITING_SHOWN)  # the first submitted first
        recent = q.runs_page(None, limit=CHART_RUNS, newest_first=True)
        return page, total, tuple(waiting.runs), waiting.total, tuple(recent.runs), recent.total

    def view(self, run_id: str) -> RunView | None:
        """The run's record, latest checkpoint and its audit against the graph it records."""
        with self._lock:
            try:
                info, checkpoint = self._reading(run_id)
            except (LookupError, ValueError):
                return None
            in_flight = self.queue.in_flight(run_id) if info.status == "running" else {}
        workflow = None if self.registry is None else self.registry.get(info.workflow)
        return _view(run_id, info.status, info, checkpoint, None, in_flight=in_flight, workflow=workflow)

    def _reading(self, run_id: str, tries: int = 20) -> tuple[RunInfo, WorkflowCheckpoint | None]:
        """The run's record and checkpoint as of one moment (a worker saves between any two reads).

        The record is read between two reads of the checkpoint: when they
        agree, no save came between, and the record's counts are that
        checkpoint's. A run that saved between every one of ``tries`` such
        reads is shown as its last record and checkpoint (at most one save apart).
        """
        before = self.queue.checkpoint(run_id)
        for _ in range(tries):
            info = self.queue.status(run_id)
            after = self.queue.checkpoint(run_id)
            if after == before:
                return info, after
            before = after
        return self.queue.status(run_id), before

    def act(self, call: Callable[[RunQueue], Any]) -> Any:
        """Run ``call(queue)`` under the lock."""
        with self._lock:
            return call(self.queue)


class FileSource(Source):
    """One store file (a checkpoint JSON, JSON lines, a ``JournalStore`` journal), re-read per request.

    Its one run is named after the file (a SQLite database: ``run_id``,
    its run to show); ``graph`` (from ``--workflow``) is audited against,
    else the graph the checkpoint records; ``workflow``, the object behind
    ``graph`` when known, is audited as such and compared with the record
    (:attr:`RunView.changed`).
    """

    def __init__(self, path: str, graph: GraphSpec | None = None,
                 versions: Mapping[str, str] | None = None, *, run_id: str | None = None,
                 workflow: object | None = None) -> None:
        self.path = path
        self.label = path
        # A database (a SqliteStore file) holds many runs: ``run_id`` picks one, and names it here.
        self.store_run_id = run_id
        self.run_id = run_id if run_id is not None else (os.path.basename(path) or path)
        self.graph = graph
        self.versions = versions
        self.workflow = workflow

    def read(self) -> RunView:
        """The file's latest checkpoint, audited; a :class:`SourceError` if unreadable."""
        recorded = read_checkpoints(self.path, run_id=self.store_run_id)
        timeline = recorded.checkpoints if recorded.kind in ("journal", "jsonl") else ()
        latest = recorded.latest
        waiting = bool(questions(latest))
        view = _view(self.run_id, "", None, latest, self.graph, self.versions, timeline,
                     workflow=self.workflow)
        report = view.report
        if waiting:
            status = "waiting"
        elif report is not None and not report.to_run:
            status = "finished"
        elif latest.failures:
            status = "failed"
        else:
            status = "incomplete"
        return RunView(view.run_id, status, None, view.checkpoint, view.report, view.graph,
                       view.questions, view.problem, view.timeline, view.states, view.items,
                       changed=view.changed)

    def runs(self) -> list[RunInfo]:
        """The file's one run, as a record (status from its audit); a :class:`SourceError` if unreadable."""
        return [self._info(self.read())]

    def _info(self, view: RunView) -> RunInfo:
        cp = view.checkpoint
        done, total = view_progress(view)
        error = None if cp is None or not cp.failures else "; ".join(
            f"{n}: {f.error_type}: {f.message}" for n, f in cp.failures.items())
        return RunInfo(
            run_id=self.run_id, workflow="-", status=view.status,  # type: ignore[arg-type]
            priority=0, epoch=0, owner=None, lease_until=None, cancel_requested=False,
            error=error, created_at=_mtime(self.path), updated_at=_mtime(self.path),
            fingerprint=None if cp is None else cp.fingerprint,
            steps_done=done, steps_total=total,
            cost=NO_USAGE if cp is None else cp.cost,
        )

    def overview(self, status: str, workflow: str, limit: int, offset: int) -> RunsView:
        """The runs page of the file: its one run, from one read of the file."""
        view = self.read()
        info = self._info(view)
        matches = (not status or info.status == status) and (not workflow or info.workflow == workflow)
        waiting = (Waiting(info, view.questions),) if view.status == "waiting" else ()
        return RunsView((info,) if matches and offset == 0 and limit > 0 else (), int(matches),
                        waiting, len(waiting), (info,), 1)

    def view(self, run_id: str) -> RunView | None:
        """The file's run, if ``run_id`` names it."""
        if run_id != self.run_id:
            return None
        return self.read()


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0
