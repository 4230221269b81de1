"""``Workflow``: ExecutionKit's workflow API over the ekit core.

``Workflow(steps)`` validates the graph once; ``await workflow.run(...)``
builds the first state (checking every argument before any step runs),
drives it with a :class:`~ekit_runtime.runner.Runner`, and turns the
settled state into a result or the documented exception.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ekit_core import (
    GraphSpec,
    State,
    TokenUsage,
    WorkflowCheckpoint,
    checkpoint_of,
    initial_state,
)
from ekit_core.usage import NO_USAGE
from ekit_runtime.approval import ApprovalFn
from ekit_runtime.errors import ApprovalDenied, BudgetExceeded
from ekit_runtime.runner import CheckpointFn, Runner, TraceFn
from ekit_runtime.step import Step

__all__ = ["Workflow", "WorkflowResult"]


@dataclass(frozen=True, slots=True)
class WorkflowResult:
    """What a finished run produced: every step's ``outputs`` and the total ``cost``.

    ``checkpoint`` is the final checkpoint of the run (resuming it runs nothing).
    """

    outputs: MappingProxyType[str, Any]
    cost: TokenUsage = NO_USAGE
    checkpoint: WorkflowCheckpoint | None = None


def _callable_or_none(value: object, name: str) -> None:
    if value is not None and not callable(value):
        raise ValueError(f"{name} must be callable or None, got {type(value).__name__}")


class Workflow:
    """A DAG of :class:`Step` objects that runs eagerly and resumes from checkpoints."""

    def __init__(self, steps: Sequence[Step]) -> None:
        steps = tuple(steps)
        for i, step in enumerate(steps):
            if not isinstance(step, Step):
                raise ValueError(f"steps[{i}] must be a Step, got {type(step).__name__}")
        self.steps: tuple[Step, ...] = steps
        self.graph: GraphSpec = GraphSpec.of((s.name, s.depends_on) for s in steps)
        self._by_name: dict[str, Step] = {s.name: s for s in steps}

    def start_state(
        self,
        initial_context: Mapping[str, Any] | None = None,
        *,
        resume_from: WorkflowCheckpoint | Mapping[str, Any] | None = None,
        max_concurrency: int | None = None,
        budget: TokenUsage | None = None,
        allow_graph_change: bool = False,
    ) -> State:
        """The core state a run with these arguments starts from (validates them all)."""
        return initial_state(
            self.graph,
            resume_from,
            context=initial_context,
            max_concurrency=max_concurrency,
            budget=budget,
            policies={s.name: s.retry for s in self.steps if s.retry is not None},
            allow_graph_change=allow_graph_change,
        )

    def runner(
        self,
        initial_context: Mapping[str, Any] | None = None,
        *,
        checkpoint_fn: CheckpointFn | None = None,
        resume_from: WorkflowCheckpoint | Mapping[str, Any] | None = None,
        max_concurrency: int | None = None,
        budget: TokenUsage | None = None,
        approval: ApprovalFn | None = None,
        trace: TraceFn | None = None,
        allow_graph_change: bool = False,
    ) -> Runner:
        """A :class:`Runner` for one run; arguments as for :meth:`run`."""
        _callable_or_none(checkpoint_fn, "checkpoint_fn")
        _callable_or_none(approval, "approval")
        _callable_or_none(trace, "trace")
        state = self.start_state(
            initial_context,
            resume_from=resume_from,
            max_concurrency=max_concurrency,
            budget=budget,
            allow_graph_change=allow_graph_change,
        )
        return Runner(
            self._by_name, state, checkpoint_fn=checkpoint_fn, approval=approval, trace=trace
        )

    async def run(
        self,
        initial_context: Mapping[str, Any] | None = None,
        *,
        checkpoint_fn: CheckpointFn | None = None,
        resume_from: WorkflowCheckpoint | Mapping[str, Any] | None = None,
        max_concurrency: int | None = None,
        budget: TokenUsage | None = None,
        approval: ApprovalFn | None = None,
        trace: TraceFn | None = None,
        allow_graph_change: bool = False,
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
        - ``resume_from``: a checkpoint (or its dict); exactly the steps whose
          output it records are skipped.
        - ``max_concurrency``: at most this many steps in flight.
        - ``budget``: stop starting steps once usage reaches any non-zero field;
          raises :class:`BudgetExceeded`.
        - ``approval``: ``approval(name, metadata)`` before each step's first
          attempt; a denial raises :class:`ApprovalDenied`.
        - ``trace``: receives every :mod:`ekit_core.events` event.
        - ``allow_graph_change``: resume a checkpoint recorded from another graph.

        A step that fails (after its retries) stops new starts; steps in flight
        finish, a final checkpoint is saved, and its own exception is raised
        with a note naming the step (an ``ExceptionGroup`` if several failed).
        Cancellation saves a final checkpoint and re-raises.
        """
        runner = self.runner(
            initial_context,
            checkpoint_fn=checkpoint_fn,
            resume_from=resume_from,
            max_concurrency=max_concurrency,
            budget=budget,
            approval=approval,
            trace=trace,
            allow_graph_change=allow_graph_change,
        )
        await runner.run()
        return outcome(runner.state, runner.last_checkpoint)

    async def iterate(
        self,
        initial_context: Mapping[str, Any] | None = None,
        *,
        checkpoint_fn: CheckpointFn | None = None,
        resume_from: WorkflowCheckpoint | Mapping[str, Any] | None = None,
        max_concurrency: int | None = None,
        budget: TokenUsage | None = None,
        approval: ApprovalFn | None = None,
        trace: TraceFn | None = None,
        allow_graph_change: bool = False,
    ) -> AsyncGenerator[State, None]:
        """Run like :meth:`run`, yielding the core :class:`~ekit_core.State` after
        each group of completions (its checkpoint already handed to ``checkpoint_fn``).

        Leaving the loop early (``break``, an exception, cancellation) cancels
        the steps in flight and saves a final checkpoint, like cancelling
        :meth:`run`; use ``contextlib.aclosing`` so this happens at once rather
        than when the generator is collected. When the run ends short (failure,
        budget, denial) the iteration raises what :meth:`run` would.
        """
        runner = self.runner(
            initial_context,
            checkpoint_fn=checkpoint_fn,
            resume_from=resume_from,
            max_concurrency=max_concurrency,
            budget=budget,
            approval=approval,
            trace=trace,
            allow_graph_change=allow_graph_change,
        )
        states = runner.states()
        try:
            async for state in states:
                yield state
        finally:
            await states.aclose()
        outcome(runner.state, runner.last_checkpoint)

    def run_sync(
        self,
        initial_context: Mapping[str, Any] | None = None,
        **options: Any,
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
        return asyncio.run(self.run(initial_context, **options))


def outcome(state: State, last: WorkflowCheckpoint | None = None) -> WorkflowResult:
    """Turn a settled state into a :class:`WorkflowResult` or raise what ended it."""
    checkpoint = last if last is not None else checkpoint_of(state)
    kind = state.outcome
    if kind == "finished":
        return WorkflowResult(MappingProxyType(state.outputs), state.cost, checkpoint)
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
    if kind == "budget_exceeded":
        assert state.limits.budget is not None
        raise BudgetExceeded(checkpoint, state.limits.budget)
    if kind == "denied":
        assert state.halt is not None and state.halt.step is not None
        raise ApprovalDenied(state.halt.step, state.halt.reason, checkpoint)
    raise RuntimeError(f"ekit: run ended as {kind!r}")
