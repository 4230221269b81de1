"""A rewound source keeps, by early cutoff, only the chained items that see nothing but their piece.

What users rely on (concepts.md, "Early cutoff"; api.md, ``rewind``): rewinding
``s0`` lets go of everything downstream of it, ``s1``'s items (mapped over
``s0``) included; the early cutoff then keeps each item whose piece comes back
unchanged, and item by item the chain below it. An item of ``s2`` (mapped over
``s1``) that also needs ``s0`` itself reads ``s0`` whole, which ran again: a
piece of ``s1`` that came back unchanged does not say that ``s0`` did, so those
items run again and ask their questions again, while ``s1``'s items are kept.
"""

from __future__ import annotations

from typing import Any

import pytest

from ekit_core import (
    Answer,
    Asked,
    GraphSpec,
    Question,
    State,
    Succeeded,
    advance,
    answer,
    checkpoint_of,
    initial_state,
    questions,
    rewind,
)
from ekit_core.shapes import Shape


def _run(state: State, batch: Any, source: list[int], ran: list[str]) -> State:
    """``state`` driven until nothing is in flight; ``s2``'s items ask before they answer."""
    while batch.names:
        ran += batch.names
        results = [Asked(n, Question("value", f"{n}?"))
                   if n.startswith("s2[") and n not in state.setbacks.asked
                   else Succeeded(n, source if n == "s0" else f"{n} on {source}")
                   for n in batch.names]
        state, batch = advance(state, results)
    return state


def _finished(graph: GraphSpec, source: list[int]) -> State:
    """A run of ``graph`` to its end, every question answered and resumed."""
    state = _run(*advance(initial_state(graph)), source, [])
    checkpoint = checkpoint_of(state)
    for step in questions(checkpoint):
        checkpoint = answer(checkpoint, step, Answer("yes", by="ann"))
    state = _run(*advance(initial_state(graph, checkpoint)), source, [])
    assert state.outcome == "finished"
    return state


@pytest.mark.parametrize("reads_source_whole", [True, False])
@pytest.mark.parametrize("again", [[1, 2], [1, 2, 3]])
def test_rewinding_the_source_reruns_the_chained_items_that_read_it_whole(
        reads_source_whole: bool, again: list[int]) -> None:
    graph = GraphSpec.of(
        {"s0": (), "s1": ("s0",), "s2": ("s0", "s1") if reads_source_whole else ("s1",)},
        {"s1": Shape(map_over="s0"), "s2": Shape(map_over="s1")},
    )
    done = checkpoint_of(_finished(graph, [1, 2]))
    rewound = rewind(graph, done, "s0")
    assert rewound.outputs == {} and not rewound.asked  # everything was downstream of s0
    ran: list[str] = []
    state = _run(*advance(initial_state(graph, rewound)), again, ran)
    new = [f"s1[{k}]" for k in range(2, len(again))]  # (a piece that is new runs, and its chain)
    if reads_source_whole:  # s2's items see s0 whole: they run, and ask, again
        assert sorted(ran) == sorted(["s0", *new, *(f"s2[{k}]" for k in range(len(again)))])
        assert state.outcome == "waiting"
        assert sorted(questions(checkpoint_of(state))) == [f"s2[{k}]" for k in range(len(again))]
    else:  # only the new piece's chain runs
        assert sorted(ran) == sorted(["s0", *new, *(f"s2[{k}]" for k in range(2, len(again)))])
    assert all(state.outputs[f"s1[{k}]"] == done.outputs[f"s1[{k}]"] for k in range(2))
