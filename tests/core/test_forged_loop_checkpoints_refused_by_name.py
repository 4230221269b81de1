"""A checkpoint whose loop records cannot come from a run is refused, naming the field.

``compacted`` counts the first iterations of a loop that keeps its last ones
(``keep_last``) whose outputs were let go of. A count for a step that is no
such loop, or one that disagrees with the iterations ``outputs`` still holds
(an output kept of an iteration it counts as compacted), is no run's: a
resume would let go of, or keep, what the count says and pay again or carry
a stale output. Refused as a ``CheckpointError`` naming ``compacted``, before
anything runs. A loop at its cap names its cap, whatever the checkpoint holds.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

from ekit_core import CheckpointError, LoopError, WorkflowCheckpoint
from ekit_runtime import Done, Repeat, Step, Workflow


def _workflow(calls: list[int], *, keep: int | None, cap: int = 9) -> Workflow:
    def agent(ctx: Any) -> Any:
        n = ctx["agent"].number
        calls.append(n)
        return Done(n) if n == 6 else n

    return Workflow([Step("a", lambda ctx: 0),
                     Step("agent", agent, ("a",), repeat=Repeat(cap, keep_last=keep)),
                     Step("z", lambda ctx: ctx["agent"], ("agent",))])


def _middle(keep: int | None) -> dict[str, Any]:
    """Saved once iteration 5 is recorded (``keep=2``: 4 and 5 kept, 1 to 3 compacted)."""
    saved: list[WorkflowCheckpoint] = []
    _workflow([], keep=keep).run_sync(checkpoint_fn=saved.append)
    data = next(cp for cp in saved if "agent#5" in cp.outputs).to_dict()
    return json.loads(json.dumps(data))


def _forged(keep: int | None, change: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
    data = copy.deepcopy(_middle(keep))
    change(data)
    return data


FORGERIES: dict[str, tuple[int | None, Callable[[dict[str, Any]], object]]] = {
    "a step that is no loop": (2, lambda d: d["compacted"].update(a=1)),
    "a step the graph does not have": (2, lambda d: d["compacted"].update(gone=1)),
    "a loop that keeps every iteration": (None, lambda d: d.update(compacted={"agent": 2})),
    "a kept iteration counted as compacted": (2, lambda d: d["compacted"].update(agent=4)),
    "an old iteration kept beside the count": (2, lambda d: d["outputs"].update({"agent#1": 1})),
}


@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_compacted_count_no_run_makes_is_refused_naming_the_field(forgery: str) -> None:
    keep, change = FORGERIES[forgery]
    calls: list[int] = []
    with pytest.raises(CheckpointError) as caught:
        _workflow(calls, keep=keep).run_sync(resume_from=_forged(keep, change))
    assert caught.value.field.startswith("compacted"), caught.value
    assert calls == []


def test_the_checkpoints_a_compacting_loop_saves_are_accepted() -> None:
    calls: list[int] = []
    result = _workflow(calls, keep=2).run_sync(resume_from=_middle(2))
    assert calls == [6] and result.outputs["z"] == 6


def test_a_loop_at_a_lowered_cap_names_its_cap() -> None:
    calls: list[int] = []
    lowered = _workflow(calls, keep=None, cap=3)
    with pytest.raises(LoopError, match=r"within repeat=3 iterations"):
        lowered.run_sync(resume_from=_middle(None), allow_graph_change=True)
    assert calls == []


def test_a_loop_that_stopped_compacting_by_a_graph_change_resumes_from_its_own_checkpoints() -> None:
    calls: list[int] = []
    saved: list[WorkflowCheckpoint] = []

    def save(checkpoint: WorkflowCheckpoint) -> None:
        saved.append(checkpoint)
        if "agent#6" in checkpoint.outputs:
            raise KeyboardInterrupt  # (a crash right after this save)

    with pytest.raises(KeyboardInterrupt):
        _workflow(calls, keep=None).run_sync(resume_from=_middle(2), allow_graph_change=True,
                                             checkpoint_fn=save)
    assert saved[-1].compacted == {"agent": 3}
    result = _workflow(calls, keep=None).run_sync(
        resume_from=json.loads(json.dumps(saved[-1].to_dict())))
    assert calls == [6] and result.outputs["z"] == 6
