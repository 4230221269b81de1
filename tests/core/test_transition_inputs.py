"""The inputs a transition folds: the fast constructors build the ordinary values, and the rare inputs
(denials, interruptions, refused reports and starts) leave the state and events the rules say.
"""

from __future__ import annotations

from typing import Any

import pytest

from ekit_core import (
    Began,
    Cancelled,
    Denied,
    Failed,
    GraphSpec,
    Interrupted,
    RetryPolicy,
    State,
    StepDenied,
    StepFailed,
    StepInterrupted,
    StepRetried,
    Succeeded,
    TokenUsage,
    TransitionError,
    apply,
    initial_state,
    plan,
)
from ekit_core.results import Start, first_start, succeeded
from ekit_core.state import Halt
from ekit_core.transitions import context_outputs

# -- fast constructors ------------------------------------------------------------------


def test_the_fast_constructors_build_the_ordinary_values() -> None:
    usage = TokenUsage(3, 2, 1)
    fast = succeeded("s", {"x": 1}, usage, 0.25)
    assert fast == Succeeded("s", {"x": 1}, usage, 0.25)
    assert (fast.name, fast.output, fast.usage, fast.duration) == ("s", {"x": 1}, usage, 0.25)
    assert type(fast) is Succeeded and hash(first_start("s")) == hash(Start("s"))
    start = first_start("s")
    assert start == Start("s", 1, 0.0, False) and not start.gated
    with pytest.raises(AttributeError):
        fast.name = "other"  # type: ignore[misc]


# -- the rare transitions: denials, interruptions, refusals, their events ------------------


def _three_ready(**options: Any) -> State:
    """a, b, c independent; a and b started (max_concurrency=2), c ready."""
    graph = GraphSpec.of({"a": [], "b": [], "c": []})
    state = initial_state(graph, max_concurrency=2, **options)
    return apply(state, plan(state).starts)


def test_a_denied_or_interrupted_step_is_ready_again_beside_the_others() -> None:
    gated = _three_ready(approval=True)
    assert sorted(gated.running_steps()) == ["a", "b"] and list(gated.ready_steps()) == ["c"]
    denied = apply(gated, [Denied("a", "no budget left")])
    assert sorted(denied.ready_steps()) == ["a", "c"] and list(denied.running_steps()) == ["b"]
    assert denied.halt == Halt("denied", "a", "no budget left")
    assert denied.events[-1] == StepDenied("a", "no budget left")
    interrupted = apply(_three_ready(), [Interrupted("b")])
    assert sorted(interrupted.ready_steps()) == ["b", "c"]
    assert list(interrupted.running_steps()) == ["a"]
    assert interrupted.events[-1] == StepInterrupted("b")
    cancelled = apply(_three_ready(), [Cancelled("user pressed Ctrl-C")])
    assert cancelled.halt == Halt("cancelled", reason="user pressed Ctrl-C")


@pytest.mark.parametrize(
    ("report", "message"),
    [
        (Failed("c", ValueError("x")), "Failed for step 'c', which is ready: no row of the phase "
                                       "table takes Failed there (only when running or gated)"),
        (Denied("c", "no"), "Denied for step 'c', which is ready: no row of the phase table "
                            "takes Denied there (only when gated)"),
        (Interrupted("c"), "Interrupted for step 'c', which is ready: no row of the phase table "
                           "takes Interrupted there (only when running or gated)"),
        (Succeeded("c", 1), "Succeeded for step 'c', which is ready: no row of the phase table "
                            "takes Succeeded there (only when running or gated)"),
        (Began("a"), "Began for step 'a', which is running: no row of the phase table takes "
                     "Began there (only when gated)"),
        (Failed("zz", ValueError("x")), "unknown step 'zz'"),
    ],
)
def test_a_report_that_does_not_fit_the_state_says_which_and_why(report: Any, message: str) -> None:
    state = _three_ready()
    with pytest.raises(TransitionError) as info:
        apply(state, [report])
    assert str(info.value) == message


def test_a_start_beyond_the_limit_or_after_a_halt_is_refused() -> None:
    state = _three_ready()
    with pytest.raises(TransitionError, match=r"^cannot start step 'c': max_concurrency=2 in flight$"):
        apply(state, [Start("c")])
    halted = apply(state, [Cancelled()])
    with pytest.raises(TransitionError, match=r"^cannot start step 'c': the run is halted \(cancelled\)$"):
        apply(halted, [Start("c")])
    freed = apply(state, [Succeeded("a", 1)])
    assert "c" in apply(freed, [Start("c")]).running_steps()


def test_retry_and_failure_events_carry_the_attempt_the_error_and_the_timing() -> None:
    graph = GraphSpec.of({"a": []})
    policy = RetryPolicy(max_attempts=2, backoff_base=0.25)
    state = initial_state(graph, policies={"a": policy})
    state = apply(state, plan(state).starts)
    retried = apply(state, [Failed("a", KeyError("k"), 0.5)])
    assert retried.events[-1] == StepRetried("a", 1, "KeyError", "'k'", 0.25, 0.5)
    again = apply(retried, plan(retried).starts)
    again = apply(again, [Began("a")])
    failed = apply(again, [Failed("a", KeyError("k2"), 0.75)])
    assert failed.events[0] == StepFailed("a", 2, "KeyError", "'k2'", 0.75)
    assert failed.halt == Halt("failed", "a", "KeyError: 'k2'")


def test_a_subclass_of_an_input_folds_like_its_base() -> None:
    class Refused(Failed):
        pass

    state = _three_ready()
    folded = apply(state, [Refused("a", ValueError("x"))])
    assert folded.halt is not None and folded.halt.kind == "failed"


def test_context_outputs_are_the_recorded_outputs_that_are_not_steps() -> None:
    graph = GraphSpec.of({"a": []})
    assert context_outputs(graph, {"a": 1, "topic": "tides"}) == {"topic": "tides"}
