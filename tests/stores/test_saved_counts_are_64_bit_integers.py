"""A checkpoint's counts (steps done, tokens, calls) are stored as 64-bit integers, or refused.

Every SQL store and both queues check the four counts before they write:
one beyond 64 bits, or one that is not an integer at all (a float or a
string a hand-made ``TokenUsage`` may hold), is an ``UnencodableError``
naming the field, and nothing of that save is written. The check runs on
every save, so it is one test for the four on the usual path; these pin
that it still names the culprit.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from ekit_core import TokenUsage, WorkflowCheckpoint
from ekit_runtime import SqliteStore, Step, Workflow
from ekit_runtime.queue import RunQueue
from ekit_runtime.stores import UnencodableError
from tests.support.queue_backends import postgres_url, queue, queue_url

__all__ = ["postgres_url", "queue", "queue_url"]

BAD = [
    ("cost.input_tokens", {"cost": TokenUsage(2**63, 0, 0)}, "64-bit"),
    ("cost.output_tokens", {"cost": TokenUsage(0, -(2**63) - 1, 0)}, "64-bit"),
    ("cost.llm_calls", {"cost": TokenUsage(0, 0, 1.5)}, "not an integer"),  # type: ignore[arg-type]
    ("cost.input_tokens", {"cost": TokenUsage("7", 0, 0)}, "not an integer"),  # type: ignore[arg-type]
    ("step_index", {"step_index": 2**64}, "64-bit"),
]


def _checkpoints() -> list[WorkflowCheckpoint]:
    seen: list[WorkflowCheckpoint] = []
    Workflow([Step("a", lambda ctx: 1), Step("b", lambda ctx: 2, ("a",))]).run_sync(checkpoint_fn=seen.append)
    return seen


@pytest.mark.parametrize(("field", "change", "why"), BAD, ids=[f"{b[0]}-{b[2]}" for b in BAD])
def test_a_queue_refuses_a_count_it_cannot_store_and_writes_nothing(
    queue: RunQueue, field: str, change: dict[str, Any], why: str
) -> None:
    first, second = _checkpoints()
    queue.submit("w", run_id="r")
    lease = queue.claim("w", {"w": None}, 60)
    assert lease is not None
    queue.save(lease, first, 60)
    with pytest.raises(UnencodableError, match=f"cannot store {field} = .*{why}; nothing was saved"):
        queue.save(lease, dataclasses.replace(second, **change), 60)
    assert queue.checkpoint("r") == first
    assert queue.save(lease, second, 60) is False  # the lease still holds, and the run takes saves
    assert queue.checkpoint("r") == second


@pytest.mark.parametrize(("field", "change", "why"), BAD, ids=[f"{b[0]}-{b[2]}" for b in BAD])
def test_a_store_refuses_a_count_it_cannot_store_and_writes_nothing(
    tmp_path: Path, field: str, change: dict[str, Any], why: str
) -> None:
    first, second = _checkpoints()
    with SqliteStore(tmp_path / "cp.db", run_id="r") as store:
        store.save(first)
        with pytest.raises(UnencodableError, match=f"cannot store {field} = .*{why}; nothing was saved"):
            store.save(dataclasses.replace(second, **change))
        assert store.load() == first
