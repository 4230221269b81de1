"""The values a run queue hands out: run records, leases, limits, and its errors.

Plain frozen dataclasses, the same for every backend, and the checks that
turn bad arguments into a ``ValueError`` naming the argument before any
backend touches its database.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, NamedTuple, NoReturn, TypeAlias

from ekit_core import TokenUsage, WorkflowCheckpoint
from ekit_core.numbers import check_number
from ekit_core.usage import NO_USAGE
from ekit_runtime import run_ids
from ekit_runtime.step import unstorable_resource

__all__ = [
    "FINAL_STATUSES",
    "MIN_LEASE_SECONDS",
    "STATUSES",
    "InFlight",
    "Lease",
    "LeaseLostError",
    "Limits",
    "QueueUnavailableError",
    "RunInfo",
    "RunStateError",
    "RunsPage",
    "RunStatus",
    "UnknownRunError",
    "check_age",
    "check_count",
    "check_lease_seconds",
    "check_priority",
    "check_resources",
    "check_run_id",
    "check_seconds",
    "check_status",
    "check_step_name",
    "check_text",
    "check_workflow_name",
]

RunStatus: TypeAlias = Literal["queued", "running", "waiting", "finished", "failed", "cancelled"]
"""Where a run is: queued for a worker, leased by one, parked until a person answers (``waiting``:
no lease, no worker), or one of the three final states."""

STATUSES: tuple[RunStatus, ...] = ("queued", "running", "waiting", "finished", "failed", "cancelled")
"""Every status, in the order a run goes through them."""

FINAL_STATUSES: frozenset[str] = frozenset({"finished", "failed", "cancelled"})
"""The statuses a run stays in unless a person reopens it (``retry``, ``rewind``); ``prune`` deletes them."""


class LeaseLostError(RuntimeError):
    """A write was refused: the lease on ``run_id`` at ``epoch`` is no longer held.

    It expired, another worker took the run over (a higher epoch), or the run
    was cancelled or finished meanwhile. Nothing of the refused write reached
    the database; the worker stops driving that run.
    """

    def __init__(self, run_id: str, epoch: int) -> None:
        super().__init__(
            f"lease on run {run_id!r} at epoch {epoch} is lost (expired or taken over); the write was refused"
        )
        self.run_id = run_id
        self.epoch = epoch


class QueueUnavailableError(ValueError):
    """The queue's database cannot be opened: unreachable, refused, or not a path or URL a queue takes.

    ``where`` names it: the SQLite path, or the PostgreSQL DSN with its
    password shown as ``***``. The message never holds a password, whatever
    the driver said.
    """

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.where = where


class RunStateError(ValueError):
    """A caller's ``retry``, ``rewind`` (or another verb reopening a run) refused: nothing was written.

    The run is in a status that verb does not take (``status``: the one read),
    or it changed between the read and the write (a worker claimed it,
    another call reopened it): the message names the run, its status and
    what to do instead. ``step`` names the step, for a verb about one.
    """

    def __init__(self, run_id: str, status: str, verb: str, problem: str, step: str | None = None) -> None:
        about = "" if step is None else f" at step {step!r}"
        super().__init__(f"cannot {verb} run {run_id!r}{about}: {problem}")
        self.run_id = run_id
        self.status = status
        self.verb = verb
        self.step = step


class UnknownRunError(LookupError):
    """No run with this ``run_id`` is in the queue."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"no run {run_id!r} in the queue")
        self.run_id = run_id


@dataclass(frozen=True, slots=True)
class RunInfo:
    """One run as the queue records it (no checkpoint: see ``queue.checkpoint``).

    ``epoch`` counts the leases granted so far (0: never claimed); ``owner``
    names the last worker that claimed it, for people reading logs, never for
    recovery; ``lease_until`` is when the current lease expires (seconds since
    the epoch, on the database's clock), ``None`` when none was granted.

    Read from the run's row, without decoding its checkpoint:

    - ``options``: the run options it was submitted with (plain data, see
      :data:`~ekit_runtime.queue.options.RUN_OPTIONS`).
    - ``steps_done`` / ``steps_total``: progress as of its last save. Done
      counts the steps recorded or skipped; total the steps of its graph,
      plus the items of each mapped step once the step it maps over has
      recorded its output (each item counts as a step, as in ``done``).
      ``steps_total`` is ``None`` before the first save.
    - ``cost``: the usage its steps reported, as of its last save.
    - ``reason``: why a run that is not final waits, or ``None``: for a
      running run what its worker set (``"rate limit llm_calls_per_minute"``
      while the fleet's usage limit holds its next step), for a queued one
      ``"no worker has workflow W"`` when no live worker serves it.
    """

    run_id: str
    workflow: str
    status: RunStatus
    priority: int
    epoch: int
    owner: str | None
    lease_until: float | None
    cancel_requested: bool
    error: str | None
    created_at: float
    updated_at: float
    fingerprint: str | None
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    steps_done: int = 0
    steps_total: int | None = None
    cost: TokenUsage = NO_USAGE
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class InFlight:
    """An attempt a live worker said it runs now (see ``RunQueue.in_flight``).

    Advisory, like the worker's announcements it comes from: up to about a
    second old, and never used for recovery. ``name`` is the step's (or
    item's, ``step[key]``), ``attempt`` its number counted across runs,
    ``worker`` the worker's name and ``since`` when its work began
    (seconds since the epoch, on the worker's clock).
    """

    name: str
    attempt: int
    worker: str
    since: float


