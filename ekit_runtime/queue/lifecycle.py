"""The run queue's lifecycle: this module owns its rules, and every backend and the worker follow it.

Nothing here does I/O or imports a database driver. The rules are values and
plain functions over values; the SQL each backend sends is rendered from the
named pieces below (:func:`render`), so a condition is written once.

Theory of operation
-------------------

A run is ``queued`` until a worker claims it; a claim grants a lease (the
run's ``epoch`` + 1, the fencing token, and an expiry ``lease_until``) and
makes it ``running``. Only the lease's holder writes to a running run, and
only while the lease is live (same epoch, unexpired, still running); once the
lease expired, anyone's claim takes the run over. Three statuses are final: a
run leaves them only when a person reopens it (``retry``, ``rewind``), and
only they may be pruned.

    TRANSITIONS (from, to, who, by doing what, on what condition)

    from       to         who        verb     condition
    ---------  ---------  ---------  -------  --------------------------------------------
    (none)     queued     submitter  submit   the run id is new (else: nothing changes)
    queued     running    anyone     claim    claimable (below); epoch + 1
    running    running    anyone     claim    the lease expired, no cancel asked; epoch + 1
    running    cancelled  anyone     claim    the lease expired with a cancel asked; epoch + 1
    running    running    holder     save     fenced (below); the lease is extended
    running    running    holder     renew    fenced; the lease is extended
    running    finished   holder     finish   fenced
    running    failed     holder     finish   fenced
    running    cancelled  holder     finish   fenced
    running    queued     holder     release  fenced, no cancel asked; the epoch stays
    running    cancelled  holder     release  fenced, a cancel asked (the holder had not seen it)
    running    waiting    holder     park     fenced, no cancel asked; lease and owner cleared, reason set
    running    cancelled  holder     park     fenced, a cancel asked (the holder had not seen it)
    queued     cancelled  submitter  cancel   at once; epoch + 1
    running    cancelled  submitter  cancel   the lease expired; epoch + 1 (else: flagged)
    running    running    submitter  cancel   the lease is live: cancel_requested is set
    waiting    cancelled  submitter  cancel   at once; epoch + 1
    failed     queued     submitter  retry    epoch + 1; error and cancel flag cleared
    cancelled  queued     submitter  retry    epoch + 1; error and cancel flag cleared
    queued     queued     submitter  rewind   no live lease; checkpoint rewound; epoch + 1
    running    queued     submitter  rewind   the lease expired; checkpoint rewound; epoch + 1
    finished   queued     submitter  rewind   checkpoint rewound; epoch + 1; error, flag cleared
    failed     queued     submitter  rewind   checkpoint rewound; epoch + 1; error, flag cleared
    cancelled  queued     submitter  rewind   checkpoint rewound; epoch + 1; error, flag cleared
    waiting    queued     submitter  rewind   checkpoint rewound (its questions too); epoch + 1
    waiting    queued     submitter  answer   a question pending at the step; answer recorded; epoch + 1
    waiting    queued     submitter  approve  an approval pending at the step; recorded; epoch + 1
    waiting    queued     submitter  deny     an approval pending at the step; recorded; epoch + 1
    (none)     queued     submitter  fork     a new run id: the source's run, checkpoint rewound
    (none)     queued     holder     spawn    the parent's lease is live; a new child id (else nothing)
    running    waiting    holder     join     fenced, no cancel asked, a child it waits for is going
    running    queued     holder     join     fenced, no cancel asked, they all ended, or one not finished
    running    cancelled  holder     join     fenced, a cancel asked
    waiting    queued     anyone     wake     its last child going ended, or one failed/cancelled; epoch + 1
    queued     cancelled  anyone     close    its parent ended failed or cancelled; epoch + 1
    waiting    cancelled  anyone     close    its parent ended failed or cancelled; epoch + 1
    running    cancelled  anyone     close    its parent ended so, the lease expired; epoch + 1
    running    running    anyone     close    its parent ended so, the lease live: cancel_requested set

WAITING: a run whose every runnable step is done and some step waits for a
person's answer (``workflow.run`` raised ``RunWaiting`` after its final
checkpoint) is parked by its holder: no lease, no owner, no worker holds it,
and no claim takes it (it is not claimable). ``reason`` says which step
waits. A person's answer, approval or denial records the answer in its
checkpoint and queues it again; the next claim resumes it and the step
receives the answer.

REOPENED (retry, rewind, answer, approve, deny: a person's verbs,
:func:`reopen_refusal` says when each is refused): one transaction reads the run's status and epoch (and its
checkpoint), and its write carries :data:`UNCHANGED`: the run still has the
epoch read and no live lease. So a claim, a cancel or another reopening that
came in between wins, and this one writes nothing
(:class:`~ekit_runtime.queue.records.RunStateError`). The epoch + 1 fences
out any stale holder. A retry keeps the checkpoint, whose failure records
count the failed attempts, so attempt numbers carry on. A fork reads its
source and leaves it as it was.

CLAIMABLE: status ``queued``, or ``running`` with an expired lease and no
cancel asked (a claim first cancels, rather than resumes, an expired run
whose cancel was asked); of a workflow the claimer drives, whose stored
fingerprint is unset or the claimer's (any fingerprint, when the run's options
allow a graph change); the highest priority first, then the oldest
submission. (A release never leaves a cancel flag on a ``queued`` run: a
worker that gives a run back before it saw the flag ends it ``cancelled``,
so that no worker starts paid work on a run someone cancelled.)

FENCED (a holder's write is accepted): same run id, the run's epoch is the
lease's, the run is ``running`` and its lease has not expired. A refused write
changes nothing (:class:`~ekit_runtime.queue.records.LeaseLostError`).

HOW A DRIVE ENDED (:func:`drive_ending`, from what the worker knows):

    lease lost (a refusal, or the worker's clock says it lapsed)  -> lost (nothing written)
    the run waits for a person (RunWaiting), no cancel asked       -> parked
    the run waits for a person (RunWaiting), a cancel asked        -> cancelled
    stopped by the worker, no cancel asked                         -> released
    cancel asked and the run stopped by cancellation               -> cancelled
    the run returned                                               -> finished
    otherwise (it raised)                                          -> failed

CHILDREN (a step's child as a run of its own, ``Child(wf, queued=True)``):
the parent's holder submits the child (``spawn``, fenced by the parent's lease,
under an id derived from the parent's, idempotent) and links it to the parent
in the same transaction. When the parent has nothing left to run but its
children, its holder ``join``s: in one transaction it locks the parent's row,
then reads the children it waits for; if they all ended already (or one of
them failed or was cancelled), the parent goes back to ``queued`` (any worker
resumes it), else it parks ``waiting`` (no lease, no worker; ``reason`` starts
with :data:`CHILDREN_REASON`). The end of its last child still going (or a
child's failure or cancel), whichever verb writes it, ``wake``s a parent
waiting for its children in the same transaction (a trigger:
:mod:`~ekit_runtime.queue.links`): a parent of many items' children is woken
once.
The claim that resumes the parent records each ended child's answer in its
checkpoint, and the parent's step hands on the child's output. A ``cancel``
applies its rows to the run's descendants first (deepest first), then to the
run; a ``retry`` queues its failed or cancelled descendants again with it. A
parent that ends ``failed`` or ``cancelled``, whichever verb writes it,
``close``s its children not yet ended in the same transaction (the cancel's
rows, made by the database: a trigger), and each child that ends so closes
its own. A parent never ends ``finished`` with a child unended: its step
waiting for the child keeps it from finishing.

RATE WINDOWS: a claim is refused while ``max_in_flight`` live leases exist or
``runs_per_minute`` leases were granted in the trailing window; no step
starts while the calls or tokens recorded in the trailing window reached
their limit (:func:`usage_wait`). An entry of a window counts while its time
is after ``now - window``.

RESOURCE SLOTS (``Limits.resources``, a cap per resource name): before an
attempt of a step tagged ``resource=R`` starts, its worker takes a slot of R
for that attempt. A slot is a row (resource, the attempt's key, run id,
epoch) and it is HELD while its run's lease at that epoch is live: the run is
``running`` at the slot's epoch and its lease has not expired
(:func:`slot_held`, the same condition as FENCED). A take is fenced (refused
with ``LeaseLostError`` unless the taker's lease is live) and succeeds only
while fewer than the cap's slots of R are held (:func:`slot_free`); counting
and inserting are one serialised step per resource (SQLite's write lock; on
PostgreSQL an advisory lock on R for the transaction). The attempt gives its
slot back when it ends, however it ends. A slot whose holder died, stalled
past its lease, or whose run was taken over, released or ended is no longer
held, with no cleanup: it stops counting the moment the lease lapses, and a
slot that stopped counting never counts again (an epoch only grows and an
expired lease is never renewed), so the next take deletes it.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, TypeAlias

from ekit_core.human import Question
from ekit_runtime.errors import RunWaiting
from ekit_runtime.queue.records import FINAL_STATUSES, STATUSES, LeaseLostError, Limits, RunStatus

__all__ = [
    "ABANDONED",
    "ANSWERING_VERBS",
    "Actor",
    "CLAIMABLE",
    "CLAIM_ORDER",
    "CHILDREN_REASON",
    "CancelEffect",
    "Ending",
    "FINAL",
    "GRAPH_CHANGE_MARK",
    "HELD",
    "IN_WINDOW",
    "LEFT_WINDOW",
    "LIVE",
    "MATCHES",
    "PARKED_AS",
    "PARK_STATUS",
    "RELEASED_AS",
    "RELEASE_STATUS",
    "REOPENED_AS",
    "RETRYABLE",
    "SLOT_HELD",
    "TRANSITIONS",
    "Transition",
    "UNCHANGED",
    "abandoned",
    "abandoned_as",
    "at_cap",
    "at_start_rate",
    "cancel_effect",
    "children_reason",
    "join_status",
    "claimable",
    "drive_ending",
    "expired",
    "fenced",
    "follows",
    "graph_change_allowed",
    "held_status",
    "live",
    "matches",
    "next_status",
    "render",
    "reopen_refusal",
    "slot_free",
    "slot_held",
    "submitted_as",
    "targets",
    "usage_limited",
    "usage_over",
    "usage_reason",
    "usage_wait",
    "waiting_reason",
]

Actor: TypeAlias = Literal["submitter", "holder", "anyone"]
"""Who makes a transition: the caller's side, the lease holder, or any worker's claim."""

Ending: TypeAlias = Literal["finished", "failed", "cancelled", "lost", "released", "parked"]
"""How a worker's drive of a run ended."""

