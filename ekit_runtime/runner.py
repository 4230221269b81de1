"""The async loop that carries out what the core decides.

Each turn folds what happened since the last one into the state and learns
what to do next, in one core transition (``advance``, which is ``apply``
then ``plan``); it then starts the attempts the batch names, cancels the
ones it withdraws, and hands the new checkpoint to ``checkpoint_fn``. It
owns only what is impure: tasks, sleeping out retry delays, asking for
approval, timeouts, the executor a step runs in, calling callbacks, and
winding down on cancellation so that no task outlives the run and the
final checkpoint is saved even while the caller keeps cancelling. It holds
no scheduling rule: what to start, retry, withdraw or stop is the core's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import warnings
from collections import deque
from collections.abc import (
    AsyncGenerator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    Sequence,
)
from contextvars import Token
from inspect import CO_COROUTINE
from time import perf_counter, time
from types import FunctionType, MappingProxyType
from typing import Any, NoReturn, TypeAlias, cast

from ekit_core import (
    Asked,
    Batch,
    Began,
    Cancelled,
    CheckpointSaved,
    Denied,
    Event,
    Failed,
    Input,
    InternalError,
    Interrupted,
    RunSettled,
    Skipped,
    Start,
    State,
    StepCacheHit,
    Succeeded,
    WorkflowCheckpoint,
    advance,
    apply,
    checkpoint_of,
)
from ekit_core.expansion import Expansion, ItemRef, item_input
from ekit_core.growth import add_steps
from ekit_core.human import Answer, answers_of
from ekit_core.ledger import Ledger
from ekit_core.results import APPROVAL, CONDITION, DELAY, Ended, Gate, HeldSucceeded, succeeded
from ekit_core.rewind import rewind
from ekit_core.shapes import item_name, iteration_name
from ekit_core.state import attempt_number
from ekit_core.transitions import context_outputs
from ekit_core.usage import NO_USAGE, TokenUsage
from ekit_runtime import attempt as attempts
from ekit_runtime import human, loops, signal_wakeup, streaming
from ekit_runtime.approval import ApprovalFn, ask
from ekit_runtime.attempt import Attempt, AttemptKey
from ekit_runtime.cache.base import CachedStep, CacheEntry, CacheHit, Reads, hit_of
from ekit_runtime.cache.together import Ahead, Together
from ekit_runtime.context import StepContext
from ekit_runtime.errors import StepCancelledError, StepTimeoutError, TraceCallbackWarning
from ekit_runtime.executors import DEFAULT_EXECUTOR, Executor
from ekit_runtime.loops import Done, Repeat
from ekit_runtime.step import PLAIN_OUTPUTS, Step, condition_name, split_result
from ekit_runtime.stores.errors import UnencodableError

__all__ = ["BeforeAttempt", "CheckpointFn", "Clock", "Runner", "Sleep", "TraceFn", "prepare_run_of"]

SAVE_FAILED_NOTE = "ekit: checkpoint_fn raised"
"""How the note the runner adds to an exception ``checkpoint_fn`` raised begins (progress.py reads it)."""

CheckpointFn: TypeAlias = Callable[[WorkflowCheckpoint], Awaitable[Any] | Any]
TraceFn: TypeAlias = (
    Callable[[Event], Awaitable[Any] | Any] | Sequence[Callable[[Event], Awaitable[Any] | Any]]
)
"""A callback receiving every trace event (sync or async), or a list of them."""
Sleep: TypeAlias = Callable[[float], Awaitable[Any]]
"""Waits out a retry delay: ``asyncio.sleep`` unless a test injects another."""
Context: TypeAlias = StepContext | dict[str, Any]
Clock: TypeAlias = Callable[[], float]
"""Seconds from an arbitrary origin, for step durations: ``time.perf_counter`` by default."""
BeforeAttempt: TypeAlias = Callable[[Attempt], Awaitable[Any] | Any]
"""Called (and awaited if async) right before each attempt's work begins: see ``Workflow.run``.