@dataclass(frozen=True, slots=True)
class Lease:
    """The right to drive one run, until ``expires`` or until another epoch is granted.

    ``epoch`` is the fencing token: every write the holder makes carries it,
    and the database refuses the write unless the run's epoch still equals it
    and the lease has not expired. ``checkpoint`` is the run's latest
    checkpoint when the lease was granted (``None`` for a fresh run);
    ``context`` the initial context it was submitted with; ``options`` its
    run options (checked plain data, see :mod:`ekit_runtime.queue.options`);
    ``limits`` the fleet's :class:`Limits` as the claim read them, in the
    transaction that granted the lease (``None`` from a backend that does not
    say: a worker then asks :meth:`RunQueue.limits`).
    """

    run_id: str
    epoch: int
    workflow: str
    context: MappingProxyType[str, Any]
    checkpoint: WorkflowCheckpoint | None
    expires: float
    cancel_requested: bool = False
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    limits: Limits | None = None


@dataclass(frozen=True, slots=True)
class Limits:
    """Limits that hold across every worker of a queue (kept in its database).

    - ``max_in_flight``: at most this many runs hold a live lease at once.
    - ``runs_per_minute``: at most this many leases granted per window.
    - ``llm_calls_per_minute`` / ``tokens_per_minute``: no step starts while
      the usage recorded by the fleet in the trailing window has reached the
      limit (input plus output tokens). Usage is known only when a step
      finishes, so steps already running when the limit is reached may
      overshoot it; see ``docs/queue.md``.
    - ``window``: the length of the trailing window, in seconds (60 for the
      per-minute limits; tests shorten it).
    - ``resources``: resource name -> at most this many attempts of the steps
      tagged with it (``Step(..., resource="openai")``) hold a slot at once,
      across the fleet. A slot counts while its run's lease is live, so a
      worker that dies frees its slots when its lease expires. A resource
      named by no entry has no cap.

    ``None`` means no limit.
    """

    max_in_flight: int | None = None
    runs_per_minute: int | None = None
    llm_calls_per_minute: int | None = None
    tokens_per_minute: int | None = None
    window: float = field(default=60.0)
    # Read-only once checked (the value is frozen); left out of the hash, as a dict has none.
    resources: Mapping[str, int] = field(default_factory=lambda: _NO_RESOURCES, hash=False)

    def __post_init__(self) -> None:
        for name in ("max_in_flight", "runs_per_minute", "llm_calls_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"Limits.{name} must be a positive int or None, got {value!r}")
        check_seconds(self.window, "Limits.window")
        object.__setattr__(self, "resources", check_resources(self.resources))

    def to_dict(self) -> dict[str, Any]:
        """Plain data, as stored in the queue's database."""
        return {
            "max_in_flight": self.max_in_flight,
            "runs_per_minute": self.runs_per_minute,
            "llm_calls_per_minute": self.llm_calls_per_minute,
            "tokens_per_minute": self.tokens_per_minute,
            "window": self.window,
            "resources": dict(self.resources),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Limits:
        """The limits :meth:`to_dict` wrote (a ``ValueError`` naming a bad field)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"limits must be a mapping, got {type(data).__name__}")
        return cls(**{k: data[k] for k in cls().to_dict() if k in data})


class _Caps(dict[str, int]):
    """``Limits.resources``: a ``dict`` (to ``==``, ``json`` and ``pickle``) that refuses writes."""

    __slots__ = ()

    def _refuse(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError(
            "Limits are frozen: make new ones, e.g. dataclasses.replace(limits, resources={...})"
        )

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse

    def __reduce__(self) -> tuple[type[_Caps], tuple[dict[str, int]]]:
        return _Caps, (dict(self),)


_NO_RESOURCES: Mapping[str, int] = _Caps()


def check_resources(resources: object) -> Mapping[str, int]:
    """``resources`` (resource name -> cap) as a read-only mapping, sorted by name, once checked.

    Each name is a resource name a step may carry (a non-empty string of at
    most 200 characters, no NUL nor lone surrogate: what the queue stores);
    each cap a positive int. A ``ValueError`` names the resource at fault.
    """
    if not isinstance(resources, Mapping):
        raise ValueError(
            f"Limits.resources must be a mapping of resource name to a positive int, "
            f"got {type(resources).__name__}"
        )
    if not resources:
        return _NO_RESOURCES
    for name, cap in resources.items():
        why = unstorable_resource(name)
        if why is not None:
            raise ValueError(f"Limits.resources: a resource name {why}")
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(f"Limits.resources[{name!r}] must be a positive int, got {cap!r}")
    return _Caps(sorted(resources.items()))


# PostgreSQL text cannot hold a NUL, and neither backend can store a lone
# surrogate (it is not UTF-8): refused here, naming the argument, rather than
# by the driver halfway through a save.
def check_text(value: object, name: str, *, limit: int) -> str:
    """``value`` if it is a non-empty string of at most ``limit`` characters that every backend stores.

    Refused (``ValueError`` naming ``name``): not a string, empty, longer than
    ``limit``, holding a NUL character, or a lone surrogate (not UTF-8).
    """
    if not isinstance(value, str) or not value or len(value) > limit:
        problem = f"must be a non-empty string of at most {limit} characters"
    elif "\x00" in value:
        problem = "must not contain a NUL character"
    elif not _utf8(value):
        problem = "must be valid Unicode (it holds a lone surrogate)"
    else:
        return value
    raise ValueError(f"{name} {problem}, got {value!r:.300}")


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_run_id(run_id: object, name: str = "run_id") -> str:
    """``run_id`` if it is a run id (:func:`ekit_runtime.run_ids.check_run_id`) a queue can keep.

    The queue's limits on top of the one rule: at most 200 characters, no NUL.
    """
    return check_text(run_ids.check_run_id(run_id, name), name, limit=200)


def check_workflow_name(workflow: object, name: str = "workflow") -> str:
    """``workflow`` if it is a non-empty string of at most 200 characters, with no NUL nor lone surrogate."""
    return check_text(workflow, name, limit=200)


def check_step_name(step: object) -> str:
    """``step`` if a queue can store it as a step name: at most 1,000 characters, no NUL nor lone surrogate.

    PostgreSQL indexes step names with the run id, and an index entry must fit
    in about 2,700 bytes: 1,000 characters of up to 4 UTF-8 bytes would not, so
    the encoded length is bounded too (1,800 bytes).
    """
    text = check_text(step, "step name", limit=1000)
    if len(text.encode("utf-8")) > 1800:
        raise ValueError(f"step name must be at most 1800 bytes in UTF-8, got {text!r:.300}")
    return text


def check_priority(priority: object) -> int:
    """``priority`` if it is an int that fits a 32-bit column (higher runs first)."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not -(2**31) <= priority < 2**31:
        raise ValueError(f"priority must be an int between -2**31 and 2**31-1, got {priority!r}")
    return priority


def check_seconds(value: object, name: str) -> float:
    """``value`` as a float if above 0 and at most :data:`~ekit_core.numbers.MAX_SECONDS` (finite) seconds."""
    return check_number(value, name, above_low=True)


# The shortest lease a queue grants. A lease ends at the clock (time.time(),
# about 1.7e9 seconds) plus its length, and a length under the clock's float
# resolution (about 2e-7 s) would leave the clock where it was: a save's new
# lease_until would equal its now, which the fence (lease_until > now)
# refuses while the save's own test of what it wrote said made.
MIN_LEASE_SECONDS = 0.001


def check_lease_seconds(value: object, name: str = "lease_seconds") -> float:
    """``value`` as a float if it is a finite number of seconds, at least :data:`MIN_LEASE_SECONDS`."""
    seconds = check_seconds(value, name)
    if seconds < MIN_LEASE_SECONDS:
        raise ValueError(f"{name} must be at least {MIN_LEASE_SECONDS} seconds, got {value!r}")
    return seconds


def check_age(value: object) -> float:
    """``value`` as a float if a finite number of seconds from 0 to :data:`~ekit_core.numbers.MAX_SECONDS`."""
    return check_number(value, "older_than")


def check_status(status: object) -> RunStatus | None:
    """``status`` if it is ``None`` or one of :data:`STATUSES`."""
    if status is not None and status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)} or None, got {status!r}")
    return status


class RunsPage(NamedTuple):
    """One page of runs, as :meth:`RunQueue.runs_page` reads it: ``(runs, total)``.

    ``runs`` are the page's records, in the order asked for; ``total`` is how
    many runs match the filters in all (every page's), counted in the same
    snapshot, so a pager can say "page 3 of 200".
    """

    runs: list[RunInfo]
    total: int


_MAX_ROWS = 2**63 - 1  # what SQLite's and PostgreSQL's LIMIT and OFFSET take (a signed 64-bit integer)


def check_count(value: object, name: str) -> int:
    """``value`` if it is a whole number from 0 to 2**63-1 (a page's ``limit``, ``offset``)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_ROWS:
        raise ValueError(f"{name} must be a whole number from 0 to 2**63-1, got {value!r}")
    return value
