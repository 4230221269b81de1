"""``audit`` of a checkpoint whose loop compacted old iterations reports no anomaly.

A compacted iteration is recorded, its output let go of on purpose
(``keep_last``, counted in ``compacted``): the first iteration kept needs it,
and audit reported ``missing_dependency`` for every clean checkpoint such a
run saves (``ekit audit`` printed it as an anomaly).
"""

from __future__ import annotations

import json
from typing import Any

from ekit_core import WorkflowCheckpoint, audit
from ekit_runtime import Done, Repeat, Step, Workflow


def test_every_checkpoint_of_a_compacting_loop_audits_clean() -> None:
    def agent(ctx: Any) -> Any:
        n = ctx["agent"].number
        return Done(n) if n == 6 else n

    workflow = Workflow([Step("a", lambda ctx: 0),
                         Step("agent", agent, ("a",), repeat=Repeat(9, keep_last=2)),
                         Step("z", lambda ctx: ctx["agent"], ("agent",))])
    saved: list[WorkflowCheckpoint] = []
    workflow.run_sync(checkpoint_fn=saved.append)
    assert saved[-1].compacted == {"agent": 4}
    for checkpoint in saved:
        report = audit(workflow, json.loads(json.dumps(checkpoint.to_dict())))
        assert not report.anomalies, (checkpoint.step_index, report.anomalies)
