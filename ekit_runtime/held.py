"""Which limit held an attempt: the run's ``max_concurrency``, timed by the runner.

A run that records times (``durations=True``, every queued run) records,
beside when each attempt began, the limits that held it back first and for
how long (the checkpoint's ``held``; see docs/checkpoint-format.md). Each
limit is timed where it holds:

- ``max_concurrency``: here. A step the core found ready while the run had
  ``max_concurrency`` attempts in flight waits from the end of that turn to
  its launch. Only a run with ``max_concurrency`` that records times is
  driven by :class:`HoldingRunner`; every other run keeps the plain
  :class:`~ekit_runtime.runner.Runner`, so the usual attempt, which nothing
  held, costs nothing more.
- ``retry_delay``: the runner, as the attempt's delay gate is waited out.
- the fleet's limits (``limit:<name>``, ``resource:<name>``): the queue's
  worker, in its ``before_attempt``, through :func:`ekit_runtime.attempt.note_hold`.

The attempts a limit held reach the core as
:class:`~ekit_core.results.HeldSucceeded`; a failed attempt's holds are not
recorded (its failure record keeps its times only).
"""

from __future__ import annotations

from typing import Any, cast

from ekit_core.results import (
    Asked,
    Denied,
    Ended,
    Failed,
    HeldSucceeded,
    Input,
    Interrupted,
    Start,
    Succeeded,
)
from ekit_core.state import RunLimits
from ekit_core.window import names_of
from ekit_runtime.runner import Runner

__all__ = ["MAX_CONCURRENCY", "HoldingRunner", "runner_class"]

MAX_CONCURRENCY = "max_concurrency"
"""The name a hold by the run's own ``max_concurrency`` is recorded under."""


def runner_class(limits: RunLimits) -> type[Runner]:
    """The runner a run with ``limits`` is driven by: :class:`HoldingRunner` for one that records
    times under a ``max_concurrency``, the plain :class:`~ekit_runtime.runner.Runner` otherwise."""
    return HoldingRunner if limits.durations and limits.max_concurrency else Runner


class HoldingRunner(Runner):
    """A :class:`~ekit_runtime.runner.Runner` that times how long ``max_concurrency`` held each attempt.

    After each turn in which the run has ``max_concurrency`` attempts in
    flight and steps ready, the steps that became ready in it are held from
    then; launching one ends its hold, and its success carries it. O(1) per
    step held (the ready steps are told apart by their bits, which C compares).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ready_seen = 0  # the ready steps' bits (absolute) at the last turn at the cap
        self._waiting_since: dict[str, float] = {}  # step -> when the cap began holding it
        self._launched_after: dict[str, float] = {}  # step -> the seconds the cap held its launch

    async def _begin(self) -> None:
        await super()._begin()
        self._note_held()

    async def _turn(self) -> Any:
        state = await super()._turn()
        self._note_held()
        return state

    async def _start_added(self) -> None:
        await super()._start_added()
        self._note_held()

    def _note_held(self) -> None:
        state = self.state
        cap = state.spec.limits.max_concurrency
        ready = state._ready
        if cap is None or not ready or state.running_count < cap:
            self._ready_seen = 0  # (nothing held: what is ready later is new)
            return
        ready <<= state._offset
        new = ready & ~self._ready_seen
        self._ready_seen = ready
        if new:
            now, since = self.clock(), self._waiting_since
            for name in names_of(state.spec.graph.names, 0, new):
                since.setdefault(name, now)

    def _launch(self, start: Start) -> None:
        since = self._waiting_since.pop(start.name, None)
        if since is not None:
            self._launched_after[start.name] = self.clock() - since
        super()._launch(start)

    def _drain(self) -> list[Input]:
        inputs = super()._drain()
        held = self._launched_after
        if held:
            for i, item in enumerate(inputs):
                kind = type(item)
                if kind is Succeeded or kind is HeldSucceeded:  # (a loop's Ended: not recorded)
                    seconds = held.pop(item.name, None)  # type: ignore[union-attr]
                    if seconds is not None:
                        done = cast(Succeeded, item)
                        holds = {MAX_CONCURRENCY: seconds}
                        if kind is HeldSucceeded:
                            holds.update(cast(HeldSucceeded, item).held)
                        inputs[i] = HeldSucceeded(done.name, done.output, done.usage, done.duration,
                                                  done.began, holds)
                elif kind in _ENDED_OTHERWISE:
                    held.pop(item.name, None)  # type: ignore[union-attr]  # (a retry is held anew)
        return inputs


# How an attempt ends without an output: its hold goes with it.
_ENDED_OTHERWISE = frozenset({Asked, Denied, Ended, Failed, Interrupted})
