"""The core, not the shell, says what an attempt does before its work, and in which order."""

from __future__ import annotations

from ekit_core import Began, Failed, GraphSpec, RetryPolicy, Start, advance, initial_state
from ekit_core.results import APPROVAL, CONDITION, DELAY
from ekit_core.shapes import Shape


def test_gates_run_delay_then_condition_then_approval_and_a_plain_start_has_none() -> None:
    assert Start("a").gates == ()
    assert Start("a", 2, 1.5, approval=True, condition=True).gates == (DELAY, CONDITION, APPROVAL)
    assert Start("a", 1, 0.0, approval=True, condition=True).gates == (CONDITION, APPROVAL)
    assert Start("a", 2, 1.5).gates == (DELAY,)


def test_a_retry_after_its_condition_and_approval_answered_only_waits_its_delay() -> None:
    graph = GraphSpec.of({"a": []}, {"a": Shape(when="cond")})
    policy = RetryPolicy(max_attempts=3, backoff_base=2.0)
    state, batch = advance(initial_state(graph, policies={"a": policy}, approval=True))
    assert batch.starts[0].gates == (CONDITION, APPROVAL)  # a first attempt asks both
    state, _ = advance(state, [Began("a")])  # both answered yes: its work began
    state, batch = advance(state, [Failed("a", RuntimeError("boom"))])
    assert batch.starts[0].gates == (DELAY,)  # the retry only waits its backoff
