"""Steps and what they return: ``Step``, ``PatternResult`` and the usage rule; and what runs them.

A step's return value becomes its output, with one exception that carries
usage: a ``PatternResult`` (ours, or any object shaped like one: a ``value``
attribute and a ``cost`` attribute holding integer (>= 0) ``input_tokens``,
``output_tokens`` and ``llm_calls``, which ExecutionKit's own
``PatternResult`` is). Then ``value`` is the output and ``cost`` is added to
the run's usage. Everything else is stored as returned, with zero usage.

A step names the :class:`Executor` that runs it, an executor runs one
:class:`Attempt` of a step, and an attempt holds its step: the three refer to
one another, so they are defined here together, and the modules that say
more about them (:mod:`ekit_runtime.attempt`, :mod:`ekit_runtime.executors`)
sit above this one and re-export them.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, Literal, NoReturn, TypeAlias, TypeVar

from ekit_core import RetryPolicy, TokenUsage
from ekit_core.code import POLICIES, CodePolicy
from ekit_core.numbers import check_number
from ekit_core.shapes import Shape, item_name
from ekit_core.usage import NO_USAGE, check_usage
from ekit_runtime.children import Child, is_workflow, unwrapped
from ekit_runtime.loops import Repeat

__all__ = [
    "Attempt",
    "AttemptKey",
    "Executor",
    "PatternResult",
    "Shaping",
    "Step",
    "StepFn",
    "condition_name",
    "split_result",
]

T = TypeVar("T")

StepFn: TypeAlias = Callable[[Any], Awaitable[Any] | Any]
"""A step body: takes the context, returns the output or an awaitable of it.

