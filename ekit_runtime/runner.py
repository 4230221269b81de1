"""The async loop that carries out what the core decides.

Each turn folds the completions that arrived into the state and learns what
to start next, in one core transition (``advance``, which is ``apply`` then
``plan``); it then starts those attempts as tasks and hands the new
checkpoint to ``checkpoint_fn``. It owns only what is impure: tasks, sleeping out retry
delays, timeouts, threads for blocking steps, calling callbacks, and
winding down on cancellation so that no task outlives the run and the
final checkpoint is saved even while the caller keeps cancelling.
"""

from __future__ import annotations

import asyncio
import inspect
import warnings
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Iterable, Mapping
from time import perf_counter
from types import CoroutineType
from typing import Any, TypeAlias, cast

from ekit_core import (
    Batch,
    Cancelled,
    CheckpointSaved,
    Denied,
    Event,
    Failed,
    Interrupted,
    Result,
    RunFinished,
    Start,
    State,
    Succeeded,
    WorkflowCheckpoint,
    advance,
    apply,
    checkpoint_of,
)
from ekit_runtime.approval import ApprovalFn, ask
from ekit_runtime.errors import TraceCallbackWarning
from ekit_runtime.step import Step, split_result

__all__ = ["CheckpointFn", "Runner", "TraceFn"]

CheckpointFn: TypeAlias = Callable[[WorkflowCheckpoint], Awaitable[Any] | Any]
TraceFn: TypeAlias = Callable[[Event], Awaitable[Any] | Any]


async def _settle(awaitable: Awaitable[Any]) -> tuple[Any, bool]:
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


def _split_finish(events: tuple[Event, ...]) -> tuple[tuple[Event, ...], tuple[Event, ...]]:
    # RunFinished is reported last, after the final CheckpointSaved, so that a
    # trace consumer may treat it as the end of the run.
    if events and isinstance(events[-1], RunFinished):
        return events[:-1], events[-1:]
    return events, ()