It may return a *release*: a callable taking no argument (returning
``None`` or an awaitable), which the runner calls exactly once when that
attempt ends: it returned, raised (a ``BaseException`` too), timed out or
was cancelled. An awaitable it returns is awaited to its end even through
further cancellations (re-raised after). What a release raises is a
``RuntimeWarning``, never the attempt's outcome. Whatever else it returns
(``None``, ``True``) is ignored. A worker returns one when the attempt took a
slot of a capped resource.
"""


async def _await_through_cancellation(awaitable: Awaitable[Any]) -> tuple[Any, bool]:
    """Await ``awaitable`` to the end even if we are cancelled meanwhile.

    Returns its result and whether a cancellation arrived, which the caller
    must then re-raise. This is what keeps the final save from being cut off.
    """
    task = asyncio.ensure_future(awaitable)
    cancelled = False
    while True:
        try:
            return await asyncio.shield(task), cancelled
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True


def _own_cancellation(name: str, task: asyncio.Task[Any]) -> StepCancelledError:
    """The failure of a step that raised ``CancelledError`` nobody asked for."""
    error = StepCancelledError(
        f"step {name!r} raised CancelledError although neither the run nor its timeout "
        "cancelled it; it counts as the step's failure"
    )
    try:
        task.result()
    except asyncio.CancelledError as exc:
        error.__cause__ = exc
    return error


class Runner:
    """One run of a workflow: the loop, its tasks and its callbacks.

    ``steps`` holds the workflow's steps in the order of ``state.graph.names``;
    the runner finds each by name (:meth:`step`), and :meth:`add_steps` grows
    the graph and the steps together while the run goes.
    """

    # What the run holds to make signals wake its loop, while it runs: see _begin.
    _signals: signal_wakeup.SignalWakeup | None = None
    # Python is closing the run's coroutines, in which nothing may await: see _turn.
    _closing = False
    # Whether a lone task in flight is awaited directly: see _turn and states.
    _join_directly = True
    # A traced run's attempts report partial output to its callbacks; the async
    # callbacks' tasks are awaited before the next event (_emit). Set on the
    # instance only then: one more attribute on every runner would cost every
    # step (the instance's attributes would no longer fit their shared layout).
    _partials: set[asyncio.Future[Any]] | None = None
    # The answers a person gave to the steps that asked (see human.py), handed
    # to those steps' attempts, and whether the first checkpoint must be saved
    # (answers were recorded in it before the run began: a denial may end it
    # before any step). Class defaults, set on the instance only in a run that
    # has answers: an instance with more than 30 attributes loses CPython's
    # shared-key dict, and every attribute read of the run's loop costs more.
    _answers: Mapping[str, tuple[Answer, ...]] = MappingProxyType({})
    # The run's cached steps (step -> CachedStep, see ekit_runtime.cache) and the
    # hits so far (name -> CacheHit): class defaults, set on the instance only in a
    # run given a cache (see _answers for why).
    _cached: Mapping[str, Any] = MappingProxyType({})
    _together: Together | None = None  # while a turn's starts launch (_launch_together)
    cache_hits: Mapping[str, CacheHit] = MappingProxyType({})
    _hit_events: tuple[Event, ...] = ()  # the hits not yet told to the trace (set on the instance)
    save_first = False
    _epoch = 0.0  # the clock's reading as epoch seconds: set as a run that records times begins

    def __init__(
        self,
        steps: Sequence[Step],
        state: State,
        *,
        checkpoint_fn: CheckpointFn | None,
        approval: ApprovalFn | None,
        trace: TraceFn | None,
        executor: Executor | None = None,
        sleep: Sleep = asyncio.sleep,
        clock: Clock = perf_counter,
        run_id: str | None = None,
        before_attempt: BeforeAttempt | None = None,
    ) -> None:
        # By name through the graph's index, which the workflow built already
        # (a dict of its own would cost a resume an entry per recorded step);
        # steps added while running are kept apart.
        self._declared, self._index = tuple(steps), state.spec.declared_graph.index
        self._added: dict[str, Step] = {}
        self.state, self.run_id, self.before_attempt = state, run_id, before_attempt
        self.executor = executor if executor is not None else DEFAULT_EXECUTOR
        self.checkpoint_fn, self.approval, self.trace = checkpoint_fn, approval, trace
        # One callback, or several in order: each sees every event, and one
        # that raises loses only its own copy of the event.
        self._traces: tuple[Callable[[Event], Any], ...] = (
            tuple(trace) if isinstance(trace, list | tuple)
            else () if trace is None else (cast(Callable[[Event], Any], trace),)
        )
        self.sleep, self.clock = sleep, clock
        self.last_checkpoint: WorkflowCheckpoint | None = None
        self._loop: asyncio.AbstractEventLoop  # the running loop, set as the run begins
        # initial_state recorded RunStarted and the skips; advance() replaces
        # the events with its own, so keep these to hand to the trace first.
        self._initial_events = state.events
        # Recorded outputs that are not steps were an ExecutionKit run's
        # context: steps keep seeing them, the run's own context wins.
        # (Only a checkpoint holding more outputs than recorded steps has any.)
        outputs = state.outputs
        self._base = context_outputs(state.graph, outputs) if len(outputs) > state.completed else {}
        self._base.update(state.context)
        self._tasks: dict[asyncio.Task[Any], str] = {}
        self._finished: deque[asyncio.Task[Any]] = deque()
        self._reports: list[Input] = []  # Began, reported by gated attempts
        self._wakeup: asyncio.Future[None] | None = None
        # Which steps run as their own task, decided at each step's first
        # launch: a resume pays nothing for the steps it skips.
        self._own: dict[str, bool] = _loops_of(state, self._declared, self._index)
        self._began: dict[asyncio.Task[Any], float] = {}
        # Tasks this runner cancelled: only their CancelledError is an
        # interruption; any other is the step's own (StepCancelledError).
        self._cancelled: set[asyncio.Task[Any]] = set()
        # Inputs drained in a turn that ended by a step's BaseException:
        # folded in by the wind-down so that no sibling's output is lost.
        self._carried: list[Input] = []
        self._accepted: WorkflowCheckpoint | None = checkpoint_of(state)  # see _refused_new
        # The task driving the run, and its cancel requests as the run began (see
        # _cancel_requested). One attribute: a 30th makes every read slower (perf doc).
        self._driver: tuple[asyncio.Task[Any] | None, int] = (None, 0)
        # Events are built only for someone to read them: a trace, or iterate().
        self.record_events = trace is not None

    def _runs_as_own_task(self, step: Step) -> bool:
        """Can the step's coroutine be the attempt's task itself, with nothing around it?

        An async step with no timeout, in the default executor, in a run with
        no identity to hand its attempts (no ``run_id``, no ``before_attempt``):
        the fast path of every such run, on which no :class:`Attempt` is built.
        Its outcome is read off the task (:meth:`_outcome_of`).
        """
        run = step.run
        own = self._own[step.name] = (
            step.timeout is None  # (a loop with an until never gets here: see __init__)
            and self.run_id is None
            and self.before_attempt is None
            and (step.executor or self.executor) is DEFAULT_EXECUTOR
            and (
                # A plain `async def` (inspect's answer, without its unwrapping).
                (type(run) is FunctionType and bool(run.__code__.co_flags & CO_COROUTINE))
                or inspect.iscoroutinefunction(run)
            )
        )
        return own

    def _in_iteration(self, context: Context, step: Step, ref: ItemRef) -> None:
        """What iteration ``ref`` of a loop body's step sees besides its inputs: the loop's
        ``Iteration`` under the loop's name, and its body dependencies as the same
        iteration's outputs, by the names the body's code knows them by (``L/d``:
        ``in_child`` strips ``L/``)."""
        outputs, k = self.state.outputs, ref.iteration
        shaped = cast(Expansion, self.state.spec.shaped)
        context[shaped.in_body[ref.step]] = loops.iteration(k, outputs[ref.source] if ref.source else None)
        suffix = f"#{k}"
        for d in step.depends_on:
            if d in shaped.in_body and d + suffix in outputs:
                context[d] = outputs[d + suffix]

    def _body_map(self, name: str) -> Step:
        """The step iteration ``name`` (``M#k``) of a loop body's mapped step ``M`` runs
        its items as: ``M``'s, named ``M#k`` (its items are ``M#k[key]``). Made per item,
        not kept: a runner holds no attribute more (see docs/performance.md)."""
        return dataclasses.replace(self.step(name.rpartition("#")[0]), name=name)

    def _take_answers(self, state: State) -> None:
        """Hold the answers recorded in ``state`` for the attempts of the steps that asked:
        those go through :meth:`_attempt`, which hands them their answers."""
        answers = answers_of(state.setbacks.asked)
        if answers:
            self._answers = answers
            self._own.update(dict.fromkeys(self._owners(answers), False))

    def _owners(self, names: Iterable[str]) -> set[str]:
        """The steps ``names`` are of: a step's own name, an item's mapped step."""
        shapes = self.state.spec.declared_graph.shapes
        mapped = [f"{n}[" for n, s in shapes.items() if s.map_over is not None]
        mapped += [f"{n}#" for n, s in shapes.items() if s.repeat is not None]
        if self.state.spec.shaped is not None:  # (a loop body's steps: L/s#k)
            mapped += [f"{n}#" for n in self.state.spec.shaped.in_body]
        return {next((m[:-1] for m in mapped if name.startswith(m)), name) for name in names}

    @property
    def steps(self) -> tuple[Step, ...]:
        """The run's steps, in the order they were given (then added)."""
        return (*self._declared, *self._added.values())

    def step(self, name: str) -> Step:
        """The step named ``name`` (``KeyError`` if the run has none)."""
        i = self._index.get(name)
        return self._declared[i] if i is not None else self._added[name]

    def add_steps(self, steps: Sequence[Step]) -> State:
        """Grow the running graph by ``steps``: they run as soon as their dependencies are recorded.

        Checked as a whole first (names new, dependencies known, no cycle: a
        ``GraphError`` otherwise, nothing changed), then added to the state
        (see :func:`ekit_core.growth.add_steps`) and to the steps this runner
        launches by name. Their retry policies and versions are not read yet:
        what a run-time shape needs of them comes with it. Returns the new state.
        """
        for i, step in enumerate(steps):
            if not isinstance(step, Step):
                raise ValueError(f"steps[{i}] must be a Step, got {type(step).__name__}")
            if step.child is not None:  # (its steps are put in its place when a Workflow is built)
                raise ValueError(f"step {step.name!r}: a step with a child workflow cannot be "
                                 "added to a running graph (yet): declare it in the Workflow")
        self.state = add_steps(self.state, {s.name: s.depends_on for s in steps})
        self._added.update((s.name, s) for s in steps)
        return self.state

    # -- the loop -----------------------------------------------------------

    async def run(self) -> State:
        """Drive the run to its end and return the settled state."""
        await self._prepare()
        try:
            await self._begin()
            while not self.state.settled:
                await self._turn()
        except BaseException as exc:
            await self._end(exc)
            raise
        finally:
            signal_wakeup.release(self._signals)
            self.__dict__.pop("_save", None)  # (keep_hits's bound method: a cycle, once ended)
        return self.state

    async def states(self) -> AsyncGenerator[State, None]:
        """Drive the run, yielding each state that follows a group of completions.

        Closing the generator early winds the run down like a cancellation.
        """
        self.record_events = True
        # A GeneratorExit that a lone step raises, awaited directly, would be
        # thrown into the consumer's task, which cannot close the generator
        # frames between: awaiting the wake-up future instead costs a loop
        # turn per step, and the step's GeneratorExit then ends the run as
        # any BaseException does.
        self._join_directly = False
        await self._prepare()
        try:
            await self._begin()
            while not self.state.settled:
                yield await self._turn()
        except BaseException as exc:
            await self._end(exc)
            raise
        finally:
            signal_wakeup.release(self._signals)
            self.__dict__.pop("_save", None)  # (keep_hits's bound method: a cycle, once ended)

    async def _prepare(self) -> None:
        """Let ``checkpoint_fn`` refuse the run before any step starts (and before any event).

        A ``checkpoint_fn`` (or the object of a bound method, or what a
        ``functools.partial`` wraps) with a ``prepare_run(checkpoint)``
        method, as every store has, is called once with the checkpoint the
        run starts from, and awaited if async: what it raises ends the run
        there, nothing started, nothing saved.
        """
        prepare = prepare_run_of(self.checkpoint_fn)
        if prepare is not None:
            returned = prepare(checkpoint_of(self.state))
            if inspect.isawaitable(returned):
                await returned

    async def _begin(self) -> None:
        if self.state.setbacks.asked:  # before any attempt starts
            self._take_answers(self.state)
        self._loop = asyncio.get_running_loop()
        if self.state.spec.limits.durations:
            # The run's clock read as UTC epoch seconds: when an attempt began,
            # for the timeline (the clock's drift from the wall clock over a run
            # is well below what a timeline shows). Only in a run that records
            # times: an attribute more on every runner would cost every step
            # (see _answers); the others hand the core times it does not keep.
            self._epoch = time() - self.clock()
        if self._traces:  # (see _partials)
            self._partials = set()
        # Until the run ends (its wind-down included), a signal the kernel
        # gives to a step's thread still wakes this loop, so that the handler
        # that cancels the run gets to run: see signal_wakeup.
        self._signals = signal_wakeup.hold(self._loop)
        current = asyncio.current_task()
        self._driver = (current, current.cancelling() if current is not None else 0)
        state, batch = advance(self.state)
        self.state = state
        if self.trace is not None:
            await self._emit(self._initial_events)
        self._carry_out(batch)
        await self._report(state, save=self.save_first)

    async def _turn(self) -> State:
        """Wait for completions, fold them in, do what the core says, save."""
        if not self._tasks:
            await self._start_added()
        if (
            not self._finished
            and not self._reports
            and len(self._tasks) == 1
            and self._join_directly
            and not self.state.setbacks.gated  # a gated attempt reports when it begins
        ):
            # Join the one task in flight by awaiting it (inline: a coroutine fewer per
            # step): a loop turn fewer than the wake-up future. Its outcome is read by
            # _outcome_of, not raised here; the run's own cancellation: see below.
            (task,) = self._tasks
            current = self._driver[0]  # (a coroutine never changes tasks: no current_task())
            try:
                await task
            except asyncio.CancelledError:
                if not task.done() or self._cancel_requested(current):
                    raise  # we are being cancelled, not just the task
            except Exception:
                pass
            except GeneratorExit:
                # The step raised GeneratorExit: asyncio throws it into the task
                # driving the run, and Python then closes this chain of coroutines,
                # in which nothing may await any more (it would end as "coroutine
                # ignored GeneratorExit" instead). See _end.
                self._closing = True
                raise
            if self._cancel_requested(current):
                raise asyncio.CancelledError  # the run's, whatever the step made of it
        while not self._finished and not self._reports:
            self._wakeup = self._loop.create_future()
            await self._wakeup
        self._wakeup = None
        reported = len(self._reports)
        inputs = self._drain()
        state, batch = advance(self.state, inputs, record_events=self.record_events)
        self.state = state
        # _carry_out and _report, inline for an untraced run: once per step.
        if batch.withdraw:
            self._withdraw(batch.withdraw)
        if len(batch.starts) > 1 and self._cached:
            self._launch_together(batch.starts)
        else:
            for start in batch.starts:
                self._launch(start)
        # An attempt that only began its work (a Began report, drained first)
        # changed nothing a checkpoint holds.
        if self.trace is not None:
            await self._report(state, save=len(inputs) > reported)
        elif len(inputs) > reported:
            saving = self._save(state)
            if saving is not None:
                await saving
        return state

    async def _start_added(self) -> None:
        """Start what :meth:`add_steps` made ready while nothing ran (else the run is stuck)."""
        state, batch = advance(self.state, (), record_events=self.record_events)
        if not batch.starts:
            raise InternalError("ekit: nothing can start and nothing is running")
        self.state = state
        self._carry_out(batch)
        await self._report(state, save=False)

    async def _report(self, state: State, *, save: bool, saved: bool = False) -> None:
        """The one order of reporting a transition: its events, the save, then the run's end.

        ``save`` saves the checkpoint of ``state`` in between; ``saved`` says
        that the caller already did (the wind-down saves before anything else).
        """
        if self.trace is None:
            if save:
                saving = self._save(state)
                if saving is not None:
                    await saving
            return
        if self._hit_events:
            hit_events, self._hit_events = self._hit_events, ()
            await self._emit(hit_events)
        events = state.events
        finish = events[-1:] if events and isinstance(events[-1], RunSettled) else ()
        await self._emit(events[: len(events) - len(finish)])
        if save:
            saving = self._save(state)
            if saving is not None:
                await saving
        if (save or saved) and self.checkpoint_fn is not None:
            await self._emit((CheckpointSaved(state.completed),))
        await self._emit(finish)

    def _cancel_requested(self, current: asyncio.Task[Any] | None) -> bool:
        """Whether the run was asked to cancel since it began (``current`` drives it).

        ``_turn`` awaits a lone step's task directly: with a single task (every
        step of a chain) that saves a loop turn over the wake-up future (the
        task's own callbacks, ``_on_done`` first, run in the turn after it
        finishes). But asyncio hands a cancellation of the awaiting task to what
        it awaits: a cancellation of the run (Ctrl-C, even one that arrived
        before the await) reaches the step's task instead. A step that swallows
        it (returns, or raises something else) must not swallow the run's, so
        the run's is told by this count of cancel requests.
        """
        return current is not None and current.cancelling() > self._driver[1]

    # -- starting and withdrawing attempts ------------------------------------

    def _carry_out(self, batch: Batch) -> None:
        if batch.withdraw:
            self._withdraw(batch.withdraw)
        if len(batch.starts) > 1 and self._cached:
            self._launch_together(batch.starts)
            return
        for start in batch.starts:
            self._launch(start)

    def _launch_together(self, starts: tuple[Start, ...]) -> None:
        """Launch ``starts``, their cached attempts looked up together (one query a cache, as
        they start, before any of them runs: :mod:`ekit_runtime.cache.together`)."""
        self._together = together = Together()
        try:
            for start in starts:
                self._launch(start)
        finally:
            self._together = None
        together.look_up()

    def _withdraw(self, names: tuple[str, ...]) -> None:
        for task, owner in self._tasks.items():
            if owner in names:
                self._cancelled.add(task)
                task.cancel()

    def _context_for(self, step: Step) -> StepContext | dict[str, Any]:
        outputs = self.state.outputs
        if step.context == "all":
            return StepContext(self._base, outputs)  # O(1): a snapshot, copy-on-write
        context = self._base.copy()
        for dep in step.depends_on:
            if dep in outputs or step.shaping is None or step.join == "all":  # (a join sees what ran)
                context[dep] = outputs[dep]
        return context

    def _item(self, name: str) -> tuple[Step, ItemRef, Context]:
        """The step ``name`` is an item of, what the item is (its key, its iteration), and
        its context.

        The item sees its input as the output of the dependency its step
        maps over (the upstream item's own output, in an item-wise chain).
        """
        # Once per item of a map: one lookup of each, no call that can be saved.
        shaped = self.state.spec.shaped
        ref = None if shaped is None else shaped.items.get(name)
        if ref is None:
            raise InternalError(f"ekit: the core started {name!r}, which is no step of this run")
        i = self._index.get(ref.step)
        step = self._declared[i] if i is not None else self._added.get(ref.step) or \
            self._body_map(ref.step)
        outputs = self.state.outputs
        context: Context = StepContext(self._base, outputs) if step.context == "all" else {
            **self._base, **{d: outputs[d] for d in step.depends_on if d in outputs}}
        in_body = shaped.nesting.in_body  # type: ignore[union-attr]  # (a field: no property call)
        if in_body and (it := shaped.items.get(step.name)) is not None:  # type: ignore[union-attr]
            self._in_iteration(context, step, it)  # (an item of a body's map, M#k[key])
        if ref.iteration:  # an iteration of a loop: its number and the state it carries
            carried = loops.iteration(ref.iteration, outputs[ref.source] if ref.source else None)
            loop = in_body.get(ref.step) if in_body else None
            if loop is None:
                if type(context) is StepContext:  # (its __setitem__'s one store, without the call)
                    context._own = {step.name: carried}
                else:
                    context[step.name] = carried
                return step, ref, context
            self._in_iteration(context, step, ref)
            return step, ref, context
        over = None if step.shaping is None else step.shaping[0]  # (a property: a call per item)
        if over is None:  # a step of a child per item, P/s[key]: the item, and its child's items
            context[ref.source] = item_input(ref, outputs)
            child = step.name[:step.name.rfind("/") + 1]  # (the parent's inputs: seen whole)
            for d in step.depends_on:
                if d.startswith(child) and (dep := item_name(d, ref.key)) in outputs:
                    context[d] = outputs[dep]
            return step, ref, context
        context[over] = item_input(ref, outputs)
        return step, ref, context

    def _launch(self, start: Start) -> None:
        name = start.name
        # A traced run hands each attempt a sink for its partial output: set here, it is in the context
        # the attempt's task (and thread) copies. (record_events first: an instance attribute.)
        reports = sink = None
        if self.record_events and self._partials is not None:
            reports = streaming.PartialSink(name, self._traces, self._loop, self._partials)
            sink = streaming.SINK.set(reports)
        i = self._index.get(name)
        item = ref = None
        if i is not None or name in self._added:
            step = self._declared[i] if i is not None else self._added[name]
            context: Context = (
                StepContext(self._base, self.state.outputs)  # O(1): a snapshot, copy-on-write
                if step.context == "all"
                else self._context_for(step)
            )
        else:
            step, ref, context = self._item(name)
            item = ref.key
        reading = self._reading(name, step, ref) if self.state.spec.shaped is not None else None
        own = self._own.get(step.name)
        if own is None:
            own = self._runs_as_own_task(step)
        # What it does before its work begins is the core's (Start.gates), followed in
        # order; its three fields are read first only to see that there is nothing (speed).
        gates = start.gates if start.delay or start.condition or start.approval else ()
        decided = None
        if gates and gates[0] == CONDITION:  # asked at once: a condition is a plain call
            decided, gates = _decided(step, name, context), gates[1:]
            if decided is None and not gates:  # it held, and nothing else gates: it begins now
                self._reports.append(Began(name))
        if decided is not None:  # skipped, or its condition raised: an attempt that never began
            task = self._loop.create_task(_at_once(decided))
        elif gates:  # it reports Began when its work begins
            task = self._loop.create_task(self._gated(step, start, gates, context, item))
        elif own:  # the step's coroutine is the task itself; _drain reads its outcome
            began = self.clock()
            try:
                body = step.run(context)
            except Exception as exc:  # the call itself raised (bad arguments): its failure
                task = self._loop.create_task(_at_once(Failed(name, exc)))
            else:
                # (No cast: it subscripts a generic on every start, 2k instructions.)
                task = self._loop.create_task(body)  # type: ignore[arg-type]
                self._began[task] = began
        else:  # (looked up with the attempts it starts with, if cached: _launch_together)
            together = self._together
            ahead = None if together is None else together.add(self._cached, step.name, item, context)
            task = self._loop.create_task(self._attempt(step, context, item, ahead))
        self._tasks[task] = name
        task.add_done_callback(self._on_done)
        if reading is not None:
            loops.READING.reset(reading)  # (not through a function: a call an attempt)
        if sink is not None:
            streaming.SINK.reset(sink)
        if reports is not None:
            # Closed as the attempt's task ends, before the run reads its
            # outcome: nothing it reports later can follow its events.
            task.add_done_callback(reports.close)

    def _reading(self, name: str, step: Step, ref: ItemRef | None) -> Token[Any] | None:
        """In a run with loops, what the attempt of ``name`` may read with ``history()``
        (set for its task to copy; ``_launch`` resets it once the task is made)."""
        state = self.state
        shaped = state.spec.shaped
        if shaped is None or not shaped.loops:
            return None
        loop = None
        if ref is not None and ref.iteration:
            in_body = shaped.nesting.in_body
            loop = in_body.get(step.name, step.name) if in_body else step.name
        # (Set here, not through a function of loops: a call an attempt; see loops.READING.)
        return loops.READING.set((name, step.depends_on, loop, state))

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        self._finished.append(task)
        wakeup = self._wakeup  # what _wake does, inline: one call per step
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    def _wake(self) -> None:
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    def _drain(self) -> list[Input]:
        """Every input since the last call: attempts that began, then attempts that ended.

        A step that raised a ``BaseException`` which is not an ``Exception``
        (KeyboardInterrupt, SystemExit, GeneratorExit, a custom one) ends the
        run: the first such exception is raised once every other finished
        task has been read, and what was read is carried to the wind-down,
        whatever order the tasks finished in.
        """
        inputs, self._reports = self._reports, []
        finished, tasks, began_at = self._finished, self._tasks, self._began
        fatal: BaseException | None = None
        while finished:
            task = finished.popleft()
            name = tasks.pop(task)
            began = began_at.pop(task, None)
            # The common case inline (a step's own task that returned a plain
            # value): one per step of every run.
            if began is not None:
                try:  # (one call: result() raises for a task cancelled or failed, read below)
                    output = task.result()
                except BaseException:
                    output = _RAISED
                if type(output) in PLAIN_OUTPUTS:  # split_result's first rule
                    inputs.append(succeeded(name, output, NO_USAGE, self.clock() - began,
                                            began + self._epoch))
                    continue
            try:
                outcome = self._outcome_of(task, name, began)
            except BaseException as exc:
                fatal = fatal or exc
                outcome = Interrupted(name)
            inputs.append(outcome)
        if fatal is not None:
            self._carried = inputs
            raise fatal
        return inputs

    def _outcome_of(self, task: asyncio.Task[Any], name: str, began: float | None) -> Input:
        """How the finished ``task`` of step ``name`` ended, as a core input.

        A wrapped attempt returns its outcome itself; the step's own task
        (``began`` is when it did) is read here. A ``BaseException`` that is
        not an ``Exception`` is raised, not recorded; a ``CancelledError``
        this runner did not cause is the step's failure.
        """
        if task.cancelled():
            if task in self._cancelled:
                return Interrupted(name)
            if began is None:
                return Failed(name, _own_cancellation(name, task))
            return Failed(name, _own_cancellation(name, task), self.clock() - began,
                          began=began + self._epoch)
        if began is None:
            result: Input = task.result()
            return result
        error = task.exception()
        duration = self.clock() - began
        if error is None:
            returned = task.result()
            if isinstance(returned, Done) and (repeat := self._repeat_of(name)) is not None:
                return _iterated(name, repeat, returned, duration, began + self._epoch)
            output, usage = split_result(returned)
            return succeeded(name, output, usage, duration, began + self._epoch)
        if isinstance(error, human.InputRequired):
            return self._asked(name, error, duration)
        if isinstance(error, Exception):
            return _failure(name, error, duration, began=began + self._epoch)
        raise error

    async def _gated(self, step: Step, start: Start, gates: tuple[Gate, ...], context: Context,
                     item: str | None) -> Input:
        """An attempt that first goes through ``gates`` (those of ``start`` not yet passed),
        in order, then begins its work."""
        name = start.name
        try:
            for gate in gates:
                if gate == DELAY:
                    await self.sleep(start.delay)
                    if self._epoch and start.delay > 0:  # (a run that records times: see _attempt)
                        attempts.HOLDS.set({"retry_delay": start.delay})
                elif gate == CONDITION:
                    decided = _decided(step, name, context)
                    if decided is not None:
                        return decided
                elif gate == APPROVAL:
                    if self.approval is None:
                        raise InternalError(f"ekit: step {name!r} was gated on an approval nobody gives")
                    try:
                        verdict = await ask(self.approval, name, step.metadata)
                    except Exception as exc:  # the condition, if any, had answered: said so
                        return _failure(name, exc, gate=APPROVAL)
                    if not verdict.approved:
                        return Denied(name, verdict.reason)
        except Exception as exc:
            return _failure(name, exc)
        self._reports.append(Began(name))
        self._wake()
        return await self._attempt(step, context, item)

    async def _attempt(self, step: Step, context: Context, item: str | None = None,
                       ahead: Ahead | None = None) -> Input:
        """One attempt through its executor, handed its identity.

        Runs in the attempt's own task, so the key set here is this attempt's alone (every task
        runs in a copy of the context). The ``before_attempt`` hook is awaited outside the step's
        timeout (a wait for admission is not the step's time); what it returns, if callable, is
        the attempt's release, called once when the attempt ends however it ends (see
        :data:`BeforeAttempt`). A cached step is looked up here, or with its turn's (``ahead``).
        """
        name, repeat = (step.name, None) if item is None else self._unit(step, item)
        attempt = Attempt(step, context, attempt_number(self.state, name), self.run_id, item)
        cached = self._cached.get(step.name) if self._cached else None
        if self.run_id is not None:
            attempts.CURRENT.set(AttemptKey(self.run_id, name, attempt.number))
        release = None
        if self._answers:
            human.enter(self._answers.get(name, ()))
        # A run that records times records what held its attempts (attempt.note_hold).
        holds = attempts.holding() if self._epoch else None
        if self.before_attempt is not None:
            try:
                admitted = self.before_attempt(attempt)
                if inspect.isawaitable(admitted):
                    admitted = await admitted
            except Exception as exc:
                return _failure(name, exc)
            if callable(admitted):
                release = admitted  # what the attempt holds, given back once it ends
        began = self.clock()
        executor = step.executor or self.executor
        reads = head = None
        try:
            if cached is not None:
                head = cached.head(item) if ahead is None else ahead.head
                hit = (cached.lookup(head, context) if ahead is None and cached.cache.local
                       else await (ahead or Ahead(cached, head, context)).entry())
                if hit is not None:  # costs nothing: recorded as a hit, with the usage it saved
                    return self._hit(name, cached, hit, began)
                reads = Reads(context, cached.encode)
                attempt = dataclasses.replace(attempt, context=reads)
            try:
                if step.timeout is not None:
                    returned = await _within(name, step.timeout, executor.run(attempt))
                else:
                    returned = await executor.run(attempt)
            except human.InputRequired as exc:
                return self._asked(name, exc, self.clock() - began)
            except Exception as exc:
                return _failure(name, exc, self.clock() - began, began=began + self._epoch)
            if repeat is not None:
                return _iterated(name, repeat, returned, self.clock() - began, began + self._epoch)
            output, usage = split_result(returned)
            if cached is not None and reads is not None and head is not None:
                output = await _stored(cached, head, reads, name, output, usage)
            return (HeldSucceeded(name, output, usage, self.clock() - began, began + self._epoch, dict(holds))
                    if holds else Succeeded(name, output, usage, self.clock() - began, began + self._epoch))
        finally:
            if release is not None:
                await _give_back(release, name)

    def _unit(self, step: Step, item: str) -> tuple[str, Repeat | None]:
        """The name of ``step``'s attempt unit ``item`` (an item, an iteration) and the
        ``Repeat`` whose ``until`` and ``Done`` its success is read by (``None``: none)."""
        spec = self.state.spec
        loop = spec.shaped.in_body.get(step.name) if spec.shaped is not None else None
        if loop is not None:  # a body step's iteration, L/s#k: its output step's tells Ended
            ends = spec.declared_graph.shapes[loop].child == step.name
            return iteration_name(step.name, int(item)), self.step(loop).repeat if ends else None
        repeat = None if step.shaping is None else step.shaping[5]
        if repeat is None:
            return item_name(step.name, item), None
        return iteration_name(step.name, int(item)), repeat

    def _repeat_of(self, name: str) -> Repeat | None:
        """The ``Repeat`` of the loop ``name`` is an iteration of, when that iteration ran as
        its own task (a one-step loop's: see ``_loops_of``); else ``None``: a ``Done`` that
        any other step returns is its plain output, as ``_attempt`` records it."""
        shaped = self.state.spec.shaped
        ref = shaped.items.get(name) if shaped is not None else None
        if ref is None or not ref.iteration or ref.step in cast(Expansion, shaped).in_body:
            return None
        return self.step(ref.step).repeat

    def _hit(self, name: str, cached: CachedStep, entry: CacheEntry, began: float) -> Input:
        """The outcome of an attempt the cache answered: its recorded output, no usage."""
        try:
            output = cached.output_of(entry)
        except Exception as exc:  # a codec that cannot decode what it stored: the step's failure
            exc.add_note(f"ekit: raised decoding the cached output of {name!r} (entry {entry.key})")
            return _failure(name, exc, self.clock() - began, began=began + self._epoch)
        hits = self.cache_hits  # a ledger: O(1) a hit, shared with the checkpoints before
        ledger = hits if type(hits) is Ledger else Ledger(hits)
        hit = hit_of(entry)
        self.keep_hits(ledger.with_item(name, hit))
        if self.trace is not None:  # told before the turn's events, StepFinished among them
            self._hit_events = (*self._hit_events, StepCacheHit(name, hit.key, entry.usage))
        return Succeeded(name, output, NO_USAGE, self.clock() - began, began + self._epoch)

    def checkpoint_now(self) -> WorkflowCheckpoint:
        """The checkpoint of the run's state now, with the cache hits its outputs came from."""
        checkpoint = checkpoint_of(self.state)
        if self.cache_hits:
            _with_hits(checkpoint, self.cache_hits)
        return checkpoint

    def told_first(self, events: tuple[Event, ...]) -> None:
        """Tell ``events`` to the trace as the run begins, right after ``RunStarted``: the
        hits found before it began (:mod:`ekit_runtime.cache.at_start`)."""
        if self.trace is not None:
            first = self._initial_events
            self._initial_events = (*first[:1], *events, *first[1:])

    def use_cache(self, cached: Mapping[str, CachedStep]) -> None:
        """Let ``cached`` (step -> :class:`~ekit_runtime.cache.CachedStep`) answer those steps'
        attempts from the cache, before their work (see :mod:`ekit_runtime.cache`)."""
        if cached:
            self._cached = cached
            self._own.update(dict.fromkeys(cached, False))  # through _attempt, which looks up

    def _asked(self, name: str, asked: human.InputRequired, duration: float) -> Input:
        """The attempt asked a question with no answer: the step waits (see :mod:`ekit_runtime.human`).

        Unless its answers are recorded already, which means they never
        reached the step: its executor ran it elsewhere (another process).
        That attempt fails, saying so, rather than asking for ever.
        """
        given = len(self._answers.get(name, ()))
        if asked.number <= given:
            error = RuntimeError(
                f"step {name!r} asked question {asked.number} again although its answer is "
                "recorded: its executor runs it where ekit_runtime.ask cannot read the recorded "
                "answers (another process); give steps that ask a person executor=LocalExecutor()"
            )
            error.__cause__ = asked
            return Failed(name, error, duration)
        return Asked(name, asked.question)

    # -- callbacks ----------------------------------------------------------

    async def _emit(self, events: Iterable[Event]) -> None:
        if self.trace is None:
            return
        while self._partials:  # async callbacks still taking partial output: theirs come first
            await asyncio.wait(tuple(self._partials))
        for event in events:
            for callback in self._traces:
                try:
                    returned = callback(event)
                    if inspect.isawaitable(returned):
                        await returned
                except Exception as exc:
                    warnings.warn(TraceCallbackWarning.dropped(exc, type(event).__name__), stacklevel=2)

    def _save(self, state: State) -> Awaitable[Any] | None:
        """Hand the checkpoint of ``state`` to ``checkpoint_fn``.

        Returns what an async ``checkpoint_fn`` returned, for the caller to
        await; ``None`` when it is sync or absent. Not a coroutine itself:
        this runs once per step.
        """
        fn = self.checkpoint_fn
        if fn is None:
            return None
        checkpoint = checkpoint_of(state)
        self.last_checkpoint = checkpoint
        try:
            returned = fn(checkpoint)
        except Exception as exc:
            if self._refused_new(exc, checkpoint) is not None:
                return self._save_without(exc, checkpoint)
            self._save_failed(exc, checkpoint)
            raise
        if returned is not None and inspect.isawaitable(returned):
            return self._finish_save(returned, checkpoint)
        self._accepted = checkpoint
        return None

    def _save_with_hits(self, state: State) -> Awaitable[Any] | None:
        """:meth:`_save` in a run with cache hits, which each checkpoint records (:func:`_with_hits`).

        It takes ``_save``'s place on the instance once the run has a hit
        (:meth:`keep_hits`), so that a run without one does not test for hits
        at every save (a class default read through the instance: 0.3k
        instructions a step). Its body is ``_save``'s, with the hits added.
        """
        fn = self.checkpoint_fn
        if fn is None:
            return None
        checkpoint = checkpoint_of(state)
        _with_hits(checkpoint, self.cache_hits)
        self.last_checkpoint = checkpoint
        try:
            returned = fn(checkpoint)
        except Exception as exc:
            if self._refused_new(exc, checkpoint) is not None:
                return self._save_without(exc, checkpoint)
            self._save_failed(exc, checkpoint)
            raise
        if returned is not None and inspect.isawaitable(returned):
            return self._finish_save(returned, checkpoint)
        self._accepted = checkpoint
        return None

    def keep_hits(self, hits: Mapping[str, CacheHit]) -> None:
        """Record ``hits`` (name -> :class:`CacheHit`) as the run's: every checkpoint from now on
        holds them (those a resume keeps, then each new hit)."""
        if "_save" not in vars(self):
            # (A bound method on its own instance is a reference cycle: the runner, its steps,
            # states and hits would wait for the cyclic collector. The run's end drops it.)
            self._save = self._save_with_hits  # type: ignore[method-assign]
        self.cache_hits = hits

    async def _finish_save(self, pending: Awaitable[Any], checkpoint: WorkflowCheckpoint) -> None:
        try:
            await pending
        except Exception as exc:
            if self._refused_new(exc, checkpoint) is not None:
                await self._save_without(exc, checkpoint)
            self._save_failed(exc, checkpoint)
            raise
        self._accepted = checkpoint

    def _refused_new(self, exc: Exception, checkpoint: WorkflowCheckpoint) -> str | None:
        """The step whose output ``exc`` says cannot be stored, if that output is new since the
        last save accepted (nothing downstream consumed it yet); else ``None``.

        ``_accepted`` is the checkpoint the last save accepted (at first, what
        the run starts from), and ``None`` once a save raised.
        """
        step = exc.step if isinstance(exc, UnencodableError) else None
        accepted = self._accepted
        if step is not None and accepted is not None and step in checkpoint.outputs and (
                step not in accepted.outputs):
            return step
        return None

    async def _save_without(self, exc: Exception, checkpoint: WorkflowCheckpoint) -> NoReturn:
        """Save ``checkpoint`` without the new outputs the store refuses, then raise ``exc``.

        The step whose output cannot be stored ends the run (``exc`` names
        it), but the outputs that finished beside it in the same turn are
        saved: a resume pays for that step only (docs/outputs.md). Its
        questions and answers are kept, so that it is not asked again.
        """
        fn, accepted = self.checkpoint_fn, self._accepted
        assert fn is not None and accepted is not None
        refused: Exception = exc
        cp = checkpoint
        left_out: list[str] = []
        while (step := self._refused_new(refused, cp)) is not None:
            try:
                kept = rewind(self.state.spec.declared_graph, cp, step)
            except ValueError:
                break  # (a step the declared graph does not know: nothing is saved)
            # (its attempt is not spent: the output was made, only not stored)
            cp = dataclasses.replace(kept, asked=cp.asked, redone=cp.redone)
            left_out.append(step)
            if not _adds_to(cp, accepted):
                break  # nothing else finished: the checkpoint last accepted stands as it is
            try:
                returned = fn(cp)
                if returned is not None and inspect.isawaitable(returned):
                    await returned
            except Exception as again:
                refused = again
                if self._refused_new(again, cp) is None:  # not one more output left out: told
                    exc.add_note(
                        f"ekit: saving the checkpoint without the output of "
                        f"{', '.join(map(repr, left_out))} failed too, so nothing was saved: "
                        f"{type(again).__name__}: {again}"
                    )
                continue
            self._accepted = self.last_checkpoint = cp
            exc.add_note(
                f"ekit: saved the checkpoint without the output of {', '.join(map(repr, left_out))}, "
                "which cannot be stored; every other output that finished is saved"
            )
            break
        self._save_failed(exc, checkpoint)
        raise exc

    def _save_failed(self, exc: Exception, checkpoint: WorkflowCheckpoint) -> None:
        self._accepted = None  # (no save is tried again: see _wind_down)
        exc.add_note(
            f"{SAVE_FAILED_NOTE} saving the checkpoint with {checkpoint.step_index} "
            "completed step(s); the checkpoint it last accepted stands"
        )

    # -- winding down -------------------------------------------------------

    async def _end(self, cause: BaseException) -> None:
        if self._closing:
            self._fold_in_closing(cause)
        else:
            await self._wind_down(cause)
        self._keep_step_errors(cause)

    def _fold_in_closing(self, cause: BaseException) -> None:
        """The wind-down of a run that Python is closing: the same, with no await.

        Reached only from :meth:`_turn`'s direct join, with one task: every
        output that finished is folded in and saved already, and that task
        adds none (it raised, or the run is closed by the garbage collector
        while it still runs, and is cancelled here), so there is no new
        checkpoint to save.
        """
        inputs: list[Input] = [*self._carried, *self._reports, Cancelled(type(cause).__name__)]
        for task, name in self._tasks.items():
            if not task.done():
                self._cancelled.add(task)
                task.cancel()
            inputs.append(Interrupted(name))
        self._carried, self._reports = [], []
        self._tasks.clear()
        self._finished.clear()
        self._began.clear()
        self.state = apply(self.state, inputs)

    async def _wind_down(self, cause: BaseException) -> None:
        """Cancel what is in flight, fold in what finished, save once more.

        Runs on cancellation, KeyboardInterrupt, or an error from a callback.
        Further cancellations while it runs are held back and re-raised after.
        """
        tasks = list(self._tasks)
        for task in tasks:
            self._cancelled.add(task)
            task.cancel()
        cancelled_again = False
        if tasks:
            _, cancelled_again = await _await_through_cancellation(asyncio.wait(tasks))
        inputs: list[Input] = [*self._carried, *self._reports, Cancelled(type(cause).__name__)]
        self._carried, self._reports = [], []
        for task in tasks:
            name = self._tasks.pop(task)
            try:
                inputs.append(self._outcome_of(task, name, self._began.pop(task, None)))
            except BaseException:
                inputs.append(Interrupted(name))
        self._finished.clear()
        state = self.state = apply(self.state, inputs)
        # Calling a checkpoint_fn that just raised would most likely raise again
        # and hide the first error; the previous checkpoint stands.
        saved = self._accepted is not None and self.checkpoint_fn is not None
        if saved:
            pending = self._save(state)
            if pending is not None:
                _, again = await _await_through_cancellation(pending)
                cancelled_again = cancelled_again or again
        # Saved first, so that a slow trace cannot delay it; reported in the usual order.
        await self._report(state, save=False, saved=saved)
        if cancelled_again and not isinstance(cause, asyncio.CancelledError):
            raise asyncio.CancelledError

    def _keep_step_errors(self, exc: BaseException) -> None:
        """Let the error that ended the run also show the steps that had failed.

        A failed run whose final save raises would otherwise surface only the
        save's error, and the step's own exception would be lost.
        """
        for name, error in self.state.errors:
            if error is exc:
                continue
            exc.add_note(f"ekit: the run had already failed: step {name!r} raised {error!r}")
            if exc.__context__ is None:
                exc.__context__ = error


def _loops_of(state: State, steps: tuple[Step, ...], index: Mapping[str, int]) -> dict[str, bool]:
    """Loop -> False for the loops whose iterations never run as their own task (see
    Runner._runs_as_own_task): those with an ``until``, asked in ``_attempt``, which tells
    ``Ended``; and a loop body's output step's. An iteration of any other loop may run as
    its own task, as a chain's step does: its ``Done`` is read off the task (``_outcome_of``),
    and it pays no wrapping coroutine (measured: 24k instructions an iteration). Decided
    once a run, so that a step that is no loop does not ask."""
    shapes = state.spec.declared_graph.shapes
    own: dict[str, bool] = {}
    for n, s in shapes.items():
        if s.repeat is None:
            continue
        if s.child is not None:
            own[n] = own[s.child] = False
        elif n in index and steps[index[n]].repeat is not None \
                and cast(Repeat, steps[index[n]].repeat).until is not None:
            own[n] = False
    return own


def _with_hits(checkpoint: WorkflowCheckpoint, hits: Mapping[str, CacheHit]) -> None:
    """Record ``hits`` in ``checkpoint``, just made by ``checkpoint_of`` and not yet handed out.

    The core makes checkpoints and knows nothing of caches: the runner adds the
    hits it saw (and those recorded before, see Workflow.runner) in O(1), the
    mapping shared until a new hit, so that a save without one stays a delta.
    """
    object.__setattr__(checkpoint, "cache_hits", hits)


def _adds_to(checkpoint: WorkflowCheckpoint, accepted: WorkflowCheckpoint) -> bool:
    """Whether ``checkpoint`` records progress beyond ``accepted``, an earlier one of its run:
    an output, a skip, a question or answer, a failure."""
    return (
        len(checkpoint.outputs) != len(accepted.outputs) or len(checkpoint.skipped) != len(accepted.skipped)
        or checkpoint.asked != accepted.asked or checkpoint.failures != accepted.failures
    )


def prepare_run_of(checkpoint_fn: Any) -> Callable[[WorkflowCheckpoint], Any] | None:
    """The ``prepare_run`` a run calls for ``checkpoint_fn`` (see :meth:`Runner._prepare`), or ``None``."""
    fn = checkpoint_fn
    while isinstance(fn, functools.partial) and getattr(fn, "prepare_run", None) is None:
        fn = fn.func  # partial(store.save, ...) saves through the store all the same
    prepare = getattr(fn, "prepare_run", None)
    if prepare is None and inspect.ismethod(fn):
        prepare = getattr(fn.__self__, "prepare_run", None)
    return cast(Callable[[WorkflowCheckpoint], Any] | None, prepare)


async def _within(name: str, limit: float, attempt: Awaitable[Any]) -> Any:
    """Await ``attempt`` within ``limit`` seconds; past it, a :class:`StepTimeoutError` naming
    ``name``, the attempt's step or item (``m[1]``): an item's record must say which item timed out."""
    scope = asyncio.timeout(limit)
    try:
        async with scope:
            return await attempt
    except TimeoutError as exc:
        if not scope.expired():
            raise  # the step's own TimeoutError, not our deadline
        raise StepTimeoutError(name, limit) from exc


def _iterated(name: str, repeat: Repeat, returned: object, duration: float, began: float) -> Input:
    """An iteration's success: ``Ended`` when it returned ``Done`` or its loop's ``until``
    holds for its output (which ends the loop), else ``Succeeded``; an ``until`` that
    raises fails the attempt."""
    ends = isinstance(returned, Done)  # (a subclass too: unwrapped, so it ends the loop)
    output, usage = split_result(returned.value if isinstance(returned, Done) else returned)
    if not ends and repeat.until is not None:
        try:
            held = repeat.until(output)
            if inspect.isawaitable(held):  # (truthy: taken as true, it would end the loop)
                if inspect.iscoroutine(held):
                    held.close()
                raise TypeError(f"Repeat.until of {name!r} returned an awaitable, not a bool")
            ends = bool(held)
        except Exception as exc:
            return _failure(name, exc, duration, began=began)
    return (Ended if ends else Succeeded)(name, output, usage, duration, began)



async def _stored(cached: CachedStep, head: str, reads: Reads, name: str, output: Any,
                  usage: TokenUsage) -> Any:
    """``output``, stored in the cache under ``head``; or the output another process stored
    under that key first, so that every run goes on with one value."""
    first = (cached.store(head, reads, name, output, usage) if cached.cache.local
             else await asyncio.to_thread(cached.store, head, reads, name, output, usage))
    return output if first is None else cached.output_of(first)

def _failure(name: str, error: Exception, duration: float | None = None, gate: Gate | None = None,
             began: float | None = None) -> Failed:
    """An attempt's failure, with the wait it asks for (:func:`~ekit_runtime.retry_after`).

    Read on the failure path only, and imported there: a run that never
    fails pays nothing for it, not even the module's import.
    """
    from ekit_runtime.retry_hints import retry_after

    return Failed(name, error, duration, retry_after(error), gate, began)


async def _give_back(release: Callable[[], Any], name: str) -> None:
    """Call an attempt's release once, awaiting what it returns through any cancellation."""
    cancelled = False
    try:
        returned = release()
        if inspect.isawaitable(returned):
            _, cancelled = await _await_through_cancellation(returned)
    except Exception as exc:
        warnings.warn(
            RuntimeWarning(
                f"ekit: the release of attempt {name!r} (what before_attempt returned) raised "
                f"{type(exc).__name__}: {exc}; the attempt's outcome stands"
            ),
            stacklevel=2,
        )
    if cancelled:
        raise asyncio.CancelledError


_RAISED: Any = object()
"""What ``_drain`` reads as the output of a task that raised or was cancelled: no plain value."""


async def _at_once(decided: Input) -> Input:
    """An attempt decided before it began: its step's call raised, or its condition."""
    return decided


def _decided(step: Step, name: str, context: Context) -> Input | None:
    """The step's condition, asked when the core's ``Start`` says: ``None`` if it holds,
    else ``name`` skipped (or failed, if the condition raised)."""
    when = cast(Callable[[Any], Any], step.when)
    try:
        holds = bool(when(context))
    except Exception as exc:
        exc.add_note(f"ekit: raised by the condition of step {name!r}")
        return _failure(name, exc)  # with the wait it asks for, as any attempt's failure
    return None if holds else Skipped(name, f"condition {condition_name(when)} was false")
