"""``ProgressPrinter`` counts a loop's iterations as they are grown, fresh and resumed.

A loop grows one iteration at a time. Before the core told each growth
(``StepExpanded(loop, 1)``) the printer's count ran past its total
(``[7/4]``); and a resumed loop's recorded iterations, which are not told
one by one as ``StepSkipped``, went uncounted: a resume that started "3
recorded" ended "(1 skipped)", where a loop-free resume that starts "2
recorded" ends "(2 skipped)".
"""

from __future__ import annotations

import io
import json
import re
from typing import Any

from ekit_runtime import Done, ProgressPrinter, Repeat, Step, Workflow, WorkflowCheckpoint


def _workflow() -> Workflow:
    def agent(ctx: Any) -> Any:
        return Done(1) if ctx["agent"].number == 4 else 0

    return Workflow([Step("a", lambda ctx: 0),
                     Step("agent", agent, ("a",), repeat=Repeat(9, keep_last=1)),
                     Step("z", lambda ctx: 5, ("agent",))])


def _counts(text: str) -> list[tuple[int, int]]:
    return [(int(n), int(total)) for n, total in re.findall(r"\[(\d+)/(\d+) ", text)]


def test_a_loops_progress_never_counts_past_its_total_and_its_end_skips_what_it_resumed() -> None:
    out = io.StringIO()
    saved: list[WorkflowCheckpoint] = []
    _workflow().run_sync(trace=ProgressPrinter(out), checkpoint_fn=saved.append)
    assert all(n <= total for n, total in _counts(out.getvalue())), out.getvalue()
    resumed = io.StringIO()
    _workflow().run_sync(trace=ProgressPrinter(resumed),
                         resume_from=json.loads(json.dumps(saved[2].to_dict())))
    assert all(n <= total for n, total in _counts(resumed.getvalue())), resumed.getvalue()
    # As a loop-free resume: what the start says was recorded, the end says was skipped.
    recorded = re.search(r"run started: \d+ steps, (\d+) recorded", resumed.getvalue())
    assert recorded is not None, resumed.getvalue()
    assert f"({recorded.group(1)} skipped)" in resumed.getvalue(), resumed.getvalue()