CancelEffect: TypeAlias = Literal["ended", "flag", "cancel"]
"""What a cancel does: nothing (already final), flag a live lease, or cancel at once."""


@dataclass(frozen=True, slots=True)
class Transition:
    """One row of :data:`TRANSITIONS`: ``who`` moves a run from ``source`` to ``target`` by ``verb``."""

    source: RunStatus | None
    target: RunStatus
    who: Actor
    verb: str
    condition: str
    lease: Literal["live", "expired"] | None = None
    """The row holds only while the run's lease is live, or only once it expired (``None``: either)."""
    cancel: bool | None = None
    """The row holds only if a cancel was asked (``True``), or only if none was (``False``; ``None``:
    either)."""


TRANSITIONS: tuple[Transition, ...] = (
    Transition(None, "queued", "submitter", "submit", "the run id is new"),
    Transition("queued", "running", "anyone", "claim", "claimable; epoch + 1"),
    Transition("running", "running", "anyone", "claim", "lease expired, no cancel asked; epoch + 1",
               cancel=False),
    Transition("running", "cancelled", "anyone", "claim", "lease expired with a cancel asked; epoch + 1",
               cancel=True),
    Transition("running", "running", "holder", "save", "fenced; lease extended"),
    Transition("running", "running", "holder", "renew", "fenced; lease extended"),
    Transition("running", "finished", "holder", "finish", "fenced"),
    Transition("running", "failed", "holder", "finish", "fenced"),
    Transition("running", "cancelled", "holder", "finish", "fenced"),
    Transition("running", "queued", "holder", "release", "fenced, no cancel asked", cancel=False),
    Transition("running", "cancelled", "holder", "release", "fenced, a cancel asked", cancel=True),
    Transition("queued", "cancelled", "submitter", "cancel", "at once; epoch + 1"),
    Transition("running", "cancelled", "submitter", "cancel", "lease expired; epoch + 1", "expired"),
    Transition("running", "running", "submitter", "cancel", "lease live: cancel_requested set", "live"),
    Transition("failed", "queued", "submitter", "retry", "epoch + 1; error and cancel flag cleared"),
    Transition("cancelled", "queued", "submitter", "retry", "epoch + 1; error and cancel flag cleared"),
    Transition("queued", "queued", "submitter", "rewind", "no live lease; epoch + 1"),
    Transition("running", "queued", "submitter", "rewind", "lease expired; epoch + 1"),
    Transition("finished", "queued", "submitter", "rewind", "epoch + 1; error, flag cleared"),
    Transition("failed", "queued", "submitter", "rewind", "epoch + 1; error, flag cleared"),
    Transition("cancelled", "queued", "submitter", "rewind", "epoch + 1; error, flag cleared"),
    Transition(None, "queued", "submitter", "fork", "a new run id; the source's checkpoint, rewound"),
    Transition("running", "waiting", "holder", "park", "fenced, no cancel asked; no lease", cancel=False),
    Transition("running", "cancelled", "holder", "park", "fenced, a cancel asked", cancel=True),
    Transition("waiting", "cancelled", "submitter", "cancel", "at once; epoch + 1"),
    Transition("waiting", "queued", "submitter", "rewind", "epoch + 1; questions rewound too"),
    Transition("waiting", "queued", "submitter", "answer", "a question pending; epoch + 1"),
    Transition("waiting", "queued", "submitter", "approve", "an approval pending; epoch + 1"),
    Transition("waiting", "queued", "submitter", "deny", "an approval pending; epoch + 1"),
    Transition(None, "queued", "holder", "spawn", "the parent's lease is live; a new child id"),
    Transition("running", "waiting", "holder", "join", "fenced, no cancel asked, a child still going",
               cancel=False),
    Transition("running", "queued", "holder", "join",
               "fenced, no cancel asked, all ended or one not finished", cancel=False),
    Transition("running", "cancelled", "holder", "join", "fenced, a cancel asked", cancel=True),
    Transition("waiting", "queued", "anyone", "wake",
               "its last child going ended, or one not finished; epoch + 1"),
    Transition("queued", "cancelled", "anyone", "close", "its parent ended early; epoch + 1"),
    Transition("waiting", "cancelled", "anyone", "close", "its parent ended early; epoch + 1"),
    Transition("running", "cancelled", "anyone", "close", "its parent ended early, lease expired; epoch + 1",
               "expired"),
    Transition("running", "running", "anyone", "close", "its parent ended early, lease live: flagged",
               "live"),
)
"""Every legal status change (the table in this module's docstring)."""