The context is a :class:`~ekit_runtime.context.StepContext` (a
``MutableMapping[str, Any]``) for ``context="all"`` and a plain ``dict`` for
``context="dependencies"``; annotate the parameter as ``Mapping[str, Any]``.
"""


@dataclass(frozen=True, slots=True)
class PatternResult(Generic[T]):
    """A step output that also reports the tokens spent making it."""

    value: T
    score: float | None = None
    cost: TokenUsage = NO_USAGE
    metadata: MappingProxyType[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        # Refused where it is made, so the attempt fails naming it: a NaN, negative,
        # float or bool count would be added to the run's usage (a NaN budget is never
        # reached) and written into a checkpoint that its own resume then refuses.
        check_usage(self.cost, "PatternResult.cost")

    def __str__(self) -> str:
        return str(self.value)


_COUNTS = ("input_tokens", "output_tokens", "llm_calls")


def _is_count(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 0


def _usage_of(cost: object) -> TokenUsage | None:
    """``cost`` as usage if it holds three counts (ints >= 0), else ``None``: it is no usage."""
    if isinstance(cost, TokenUsage):
        counts = [getattr(cost, n) for n in _COUNTS]
    else:
        counts = [getattr(cost, n, None) for n in _COUNTS]
    if not all(_is_count(value) for value in counts):
        return None
    return cost if isinstance(cost, TokenUsage) else TokenUsage(*counts)


PLAIN_OUTPUTS = frozenset({str, int, float, bool, bytes, dict, list, tuple, type(None)})
"""Types whose values are outputs as they are, with no usage (no ``value``/``cost`` to read)."""


def split_result(returned: object) -> tuple[Any, TokenUsage]:
    """Split what a step returned into ``(output, usage)`` by the rule above."""
    if type(returned) in PLAIN_OUTPUTS:
        return returned, NO_USAGE
    if isinstance(returned, PatternResult):
        return returned.value, returned.cost
    if hasattr(returned, "value") and hasattr(returned, "cost"):
        usage = _usage_of(returned.cost)
        if usage is not None:
            return returned.value, usage
    return returned, NO_USAGE


def unencodable(text: str) -> str | None:
    """Why no store could keep ``text``, a step name or version tag, or ``None`` if one can.

    Every store writes text as UTF-8, which cannot hold a lone surrogate
    (what ``os.listdir`` returns for a file name that is not UTF-8). Such a
    name fails no check of the graph; refused here, it fails before any
    step runs rather than at the first save, after paid work.
    """
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"holds {text[exc.start:exc.end]!r} at {exc.start}, which UTF-8 cannot encode, "
            "so no store could save it"
        )
    return None


RESOURCE_NAME_LIMIT = 200
"""The longest resource name (in characters) a step may be tagged with: what a run queue stores."""


def unstorable_resource(name: object) -> str | None:
    """Why a run queue could not keep ``name`` as a resource name, or ``None`` if it can.

    A non-empty string of at most :data:`RESOURCE_NAME_LIMIT` characters, with
    no NUL (PostgreSQL text cannot hold one) and no lone surrogate (not UTF-8):
    the rule of ``Limits.resources`` too, so a step's tag and a cap always match.
    """
    if not isinstance(name, str) or not name or len(name) > RESOURCE_NAME_LIMIT:
        limit = RESOURCE_NAME_LIMIT
        return f"must be a non-empty string of at most {limit} characters, got {name!r:.300}"
    if "\x00" in name:
        return f"must not contain a NUL character, got {name!r:.300}"
    return unencodable(name)


class _NoMetadata(dict[str, Any]):
    """The metadata of every step given none: one empty dict, shared and read-only.

    Shared so that building a step allocates one object, not two: a resume
    builds a ``Step`` for every recorded step, and each allocation brings the
    next pass of the garbage collector nearer. It is a ``dict`` (``{}`` to
    ``==``, ``json.dumps`` and ``isinstance``); writing to it raises
    ``TypeError``: pass ``metadata={...}`` to give a step its own.
    """

    __slots__ = ()

    def _refuse(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError(
            "a step given no metadata shares one empty, read-only dict: "
            "pass metadata={...} to give the step its own"
        )

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse

    def __reduce__(self) -> str:
        return "_NO_METADATA"  # unpickles as the shared one

    def __copy__(self) -> dict[str, Any]:
        return {}  # a copy is made to be written to: a plain dict of its own

    def __deepcopy__(self, memo: object) -> dict[str, Any]:
        return {}


_NO_METADATA = _NoMetadata()


def _runs_a_child(context: Any) -> Any:
    """What a step declared with a child runs, had its workflow not put the child in its place."""
    raise RuntimeError("ekit: a step with a child workflow runs as part of a Workflow")


@dataclass(frozen=True, slots=True, init=False)
class Step:
    """A named unit of work and the steps it depends on.

    ``run`` receives its own context: the initial context plus the outputs
    finished before it started (``context="all"``, ExecutionKit's behaviour,
    as a copy-on-write :class:`~ekit_runtime.context.StepContext` built in
    O(1)), or the initial context plus only this step's dependencies
    (``context="dependencies"``, a plain ``dict``, the same on every run
    whatever finished first). Writes to it are the step's own.
    ``run`` may be sync or async. Where it runs is the ``executor``'s
    business (the run's, unless the step names its own): by default async
    steps run on the event loop and sync steps in a worker thread, so that
    they never stall their siblings; ``inline=True`` runs a cheap sync step
    on the loop's thread instead. ``blocking=True`` is accepted for
    compatibility and changes nothing now (sync steps use a thread anyway).
    ``retry`` and ``timeout`` (seconds per attempt) are optional.
    ``metadata`` (handed to the approval callback) defaults to one empty
    ``dict`` shared by every step given none, which refuses writes.
    ``version`` is a tag to bump when the step's code changes: a checkpoint
    recorded under another tag runs this step again on resume, with
    everything downstream of it.
    ``resource`` names what the step's attempts use (``"openai"``): under a
    queue's workers, no attempt starts while the fleet's cap on that
    resource (``Limits(resources={"openai": 4})``) is reached, and each
    holds a slot until it ends (see ``docs/queue.md``, "Capping calls to one
    provider"). A plain ``workflow.run`` ignores it. It is not part of the
    graph's fingerprint: tagging a step changes no checkpoint.
    ``on_code_change`` (``"again"``, ``"keep"`` or ``"refuse"``) fingerprints
    the step's code and says what a resume does when it changed since its
    output was recorded (overriding the workflow's ``on_code_change``);
    ``cache=True`` lets the run's cache (``run(cache=...)``) hand back an
    output recorded for the same code and the same inputs (see
    ``docs/cache.md``). Neither is part of the graph's fingerprint.

    Run-time shapes (see ``docs/concepts.md``, "Shapes decided at run
    time"): ``map_over`` names a dependency whose output (a list, tuple or
    mapping) the step runs over once per item; each item is an attempt
    unit of its own, named ``step[key]``, seeing its item as that
    dependency's output, and the step's output is the list (or mapping) of
    the item outputs. ``item_key`` keys the items by a field of each item
    instead of by position. ``when(context) -> bool`` is a condition checked
    once the dependencies are recorded: false skips the step (and what needs
    it) for good. ``join="any"`` runs the step once its dependencies are
    settled if any of them ran, seeing the outputs that exist.
    ``repeat=Repeat(max_iterations=N, until=..., keep_last=K)`` makes the
    step a loop: iteration ``k`` runs as a step of its own, ``step#k``, once
    ``k-1`` is recorded, and finds ``Iteration(k, previous_output)`` under
    the step's own name in its context; it ends the loop by returning
    ``Done(value)`` (or when ``until(output)`` holds), and the step's output
    is the last iteration's (see ``ekit_runtime.loops``).
    """

    name: str
    run: StepFn
    depends_on: tuple[str, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=lambda: _NO_METADATA)
    retry: RetryPolicy | None = None
    timeout: float | None = None
    # Accepted for compatibility with versions that needed it to put a sync
    # step in a thread; it changes nothing now (sync steps use a thread
    # anyway). Kept, compared and pickled as any field; its one effect is
    # refusing inline=True beside it (see _check). Nothing else reads it.
    blocking: bool = False
    context: Literal["all", "dependencies"] = "all"
    inline: bool = False
    executor: Executor | None = None
    version: str | None = None
    # The run-time shape, the resource and the cache options, ``(map_over,
    # item_key, when, join, resource, cache, on_code_change)``, or ``None`` for
    # a plain step: one slot, not seven, because a
    # workflow builds a Step per step (a resume, one per recorded step) and
    # each slot costs its store, its check and the collector's visit (a
    # thirteenth would also move a Step past 128 bytes, into a bigger size
    # class: measured, 1% more per recorded step on resume). Read it as the
    # five properties.
    shaping: Shaping | None = field(default=None, repr=False)

    def __new__(
        cls,
        name: str,
        run: StepFn | None = None,
        depends_on: tuple[str, ...] = (),
        metadata: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
        blocking: bool = False,
        context: Literal["all", "dependencies"] = "all",
        inline: bool = False,
        executor: Executor | None = None,
        version: str | None = None,
        map_over: str | None = None,
        item_key: str | None = None,
        when: Callable[[Any], Any] | None = None,
        join: Literal["all", "any"] = "all",
        shaping: Shaping | None = None,
        resource: str | None = None,
        repeat: Repeat | None = None,
        cache: bool = False,
        on_code_change: str | None = None,
        child: Any = None,
    ) -> Step:
        # A 10,000-step workflow builds 10,000 of these: built through
        # _StepDraft (a frozen dataclass's __init__ costs several times as
        # much), and the common shape (a tuple of
        # dependencies, every option at its default) passes one test.
        step = _StepDraft()
        step.name, step.run, step.depends_on = name, run, depends_on
        step.metadata = _NO_METADATA if metadata is None else metadata
        step.retry, step.timeout, step.blocking, step.context = retry, timeout, blocking, context
        step.inline, step.executor, step.version = inline, executor, version
        if (map_over is None and item_key is None and when is None and join == "all" and resource is None
                and repeat is None and cache is False and on_code_change is None and child is None):
            step.shaping = shaping  # (dataclasses.replace hands the shape back as shaping=)
        elif (cache is True and shaping is None and map_over is None and item_key is None
              and when is None and join == "all" and resource is None and repeat is None
              and on_code_change is None):
            step.shaping = _CACHED  # (checked already: passes the plain test below)
        else:
            step.shaping = _shaping(shaping, map_over, item_key, when, join, resource, repeat, cache,
                                    on_code_change, child)
        step.__class__ = cls
        if not (
            type(depends_on) is tuple
            and metadata is None
            and retry is None
            and timeout is None
            and executor is None
            and version is None
            and (step.shaping is None or step.shaping is _CACHED)
            and (context == "all" or context == "dependencies")
            and blocking is False
            and inline is False
            and callable(run)
        ):
            step._check()
        return step  # type: ignore[no-any-return]  # (a cast is a call per step)

    def __reduce__(self) -> tuple[type[Step], tuple[Any, ...]]:
        # Rebuilt through the constructor: pickle's default calls __new__
        # with no arguments (copy.deepcopy too).
        return type(self), (
            self.name, self.run, self.depends_on, self.metadata, self.retry, self.timeout,
            self.blocking, self.context, self.inline, self.executor, self.version,
            None, None, None, "all", self.shaping,
        )

    def _check(self) -> None:
        def bad(problem: str) -> ValueError:
            return ValueError(f"step {self.name!r}: {problem}")

        if self.run is None and self.child is not None:  # (its workflow puts the child in its place)
            object.__setattr__(self, "run", _runs_a_child)
        if not callable(self.run):
            raise bad(f"run must be callable, got {type(self.run).__name__}")
        depends_on = self.depends_on
        if type(depends_on) is not tuple:
            if isinstance(depends_on, str):
                raise bad(f"depends_on must be a tuple of names, not the string {depends_on!r}")
            try:
                object.__setattr__(self, "depends_on", tuple(depends_on))
            except TypeError:
                raise bad("depends_on must be a tuple of names") from None
        if type(self.metadata) is not dict and not isinstance(self.metadata, Mapping):
            raise bad("metadata must be a mapping")
        if self.retry is not None and not isinstance(self.retry, RetryPolicy):
            raise bad("retry must be a RetryPolicy or None")
        if self.timeout is not None:
            try:
                check_number(self.timeout, "timeout", above_low=True)
            except ValueError as exc:  # NaN or 10**400 would fail every attempt at once, each still paid
                raise bad(str(exc).replace("must be", "must be None or", 1)) from None
        if self.context != "all" and self.context != "dependencies":
            raise bad("context must be 'all' or 'dependencies'")
        if self.executor is not None and not isinstance(self.executor, Executor):
            raise bad(f"executor must be an ekit Executor, got {type(self.executor).__name__}")
        if self.version is not None and (not isinstance(self.version, str) or not self.version):
            raise bad("version must be a non-empty string or None")
        # The text a checkpoint records (Workflow checks the names of steps
        # built the quick way, which skip this method).
        for field_name, text in (("name", self.name), ("version", self.version)):
            why = unencodable(text) if isinstance(text, str) else None
            if why is not None:
                raise bad(f"{field_name} {why}")
        if self.inline and self.blocking:  # blocking's only effect: see its field
            raise bad("inline=True and blocking=True contradict each other")
        self._check_shape(bad)

    def _check_shape(self, bad: Callable[[str], ValueError]) -> None:
        """The checks of the run-time shape, the loop, the resource and the cache options."""
        shaping = self.shaping
        if shaping is not None and (type(shaping) is not tuple or len(shaping) not in (8, 9)):
            raise bad("shaping must be None or (map_over, item_key, when, join, resource, repeat, "
                      "cache, on_code_change[, child])")
        if self.child is not None:
            self._check_child(bad)
        if self.repeat is not None and not isinstance(self.repeat, Repeat):
            raise bad(f"repeat must be a Repeat or None, got {type(self.repeat).__name__}")
        if self.repeat is not None and self.cache:
            # A hit hands back an output without the iteration's decision to end the loop
            # (Done, until): a cached loop would run to its cap. Refused until hits carry it.
            raise bad("cache=True is not supported on a loop (repeat=) yet")
        for field_name in ("map_over", "item_key"):
            value = getattr(self, field_name)
            if value is not None and (not isinstance(value, str) or not value):
                raise bad(f"{field_name} must be a non-empty string or None")
        if self.when is not None and not callable(self.when):
            raise bad(f"when must be callable or None, got {type(self.when).__name__}")
        if self.join != "all" and self.join != "any":
            raise bad(f"join must be 'all' or 'any', got {self.join!r}")
        if self.resource is not None:
            why = unstorable_resource(self.resource)
            if why is not None:
                raise bad(f"resource {why}")
        if not isinstance(self.cache, bool):
            raise bad(f"cache must be True or False, got {self.cache!r:.80}")
        if self.on_code_change is not None and self.on_code_change not in POLICIES:
            raise bad(f"on_code_change must be None or one of {', '.join(map(repr, POLICIES))}, "
                      f"got {self.on_code_change!r:.80}")

    @property
    def map_over(self) -> str | None:
        """The dependency whose output the step runs over, once per item (``None``: once)."""
        return None if self.shaping is None else self.shaping[0]

    @property
    def item_key(self) -> str | None:
        """The field of each item that keys it (``None``: its position, or its mapping key)."""
        return None if self.shaping is None else self.shaping[1]

    @property
    def when(self) -> Callable[[Any], Any] | None:
        """The step's condition, asked before its first attempt, then until it answers (``None``: runs)."""
        return None if self.shaping is None else self.shaping[2]

    @property
    def join(self) -> Literal["all", "any"]:
        """``"any"`` runs the step on whichever of its dependencies ran; ``"all"`` needs every one."""
        return "all" if self.shaping is None else self.shaping[3]

    @property
    def resource(self) -> str | None:
        """What the step's attempts use, capped across a queue's fleet (``None``: nothing)."""
        return None if self.shaping is None else self.shaping[4]

    @property
    def repeat(self) -> Repeat | None:
        """How the step repeats, one iteration at a time (``None``: it runs once)."""
        return None if self.shaping is None else self.shaping[5]

    @property
    def cache(self) -> bool:
        """Whether the run's cache may hand back this step's output (see ``docs/cache.md``)."""
        return False if self.shaping is None else self.shaping[6]

    @property
    def on_code_change(self) -> CodePolicy | None:
        """What a resume does when this step's code changed (``None``: the workflow's policy)."""
        return None if self.shaping is None else self.shaping[7]

    @property
    def child(self) -> Any:
        """The child workflow the step runs (a ``Workflow`` or a :class:`~ekit_runtime.Child`;
        once its workflow is built, the name of the child's output step), or ``None``."""
        shaping = self.shaping
        return None if shaping is None or len(shaping) < 9 else shaping[8]

    def _check_child(self, bad: Callable[[str], ValueError]) -> None:
        child = self.child
        if not (isinstance(child, Child | str) or is_workflow(child)):
            raise bad(f"child must be an ekit Workflow or a Child, got {type(child).__name__}")
        if isinstance(child, str):
            return  # (the step a built workflow puts in a child's place: checked by the core)
        if self.run is not _runs_a_child:
            raise bad("a step with a child workflow takes no run: the child's steps are its work")
        given = [n for n, v in (("when", self.when), ("retry", self.retry), ("timeout", self.timeout),
                                ("version", self.version), ("executor", self.executor),
                                ("resource", self.resource), ("on_code_change", self.on_code_change))
                 if v is not None]
        given += ["join='any'"] if self.join == "any" else []
        given += ["context='dependencies'"] if self.context != "all" else []
        given += ["inline=True"] if self.inline else []
        given += ["cache=True"] if self.cache else []
        if given:
            raise bad(f"a step with a child workflow cannot take {given[0]} (yet): give it to "
                      "the child's steps")
        if self.map_over is not None and self.repeat is not None:
            raise bad("a step with a child workflow cannot take both map_over and repeat (yet)")

    @property
    def shape(self) -> Shape | None:
        """The step's run-time shape, as the graph records it (``None`` for a plain step)."""
        if self.shaping is None:
            return None
        child = self.child
        if isinstance(child, str):
            repeat = self.shaping[5]  # (a loop whose body is its child; or a child per item)
            return Shape(self.shaping[0], self.shaping[1], child=child) if repeat is None else Shape(
                child=child, repeat=repeat.max_iterations, keep_last=repeat.keep_last)
        map_over, item_key, when, join, _resource, repeat = self.shaping[:6]
        if map_over is None and item_key is None and when is None and join == "all" \
                and repeat is None:
            return None  # only a resource: no shape (and no change to the fingerprint)
        return Shape(map_over, item_key, None if when is None else condition_name(when), join,
                     None if repeat is None else repeat.max_iterations,
                     None if repeat is None else repeat.keep_last)


Shaping: TypeAlias = tuple[Any, ...]
"""A step's run-time shape, resource, loop and cache options as it holds them:
``(map_over, item_key, when, join, resource, repeat, cache, on_code_change, child)``
(a tuple of eight, without ``child``, is read as one without a child)."""


_CACHED: Shaping = (None, None, None, "all", None, None, True, None)
"""The shaping of a step whose only option among them is ``cache=True`` (shared: no check to make)."""


def _shaping(base: Shaping | None, map_over: str | None, item_key: str | None,
             when: Callable[[Any], Any] | None, join: Literal["all", "any"],
             resource: str | None, repeat: Repeat | None = None, cache: bool = False,
             on_code_change: str | None = None, child: Any = None) -> Shaping:
    """The options given as arguments, over ``base`` (what ``dataclasses.replace`` hands back)."""
    old: Shaping = base if base is not None else (None, None, None, "all", None, None, False, None)
    inner = child if child is not None else old[8] if len(old) > 8 else None
    return (map_over if map_over is not None else old[0],
            item_key if item_key is not None else old[1],
            when if when is not None else old[2],
            join if join != "all" else old[3],
            resource if resource is not None else old[4],
            repeat if repeat is not None else old[5],
            cache if cache is not False else old[6],
            on_code_change if on_code_change is not None else old[7],
            inner)


def condition_name(when: Callable[[Any], Any]) -> str:
    """How the fingerprint names a condition: its qualified name (its type's, for an object);
    a child workflow's condition by its own name, not by the wrapper that nests it."""
    when = unwrapped(when)
    name = getattr(when, "__qualname__", None)
    return name if isinstance(name, str) and name else type(when).__qualname__


# A plain class with Step's very slots: its instances take cheap attribute
# stores, then become Steps by assigning __class__ (same layout, immutable from
# then on). ekit_core builds its per-step values the same way, in its own
# modules (ekit_core._frozen says why); a workflow's steps are the runtime's one
# such value, built here.
_StepDraft: type[Any] = type("_StepDraft", (), {"__slots__": vars(Step)["__slots__"]})


# -- one attempt of a step, and what runs it (see ekit_runtime.attempt and .executors) --


@dataclass(frozen=True, slots=True)
class AttemptKey:
    """Which attempt of which step of which run is running: ``str(key)`` is ``run/step/attempt``."""

    run_id: str
    step: str
    attempt: int

    def __str__(self) -> str:
        return f"{self.run_id}/{self.step}/{self.attempt}"


@dataclass(frozen=True, slots=True)
class Attempt:
    """One attempt of ``step``, as the runner hands it to an executor.

    - ``step``: the :class:`~ekit_runtime.step.Step` to run;
    - ``context``: what ``step.run`` is called with;
    - ``number``: the attempt's number counted across runs, from 1: one more
      than the failed attempts recorded for the step so far and the attempts
      whose output was let go of (the checkpoint's ``redone``);
    - ``run_id``: the run's id, or ``None`` for a run given none;
    - ``item``: for an item of a mapped step, the item's key (else ``None``).
    """

    step: Step
    context: MutableMapping[str, Any]
    number: int = 1
    run_id: str | None = None
    item: str | None = None

    @property
    def name(self) -> str:
        """What the attempt runs: the step's name, or its item's (``step[key]``)."""
        return self.step.name if self.item is None else item_name(self.step.name, self.item)

    @property
    def key(self) -> AttemptKey | None:
        """The attempt's idempotency key (``run_id/name/number``), or ``None`` without a run id."""
        if self.run_id is None:
            return None
        return AttemptKey(self.run_id, self.name, self.number)


class Executor:
    """Runs one attempt of a step. Subclass it and implement :meth:`run`.

    :meth:`check` is called once per run with the steps this executor will
    run, before any step starts: raise ``ValueError`` naming a step that
    cannot run here (a function a remote engine cannot serialise, say).
    :meth:`run` must not retry on its own (the step's policy decides) and
    must stop the attempt when the awaiting task is cancelled. It runs in
    the attempt's own task, where :func:`~ekit_runtime.attempt.attempt_key`
    is already set; code it runs elsewhere (a thread, another process) must
    carry ``attempt.key`` there itself if the step is to see it.

    A subclass written for earlier versions, ``run(self, step, context)``,
    still works: it is adapted when the class is defined, with a
    ``DeprecationWarning``.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        run = cls.__dict__.get("run")
        if run is not None and _takes_step_and_context(run):
            warnings.warn(
                f"{cls.__qualname__}.run(self, step, context) is the old executor signature: "
                "define run(self, attempt) and read attempt.step and attempt.context",
                DeprecationWarning,
                stacklevel=2,
            )
            cls.run = _adapted(run)  # type: ignore[method-assign]

    def check(self, steps: Sequence[Step]) -> None:
        """Refuse, with a ``ValueError`` naming the step, what cannot run here."""

    async def run(self, attempt: Attempt) -> Any:
        """Run ``attempt.step.run(attempt.context)`` once and return what it returned."""
        raise NotImplementedError


def _takes_step_and_context(run: Callable[..., Any]) -> bool:
    try:
        parameters = list(inspect.signature(run).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [
        p for p in parameters[1:]
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    return len(positional) == 2


def _adapted(legacy: Callable[..., Any]) -> Callable[..., Any]:
    async def run(self: Executor, attempt: Attempt) -> Any:
        return await legacy(self, attempt.step, attempt.context)

    run.__doc__ = legacy.__doc__
    return run