class Runner:
    """One run of a workflow: the loop, its tasks and its callbacks."""

    def __init__(
        self,
        steps: Mapping[str, Step],
        state: State,
        *,
        checkpoint_fn: CheckpointFn | None,
        approval: ApprovalFn | None,
        trace: TraceFn | None,
    ) -> None:
        self.steps = steps
        self.state = state
        # initial_state recorded RunStarted and the skips; advance() replaces
        # the events with its own, so keep these to hand to the trace first.
        self._initial_events = state.events
        self.checkpoint_fn = checkpoint_fn
        self.approval = approval
        self.trace = trace
        self.last_checkpoint: WorkflowCheckpoint | None = None
        graph = state.graph
        # Keys of a resumed ExecutionKit checkpoint that are not steps were its
        # initial context: steps keep seeing them, the run's context wins.
        self._base = {k: v for k, v in state.outputs.items() if k not in graph.index}
        self._base.update(state.context)
        # Every output so far as a plain dict: copied whole for context="all",
        # and a C-speed lookup for a step's dependencies otherwise.
        self._all = dict(self._base)
        self._all.update((k, v) for k, v in state.outputs.items() if k in graph.index)
        self._tasks: dict[asyncio.Task[Any], str] = {}
        self._finished: deque[asyncio.Task[Any]] = deque()
        self._wakeup: asyncio.Future[None] | None = None
        self._preparing: set[str] = set()
        # Steps whose attempts need no wrapper (async, no timeout, no thread):
        # their coroutine is the task. _began holds those tasks' start times.
        self._direct = {
            name
            for name, step in steps.items()
            if step.timeout is None and not step.blocking and inspect.iscoroutinefunction(step.run)
        }
        self._began: dict[asyncio.Task[Any], float] = {}
        self._save_raised = False
        # Events are built only for someone to read them: a trace, or iterate().
        self.record_events = trace is not None

    # -- the loop -----------------------------------------------------------

    async def run(self) -> State:
        """Drive the run to its end and return the settled state."""
        try:
            await self._begin()
            while not self.state.settled:
                await self._turn()
        except BaseException as exc:
            await self._wind_down(exc)
            raise
        return self.state

    async def states(self) -> AsyncGenerator[State, None]:
        """Drive the run, yielding each state that follows a group of completions.

        Closing the generator early winds the run down like a cancellation.
        """
        self.record_events = True
        try:
            await self._begin()
            while not self.state.settled:
                yield await self._turn()
        except BaseException as exc:
            await self._wind_down(exc)
            raise

    async def _begin(self) -> None:
        state, batch = advance(self.state)
        self.state = state
        if self.trace is not None:
            await self._emit(self._initial_events + state.events)
        self._launch_all(batch)

    async def _turn(self) -> State:
        """Wait for completions, fold them in, start what is next, save."""
        if not self._tasks:
            raise RuntimeError("ekit: nothing can start and nothing is running")
        if not self._finished and len(self._tasks) == 1:
            await self._join_only_task()
        while not self._finished:
            self._wakeup = asyncio.get_running_loop().create_future()
            await self._wakeup
        self._wakeup = None
        state, batch = advance(self.state, self._drain(), record_events=self.record_events)
        self.state = state
        if state.incidents.halt is not None:
            self._cancel_preparing()
        self._launch_all(batch)
        trace = self.trace
        if trace is None:
            saving = self._save(state)
            if saving is not None:
                await saving
            return state
        events, finish = _split_finish(state.events)
        await self._emit(events)
        saving = self._save(state)
        if saving is not None:
            await saving
        if self.checkpoint_fn is not None:
            await self._emit((CheckpointSaved(state.completed),))
        await self._emit(finish)
        return state

    async def _join_only_task(self) -> None:
        """Wait for the one task in flight by awaiting it directly.

        With a single task (every step of a chain) this saves a loop turn over
        the wake-up future: the task's own callbacks, ``_on_done`` first, run
        in the turn after it finishes. Its outcome is read later by
        ``_result_of``, so an error it raised is not ours to raise here.
        """
        (task,) = self._tasks
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not task.done() or (current is not None and current.cancelling()):
                raise  # we are being cancelled, not just the task
        except Exception:
            pass

    def _launch_all(self, batch: Batch) -> None:
        everything = self._all
        for start in batch.starts:
            step = self.steps[start.name]
            if step.context == "all":
                context = everything.copy()
            else:
                context = self._base.copy()
                for dep in step.depends_on:
                    context[dep] = everything[dep]
            body = None
            if step.name in self._direct and start.delay == 0 and (
                self.approval is None or start.attempt > 1
            ):
                # Nothing to do around the body: run its coroutine as the task
                # itself and read the outcome from the task (see _result_of).
                # A call that raises at once (bad arguments) goes the slow way,
                # where the error becomes the step's failure.
                try:
                    body = step.run(context)
                except Exception:
                    body = None
            if body is not None:
                task = asyncio.create_task(cast(Coroutine[Any, Any, Any], body))
                self._began[task] = perf_counter()
            else:
                task = asyncio.create_task(self._attempt(step, start, context))
            self._tasks[task] = step.name
            task.add_done_callback(self._on_done)

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        self._finished.append(task)
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    def _drain(self) -> list[Result]:
        """The results of every task that finished since the last call."""
        results: list[Result] = []
        everything, finished, tasks = self._all, self._finished, self._tasks
        while finished:
            task = finished.popleft()
            result = self._result_of(task, tasks.pop(task))
            if isinstance(result, Succeeded):
                everything[result.name] = result.output
            results.append(result)
        return results

    def _result_of(self, task: asyncio.Task[Any], name: str) -> Result:
        """How the finished ``task`` of step ``name`` ended, as a core result.

        A wrapped attempt returns its result itself; a direct one (the step's
        own coroutine) is read here. A ``BaseException`` that is not an
        ``Exception`` (KeyboardInterrupt, SystemExit) is raised, not recorded.
        """
        began = self._began.pop(task, None)
        if task.cancelled():
            return Interrupted(name)
        if began is None:
            result: Result = task.result()
            return result
        error = task.exception()
        duration = perf_counter() - began
        if error is None:
            output, usage = split_result(task.result())
            return Succeeded(name, output, usage, duration)
        if isinstance(error, Exception):
            return Failed(name, error, duration)
        raise error

    async def _attempt(self, step: Step, start: Start, context: dict[str, Any]) -> Result:
        name = step.name
        if start.delay > 0 or (self.approval is not None and start.attempt == 1):
            self._preparing.add(name)
            try:
                if start.delay > 0:
                    await asyncio.sleep(start.delay)
                if self.approval is not None and start.attempt == 1:
                    verdict = await ask(self.approval, name, step.metadata)
                    if not verdict.approved:
                        return Denied(name, verdict.reason)
            except Exception as exc:
                return Failed(name, exc)
            finally:
                self._preparing.discard(name)
        began = perf_counter()
        try:
            if step.timeout is not None:
                async with asyncio.timeout(step.timeout):
                    returned = await self._call(step, context)
            elif step.blocking:
                returned = await self._call(step, context)
            else:
                returned = step.run(context)
                if type(returned) is CoroutineType or inspect.isawaitable(returned):
                    returned = await returned
        except Exception as exc:
            return Failed(name, exc, perf_counter() - began)
        output, usage = split_result(returned)
        return Succeeded(name, output, usage, perf_counter() - began)

    @staticmethod
    async def _call(step: Step, context: dict[str, Any]) -> Any:
        if step.blocking:
            returned = await asyncio.to_thread(step.run, context)
        else:
            returned = step.run(context)
        if inspect.isawaitable(returned):
            returned = await returned
        return returned

    def _cancel_preparing(self) -> None:
        # A halted run starts nothing new: attempts still sleeping out a retry
        # delay or waiting for approval have not begun their work, so stop them.
        for task, name in self._tasks.items():
            if name in self._preparing:
                task.cancel()

    # -- callbacks ----------------------------------------------------------

    async def _emit(self, events: Iterable[Event]) -> None:
        if self.trace is None:
            return
        for event in events:
            try:
                returned = self.trace(event)
                if inspect.isawaitable(returned):
                    await returned
            except Exception as exc:
                warnings.warn(
                    TraceCallbackWarning(
                        f"trace callback raised {type(exc).__name__}: {exc} "
                        f"(event {type(event).__name__} dropped; the run goes on)"
                    ),
                    stacklevel=2,
                )

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
        except Exception:
            self._save_raised = True
            raise
        if returned is not None and inspect.isawaitable(returned):
            return self._finish_save(returned)
        return None

    async def _finish_save(self, pending: Awaitable[Any]) -> None:
        try:
            await pending
        except Exception:
            self._save_raised = True
            raise

    # -- winding down -------------------------------------------------------

    async def _wind_down(self, cause: BaseException) -> None:
        """Cancel what is in flight, fold in what finished, save once more.

        Runs on cancellation, KeyboardInterrupt, or an error from a callback.
        Further cancellations while it runs are held back and re-raised after.
        """
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        cancelled_again = False
        if tasks:
            _, cancelled_again = await _settle(asyncio.wait(tasks))
        results: list[Result] = [Cancelled(type(cause).__name__)]
        for task in tasks:
            name = self._tasks.pop(task)
            try:
                results.append(self._result_of(task, name))
            except BaseException:
                results.append(Interrupted(name))
        self._finished.clear()
        state = self.state = apply(self.state, results)
        # Calling a checkpoint_fn that just raised would most likely raise again
        # and hide the first error; the previous checkpoint stands.
        saved = False
        if not self._save_raised:
            saved = self.checkpoint_fn is not None
            pending = self._save(state)
            if pending is not None:
                _, again = await _settle(pending)
                cancelled_again = cancelled_again or again
        if self.trace is not None:
            # Saved first so a slow trace cannot delay it, but reported in the
            # same order as any other transition.
            events, finish = _split_finish(state.events)
            await self._emit(events)
            if saved:
                await self._emit((CheckpointSaved(state.completed),))
            await self._emit(finish)
        if cancelled_again and not isinstance(cause, asyncio.CancelledError):
            raise asyncio.CancelledError
