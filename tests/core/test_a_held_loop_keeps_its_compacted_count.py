"""A loop a selective run holds (``only=`` names other steps) keeps its compacted count.

The held loop is never grown, and its ``compacted`` count was not carried:
the selective run's checkpoint kept the loop's last iterations without the
count, and the next resume refused the run's own checkpoint ("records
iteration 's2#2', yet not every iteration before it"). Found by
``test_step_selection``'s property test.
"""

from __future__ import annotations

import json

from ekit_core import GraphSpec, Shape, Succeeded, advance, checkpoint_of, initial_state


def test_a_selective_run_keeps_a_held_loops_compacted_count_and_its_checkpoint_resumes() -> None:
    graph = GraphSpec.of({"s0": [], "s2": [], "s3": ["s0", "s2"]},
                         {"s2": Shape(repeat=3, keep_last=1)})
    state, _batch = advance(initial_state(graph))
    for name in ("s2#1", "s2#2"):
        state, _batch = advance(state, [Succeeded(name, name)])
    partial = json.loads(json.dumps(checkpoint_of(state).to_dict()))
    assert partial["compacted"] == {"s2": 1}
    state, _batch = advance(initial_state(graph, partial, only=["s0"]))
    state, _batch = advance(state, [Succeeded("s0", 0)])
    assert state.outcome == "finished"
    selective = json.loads(json.dumps(checkpoint_of(state).to_dict()))
    assert selective["compacted"] == {"s2": 1}
    state, batch = advance(initial_state(graph, selective))
    assert batch.names == ("s2#3",)
