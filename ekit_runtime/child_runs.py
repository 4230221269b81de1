"""A step's child workflow as a queued run of its own: what the step runs, and what it reads.

A step declared ``Child(wf, queued=True)`` runs :func:`run_queued_child`
(:mod:`ekit_runtime.nesting` puts it in the step's place). In a queued run (a
worker sets :data:`SPAWNER` for the run it drives) the child is a run of its
own, submitted under an id derived from the parent's, and the step waits for
it as a step waits for a person: its wait is a question whose details name the
child (:data:`CHILD_RUN`), so the parent parks holding no worker, and the claim
that resumes it once the child ended records an answer. Without a queue the
step runs the child inline, as one run. See decision 022.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any, NamedTuple, Protocol

from ekit_core.human import Question
from ekit_core.usage import TokenUsage
from ekit_runtime import human
from ekit_runtime.attempt import attempt_key
from ekit_runtime.loops import Iteration
from ekit_runtime.step import PatternResult

__all__ = [
    "CHILD_RUN",
    "SPAWNER",
    "ChildRunFailed",
    "ChildState",
    "QueuedChild",
    "Spawner",
    "child_run_of",
    "run_queued_child",
]


CHILD_RUN = "ekit_child_run"
"""The key of a waiting question's ``details`` naming the child run a step waits for (the
question no person answers: the claim that resumes the parent records the child's end)."""


class QueuedChild(NamedTuple):
    """What a step declared ``Child(wf, queued=True)`` runs: the child ``workflow`` and the
    name of its step whose output the parent's step hands on."""

    workflow: Any
    output: str


class ChildState(NamedTuple):
    """A child run as its parent's step reads it: its status, error, output step's output
    (``None`` until it finished) and the usage it reported."""

    status: str
    error: str | None
    output: Any
    cost: TokenUsage


class ChildRunFailed(Exception):
    """The child run a step waited for ended ``failed`` or ``cancelled``: the step fails with it
    (the parent's ``isolate_failures`` decides what else stops)."""

    def __init__(self, run_id: str, status: str, error: str | None) -> None:
        super().__init__(f"child run {run_id!r} {status}" + (f": {error}" if error else ""))
        self.run_id, self.status, self.error = run_id, status, error

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.run_id, self.status, self.error))


class Spawner(Protocol):
    """What a queue worker gives the steps of the run it drives (:data:`SPAWNER`)."""

    def child_run_id(self, step: str, number: int) -> str:
        """The id of the child run of the driven run's ``step`` at its attempt ``number``."""

    async def state(self, run_id: str, output: str) -> ChildState | None:
        """The child run ``run_id`` (``output``: its step to hand on), ``None`` if not submitted."""

    async def spawn(self, run_id: str, step: str, workflow: Any, context: Mapping[str, Any]) -> None:
        """Submit ``workflow`` as the child run ``run_id`` of ``step`` (nothing if it exists)."""


SPAWNER: ContextVar[Spawner | None] = ContextVar("ekit_spawner", default=None)
"""Set by a queue worker for the run it drives; unset (``None``) in a plain ``workflow.run``."""

_FINAL = frozenset({"finished", "failed", "cancelled"})


def child_run_of(details: object) -> str | None:
    """The child run a waiting question's ``details`` names, or ``None``: a person's question."""
    if isinstance(details, Mapping):
        found = details.get(CHILD_RUN)
        return found if isinstance(found, str) else None
    return None


async def run_queued_child(child: QueuedChild, context: Mapping[str, Any]) -> Any:
    """The work of a step whose child runs as a queued run of its own (see the module docstring).

    In a queued run: a child that ended hands on its output (and its usage, rolled up
    into the step's) or fails the step (:class:`ChildRunFailed`); one not yet ended is
    submitted if it was not (idempotent: its id is the parent's and the step's, an
    item's ``step[key]`` or an iteration's ``step#k``, each a child of its own) and the
    step waits, as a step waiting for a person does, until the child's end queues the
    parent again. Each wait is a question of its own, numbered after those recorded.
    """
    spawner = SPAWNER.get()
    context = _plain(context)
    if spawner is None:
        result = await child.workflow.run(context)
        if not result.ok:
            raise ChildRunFailed("(inline)", "failed", "; ".join(
                f"{n!r}: {type(e).__name__}: {e}" for n, e in result.failed.items()))
        return PatternResult(result.outputs[child.output], cost=result.cost)
    key = attempt_key()
    step = key.step
    asking = human.ANSWERS.get(None)
    # The child this step's work waits for: the one its last join answer names (a retry's next
    # attempt resumes that child, which the retry queued again), else its attempt's own.
    run_id = _joined_child(asking) or spawner.child_run_id(step, key.attempt)
    state = await spawner.state(run_id, child.output)
    if state is not None and state.status in _FINAL:
        if state.status == "finished":
            return PatternResult(state.output, cost=state.cost)
        raise ChildRunFailed(run_id, state.status, state.error)
    if state is None:
        await spawner.spawn(run_id, step, child.workflow, context)
    number = 1 if asking is None else len(asking.answers) + 1
    question = Question("value", f"waiting for child run {run_id!r}", {CHILD_RUN: run_id})
    raise human.InputRequired(question, number)


def _joined_child(asking: Any) -> str | None:
    """The child run the last answer of ``asking`` (the attempt's recorded answers) names, if the
    claim that resumed the run recorded it for a child's end; ``None`` for none, or a person's."""
    if asking is None or not asking.answers:
        return None
    last = asking.answers[-1]
    value = last.value
    if last.by == "ekit" and isinstance(value, Mapping) and isinstance(value.get("child_run"), str):
        return str(value["child_run"])
    return None


def _plain(context: Mapping[str, Any]) -> dict[str, Any]:
    """The child's input: the step's context, a loop's :class:`~ekit_runtime.Iteration` as
    ``{"number": k, "previous": output}`` (what a run's JSON context keeps of it, by name; the
    same inline, so the child reads it alike in both places)."""
    return {k: {"number": v.number, "previous": v.previous} if isinstance(v, Iteration) else v
            for k, v in context.items()}
