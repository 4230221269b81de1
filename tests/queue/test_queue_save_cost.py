"""A save costs O(that step), not O(the run): only what is new is checked and written; no bad name slips by.

The queue refuses a step name it cannot store before it writes anything.
It used to check every name of the checkpoint at every save, so the n-th
save of a run cost O(n) in checks alone (0.6 ms a save at 300 steps, more
than the commit). A save that extends the last one now checks only the
names it adds (stored names were checked when written); a full save checks
all. These tests pin both halves on both backends: the checks of a delta do
not grow with the run, and a bad name that first appears in a later save is
still refused, naming the step, with nothing of that save written.
"""

from __future__ import annotations

from typing import Any

import pytest

import ekit_runtime.queue.base as queue_base
from ekit_core import WorkflowCheckpoint
from ekit_runtime import Step, Workflow
from ekit_runtime.queue import RunQueue
from ekit_runtime.stores import UnencodableError
from tests.support.queue_backends import postgres_url, queue, queue_url

__all__ = ["postgres_url", "queue", "queue_url"]


def _checkpoints(flow: Workflow) -> list[WorkflowCheckpoint]:
    seen: list[WorkflowCheckpoint] = []
    flow.run_sync(checkpoint_fn=seen.append)
    return seen


def test_the_checks_of_a_save_do_not_grow_with_the_run(
    queue: RunQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = 60
    chain = Workflow([Step(f"s{i}", lambda ctx: "ok", (f"s{i - 1}",) if i else ()) for i in range(steps)])
    checkpoints = _checkpoints(chain)
    queue.submit("chain", run_id="r")
    lease = queue.claim("w", {"chain": None}, 60)
    assert lease is not None
    checked: list[Any] = []
    real = queue_base.check_step_name

    def counting(name: Any) -> str:
        checked.append(name)
        return real(name)

    monkeypatch.setattr(queue_base, "check_step_name", counting)
    queue.save(lease, checkpoints[0], 60)  # the first save writes (and checks) the run in full
    per_save = []
    for cp in checkpoints[1:]:
        checked.clear()
        queue.save(lease, cp, 60)
        per_save.append(len(checked))
    assert max(per_save) <= 2, per_save  # the new step's output (and its usage, if any)
    assert queue.checkpoint("r") == checkpoints[-1]
    queue.finish(lease, "finished")


def _without_graph(checkpoint: WorkflowCheckpoint, rename: dict[str, str]) -> WorkflowCheckpoint:
    """``checkpoint`` as a hand-made one may come: no graph, and outputs renamed."""
    data = checkpoint.to_dict()
    for key in ("graph_steps", "graph_needs"):
        data.pop(key, None)
    data["outputs"] = {rename.get(k, k): v for k, v in data["outputs"].items()}
    return WorkflowCheckpoint.from_dict(data)


def test_a_bad_name_is_refused_in_a_first_save_and_in_a_later_one(queue: RunQueue) -> None:
    bad = "é" * 1001  # a step may be named so, but no queue can store it
    first = _checkpoints(Workflow([Step("a", lambda ctx: 1), Step(bad, lambda ctx: 2, ("a",))]))[0]
    queue.submit("w", run_id="r")
    lease = queue.claim("w", {"w": None}, 60)
    assert lease is not None
    # The first save holds the graph, which names every step: refused at once.
    with pytest.raises(UnencodableError) as refused:
        queue.save(lease, first, 60)
    assert refused.value.step == bad
    assert queue.checkpoint("r") is None
    # A checkpoint without a graph names a step first in a later save (a delta): refused too.
    pair = _checkpoints(Workflow([Step("a", lambda ctx: 1), Step("b", lambda ctx: 2, ("a",))]))
    a, b = (_without_graph(cp, {}) for cp in pair)
    queue.save(lease, a, 60)
    with pytest.raises(UnencodableError) as refused:
        queue.save(lease, _without_graph(b, {"b": bad}), 60)
    assert refused.value.step == bad
    assert queue.checkpoint("r") == a  # nothing of the refused save was written
    # The lease is still held and the run still takes saves.
    assert queue.save(lease, b, 60) is False
    assert queue.checkpoint("r") == b
    queue.finish(lease, "finished")


def test_a_remembered_good_name_never_lets_a_bad_one_through(monkeypatch: pytest.MonkeyPatch) -> None:
    # The names a save found storable are remembered (so the usual save checks
    # none), within a bound; only plain strings are, as a str subclass may lie
    # about its equality and hash.
    monkeypatch.setattr(queue_base, "_STORABLE_NAMES", set())
    monkeypatch.setattr(queue_base, "_STORABLE_NAMES_MAX", 4)
    checked: list[Any] = []
    real = queue_base.check_step_name
    monkeypatch.setattr(queue_base, "check_step_name", lambda name: checked.append(name) or real(name))
    good = [f"step{i}" for i in range(10)]
    queue_base._check_names(good)
    assert checked == good and len(queue_base._STORABLE_NAMES) <= 4
    checked.clear()
    queue_base._check_names(good[-2:])  # remembered: not checked again
    assert checked == []

    class Liar(str):
        def __eq__(self, other: object) -> bool:
            return True

        def __hash__(self) -> int:
            return hash("step9")

    for bad in ("a\x00b", "é" * 1001, Liar("x\x00y")):
        with pytest.raises(UnencodableError) as refused:
            queue_base._check_names(["step9", bad])
        assert refused.value.step == bad
    assert all(type(n) is str and "\x00" not in n for n in queue_base._STORABLE_NAMES)
    # Long names (up to 1,800 bytes each) are checked every time rather than kept.
    queue_base._check_names(["x" * 101])
    assert "x" * 101 not in queue_base._STORABLE_NAMES