# -- the conditions, as plain functions over values -------------------------


def live(status: str, lease_until: float | None, now: float) -> bool:
    """Whether a run holds an unexpired lease (it counts against ``max_in_flight``)."""
    return status == "running" and lease_until is not None and lease_until > now


def expired(lease_until: float | None, now: float) -> bool:
    """Whether a lease was granted and has run out (a run is never running without one)."""
    return lease_until is not None and lease_until <= now


def claimable(status: str, lease_until: float | None, cancel_requested: bool, now: float) -> bool:
    """Whether a claim may take the run (its workflow and fingerprint aside: :func:`matches`)."""
    if status == "queued":
        return True
    return status == "running" and expired(lease_until, now) and not cancel_requested


def abandoned(status: str, lease_until: float | None, cancel_requested: bool, now: float) -> bool:
    """Whether a claim cancels the run: its lease expired after a cancel was asked."""
    return status == "running" and cancel_requested and expired(lease_until, now)


def matches(
    workflow: str, fingerprint: str | None, workflows: Mapping[str, str | None], *, graph_change: bool = False
) -> bool:
    """Whether a claimer driving ``workflows`` (name -> its graph fingerprint) may take the run.

    ``graph_change``: the run's options allow a checkpoint of another graph
    (``allow_graph_change``), so any version of its workflow may resume it.
    """
    if workflow not in workflows:
        return False
    return graph_change or fingerprint is None or fingerprint == workflows[workflow]


