"""A worker's ``max_runs`` is refused where it is given when no claim could take it.

``Worker(max_runs=20_000)`` was accepted, then the worker died at its first
claim with "limit must be a whole number from 1 to 10000" (``claim_many``'s
cap), naming neither ``max_runs`` nor the worker: a bad number must be
refused by name when given, before anything is claimed.
"""

from __future__ import annotations

from typing import Any

import pytest

from ekit_runtime import Step, Workflow
from ekit_runtime.queue import SqliteQueue, Worker


def _ok(context: Any) -> int:
    return 1


@pytest.mark.parametrize("bad", [0, -1, 10_001, 20_000, 10**400, True, 2.0, "4", None])
def test_a_max_runs_no_claim_takes_is_refused_naming_it(bad: Any, tmp_path: Any) -> None:
    queue = SqliteQueue(str(tmp_path / "q.db"))
    try:
        with pytest.raises(ValueError, match="max_runs"):
            Worker(queue, {"w": Workflow([Step("a", _ok)])}, max_runs=bad)
    finally:
        queue.close()


def test_the_largest_max_runs_a_claim_takes_is_taken(tmp_path: Any) -> None:
    queue = SqliteQueue(str(tmp_path / "q.db"))
    try:
        assert Worker(queue, {"w": Workflow([Step("a", _ok)])}, max_runs=10_000).max_runs == 10_000
    finally:
        queue.close()
