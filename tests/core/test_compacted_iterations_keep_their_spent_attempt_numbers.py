"""A loop's compacted iterations keep the attempt numbers they spent (``compacted_retries``).

"Every step whose work changed ... gets a new attempt number" (docs/concepts.md). An
iteration that failed attempts before it succeeded, then compacted (``keep_last``), lost
its failure record, which counted them; the checkpoint keeps the most failed attempts of
any compacted iteration of the loop instead. Whatever the run went through since (a
store's round trip, a rewind beside the loop, a resume that held the loop), a bump or a
rewind that runs those iterations again sends none of their work under a key it used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ekit_core import WorkflowCheckpoint, rewind
from ekit_runtime import (
    Done,
    JournalStore,
    Repeat,
    RetryPolicy,
    SqliteStore,
    Step,
    Workflow,
    attempt_key,
)

END = 4


class _Agent:
    """A loop whose iterations 1 and 2 fail their first attempt (2 failed twice: its most)."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.tries: dict[tuple[str, int], int] = {}

    def workflow(self, version: str) -> Workflow:
        def turn(ctx: dict[str, Any]) -> Any:
            number = ctx["agent"].number
            self.keys.append(str(attempt_key()))
            tried = self.tries[version, number] = self.tries.get((version, number), 0) + 1
            if tried <= {1: 1, 2: 2}.get(number, 0):
                raise ConnectionError("overloaded")
            return Done(version) if number == END else version

        return Workflow([
            Step("a", lambda ctx: "a"), Step("b", lambda ctx: "b"),
            Step("agent", turn, ("a",), version=version,
                 repeat=Repeat(9, keep_last=1), retry=RetryPolicy(max_attempts=3, backoff_base=0)),
            Step("c", lambda ctx: "c", ("agent", "b")),
        ])

    def first_run(self) -> WorkflowCheckpoint:
        cp = self.workflow("v0").run_sync(run_id="r", max_concurrency=1).checkpoint
        assert cp is not None
        assert dict(cp.compacted) == {"agent": END - 1}
        assert dict(cp.compacted_retries) == {"agent": 2}
        assert not any(name.startswith("agent#") and name in cp.failures for name in cp.failures)
        return cp


def _spent(keys: list[str]) -> set[str]:
    return {k for k in keys if k.startswith("r/agent#")}


def test_a_bump_after_a_stores_round_trip_sends_no_spent_key(tmp_path: Path) -> None:
    agent = _Agent()
    first = agent.first_run()
    spent = _spent(agent.keys)
    for store in (JournalStore(tmp_path / "cp.jsonl"), SqliteStore(tmp_path / "cp.db", run_id="r")):
        store.save(first)
        loaded = store.load()
        store.close()
        assert loaded == first
        agent.keys.clear()
        agent.workflow("v1").run_sync(resume_from=loaded, run_id="r", max_concurrency=1)
        assert not spent & set(agent.keys), sorted(spent & set(agent.keys))
        assert "r/agent#2/4" in agent.keys  # past its 3 attempts: the most any compacted one made


def test_a_rewind_beside_the_loop_keeps_the_count_for_a_later_bump() -> None:
    agent = _Agent()
    first = agent.first_run()
    spent = _spent(agent.keys)
    rewound = rewind(agent.workflow("v0"), first, "b")
    assert rewound.compacted_retries == first.compacted_retries
    again = agent.workflow("v0").run_sync(resume_from=rewound, run_id="r", max_concurrency=1,
                                          only=("b",)).checkpoint
    assert again is not None and again.compacted_retries == first.compacted_retries
    agent.keys.clear()
    agent.workflow("v1").run_sync(resume_from=again, run_id="r", max_concurrency=1)
    assert not spent & set(agent.keys), sorted(spent & set(agent.keys))


@pytest.mark.parametrize("target", ["agent", "a", f"agent#{END}"])
def test_a_rewind_that_runs_the_loop_again_sends_no_spent_key(target: str) -> None:
    agent = _Agent()
    first = agent.first_run()
    spent = _spent(agent.keys)
    rewound = rewind(agent.workflow("v0"), first, target)
    assert not rewound.compacted  # the loop starts again from its first iteration
    agent.keys.clear()
    agent.tries.clear()  # (its work fails as it did: the same attempts again, numbered past)
    agent.workflow("v0").run_sync(resume_from=rewound, run_id="r", max_concurrency=1)
    assert not spent & set(agent.keys), sorted(spent & set(agent.keys))
