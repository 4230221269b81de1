"""The run page's timeline draws one bar per attempt the checkpoint records, at its times.

A run with a retried step, a question answered by a person and a mapped
step, recording durations: its timeline (the SVG of ``/run/<id>``, parsed
without a browser) has a ``recorded`` bar for each timed output at exactly
its ``began`` and ``began + duration``, a ``failed`` bar for the failed
attempt at its failure record's times, and a ``waiting`` bar that ends when
the person answered; bars are grouped by step, an item's under its step.
Hostile step names and messages reach the SVG escaped.
"""

from __future__ import annotations

import asyncio
import json
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from ekit_core import Answer, WorkflowCheckpoint
from ekit_runtime import RetryPolicy, RunWaiting, Step, Workflow, ask
from ekit_runtime.ui import FileSource
from ekit_runtime.ui.timeline_svg import timeline_svg
from tests.support.dashboard_http import fetch, serving

SVG = "{http://www.w3.org/2000/svg}"


def workflow(flaky: list[bool]) -> Workflow:
    async def fetch_it(context: Any) -> str:
        if flaky and flaky.pop():
            raise RuntimeError("provider <b>down</b>")
        return "report"

    def name_it(context: Any) -> str:
        return f"title {ask('What title?')}"

    async def split(context: Any) -> list[int]:
        return [1, 2, 3]

    async def check(context: Any) -> int:
        return int(context["split"]) * 2

    return Workflow([
        Step("fetch", fetch_it, retry=RetryPolicy(max_attempts=3, backoff_base=0)),
        Step("name_it", name_it, depends_on=("fetch",)),
        Step("split", split, depends_on=("fetch",)),
        Step("check", check, depends_on=("split",), map_over="split"),
    ])


def finished_run() -> tuple[WorkflowCheckpoint, float]:
    async def main() -> tuple[WorkflowCheckpoint, float]:
        wf = workflow([True])
        try:
            await wf.run(durations=True)
        except RunWaiting as waiting:
            parked = waiting
        assert set(parked.questions) == {"name_it"}
        answered_at = time.time()
        done = await wf.run(resume_from=parked.checkpoint, durations=True,
                            answers={"name_it": Answer("Tides", by="ann", at=answered_at)})
        assert done.outputs["name_it"] == "title Tides"
        return done.checkpoint, answered_at

    return asyncio.run(main())


def bars_of(svg_text: str) -> list[dict[str, str]]:
    root = ET.fromstring(svg_text)
    found = []
    for group in root.iter(f"{SVG}g"):
        if group.get("class") != "step":
            continue
        for rect in group.iter(f"{SVG}rect"):
            found.append({**rect.attrib, "group": group.get("data-step", "")})
    return found


def test_each_recorded_failed_and_waiting_attempt_is_one_bar_at_its_times(tmp_path: Path) -> None:
    cp, answered_at = finished_run()
    assert set(cp.began) == set(cp.durations) == {"fetch", "name_it", "split", "check[0]", "check[1]",
                                                  "check[2]"}
    failure = cp.failures["fetch"]
    assert failure.began is not None and failure.ended is not None
    assert failure.began <= failure.ended <= cp.began["fetch"]  # the retry began after the failure

    path = tmp_path / "run.json"
    path.write_text(json.dumps(cp.to_dict()))
    with serving(FileSource(str(path))) as server:
        page = fetch(server, "/run/run.json")
    assert page.status == 200
    start = page.body.index("<svg xmlns=\"http://www.w3.org/2000/svg\" id=\"timeline-chart\"")
    svg_text = page.body[start:page.body.index("</svg>", start) + len("</svg>")]
    found = bars_of(svg_text)

    recorded = {b["data-name"]: b for b in found if b["data-outcome"] == "recorded"}
    assert set(recorded) == set(cp.durations)
    for name, bar in recorded.items():
        assert float(bar["data-began"]) == cp.began[name]
        assert float(bar["data-ended"]) == cp.began[name] + cp.durations[name]
        assert bar["group"] == ("check" if name.startswith("check[") else name)
    (failed,) = [b for b in found if b["data-outcome"] == "failed"]
    assert (failed["data-name"], float(failed["data-began"]), float(failed["data-ended"])) == (
        "fetch", failure.began, failure.ended)
    (waiting,) = [b for b in found if b["data-outcome"] == "waiting"]
    assert waiting["data-name"] == "name_it" and float(waiting["data-ended"]) == answered_at
    assert float(waiting["data-began"]) == cp.began["fetch"] + cp.durations["fetch"]  # when it could ask
    assert len(found) == len(recorded) + 2  # nothing else is drawn
    # The retry's bars are two, on the step's one row: the failure first.
    fetch_bars = [b for b in found if b["data-name"] == "fetch"]
    assert [b["data-outcome"] for b in fetch_bars] == ["failed", "recorded"]
    assert len({b["y"] for b in fetch_bars}) == 1
    assert "provider &lt;b&gt;down&lt;/b&gt;" in svg_text and "<b>down" not in svg_text


def test_a_run_without_times_says_how_to_record_them(tmp_path: Path) -> None:
    async def main() -> WorkflowCheckpoint:
        async def one(context: Any) -> int:
            return 1

        return (await Workflow([Step("one", one)]).run()).checkpoint

    cp = asyncio.run(main())
    assert not cp.began and timeline_svg(cp) == ""
    path = tmp_path / "plain.json"
    path.write_text(json.dumps(cp.to_dict()))
    with serving(FileSource(str(path))) as server:
        body = fetch(server, "/run/plain.json").body
    assert "No attempt times recorded" in body and "durations=True" in body


def test_names_reach_the_timeline_escaped() -> None:
    evil = "<script>x</script>"
    data = {"format_version": 1, "step_index": 1, "outputs": {evil: 1}, "cost":
            {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0},
            "durations": {evil: 0.5}, "began": {evil: 1_800_000_000.0}}
    svg_text = timeline_svg(WorkflowCheckpoint.from_dict(data), worker='w"<1>')
    assert evil not in svg_text and "&lt;script&gt;" in svg_text and 'w"<1>' not in svg_text
    (bar,) = bars_of(svg_text)
    assert bar["data-name"] == evil and bar["data-worker"] == 'w"<1>'
