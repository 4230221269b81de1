"""``ekit graph`` draws a loop (``repeat=``) as a cycle: an edge to itself, its cap noted."""

from __future__ import annotations

from ekit_runtime import Repeat, Step, Workflow
from ekit_runtime.cli import dot, mermaid


def _agent() -> Workflow:
    return Workflow([
        Step("task", lambda ctx: "t"),
        Step("agent", lambda ctx: ctx["agent"].number, ("task",),
             repeat=Repeat(max_iterations=12, keep_last=3)),
        Step("report", lambda ctx: ctx["agent"], ("agent",)),
    ])


def test_mermaid_draws_a_loop_as_an_edge_to_itself() -> None:
    text = mermaid(_agent().graph)
    assert '    s1["agent (repeat up to 12, keep last 3)"]' in text.splitlines()
    assert "    s1 -->|next| s1" in text.splitlines()
    assert "    s0 -->|next| s0" not in text and "    s2 -->|next| s2" not in text


def test_dot_draws_a_loop_as_an_edge_to_itself() -> None:
    lines = dot(_agent().graph).splitlines()
    assert '    n1 -> n1 [label="next"];' in lines
    assert sum(1 for line in lines if 'label="next"' in line) == 1
