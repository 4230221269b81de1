"""A run of 2,000 items shows every item's output and usage, and its live update the same.

The content side of the scale promise (docs/dashboard.md, "How fast"): the
speed is measured by ``python -m benchmarks.ui`` (a run page of 2,000 steps
and one of 2,000 items, each under 300 ms); this test asserts what the page
holds, on a loaded machine, without a clock.
"""

from __future__ import annotations

import re
from typing import Any

from ekit_core import WorkflowCheckpoint
from ekit_runtime.queue import SqliteQueue
from ekit_runtime.ui import QueueSource
from tests.support.dashboard_http import fetch, serving

ITEMS = 2_000


def test_every_item_of_a_mapped_step_is_on_the_page(tmp_path: Any) -> None:
    keys = [f"k{i:04d}" for i in range(ITEMS)]
    outputs: dict[str, Any] = {"split": {k: i for i, k in enumerate(keys)}}
    outputs.update({f"work[{k}]": {"n": i, "text": "x" * (i % 300)} for i, k in enumerate(keys)})
    usage = {f"work[{k}]": {"input_tokens": i, "output_tokens": 1, "llm_calls": 1}
             for i, k in enumerate(keys)}
    q = SqliteQueue(str(tmp_path / "q.db"))
    q.submit("big", {}, run_id="big")
    lease = q.claim("w", {"big": None}, 60)
    assert lease is not None
    q.save(lease, WorkflowCheckpoint.from_dict({
        "format_version": 3, "step_index": len(outputs), "outputs": outputs,
        "cost": {"input_tokens": sum(range(ITEMS)), "output_tokens": ITEMS, "llm_calls": ITEMS},
        "context": {}, "step_usage": usage, "graph": {"split": [], "work": ["split"], "total": ["work"]},
        "shapes": {"work": {"map_over": "split"}}}), 60)
    with serving(QueueSource(q, "q")) as server:
        api = fetch(server, "/api/run/big").json()
        for html in (fetch(server, "/run/big").body, api["parts"]["run-outputs"]):
            table = re.search(r'<table id="outputs">.*?</table>', html, re.S)
            assert table is not None
            rows = re.findall(r'<tr data-step="work\[(k\d{4})\]">(.*?)</tr>', table.group(0), re.S)
            assert [k for k, _ in rows] == keys
            assert all(f"{i:,}/1/1" in row for i, (_, row) in enumerate(rows))
            assert sum("<details" in row for _, row in rows) == sum(
                1 for i in range(ITEMS) if len(f'{{"n": {i}, "text": "{"x" * (i % 300)}"}}') > 120)
    q.close()