GRAPH_CHANGE_MARK = '"allow_graph_change":true'
"""The text that stored run options (compact JSON, as submit writes them) hold when they
allow a graph change. Inside a JSON string every quote is escaped, so this text can only
be the option itself: the claim's SQL looks for it without parsing the options."""


def graph_change_allowed(options: str | None) -> bool:
    """Whether stored run options (their JSON text) allow a checkpoint of another graph."""
    return options is not None and GRAPH_CHANGE_MARK in options


def fenced(
    status: str, epoch: int, lease_until: float | None, lease_epoch: int, now: float
) -> bool:
    """Whether a write of the holder of the lease at ``lease_epoch`` is accepted."""
    return epoch == lease_epoch and live(status, lease_until, now)


def follows(verb: str, status: str | None, lease_live: bool) -> Transition | None:
    """The row of :data:`TRANSITIONS` by which ``verb`` moves a run in ``status``, or ``None``: no row.

    Read at each call, so the table decides (a verb that consults it follows a
    changed row); a row's ``lease`` narrows it to a live or an expired lease.
    """
    for row in TRANSITIONS:
        if row.verb == verb and row.source == status and (
            row.lease is None or (row.lease == "live") == lease_live
        ):
            return row
    return None


def targets(verb: str, source: RunStatus | None) -> frozenset[RunStatus]:
    """Every status ``verb`` may move a run in ``source`` to, by the rows of :data:`TRANSITIONS`
    (read at each call: a holder's ``finish`` writes only a status a row names)."""
    return frozenset(row.target for row in TRANSITIONS if row.verb == verb and row.source == source)


