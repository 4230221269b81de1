"""``Workflow``: ExecutionKit's workflow API over the ekit core.

``Workflow(steps)`` validates the graph once; ``await workflow.run(...)``
builds the first state (checking every argument before any step runs),
drives it with a :class:`~ekit_runtime.runner.Runner`, and turns the
settled state into a result or the documented exception.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from time import perf_counter, time
from types import MappingProxyType
from typing import Any, TypedDict, Unpack, cast

from ekit_core import (
    GraphSpec,
    InternalError,
    State,
    StepCacheHit,
    TokenUsage,
    WorkflowCheckpoint,
    checkpoint_of,
    initial_state,
)
from ekit_core.checkpoint import DriveRecord
from ekit_core.children import rolled_up
from ekit_core.code import POLICIES, CacheHit, CodeChangedError, CodeDecision, CodePolicy, decide
from ekit_core.expansion import iterating, iteration_of
from ekit_core.human import questions
from ekit_core.selection import left_out, selected
from ekit_core.shapes import Shape
from ekit_core.transitions import resume_checkpoint
from ekit_core.usage import NO_USAGE
from ekit_runtime import logs
from ekit_runtime.approval import ApprovalFn
from ekit_runtime.cache.at_start import (
    Found,
    fresh_with_hits,
    hits_at_start,
    hits_of,
    hits_when_fresh,
    with_hits,
)
from ekit_runtime.cache.base import Cache, CachedStep
from ekit_runtime.errors import ApprovalDenied, BudgetExceeded, RunWaiting
from ekit_runtime.executors import DEFAULT_EXECUTOR, Executor, LocalExecutor
from ekit_runtime.held import runner_class
from ekit_runtime.human import refuse_dropped_answers, with_answers
from ekit_runtime.nesting import flatten
from ekit_runtime.run_ids import check_run_id
from ekit_runtime.runner import BeforeAttempt, CheckpointFn, Clock, Runner, Sleep, TraceFn
from ekit_runtime.step import _CACHED, Step, unencodable
from ekit_runtime.typed import Codec, final_checkpoint, run_options

__all__ = ["RunOptions", "Workflow", "WorkflowResult"]


@dataclass(frozen=True, slots=True)
class WorkflowResult:
    """What a run produced: every step's ``outputs`` and the total ``cost``.

    ``checkpoint`` is the final checkpoint of the run (resuming it runs what
    is missing, and nothing when the run completed). A run with
    ``isolate_failures=True`` returns even when steps failed: ``failed``
    maps each step that failed (after its retries) to its exception, and
    ``not_started`` lists the steps that waited on one; ``ok`` is false then.
    A run with ``only`` lists in ``left_out`` the steps outside its selection
    that are neither recorded nor skipped: what a later run without ``only``
    (resuming ``checkpoint``) runs. Leaving them out is what was asked, so
    ``ok`` does not count them.
    """

    outputs: MappingProxyType[str, Any]
    cost: TokenUsage = NO_USAGE
    checkpoint: WorkflowCheckpoint | None = None
    failed: Mapping[str, BaseException] = field(default_factory=lambda: MappingProxyType({}))
    not_started: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()

    def usage_of(self, step: str) -> TokenUsage:
        """What step ``step`` used, with its child workflow's steps (``step/...``) when it has
        one: their usage rolled up (what a person reads as what the step cost)."""
        recorded = self.checkpoint.step_usage if self.checkpoint is not None else {}
        return rolled_up(recorded, step)

    @property
    def ok(self) -> bool:
        """Whether every step the run was to run is recorded (or skipped by a condition):
        every step, or with ``only`` every selected step and what it needs."""
        return not self.failed and not self.not_started

    def __repr__(self) -> str:
        # Bounded, as the output ledger's is: asyncio reprs a finished task's
        # result in passing (asyncio.run does, twice), and a run may hold many
        # thousands of outputs.
        outputs = self.outputs
        shown = ", ".join(f"{k!r}: {v!r}" for k, v in islice(outputs.items(), 8))
        more = f", ... ({len(outputs)} entries)" if len(outputs) > 8 else ""
        return (
            f"WorkflowResult(outputs={{{shown}{more}}}, cost={self.cost!r}, "
            f"checkpoint={self.checkpoint!r}, failed={dict(self.failed)!r}, "
            f"not_started={self.not_started!r}"
            + (f", left_out={self.left_out!r})" if self.left_out else ")")
        )


def _check_options(options: Mapping[str, object]) -> None:
    """Refuse, naming it, an option that is unknown or of the wrong kind (before anything runs)."""
    unknown = sorted(set(options) - set(RunOptions.__annotations__))
    if unknown:
        known = ", ".join(RunOptions.__annotations__)
        raise ValueError(f"unknown run option(s): {', '.join(unknown)} (options: {known})")
    if options.get("run_id") is not None:
        check_run_id(options["run_id"])
    # ``only`` is checked with the graph (ekit_core.selection), in start_state.
    for name in ("checkpoint_fn", "approval", "before_attempt"):
        _callable_or_none(options.get(name), name)
    trace = options.get("trace")
    if isinstance(trace, list | tuple):
        for i, callback in enumerate(trace):
            _callable_or_none(callback, f"trace[{i}]")
    else:
        _callable_or_none(trace, "trace")
    executor = options.get("executor")
    if executor is not None and not isinstance(executor, Executor):
        raise ValueError(f"executor must be an ekit Executor, got {type(executor).__name__}")
    cache = options.get("cache")
    if cache is not None and not isinstance(cache, Cache):
        raise ValueError(f"cache must be an ekit Cache (SqliteCache, DirectoryCache, ...) or None, "
                         f"got {type(cache).__name__}")
    answers = options.get("answers")
    if answers is not None and not isinstance(answers, Mapping):
        raise ValueError(f"answers must be a mapping of step -> answer, got {type(answers).__name__}")
    worker = options.get("worker")
    if worker is not None and (not isinstance(worker, str) or not worker):
        raise ValueError(f"worker must be a non-empty string or None, got {worker!r:.80}")


_Recorded = WorkflowCheckpoint | Mapping[str, Any] | None  # (what a run resumes from)


def _drive(worker: str | None) -> DriveRecord | None:
    """This run's drive: ``worker`` from now (the wall clock, read once per run)."""
    return None if worker is None else DriveRecord(worker, round(time(), 6))


