"""The run page's step table shows a mapped step's usage, summed from its items (it showed "-")."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

from ekit_runtime import PatternResult, Step, TokenUsage, Workflow
from ekit_runtime.queue import SqliteQueue, Worker
from ekit_runtime.ui import QueueSource
from ekit_runtime.ui.pages import steps_tbody


def _item(ctx: Any) -> PatternResult[int]:
    n = int(ctx["split"])
    return PatternResult(n, cost=TokenUsage(10 * n, n, 1))


MAPPED = Workflow([
    Step("split", lambda ctx: [1, 2, 3, 4]),
    Step("work", _item, ("split",), map_over="split"),
    Step("total", lambda ctx: PatternResult(sum(ctx["work"]), cost=TokenUsage(5, 5, 1)), ("work",)),
])


def test_a_mapped_steps_row_shows_its_items_usage_summed(tmp_path: Path) -> None:
    queue = SqliteQueue(str(tmp_path / "runs.db"))
    queue.submit("mapped", {}, run_id="m-1")
    asyncio.run(Worker(queue, {"mapped": MAPPED}, poll=0.01).run_until_idle())
    view = QueueSource(queue, "q").view("m-1")
    assert view is not None
    rows = {m.group(1): m.group(2) for m in re.finditer(
        r'<tr data-step="([^"]+)">.*?<td class="num usage">(.*?)</td>', steps_tbody(view))}
    # 10+20+30+40 input, 1+2+3+4 output, 4 calls, from the 4 items.
    assert rows["work"].startswith("100/10/4") and "(4 items)" in rows["work"], rows
    assert rows["total"] == "5/5/1"
    queue.close()