def submitted_as() -> RunStatus:
    """The status a ``submit`` stores a new run in: the target of the table's ``submit`` row."""
    row = follows("submit", None, False)
    if row is None:
        raise ValueError("the lifecycle table has no row for submit: no run can be queued")
    return row.target


def abandoned_as() -> RunStatus:
    """The status a claim leaves a run whose lease expired after a cancel was asked (:func:`abandoned`):
    the target of the table's ``claim`` row from ``running`` with a cancel asked."""
    for row in TRANSITIONS:
        if (row.verb, row.source, row.cancel) == ("claim", "running", True):
            return row.target
    raise ValueError("the lifecycle table has no row for a claim of an abandoned run")


def held_status(verb: str) -> str:
    """SQL of the status a holder's ``release`` or ``park`` writes, for its ``SET status = ...``.

    The run's ``cancel_requested`` column picks the row (a cancel asked or
    not); each row's target, read from :data:`TRANSITIONS` at each call, is
    the status written. A verb the table gives no such row is refused.
    """
    chosen = {}
    for asked in (True, False):
        row = next(
            (t for t in TRANSITIONS
             if t.verb == verb and t.source == "running" and t.cancel in (asked, None)),
            None,
        )
        if row is None:
            what = "a cancel asked" if asked else "no cancel asked"
            raise ValueError(f"the lifecycle table has no row for {verb} of a running run with {what}")
        chosen[asked] = row.target
    if chosen[True] == chosen[False]:
        return f"'{chosen[True]}'"
    return f"CASE WHEN cancel_requested THEN '{chosen[True]}' ELSE '{chosen[False]}' END"


def cancel_effect(status: str, lease_live: bool) -> CancelEffect:
    """What asking to cancel a run does (``lease_live``: :func:`live` of the run), by the table's row.

    No row: nothing (a final run, already ended); a row that keeps the status
    flags the live lease's holder; any other ends the run ``cancelled`` at once.
    """
    row = follows("cancel", status, lease_live)
    if row is None:
        return "ended"
    return "flag" if row.target == status else "cancel"


