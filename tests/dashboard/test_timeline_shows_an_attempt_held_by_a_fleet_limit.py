"""The timeline names the fleet limit that held an attempt before it began (a ``held`` bar).

The promise (docs/dashboard.md, "Attempts over time"): a queued run records
which limit held each attempt and for how long (the checkpoint's ``held``);
the timeline draws one ``held`` bar per limit, named (``data-limit``, its
title, its label), ending when the attempt began. A run with two steps that
share a resource capped at one slot across the fleet shows the second one
held by ``resource:api`` for as long as the first ran. A checkpoint written
before limits were recorded (``drives`` but no ``held``) still shows the
wait, as a bar that names no limit and says none was recorded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import xml.etree.ElementTree as ET
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ekit_core import WorkflowCheckpoint
from ekit_runtime import Step, Workflow
from ekit_runtime.queue import Limits, SqliteQueue, Worker
from ekit_runtime.ui import QueueSource
from ekit_runtime.ui.pages import run_page
from ekit_runtime.ui.sources import RunView
from ekit_runtime.ui.timeline_svg import HELD_MIN

SECONDS = 0.4
SVG = "{http://www.w3.org/2000/svg}"


async def _call(ctx: Any) -> str:
    await asyncio.sleep(SECONDS)  # (a provider's call, holding the one slot)
    return "answer"


def held_bars(page: str) -> list[dict[str, str]]:
    """Each held bar of the page's timeline: its attributes, its title and its label (if drawn)."""
    start = page.index('<svg xmlns="http://www.w3.org/2000/svg" id="timeline-chart"')
    root = ET.fromstring(page[start:page.index("</svg>", start) + len("</svg>")])
    labels = {(t.get("data-name"), t.get("data-limit")): t.text or ""
              for t in root.iter(f"{SVG}text") if t.get("class") == "held-label"}
    found = []
    for rect in root.iter(f"{SVG}rect"):
        if rect.get("data-outcome") == "held":
            title = rect.find(f"{SVG}title")
            found.append({**rect.attrib, "title": "" if title is None else title.text or "",
                          "label": labels.get((rect.get("data-name"), rect.get("data-limit")), "")})
    return found


def _run(tmp_path: Path) -> tuple[SqliteQueue, RunView]:
    queue = SqliteQueue(str(tmp_path / "q.db"), limits=Limits(resources={"api": 1}))
    flows = {"pair": Workflow([Step("left", _call, resource="api"), Step("right", _call, resource="api")])}
    run_id = queue.submit("pair", {})
    asyncio.run(Worker(queue, flows, poll=0.01).run_until_idle())
    assert queue.status(run_id).status == "finished"
    view = QueueSource(queue, "q").view(run_id)
    assert view is not None and view.checkpoint is not None
    return queue, view


def test_a_step_waiting_for_a_resource_slot_is_drawn_held_by_that_resource(tmp_path: Path) -> None:
    queue, view = _run(tmp_path)
    cp = view.checkpoint
    assert cp is not None
    first, second = sorted(cp.began, key=lambda name: cp.began[name])
    # The second began once the first gave its slot back, SECONDS later: held all that while.
    assert cp.began[second] - cp.began[first] >= SECONDS * 0.9
    assert first not in cp.held and list(cp.held[second]) == ["resource:api"]
    seconds = cp.held[second]["resource:api"]
    assert SECONDS * 0.9 <= seconds <= cp.began[second] - cp.began[first] + 0.05
    page = run_page("q", view, None)
    named = [b for b in held_bars(page) if b.get("data-limit")]
    assert [(b["data-name"], b["data-limit"]) for b in named] == [(second, "resource:api")]
    (bar,) = named
    assert float(bar["data-ended"]) == cp.began[second]
    assert abs(float(bar["data-ended"]) - float(bar["data-began"]) - seconds) < 1e-6
    assert f"held {seconds:,.3f} s by resource:api" in bar["title"] and bar["label"] == "resource:api"
    # The step table says it too, under the step's duration.
    row = page[page.index(f'<tr data-step="{second}"'):]
    note = f'data-limits="resource:api">held {seconds:,.3f} s by resource:api</small>'
    assert note in row[:row.index("</tr>")]
    queue.close()


def test_a_checkpoint_without_held_draws_the_wait_naming_no_limit(tmp_path: Path) -> None:
    queue, view = _run(tmp_path)
    cp = view.checkpoint
    assert cp is not None
    older = WorkflowCheckpoint.from_dict({k: v for k, v in cp.to_dict().items() if k != "held"})
    assert older.drives and not older.held
    page = run_page("q", dataclasses.replace(view, checkpoint=older), None)
    (bar,) = held_bars(page)
    second = max(older.began, key=lambda name: older.began[name])
    assert bar["data-name"] == second and "data-limit" not in bar and bar["label"] == ""
    assert float(bar["data-ended"]) == older.began[second]
    assert float(bar["data-ended"]) - float(bar["data-began"]) >= SECONDS * 0.9 > HELD_MIN
    assert "no limit was recorded holding it" in bar["title"]
    assert MappingProxyType(cp.held) != older.held
    queue.close()


async def _items(ctx: Any) -> list[str]:
    return ["x", "y", "z"]


def test_a_mapped_steps_row_counts_its_items_a_limit_held(tmp_path: Path) -> None:
    queue = SqliteQueue(str(tmp_path / "q.db"), limits=Limits(resources={"api": 1}))
    flows = {"fan": Workflow([Step("items", _items),
                              Step("call", _call, ("items",), map_over="items", resource="api")])}
    run_id = queue.submit("fan", {})
    asyncio.run(Worker(queue, flows, poll=0.01).run_until_idle())
    view = QueueSource(queue, "q").view(run_id)
    assert view is not None and view.checkpoint is not None
    held = view.checkpoint.held
    # Two of the three items waited for the one slot, each for the items before it.
    assert len(held) == 2 and all(name.startswith("call[") for name in held)
    longest = max(held, key=lambda name: held[name]["resource:api"])
    page = run_page("q", view, None)
    row = page[page.index('<tr data-step="call"'):]
    row = row[:row.index("</tr>")]
    seconds = held[longest]["resource:api"]
    assert (f'data-limits="resource:api">2 items held; longest {longest}: '
            f"held {seconds:,.3f} s by resource:api</small>") in row
    queue.close()
