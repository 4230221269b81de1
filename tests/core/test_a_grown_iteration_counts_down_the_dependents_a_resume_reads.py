"""An iteration grown one at a time has the dependents a resume reads for it: none.

``_grow_next`` leaves a one-step loop's new iteration out of the run's dependents (nothing
depends on it but the next iteration, grown once it is recorded), and ``_after_recorded``
reads a missing entry as none. After every fold, each step still to run reads the same
dependents (a missing entry as none) in the live state as in the state resumed from its
checkpoint through JSON, and the run ends as an uninterrupted one does: the steps after the
loop ready once it ends, with its last iteration's output.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import Ended, GraphSpec, Shape, State, Succeeded, advance, checkpoint_of, initial_state


def _graph(cap: int, keep: int | None, inputs: bool) -> GraphSpec:
    steps = {"a": [], "agent": ["a"] if inputs else [], "z": ["agent"], "y": ["a", "z"]}
    return GraphSpec.of(steps, {"agent": Shape(repeat=cap, keep_last=keep)})


def _pending(state: State) -> dict[str, tuple[str, ...]]:
    dependents = state.spec.dependents
    return {n: tuple(dependents.get(n, ())) for n in state.spec.graph.names if n not in state.outputs}


@settings(max_examples=60, deadline=None)
@given(cap=st.integers(1, 10), ends_at=st.integers(1, 12), keep=st.sampled_from([None, 2]),
       inputs=st.booleans())
def test_each_fold_reads_the_dependents_its_resume_reads(cap: int, ends_at: int, keep: int | None,
                                                         inputs: bool) -> None:
    graph = _graph(cap, keep, inputs)
    state, _ = advance(initial_state(graph))
    while not state.settled:
        name = state.running_steps()[0]
        k = int(name.rpartition("#")[2]) if "#" in name else 0
        state, _ = advance(state, [Ended(name, k) if k == ends_at else Succeeded(name, k)])
        resumed = initial_state(graph, json.loads(json.dumps(checkpoint_of(state).to_dict())))
        assert _pending(state) == _pending(resumed)
    if ends_at <= cap:
        assert state.outcome == "finished"
        assert (state.outputs["agent"], state.outputs["z"], state.outputs["y"]) == (ends_at, 0, 0)
    else:
        assert state.outcome == "failed" and "z" not in state.outputs