def _callable_or_none(value: object, name: str) -> None:
    if value is not None and not callable(value):
        raise ValueError(f"{name} must be callable or None, got {type(value).__name__}")


def _with_options(steps: tuple[Step, ...]) -> list[Step]:
    """The steps with an option that start_state or the executors must see; a wrong item
    (not a Step) is refused, naming its position, before the graph is read.

    Once per workflow, not once per option per run. A plain loop: measured
    cheaper per step than a comprehension or a C pass for each.
    """
    with_options = []
    for step in steps:
        if (
            type(step) is Step
            and step.retry is None
            and step.version is None
            and step.executor is None
            and step.shaping is None
        ):
            continue
        if not isinstance(step, Step):
            i = next(i for i, s in enumerate(steps) if s is step)
            raise ValueError(f"steps[{i}] must be a Step, got {type(step).__name__}")
        with_options.append(step)  # a subclass's may have none: the readers check
    return with_options


def _child_codecs(with_options: list[Step]) -> list[Codec]:
    """The codecs of the child workflows the steps run (a child's own children's are in its)."""
    found = []
    for step in with_options:
        child = step.child
        if child is not None:
            codec = getattr(getattr(child, "workflow", child), "codec", None)
            if isinstance(codec, Codec):
                found.append(codec)
    return found


class RunOptions(TypedDict, total=False):
    """The options of one run, declared once: see :meth:`Workflow.run` for each."""

    checkpoint_fn: CheckpointFn | None
    resume_from: WorkflowCheckpoint | Mapping[str, Any] | None
    max_concurrency: int | None
    budget: TokenUsage | None
    approval: ApprovalFn | None
    trace: TraceFn | None
    allow_graph_change: bool
    executor: Executor | None
    isolate_failures: bool
    run_id: str | None
    before_attempt: BeforeAttempt | None
    answers: Mapping[str, Any] | None
    only: list[str] | tuple[str, ...] | None
    durations: bool
    cache: Cache | None
    worker: str | None