def next_status(
    verb: str,
    status: RunStatus,
    lease_until: float | None,
    cancel_requested: bool,
    now: float,
    *,
    fenced_ok: bool = True,
    final: RunStatus = "finished",
    child_ended: bool = False,
) -> RunStatus | None:
    """The status ``verb`` leaves a run in, or ``None`` when it changes nothing (or is refused).

    ``fenced_ok``: for a holder's verb (save, renew, finish, release), whether
    the lease's epoch is the run's (:func:`fenced` checks the rest); ``final``:
    the status a finish writes; ``child_ended``: for a ``join``, whether a
    child it waits for ended already. Every change it allows is a row of
    :data:`TRANSITIONS`, made by that row's ``who``.
    """
    if verb == "claim":
        if abandoned(status, lease_until, cancel_requested, now):
            return "cancelled"
        return "running" if claimable(status, lease_until, cancel_requested, now) else None
    if verb in ("cancel", "close"):  # (a close: a cancel the parent's early end makes)
        effect = cancel_effect(status, live(status, lease_until, now))
        return None if effect == "ended" else "running" if effect == "flag" else "cancelled"
    if verb in _REOPENING_VERBS:
        return None if reopen_refusal(verb, status, live(status, lease_until, now)) else REOPENED_AS
    if verb == "wake":
        return "queued" if status == "waiting" else None
    if verb == "spawn":
        return None  # (a new run's status: submitted_as(); an id that exists changes nothing)
    if verb not in _HOLDER_VERBS:
        raise ValueError(f"not a verb of a run's lifecycle: {verb!r}")
    if not (fenced_ok and live(status, lease_until, now)):
        return None
    if verb == "release":
        return RELEASED_AS[cancel_requested]
    if verb == "park":
        return PARKED_AS[cancel_requested]
    if verb == "join":
        return join_status(cancel_requested, child_ended)
    return {"save": status, "renew": status, "finish": final}[verb]


_HOLDER_VERBS = frozenset({"save", "renew", "finish", "release", "park", "join"})
_REOPENING_VERBS = frozenset({"retry", "rewind", "answer", "approve", "deny"})
ANSWERING_VERBS: frozenset[str] = frozenset({"answer", "approve", "deny"})
"""A person's verbs that answer the question a waiting run's step asked."""

REOPENED_AS: RunStatus = "queued"
"""The status a person's reopening verb (retry, rewind) leaves a run in: any worker claims it next."""

RETRYABLE: frozenset[str] = frozenset({"failed", "cancelled"})
"""The statuses a ``retry`` takes: a run that ended without finishing."""

_RETRY_ADVICE: Mapping[str, str] = {
    "queued": "it is queued already: a worker will claim it",
    "running": "it is running: cancel it first (ekit queue cancel), then retry it once it is cancelled",
    "waiting": "it is waiting for a person: answer it (ekit queue answer, approve or deny)",
    "finished": "it finished: to run steps again, rewind them (ekit queue rewind) or fork it "
    "(ekit queue fork)",
}


def reopen_refusal(verb: str, status: str, lease_live: bool) -> str | None:
    """Why ``verb`` (``retry``, ``rewind``, ``answer``, ``approve``, ``deny``) may not reopen
    a run in ``status``; ``None``: it may.

    ``lease_live``: :func:`live` of the run. A retry takes a failed or
    cancelled run; a rewind any run no live lease holds (a running one whose
    worker is alive is refused: cancel it first); an answer, approval or
    denial only a waiting run (whether the step has a question pending is
    the checkpoint's to say: :func:`ekit_core.answer`).
    """
    if verb in ANSWERING_VERBS:
        if status == "waiting":
            return None
        return f"it is {status}, not waiting for an answer"
    if verb == "retry":
        if status in RETRYABLE:
            return None
        return f"{_RETRY_ADVICE.get(status, f'it is {status}')}; only a failed or cancelled run is retried"
    if verb == "rewind":
        if not lease_live:
            return None
        return (
            "it is running under a live lease (a worker is driving it): cancel it first "
            "(ekit queue cancel), then rewind it once it is cancelled"
        )
    raise ValueError(f"not a verb that reopens a run: {verb!r}")

RELEASED_AS: Mapping[bool, RunStatus] = {False: "queued", True: "cancelled"}
"""The status a release leaves a run in, by whether a cancel was asked."""

RELEASE_STATUS = held_status("release")
"""SQL of :data:`RELEASED_AS`, for the release's ``SET status = ...``."""

PARKED_AS: Mapping[bool, RunStatus] = {False: "waiting", True: "cancelled"}
"""The status a park leaves a run in, by whether a cancel was asked (a cancelled run is not parked)."""

PARK_STATUS = held_status("park")
"""SQL of :data:`PARKED_AS`, for the park's ``SET status = ...``."""


CHILDREN_REASON = "waiting for child run"
"""How the reason of a parent parked for its children begins (what a child's end looks for)."""


