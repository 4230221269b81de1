"""The timeline shows an attempt held back by a fleet limit before it began (a ``held`` bar).

The promise (docs/dashboard.md, "Attempts over time"): for a run that records
its drives (every queued run), a recorded attempt that began well after it
could (its dependencies recorded, its drive begun) has a ``held`` bar from
then to when it began; a run with two steps that share a resource capped at
one slot across the fleet shows the second one held for as long as the first
ran. An attempt that began as soon as it could has none.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from ekit_runtime import Step, Workflow
from ekit_runtime.queue import Limits, SqliteQueue, Worker
from ekit_runtime.ui import QueueSource
from ekit_runtime.ui.pages import run_page
from ekit_runtime.ui.timeline_svg import HELD_MIN
from tests.dashboard.test_timeline_bars_match_the_recorded_attempts import bars_of

SECONDS = 0.4


async def _call(ctx: Any) -> str:
    await asyncio.sleep(SECONDS)  # (a provider's call, holding the one slot)
    return "answer"


def test_a_step_waiting_for_a_resource_slot_is_drawn_held(tmp_path: Path) -> None:
    queue = SqliteQueue(str(tmp_path / "q.db"), limits=Limits(resources={"api": 1}))
    flows = {"pair": Workflow([Step("left", _call, resource="api"), Step("right", _call, resource="api")])}
    run_id = queue.submit("pair", {})
    asyncio.run(Worker(queue, flows, poll=0.01).run_until_idle())
    assert queue.status(run_id).status == "finished"
    view = QueueSource(queue, "q").view(run_id)
    assert view is not None and view.checkpoint is not None
    cp = view.checkpoint
    page = run_page("q", view, None)
    start = page.index('<svg xmlns="http://www.w3.org/2000/svg" id="timeline-chart"')
    found = bars_of(page[start:page.index("</svg>", start) + len("</svg>")])
    first, second = sorted(cp.began, key=lambda name: cp.began[name])
    # The second began once the first gave its slot back, SECONDS later: held all that while.
    assert cp.began[second] - cp.began[first] >= SECONDS * 0.9
    (held,) = [b for b in found if b["data-outcome"] == "held"]
    assert held["data-name"] == second and held["group"] == second
    assert float(held["data-ended"]) == cp.began[second]
    assert float(held["data-ended"]) - float(held["data-began"]) >= SECONDS * 0.9 > HELD_MIN
    assert "a limit (the fleet&#x27;s usage limits or a resource&#x27;s slots" in page
    queue.close()