class Workflow:
    """A DAG of :class:`Step` objects that runs eagerly and resumes from checkpoints.

    ``codec``, a :class:`~ekit_runtime.typed.Codec`, stores outputs of the
    steps' own types (pydantic models, dataclasses, registered types) and
    restores them as those types on a resume: see docs/outputs.md.

    ``on_code_change`` (``"again"``, ``"keep"`` or ``"refuse"``) fingerprints
    every step's code (:func:`~ekit_runtime.fingerprints.code_fingerprint`),
    records the fingerprints in the checkpoints, and says what a resume does
    with a recorded step whose code changed since (``Step(on_code_change=...)``
    overrides it per step): see docs/cache.md. ``None`` (the default)
    fingerprints only the steps that ask for it themselves, or use a cache.
    """

    def __init__(self, steps: Sequence[Step], *, codec: Codec | None = None,
                 on_code_change: CodePolicy | None = None) -> None:
        steps = tuple(steps)
        with_options = _with_options(steps)
        moved: dict[str, Shape] = {}
        adopted: list[Codec] = []
        if with_options and any(s.child is not None for s in with_options):
            adopted = _child_codecs(with_options)
            steps, moved = flatten(steps)  # each child's steps in its step's place
            with_options = _with_options(steps)
        self._steps = steps
        shapes: dict[str, Shape] = {}
        for s in with_options:
            if s.shaping is not _CACHED:  # (cached and no other option: no shape, no call to ask)
                shape = s.shape
                if shape is not None:
                    shapes[s.name] = shape
        if moved:
            shapes.update(moved)
        self._graph = GraphSpec.of_steps(steps, shapes)
        self._with_options = tuple(with_options)
        # The steps with a retry policy or a version tag, read at every run's start.
        self._tagged = tuple(s for s in with_options if s.retry is not None or s.version is not None)
        names = self._graph.names
        if not "".join(names).isascii():  # one pass in C over every name (their dependencies too)
            for name in names:
                why = unencodable(name)
                if why is not None:
                    raise ValueError(f"step {name!r}: name {why}")
        if on_code_change is not None and on_code_change not in POLICIES:
            raise ValueError(f"on_code_change must be None or one of {', '.join(map(repr, POLICIES))}, "
                             f"got {on_code_change!r:.80}")
        # Step -> its policy, for the steps whose code is fingerprinted (a cached
        # step's is: its key covers it): empty for most workflows, which pay nothing.
        policies: dict[str, CodePolicy] = {}
        for step in with_options if on_code_change is None else steps:
            policy = step.on_code_change or on_code_change
            if policy is not None or step.cache:
                policies[step.name] = policy or "again"
        self._code_policies = MappingProxyType(policies)
        if codec is not None and not isinstance(codec, Codec):
            raise ValueError(f"codec must be an ekit Codec or None, got {type(codec).__name__}")
        if adopted:  # a child's steps store their types as the child alone would
            codec = codec if codec is not None else Codec()
            for child_codec in adopted:
                codec._adopt(child_codec)
        self._codec = codec
        if codec is not None:
            codec._bind(steps)  # the types the steps' return annotations name

    @property
    def codec(self) -> Codec | None:
        """The codec that stores the outputs of the steps' own types (``None``: plain data only)."""
        return self._codec

    @property
    def steps(self) -> tuple[Step, ...]:
        """The steps, in declaration order (read-only: the graph was validated from them)."""
        return self._steps

    @property
    def graph(self) -> GraphSpec:
        """The validated graph of the steps."""
        return self._graph

    @property
    def code_policies(self) -> MappingProxyType[str, CodePolicy]:
        """Step -> what a resume does when its code changed, for every fingerprinted step."""
        return self._code_policies

    def code_fingerprints(self) -> dict[str, str]:
        """Step -> the fingerprint of its code now, for every fingerprinted step."""
        from ekit_runtime.fingerprints import code_fingerprint  # only where code is fingerprinted

        policies = self._code_policies
        memo: dict[int, str] = {}  # a function many steps share is hashed once
        prints: dict[str, str] = {}
        for step in self._steps:  # (in the order of the policies: both the steps')
            if step.name in policies:
                run = step.run
                key = id(run)
                found = memo.get(key)
                if found is None:
                    found = memo[key] = code_fingerprint(run)
                prints[step.name] = found
        return prints

    def code_decision(self, resume_from: WorkflowCheckpoint | None,
                      current: Mapping[str, str] | None = None) -> CodeDecision:
        """What a resume of ``resume_from`` does with each step's code (:func:`ekit_core.code.decide`);
        ``current``: the steps' fingerprints now, if already computed."""
        current = dict(current) if current is not None else self.code_fingerprints()
        if resume_from is None:
            return CodeDecision(MappingProxyType(current))
        return decide(self._graph.names, resume_from.code_fingerprints, current,
                      self._code_policies, resume_from.outputs)

    def start_state(
        self,
        initial_context: Mapping[str, Any] | None = None,
        *,
        resume_from: WorkflowCheckpoint | Mapping[str, Any] | None = None,
        max_concurrency: int | None = None,
        budget: TokenUsage | None = None,
        allow_graph_change: bool = False,
        approval: bool = False,
        isolate_failures: bool = False,
        record_events: bool = True,
        run_id: str | None = None,
        only: list[str] | tuple[str, ...] | None = None,
        durations: bool = False,
        _current_code: Mapping[str, str] | None = None,
        drive: DriveRecord | None = None,
    ) -> State:
        """The core state a run with these arguments starts from (validates them all).

        ``approval`` says whether the run has an approval callback; ``run_id``
        seeds the jitter of retry delays (:attr:`RetryPolicy.jitter`);
        ``only`` selects the steps to run and ``durations`` records how long
        each took (see :meth:`run`). A workflow that fingerprints code decides
        here what the resume does with changed code: :class:`CodeChangedError`
        names the steps whose policy refuses it, before anything runs.
        """
        code: Mapping[str, str] | None = None
        kept: tuple[str, ...] = ()  # (the steps whose changed code is kept: CodeDecision.kept)
        if self._code_policies:
            recorded = (None if resume_from is None else
                        resume_checkpoint(self.graph, resume_from, allow_graph_change=allow_graph_change))
            decision = self.code_decision(recorded, _current_code)
            if decision.refused:
                raise CodeChangedError(decision.refused)
            code, kept = decision.fingerprints, decision.kept
        return initial_state(
            self.graph,
            resume_from,
            context=initial_context,
            max_concurrency=max_concurrency,
            budget=budget,
            policies={s.name: s.retry for s in self._tagged if s.retry is not None},
            allow_graph_change=allow_graph_change,
            approval=approval,
            isolate_failures=isolate_failures,
            versions={s.name: s.version for s in self._tagged if s.version is not None},
            record_events=record_events,
            run_id=run_id,
            only=only,
            durations=durations,
            code_fingerprints=code,
            drive=drive,
            code_kept=kept,
        )

    def runner(
        self,
        initial_context: Mapping[str, Any] | None = None,
        *,
        sleep: Sleep = asyncio.sleep,
        clock: Clock = perf_counter,
        record_events: bool | None = None,
        **options: Unpack[RunOptions],
    ) -> Runner:
        """A :class:`Runner` for one run; options as for :meth:`run`.

        Checks every argument (and asks each executor to check its steps)
        before anything runs. ``sleep`` (what waits out a retry delay) and
        ``clock`` (what times a step) are injectable, for tests: ``await
        workflow.runner(sleep=fake).run()`` never waits for real.
        ``record_events`` builds the core's events (default: when a ``trace``
        is given; ``iterate`` always does).
        """
        _check_options(options)
        if self._codec is not None:  # checkpoints handed out with outputs in their stored form
            options = cast(RunOptions, run_options(self._codec, options))
        checkpoint_fn = options.get("checkpoint_fn")
        approval, trace = options.get("approval"), options.get("trace")
        executor = options.get("executor")
        run_id, before_attempt = options.get("run_id"), options.get("before_attempt")
        trace = logs.with_run_trace(trace, run_id)  # unchanged unless ekit.run/ekit.step listen
        resume_from, answers = self._answered(options), options.get("answers")
        prints = self.code_fingerprints() if self._code_policies else None
        starting: dict[str, Any] = dict(
            max_concurrency=options.get("max_concurrency"), budget=options.get("budget"),
            allow_graph_change=options.get("allow_graph_change", False), approval=approval is not None,
            isolate_failures=options.get("isolate_failures", False),
            record_events=trace is not None if record_events is None else record_events,
            run_id=run_id, only=options.get("only"), durations=options.get("durations", False),
            _current_code=prints, drive=_drive(options.get("worker")),
        )
        cache = options.get("cache")
        if cache is not None and resume_from is None and self._fresh_lookup(initial_context, options):
            state, cached, found = self._start_fresh(cache, executor, initial_context, prints or {}, starting)
        else:
            state, cached, found = self._start_first_way(cache, executor, initial_context, prints or {},
                                                         starting, resume_from, answers)
        runner = runner_class(state.limits)(
            self.steps,
            state,
            checkpoint_fn=checkpoint_fn,
            approval=approval,
            trace=trace,
            executor=executor,
            sleep=sleep,
            clock=clock,
            run_id=run_id,
            before_attempt=before_attempt,
        )
        if answers:
            runner.save_first = True
        self._bind_cache(runner, cached, resume_from, found)
        return runner

    def _start_fresh(self, cache: Cache, executor: Executor | None, initial_context: Mapping[str, Any] | None,
                     prints: Mapping[str, str], starting: Mapping[str, Any]
                     ) -> tuple[State, dict[str, CachedStep], Found]:
        """A fresh run's first state, its cached steps and its hits: the hits are looked up
        before the state is built (ekit_runtime.cache.at_start), which is then built once, from
        them, as a resume starts from recorded outputs; not built twice, the first thrown away."""
        self._check_executors(executor)
        cached = self._cached_steps(cache, executor, prints)
        found = hits_when_fresh(self._steps, initial_context, cached)
        recorded = fresh_with_hits(
            found, self._graph, initial_context,
            {s.name: s.version for s in self._tagged if s.version is not None}, prints) if found else None
        return self.start_state(initial_context, resume_from=recorded, **starting), cached, found

    def _start_first_way(self, cache: Cache | None, executor: Executor | None,
                         initial_context: Mapping[str, Any] | None, prints: Mapping[str, str],
                         starting: Mapping[str, Any], resume_from: _Recorded,
                         answers: Mapping[str, Any] | None) -> tuple[State, dict[str, CachedStep], Found]:
        """A run's first state, its cached steps and the hits found as it starts (then the state
        with them, ekit_runtime.cache.at_start): a resume's, or a run :meth:`_start_fresh` leaves."""
        state = self.start_state(initial_context, resume_from=resume_from, **starting)
        if answers:  # an answer to a question the resume dropped (its work changed) is refused
            refuse_dropped_answers(answers, state.setbacks.asked)
        self._check_executors(executor)
        cached = {} if cache is None else self._cached_steps(cache, executor, prints)
        found = hits_at_start(self._steps, state, cached) if cached and not answers else {}
        return (self._start_with(found, state, initial_context, starting) if found else state), cached, found

    def _fresh_lookup(self, initial_context: object, options: RunOptions) -> bool:
        """Whether a fresh run's hits may be looked up before its first state: a static graph, no
        ``only=``, approval callback or answers (each decided as the run goes), and a plain dict
        (or no) context, which the state then checks as ever (a ValueError before any step)."""
        return (not self._graph.shapes and options.get("only") is None and options.get("approval") is None
                and not options.get("answers") and (initial_context is None or type(initial_context) is dict))

    def _start_with(self, found: Found, state: State, initial_context: Mapping[str, Any] | None,
                    starting: Mapping[str, Any]) -> State:
        """The run's first state with the hits ``found`` as it starts (ekit_runtime.cache.at_start):
        from them, as a resume starts from recorded outputs."""
        # (The state's checkpoint records this run's drive already: not added twice.)
        return self.start_state(initial_context, resume_from=with_hits(state, found),
                                **{**starting, "drive": None})

    def _bind_cache(self, runner: Runner, cached: Mapping[str, CachedStep], resume_from: object,
                    found: Found) -> None:
        """Give ``runner`` the run's cached steps, the hits ``resume_from`` records and those
        ``found`` as the run starts (saved in its first checkpoint, told first to its trace)."""
        runner.use_cache(cached)
        hits = _recorded_hits(resume_from, runner.state)
        if found:
            runner.keep_hits(MappingProxyType({**(hits or {}), **hits_of(found)}))
            runner.save_first = True
            if runner.trace is not None:
                runner.told_first(tuple(StepCacheHit(name, runner.cache_hits[name].key, entry.usage)
                                        for name, (_, entry) in found.items()))
        elif hits:
            runner.keep_hits(hits)

    def _cached_steps(self, cache: Cache, default: Executor | None, prints: Mapping[str, str]
                      ) -> dict[str, CachedStep]:
        """The run's cached steps, bound to ``cache`` and the codec (see :mod:`ekit_runtime.cache`)."""
        codec = self._codec
        encode = codec.encode if codec is not None else _as_is
        decode = codec.decode if codec is not None else _as_is
        types = codec.names if codec is not None else ()
        cached: dict[str, CachedStep] = {}
        for step in self._with_options:
            if not step.cache:
                continue
            if not isinstance(step.executor or default or DEFAULT_EXECUTOR, LocalExecutor):
                raise ValueError(f"step {step.name!r}: cache=True needs a LocalExecutor (the cache "
                                 "records what the step reads from its context, in this process)")
            cached[step.name] = CachedStep(cache, step.name, prints[step.name], step.version,
                                           types, encode, decode)
        return cached

    def _answered(self, options: RunOptions) -> WorkflowCheckpoint | Mapping[str, Any] | None:
        """``resume_from`` with the run's ``answers`` recorded, before anything runs: a step
        that is not waiting is refused."""
        resume_from, answers = options.get("resume_from"), options.get("answers")
        if not answers:
            return resume_from
        return with_answers(resume_checkpoint(
            self.graph, resume_from, allow_graph_change=options.get("allow_graph_change", False)
        ), answers)

    def _check_executors(self, default: Executor | None) -> None:
        if not any(s.executor is not None for s in self._with_options):
            (default or DEFAULT_EXECUTOR).check(self.steps)
            return
        groups: dict[int, tuple[Executor, list[Step]]] = {}
        for step in self.steps:
            executor = step.executor or default or DEFAULT_EXECUTOR
            groups.setdefault(id(executor), (executor, []))[1].append(step)
        for executor, steps in groups.values():
            executor.check(steps)

    async def run(
        self, initial_context: Mapping[str, Any] | None = None, **options: Unpack[RunOptions]
    ) -> WorkflowResult:
        """Run every step not recorded in ``resume_from`` and return the outputs.

        - ``initial_context``: extra keys every step sees; recorded in the
          checkpoint, so a resume without it sees the same. On a resume, the
          keys passed are merged over the recorded ones (passed keys win, the
          others stay); recorded outputs never change, and the new checkpoints
          record the merged context. A key equal to a step name is a
          ``ValueError``.
        - ``checkpoint_fn``: called (and awaited if async) with a new
          :class:`WorkflowCheckpoint` after each group of completions; an
          exception from it propagates out of ``run``.
        - ``resume_from``: a checkpoint (or its dict) whose recorded steps are skipped.
        - ``max_concurrency``: at most this many steps in flight.
        - ``budget``: stop starting steps once usage reaches any non-zero field;
          raises :class:`BudgetExceeded`.
        - ``approval``: ``approval(name, metadata)`` before each step's first
          attempt; a denial raises :class:`ApprovalDenied`.
        - ``trace``: receives every :mod:`ekit_core.events` event (a callback, or a list of them).
        - ``allow_graph_change``: resume a checkpoint recorded from another graph.
        - ``executor``: where steps run unless they name their own (default:
          async steps on the loop, sync steps in a worker thread).
        - ``isolate_failures``: a failed step (after its retries) stops only its dependants;
          the rest run, and the result lists ``failed`` and ``not_started`` steps instead of
          raising. A resume runs just those.
        - ``run_id``: the run's id. Each attempt then has an idempotency key,
          ``run_id/step/number`` (the number counts attempts across runs),
          which the step reads with :func:`~ekit_runtime.attempt.attempt_key`
          and its executor as ``attempt.key``. Queue workers pass theirs.
        - ``before_attempt``: ``before_attempt(attempt)``, awaited if async,
          right before each attempt's work begins (after its retry delay and
          approval, outside its timeout); it may wait (a rate limiter, a
          worker's admission). What it raises fails that attempt, as the
          step's own error would. A callable it returns is the attempt's
          release, called once when the attempt ends, however it ends.
        - ``answers``: ``{step: answer}``, recorded in ``resume_from`` before
          anything runs, for steps that wait on a question a person must
          answer (see :mod:`ekit_runtime.human`): an
          :class:`~ekit_core.Answer` (``Answer(value, by=...)``,
          ``Answer.approve(by=...)``, ``Answer.deny(reason, by=...)``), or a
          plain value for a value question. A step that is not waiting, or
          an answer that does not fit its question, is a ``ValueError``.
        - ``only``: step names to run, with what they need, and none else: :mod:`ekit_core.selection`.
        - ``durations``: record how long each step took in the checkpoints (off by default).
        - ``cache``: a :class:`~ekit_runtime.cache.Cache` for steps with ``cache=True`` (docs/cache.md).
        - ``worker``: who drives this run, recorded in the checkpoints' ``drives`` (docs/api.md).

        A step that fails (after its retries) stops new starts; steps in flight
        finish, a final checkpoint is saved, and its own exception is raised
        with a note naming the step (an ``ExceptionGroup`` if several failed).
        A step that asks a person (``ekit_runtime.ask``, ``approve``) with no
        answer recorded waits: what needs it does not start, the rest runs,
        and then, the final checkpoint saved, :class:`RunWaiting` is raised.
        Cancellation saves a final checkpoint and re-raises.
        """
        runner = self.runner(initial_context, **options)
        await runner.run()
        return outcome(runner.state, self._last_checkpoint(runner))

    async def iterate(
        self, initial_context: Mapping[str, Any] | None = None, **options: Unpack[RunOptions]
    ) -> AsyncGenerator[State, None]:
        """Run like :meth:`run`, yielding the core :class:`~ekit_core.State` after
        each group of completions (its checkpoint already handed to ``checkpoint_fn``).

        Leaving the loop early (``break``, an exception, cancellation) cancels
        the steps in flight and saves a final checkpoint, like cancelling
        :meth:`run`; use ``contextlib.aclosing`` so this happens at once rather
        than when the generator is collected. When the run ends short (failure,
        budget, denial) the iteration raises what :meth:`run` would.
        """
        runner = self.runner(initial_context, record_events=True, **options)
        states = runner.states()
        try:
            async for state in states:
                yield state
        finally:
            await states.aclose()
        outcome(runner.state, self._last_checkpoint(runner))

    def _last_checkpoint(self, runner: Runner) -> WorkflowCheckpoint | None:
        """The run's last checkpoint as handed out (in its stored form, with a codec)."""
        if self._codec is None:
            last = runner.last_checkpoint
            return runner.checkpoint_now() if last is None and runner.cache_hits else last
        return final_checkpoint(self._codec, runner)

    def run_sync(
        self, initial_context: Mapping[str, Any] | None = None, **options: Unpack[RunOptions]
    ) -> WorkflowResult:
        """Run from synchronous code (a script): ``asyncio.run(self.run(...))``.

        Refuses with ``RuntimeError`` when called inside a running event loop
        (await :meth:`run` there instead); nothing is left un-awaited.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError(
                "Workflow.run_sync() cannot be called from a running event loop; "
                "use 'await workflow.run(...)' instead"
            )
        _check_options(options)
        return asyncio.run(self.run(initial_context, **options))


def _recorded_hits(resume_from: object, state: State) -> MappingProxyType[str, CacheHit] | None:
    """The cache hits ``resume_from`` records for outputs the resume keeps (``None``: none)."""
    if isinstance(resume_from, WorkflowCheckpoint):
        hits: Mapping[str, CacheHit] = resume_from.cache_hits
    elif isinstance(resume_from, Mapping) and resume_from.get("cache_hits"):
        hits = WorkflowCheckpoint.from_dict(dict(resume_from)).cache_hits
    else:
        return None
    outputs = state.outputs
    kept = {k: h for k, h in hits.items() if k in outputs}
    return MappingProxyType(kept) if kept else None


def _as_is(value: Any) -> Any:
    return value


def _outputs(state: State) -> MappingProxyType[str, Any]:
    """The outputs a result shows: every step's, the items of mapped steps left to the checkpoint."""
    outputs = state.outputs.as_dict()
    shaped = state.spec.shaped
    if shaped is not None and shaped.items:
        items = shaped.items
        outputs = {k: v for k, v in outputs.items() if k not in items}
    if shaped is not None:  # (a loop ``only=`` holds is never grown: its iterations are no items)
        loops = iterating(state.spec.declared_graph)
        if loops:
            outputs = {k: v for k, v in outputs.items() if iteration_of(k, loops) is None}
    return MappingProxyType(outputs)