def children_reason(children: list[str] | tuple[str, ...]) -> str:
    """The reason a parent parked for its children shows: which child runs it waits for."""
    if len(children) == 1:
        return f"{CHILDREN_REASON} {children[0]!r}"
    return f"{CHILDREN_REASON}s {', '.join(map(repr, children))}"


def join_status(cancel_requested: bool, child_ended: bool) -> RunStatus:
    """The status a holder's ``join`` leaves its run in, by the table's ``join`` rows: ``cancelled``
    if a cancel was asked, else ``queued`` if the children it waits for ended already (all of them,
    or one that did not finish: ``child_ended``), else ``waiting``."""
    for row in TRANSITIONS:
        if row.verb != "join" or row.source != "running" or row.cancel not in (cancel_requested, None):
            continue
        if cancel_requested or (row.target == "queued") == child_ended:
            return row.target
    raise ValueError("the lifecycle table has no row for a join of a running run")


def drive_ending(
    *,
    lost: bool,
    stopping: bool,
    cancel_asked: bool,
    cancelled: bool,
    error: BaseException | None,
) -> Ending:
    """How a drive ended, from the worker's flags and the run task's end.

    ``cancelled``: the run's task was cancelled; ``error``: what it raised
    (``None`` if it returned or was cancelled). ``lost`` and ``released`` write
    no final status, ``parked`` parks the run (status ``waiting``); the other
    three are the status the holder finishes with. A run that waits for a
    person is parked even while the worker stops: it needs no worker until
    someone answers.
    """
    if lost or _refused(error):
        return "lost"
    if isinstance(error, RunWaiting):
        return "cancelled" if cancel_asked else "parked"
    if stopping and not cancel_asked:
        return "released"
    if cancel_asked and (cancelled or isinstance(error, asyncio.CancelledError)):
        return "cancelled"
    if error is None and not cancelled:
        return "finished"
    return "failed"


def waiting_reason(questions: Mapping[str, Question]) -> str:
    """The reason a parked run shows (``RunInfo.reason``, ``ekit queue list``): who waits, for what."""
    names = list(questions)
    if len(names) != 1:
        return f"waiting for answers to steps {', '.join(map(repr, names))}"
    question = questions[names[0]]
    how = " (approve or deny)" if question.kind == "approval" else ""
    return f"waiting for an answer to step {names[0]!r}{how}: {question.prompt}"


def _refused(error: BaseException | None) -> bool:
    """Whether ``error`` is, or holds, a refused write."""
    if isinstance(error, LeaseLostError):
        return True
    if isinstance(error, BaseExceptionGroup):
        return any(_refused(e) for e in error.exceptions)
    return False


def slot_held(slot_epoch: int, status: str, epoch: int, lease_until: float | None, now: float) -> bool:
    """Whether a slot taken at ``slot_epoch`` counts, its run being at ``status``/``epoch``/``lease_until``.

    It counts while the lease it was taken under is live: :func:`fenced` of
    a write at that epoch. A dead holder's slot is thus free once its lease
    expired, and a taken-over, released or ended run's at once.
    """
    return fenced(status, epoch, lease_until, slot_epoch, now)


def slot_free(cap: int | None, held: int) -> bool:
    """Whether ``held`` slots of a resource leave one for another attempt (``cap`` ``None``: no cap)."""
    return cap is None or held < cap


def at_cap(limits: Limits, live_leases: int) -> bool:
    """Whether ``live_leases`` live leases leave no room under ``max_in_flight`` (no claim)."""
    return limits.max_in_flight is not None and live_leases >= limits.max_in_flight


def at_start_rate(limits: Limits, started: int) -> bool:
    """Whether ``started`` leases granted in the window reached ``runs_per_minute`` (no claim)."""
    return limits.runs_per_minute is not None and started >= limits.runs_per_minute


def usage_limited(limits: Limits) -> bool:
    """Whether the fleet limits calls or tokens (only then does a step ask :func:`usage_wait`)."""
    return limits.llm_calls_per_minute is not None or limits.tokens_per_minute is not None


