"""``isolate_failures=True``: a failed step stops only what depends on it.

The default stays ExecutionKit's (the first failure stops new starts and is
raised). Isolated, every step that does not depend on a failed one runs to
completion, the result names the failed and the not-started steps, and a
resume runs exactly those.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import Failed, GraphSpec, Succeeded, advance, initial_state
from ekit_runtime import RetryPolicy, Step, Workflow, WorkflowCheckpoint
from tests.support.strategies import dags


class Bad(Exception):
    """A document the pipeline cannot handle."""


def downstream(graph: GraphSpec, roots: set[str]) -> set[str]:
    out: set[str] = set()
    frontier = list(roots)
    while frontier:
        for child in graph.dependents[frontier.pop()]:
            if child not in out:
                out.add(child)
                frontier.append(child)
    return out


@settings(max_examples=200)
@given(dags(min_steps=2, max_steps=12), st.data())
def test_everything_not_downstream_of_a_failure_completes(
    graph: GraphSpec, data: st.DataObject
) -> None:
    failing = data.draw(st.sets(st.sampled_from(graph.names), min_size=1), label="failing")
    state, _ = advance(initial_state(graph, isolate_failures=True))
    started: list[str] = []
    while not state.settled:
        running = state.running_steps()
        started.extend(n for n in running if n not in started)
        chosen = data.draw(st.lists(st.sampled_from(running), min_size=1, unique=True))
        state, _ = advance(state, [
            Failed(n, Bad(n)) if n in failing else Succeeded(n, n) for n in chosen
        ])
    failed = {name for name, _ in state.errors}
    blocked = downstream(graph, failed)
    assert failed == failing - blocked  # a failing step behind another never started
    assert set(state.outputs) == set(graph.names) - failed - blocked
    assert not set(started) & blocked
    assert state.outcome == "failed" and state.halt is None


def pipeline(bad: set[str], ran: list[str]) -> Workflow:
    def parse(doc: str) -> Any:
        def run(context: Any) -> str:
            ran.append(f"parse:{doc}")
            if doc in bad:
                raise Bad(doc)
            return f"parsed {doc}"
        return run

    def summarize(doc: str) -> Any:
        def run(context: Any) -> str:
            ran.append(f"summarize:{doc}")
            return context[f"parse:{doc}"].upper()
        return run

    steps = []
    docs = [f"d{i:02d}" for i in range(20)]
    for doc in docs:
        steps.append(Step(f"parse:{doc}", parse(doc), retry=RetryPolicy(2, backoff_base=0)))
        steps.append(Step(f"summarize:{doc}", summarize(doc), (f"parse:{doc}",)))
    steps.append(Step("report", lambda c: len(c), tuple(f"summarize:{d}" for d in docs)))
    return Workflow(steps)


def test_one_bad_document_does_not_stop_the_other_nineteen() -> None:
    ran: list[str] = []
    saved: list[WorkflowCheckpoint] = []
    result = pipeline({"d07"}, ran).run_sync(isolate_failures=True, checkpoint_fn=saved.append)
    assert not result.ok
    assert set(result.failed) == {"parse:d07"} and isinstance(result.failed["parse:d07"], Bad)
    assert result.not_started == ("summarize:d07", "report")
    assert len(result.outputs) == 38
    assert ran.count("parse:d07") == 2  # its retry policy still applied
    assert saved[-1].failures["parse:d07"].attempts == 2
    # Fixed, the resume runs only the failed step and what waited on it.
    again: list[str] = []
    resumed = pipeline(set(), again).run_sync(resume_from=saved[-1], isolate_failures=True)
    assert resumed.ok and again == ["parse:d07", "summarize:d07"]
    assert resumed.outputs["report"] == 40  # every output before it, in its context


def test_the_default_still_stops_at_the_first_failure() -> None:
    ran: list[str] = []
    with pytest.raises(Bad):
        pipeline({"d00"}, ran).run_sync(max_concurrency=1)
    assert not any(r.startswith("summarize") for r in ran)