def outcome(state: State, last: WorkflowCheckpoint | None = None) -> WorkflowResult:
    """Turn a settled state into a :class:`WorkflowResult` or raise what ended it."""
    checkpoint = last if last is not None else checkpoint_of(state)
    kind = state.outcome
    if kind == "finished":
        if state.limits.only is not None:
            return WorkflowResult(_outputs(state), state.cost, checkpoint, left_out=left_out(state))
        return WorkflowResult(_outputs(state), state.cost, checkpoint)
    if kind == "failed" and state.limits.isolate_failures:
        failed = dict(state.errors)
        left = (state.outputs, failed, state.skipped)
        waiting = tuple(n for n in state.graph.names if not any(n in x for x in left))
        only = state.limits.only
        if only is not None:  # what waits on a failure, of what the run was to run
            waiting = tuple(n for n in waiting if selected(only, state.spec.shaped, n))
        return WorkflowResult(
            _outputs(state), state.cost, checkpoint, MappingProxyType(failed), waiting,
            left_out(state),
        )
    if kind == "failed":
        errors = []
        for name, error in state.errors:
            if isinstance(error, Exception):
                attempts = state.tries.get(name, 1)
                error.add_note(
                    f"ekit: step {name!r} failed (attempt {attempts}); "
                    f"{checkpoint.step_index} completed step(s) are in the last checkpoint"
                )
                errors.append(error)
        if len(errors) == 1:
            raise errors[0]
        names = ", ".join(repr(n) for n, _ in state.errors)
        raise ExceptionGroup(f"{len(errors)} steps failed: {names}", errors)
    halt, budget = state.halt, state.limits.budget
    if kind == "budget_exceeded" and budget is not None:
        step = halt.step if halt is not None else None
        shape = None if step is None else state.spec.declared_graph.shapes.get(step)
        within = "child" if shape is not None and shape.child is not None \
            and shape.repeat is None else "loop"  # (a loop whose body is a child: a loop)
        raise BudgetExceeded(checkpoint, budget, step, within)
    if kind == "denied" and halt is not None and halt.step is not None:
        raise ApprovalDenied(halt.step, halt.reason, checkpoint)
    if kind == "waiting":
        raise RunWaiting(checkpoint, questions(checkpoint))
    raise InternalError(f"ekit: run ended as {kind!r}, which has no result")