def usage_over(limits: Limits, calls: int, tokens: int) -> bool:
    """Whether the window's recorded ``calls`` and ``tokens`` reached a limit (no step may start)."""
    return (limits.llm_calls_per_minute is not None and calls >= limits.llm_calls_per_minute) or (
        limits.tokens_per_minute is not None and tokens >= limits.tokens_per_minute
    )


def usage_wait(limits: Limits, calls: int, tokens: int, oldest: float | None, now: float) -> float:
    """Seconds before the window (its oldest entry at ``oldest``) lets a step start; 0: go.

    Once over, the wait is until the oldest entry leaves the window, and at
    least 10 ms (a caller then asks again).
    """
    if not usage_over(limits, calls, tokens) or oldest is None:
        return 0.0
    return max(float(oldest) + limits.window - float(now), 0.01)


def usage_reason(limits: Limits, calls: int, tokens: int) -> str | None:
    """Which usage limit holds steps back (``"rate limit llm_calls_per_minute"``), or ``None``."""
    if limits.llm_calls_per_minute is not None and calls >= limits.llm_calls_per_minute:
        return "rate limit llm_calls_per_minute"
    if limits.tokens_per_minute is not None and tokens >= limits.tokens_per_minute:
        return "rate limit tokens_per_minute"
    return None


# -- the same conditions as SQL pieces --------------------------------------
#
# ``:name`` is a named placeholder that a backend's dialect table maps to its
# SQL (``render``): ``:now`` to the clock (a parameter on SQLite, the server's
# now() on PostgreSQL), ``:since`` to the start of a rate window, the others
# to a parameter marker or a column. They are read left to right, which is the
# order of a backend's positional arguments.


def _sql(text: str) -> str:
    """``text`` with each ``{status}`` written as that status's SQL literal."""
    return text.format(**{s: f"'{s}'" for s in STATUSES})


LIVE = _sql("status = {running} AND lease_until > :now")
"""SQL of :func:`live`."""

HELD = _sql("run_id = :run_id AND epoch = :epoch AND status = {running} AND lease_until > :now")
"""SQL of :func:`fenced`, for one run: the condition every holder's write carries."""

CLAIMABLE = _sql("(status = {queued} OR (status = {running} AND lease_until <= :now))")
"""SQL of :func:`claimable` once the claim has cancelled the :data:`ABANDONED` runs."""

ABANDONED = _sql("status = {running} AND cancel_requested AND lease_until <= :now")
"""SQL of :func:`abandoned`: the runs a claim cancels first."""

MATCHES = "workflow = :workflow AND (fingerprint IS NULL OR fingerprint = :fingerprint OR :graph_change)"
"""SQL of :func:`matches`, for one (workflow, fingerprint) pair of the claimer; ``:graph_change``
is the backend's test of :func:`graph_change_allowed` on the ``options`` column."""

UNCHANGED = _sql(
    "run_id = :run_id AND epoch = :epoch "
    "AND (status <> {running} OR lease_until IS NULL OR lease_until <= :now)"
)
"""The fence of a person's write (retry, rewind): the run still has the epoch read, and no live lease."""

CLAIM_ORDER = "priority DESC, seq"
"""The order claims take runs in: the highest priority first, then the oldest submission."""

FINAL = "status IN (" + ", ".join(f"'{s}'" for s in sorted(FINAL_STATUSES)) + ")"
"""SQL of ``status in FINAL_STATUSES``."""

SLOT_HELD = _sql(
    "EXISTS (SELECT 1 FROM ekit_queue_runs r WHERE r.run_id = s.run_id AND r.epoch = s.epoch "
    "AND r.status = {running} AND r.lease_until > :now)"
)
"""SQL of :func:`slot_held`, for a slot row aliased ``s`` (of ``ekit_queue_slots``)."""

IN_WINDOW = "at > :since"
"""An entry of a rate window (a lease granted, a save's usage) that still counts: after ``now - window``."""

LEFT_WINDOW = "at <= :since"
"""An entry that no longer counts (deleted by the next claim)."""

_NAME = re.compile(r":(\w+)")


def render(template: str, dialect: Mapping[str, str]) -> str:
    """``template`` with each ``:name`` replaced by ``dialect[name]`` (a ``KeyError`` if missing)."""
    return _NAME.sub(lambda m: dialect[m.group(1)], template)
