"""A queued run whose step runs a child workflow, on SQLite and PostgreSQL.

What users rely on: a worker runs the child's steps as the run's steps; a
question asked inside the child parks the run (no lease held), is answered
by the child step's name (``research/pick``) and resumed by a worker; the
child's typed outputs (its codec, adopted by the parent) are stored by the
queue, tagged, and read back as their type by a resume (``summary`` reads
``.choice``); rewinding an item of the child's map through the queue runs it
and what follows again, and rewinding the parent step runs its whole child again.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from ekit_runtime import Child, Codec, Step, Workflow, ask
from ekit_runtime.queue import RunQueue, Worker
from tests.support.queue_backends import live_leases, queue, queue_url

__all__ = ["queue", "queue_url"]


@dataclass(frozen=True)
class Pick:
    choice: str


def _workflow(calls: list[str]) -> Workflow:
    def fetch(ctx: Any) -> list[str]:
        calls.append("fetch")
        return [f"{ctx['topic']} 1", f"{ctx['topic']} 2"]

    def pick(ctx: Any) -> Pick:
        calls.append("pick")
        return Pick(str(ask("which one?", details={"of": ctx["read"]})))

    child = Workflow([
        Step("fetch", fetch),
        Step("read", lambda ctx: calls.append("read") or ctx["fetch"].upper(), ("fetch",),
             map_over="fetch"),
        Step("pick", pick, ("read",)),
        Step("summary", lambda ctx: f"{ctx['pick'].choice} of {len(ctx['read'])}", ("pick",)),
    ], codec=Codec(Pick))
    return Workflow([
        Step("topic", lambda ctx: "cats"),
        Step("research", depends_on=("topic",), child=Child(child, output="summary")),
        Step("report", lambda ctx: calls.append("report") or ctx["research"].upper(), ("research",)),
    ])


def test_a_queued_run_parks_on_a_question_in_its_child_and_a_rewind_runs_the_child_again(
        queue: RunQueue, queue_url: str) -> None:
    calls: list[str] = []
    workflows = {"child": _workflow(calls)}
    run = queue.submit("child", run_id="with-child")
    assert asyncio.run(Worker(queue, workflows, poll=0.01).run_until_idle()) == 1
    assert queue.status(run).status == "waiting", queue.status(run).error
    assert list(queue.questions(run)) == ["research/pick"]
    assert live_leases(queue_url) == 0
    queue.answer(run, "research/pick", "second")
    assert asyncio.run(Worker(queue, workflows, poll=0.01).run_until_idle()) == 1
    assert queue.status(run).status == "finished", queue.status(run).error
    result = queue.result(run)
    assert result is not None
    assert result.outputs["report"] == "SECOND OF 2"
    stored = result.checkpoint.outputs["research/pick"] if result.checkpoint is not None else None
    assert stored == {"$ekit": "type", "type": f"{__name__}:Pick", "value": {"choice": "second"}}
    assert calls == ["fetch", "read", "read", "pick", "pick", "report"]
    calls.clear()
    rewound = queue.rewind(run, "research/read[1]")
    assert "research/read[0]" in rewound.outputs and "research/pick" not in rewound.outputs
    assert asyncio.run(Worker(queue, workflows, poll=0.01).run_until_idle()) == 1
    # the rewound item runs again, and the question is asked again of a person
    assert calls == ["read", "pick"]
    assert queue.status(run).status == "waiting"
    calls.clear()
    queue.rewind(run, "research")
    assert asyncio.run(Worker(queue, workflows, poll=0.01).run_until_idle()) == 1
    assert calls == ["fetch", "read", "read", "pick"]
    assert list(queue.questions(run)) == ["research/pick"]
