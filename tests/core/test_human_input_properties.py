"""Property tests of the core's rules for steps that ask a person (ekit_core.human).

Random DAGs in which random steps ask one or two questions before they can
succeed; hypothesis chooses the order in which attempts end, and which
pending questions a person answers before each resume, in which order.
Every run checks:

1. a step with a pending question never starts (in the run that asked, or
   in any resume before its answer is recorded);
2. a run never settles ``"waiting"`` while something is ready or in flight,
   nor while a step that is not waiting has every dependency recorded;
3. a resume from a waiting checkpoint, with no answer recorded, settles
   ``"waiting"`` at once, starting nothing (never asked twice);
4. once every question is answered, the run completes with the outputs of
   a run in which nobody asked, and every answer stays recorded, in order;
5. checkpoints survive their dict form, questions and answers included.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import (
    Answer,
    Asked,
    GraphSpec,
    Question,
    State,
    Succeeded,
    WorkflowCheckpoint,
    advance,
    answer,
    checkpoint_of,
    initial_state,
    questions,
)
from ekit_core.transitions import dependencies_recorded
from tests.support.strategies import dags


def output_of(graph: GraphSpec, name: str, outputs: Any) -> str:
    return f"{name}({','.join(outputs[d] for d in sorted(graph.deps[name]))})"


def fresh_outputs(graph: GraphSpec) -> dict[str, str]:
    done: dict[str, str] = {}
    while len(done) < len(graph):
        for name in graph.names:
            if name not in done and all(d in done for d in graph.deps[name]):
                done[name] = output_of(graph, name, done)
    return done


def answered(cp: WorkflowCheckpoint | None, name: str) -> int:
    if cp is None:
        return 0
    return sum(1 for e in cp.asked.get(name, ()) if e.answer is not None)


def run_once(graph: GraphSpec, cp: WorkflowCheckpoint | None, asks: dict[str, int],
             data: st.DataObject, concurrency: int | None) -> State:
    """One run from ``cp`` to its end, attempts ending in an order hypothesis picks."""
    waiting_at_start = set(questions(cp)) if cp is not None else set()
    first = initial_state(graph, cp, max_concurrency=concurrency)
    assert not (first.settled and first.ready_count), "settled with steps ready"
    state, batch = advance(first)
    in_flight: list[str] = []
    while True:
        for start in batch.starts:
            # 1. never a step that waits for an answer (at the start, or asked since)
            assert start.name not in waiting_at_start
            assert start.name not in questions(checkpoint_of(state))
            assert dependencies_recorded(graph, state.outputs, start.name)
            in_flight.append(start.name)
        if state.settled:
            return state
        assert in_flight, "not settled, yet nothing in flight"
        name = in_flight.pop(data.draw(st.integers(0, len(in_flight) - 1)))
        given_answers = answered(cp, name)
        if given_answers < asks.get(name, 0):  # asks its next question, which has no answer
            ending: Any = Asked(name, Question("value", f"{name} #{given_answers + 1}"))
        else:
            ending = Succeeded(name, output_of(graph, name, state.outputs))
        state, batch = advance(state, [ending])
        assert not (state.settled and (state.ready_count or state.running_count))
        if isinstance(ending, Asked):
            assert name in questions(checkpoint_of(state))


def check_settled_waiting(graph: GraphSpec, state: State) -> None:
    """2. waiting only when nothing can run."""
    assert state.ready_count == 0 and state.running_count == 0
    pending = questions(checkpoint_of(state))
    assert pending
    for name in graph.names:
        if name in state.outputs or name in pending:
            continue
        assert not dependencies_recorded(graph, state.outputs, name), (
            f"{name} could run, yet the run settled waiting")


@settings(max_examples=150, deadline=None)
@given(graph=dags(max_steps=9), data=st.data())
def test_answered_runs_complete_as_if_nobody_asked(graph: GraphSpec, data: st.DataObject) -> None:
    askers = data.draw(st.lists(st.sampled_from(graph.names), unique=True, max_size=4))
    asks = {name: data.draw(st.integers(1, 2)) for name in askers}
    concurrency = data.draw(st.none() | st.integers(1, 3))
    cp: WorkflowCheckpoint | None = None
    for _ in range(2 * len(graph) + 2):
        state = run_once(graph, cp, asks, data, concurrency)
        cp = checkpoint_of(state)
        # 5. the dict form holds everything
        assert WorkflowCheckpoint.from_dict(cp.to_dict()) == cp
        if state.outcome == "finished":
            break
        assert state.outcome == "waiting"
        check_settled_waiting(graph, state)
        # 3. a resume without answers starts nothing and waits at once
        again = initial_state(graph, cp)
        assert again.outcome == "waiting" and again.ready_count == 0
        # A person answers some of the pending questions, in an order of their choosing.
        pending = sorted(questions(cp))
        chosen = data.draw(st.lists(st.sampled_from(pending), unique=True, min_size=1))
        for name in chosen:
            cp = answer(cp, name, Answer(f"answer to {name}", by="someone"))
    else:
        raise AssertionError("the run never finished")
    # 4. the outputs of a run in which nobody asked; every answer kept, in order
    assert state.outputs.as_dict() == fresh_outputs(graph)
    assert cp is not None
    for name, n in asks.items():
        exchanges = cp.asked[name]
        assert [e.question.prompt for e in exchanges] == [f"{name} #{k}" for k in range(1, n + 1)]
        assert all(e.answer == Answer(f"answer to {name}", by="someone") for e in exchanges)
    assert set(cp.asked) == set(asks)
