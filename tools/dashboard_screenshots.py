"""Screenshots of the dashboard for the docs: ``python -m tools.dashboard_screenshots``.

Builds the browser tests' queue (a run in every status, tests/support/ui_flows.py),
adds a small fleet of ``report`` runs (each reports its usage; a typed
outline, a step mapped over its sections, a title a person gives), spreads
the fleet's submission times over the last six hours (a demo's SQLite file:
its ``created_at`` column, so that the chart has a shape), serves it with
``ekit ui --allow-actions``, and saves, in headless Chromium at 1280 wide:

- ``docs/dashboard-runs.png``: the runs page (the runs waiting for you
  first, with their forms; the chart of the fleet; the table);
- ``docs/dashboard-run.png``: the page of a finished ``report`` run (its
  graph, steps, usage, outputs and the answer a person gave; served with
  ``--workflows`` naming :data:`CHANGED`, whose ``outline`` is at version 2,
  so the page lists it as changed since recorded);
- ``docs/dashboard-timeline.png``: that page's timeline (each attempt on a
  time axis: the wait for the title's answer, the mapped step's items, each
  held by the fleet's one slot of the ``llm`` resource while the one before
  it wrote, a labelled ``held`` bar, and the two workers that drove the run:
  ``worker-a`` until it parked, waiting for the title, and ``worker-b``,
  which resumed it once answered).

Needs Chromium and chromedriver (Debian: ``apt-get install chromium
chromium-driver``) and selenium (``pip install -e '.[test]'``). Not run in CI;
rerun it when the pages change, and commit the PNGs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sqlite3
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class Outline:
    """A typed output: shown on the run page as its tagged plain data."""

    title: str
    sections: list[str]


def _report(outline_version: str | None = None) -> Any:
    from ekit_runtime import Codec, PatternResult, Step, TokenUsage, Workflow, ask

    async def outline(ctx: Any) -> PatternResult[Outline]:
        topic = ctx.get("topic", "tides")
        return PatternResult(Outline(f"On {topic}", ["causes", "tables", "safety"]),
                             cost=TokenUsage(1_400, 320, 1))

    async def sections(ctx: Any) -> dict[str, str]:
        return {name: name for name in ctx["outline"].sections}

    async def write(ctx: Any) -> PatternResult[str]:
        await asyncio.sleep(0.4)  # (a provider's call: the next item waits for the llm slot)
        name = ctx["sections"]
        text = (f"The {name} of the tides, in plain words. " * 12).strip()
        return PatternResult(text, cost=TokenUsage(900 + 150 * len(name), 700, 1))

    async def title(ctx: Any) -> PatternResult[str]:
        given = ask("Title for the report?", details={"draft": ctx["outline"].title})
        return PatternResult(str(given), cost=TokenUsage(200, 20, 1))

    codec = Codec()
    codec.register(Outline, name="reports:Outline")
    return Workflow([
        Step("outline", outline, version=outline_version), Step("sections", sections, ("outline",)),
        Step("write", write, ("sections",), map_over="sections", resource="llm"),
        Step("title", title, ("write", "outline")),
    ], codec=codec)


def __getattr__(name: str) -> Any:
    """``CHANGED``: the report workflow as the dashboard's ``--workflows`` knows it now (built on
    first use: importing this module runs no workflow code)."""
    if name == "CHANGED":
        return {"report": _report(outline_version="2")}
    raise AttributeError(name)


def _spread(db: Path, hours: float = 6.0) -> None:
    """Spread the demo runs' submission times over the last ``hours`` (a demo file only)."""
    with sqlite3.connect(db) as conn:
        ids = [r[0] for r in conn.execute("SELECT run_id FROM ekit_queue_runs ORDER BY seq")]
        now = time.time()
        for i, run_id in enumerate(ids):
            at = now - hours * 3600 * (1 - i / max(1, len(ids))) ** 1.5
            conn.execute("UPDATE ekit_queue_runs SET created_at = ? WHERE run_id = ?", (at, run_id))


def main(argv: list[str] | None = None) -> int:
    """Write the two screenshots into ``--out`` (default docs/)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from ekit_runtime.queue import Limits, SqliteQueue, Worker
    from tests.support import ui_flows
    from tests.support.browser import UiServer, chrome, wait_until

    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "runs.db"
        queue = SqliteQueue(str(db), limits=Limits(resources={"llm": 1}))
        report = {"report": _report()}
        # The run shown first, alone, answered as soon as it parks: its timeline spans its own
        # work (the other runs' would stretch its wait for the answer over all of theirs).
        queue.submit("report", {"topic": "tides"}, run_id="report-tides")
        asyncio.run(Worker(queue, report, poll=0.05, name="worker-a").run_until_idle())
        queue.answer("report-tides", "title", "The tides, explained", by="ann")
        asyncio.run(Worker(queue, report, poll=0.05, name="worker-b").run_until_idle())
        for i, topic in enumerate(("storms", "reefs", "currents", "dunes", "glaciers")):
            queue.submit("report", {"topic": topic}, run_id=f"report-{topic}")
            if not i % 2:
                asyncio.run(Worker(queue, report, poll=0.05, name="worker-a").run_until_idle())
        asyncio.run(Worker(queue, report, poll=0.05, name="worker-a").run_until_idle())
        for topic in ("reefs", "dunes"):
            queue.answer(f"report-{topic}", "title", f"The {topic}, explained", by="ann")
        asyncio.run(Worker(queue, report, poll=0.05, name="worker-b").run_until_idle())
        ui_flows.populate(queue)
        queue.close()
        _spread(db)
        queue = SqliteQueue(str(db))
        shown = "report-tides"
        server_args = ["--queue", "runs.db", "--allow-actions", "--port", "0",  # shown as the source
                       "--workflows", "tools.dashboard_screenshots:CHANGED"]
        with UiServer(server_args, cwd=Path(tmp)) as server, chrome(1280, 1500) as driver:
            driver.get(server.url + "/")
            wait_until(driver, lambda d: d.find_elements("css selector", "#runs tr[data-run-id]"), 20)
            runs_png = args.out / "dashboard-runs.png"
            driver.save_screenshot(str(runs_png))
            driver.get(f"{server.url}/run/{urllib.parse.quote(shown, safe='')}")
            wait_until(driver, lambda d: d.find_elements("css selector", "#outputs"), 20)
            driver.execute_script("document.querySelector('#outputs details').open = true;")
            run_png = args.out / "dashboard-run.png"
            driver.save_screenshot(str(run_png))
            timeline_png = args.out / "dashboard-timeline.png"
            driver.find_element("css selector", "#attempts").screenshot(str(timeline_png))
        queue.close()
    print(f"wrote {runs_png}, {run_png} and {timeline_png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
