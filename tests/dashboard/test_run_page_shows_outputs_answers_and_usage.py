"""A run's page shows what the run made and what people told it: outputs, answers, usage, failures.

The promise (docs/dashboard.md, "A run's page"): each step's and each item's
output, as the checkpoint holds it (a typed output as its tagged plain data,
its type named), escaped, on one line, all of it under ``<details>`` (no
script needed) and, past 20,000 characters, served whole at
``/run/<id>/output/<name>``; each answered question with the answer, who gave
it and when; the run's usage and its steps' usage; a failure with its message.
The live update (``/api/run/<id>``) carries the same parts. Over HTTP,
without a browser; tests/dashboard/test_hostile_outputs_in_chromium.py
checks the same fields in Chromium.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from html import unescape
from typing import Any

from ekit_core import WorkflowCheckpoint
from ekit_runtime.queue import RunInfo, SqliteQueue
from ekit_runtime.ui import FileSource, QueueSource
from ekit_runtime.ui.outputs import INLINE, PREVIEW
from tests.support.dashboard_http import fetch, serving
from tests.support.ui_hostile import unsafe_markup

HOSTILE = "<script>alert(1)</script>\"><img src=x onerror=alert(2)>'"
HUGE = "tide " * 10_000  # 50,000 characters: past what the page holds
TYPED = {"$ekit": "type", "type": "app.models:Summary",
         "value": {"title": "Tides", "sources": [{"$ekit": "type", "type": "app.models:Source",
                                                  "value": {"url": "https://example.org", "score": 0.9}}]}}
AT = 1_765_000_000.0  # 2025-12-06 05:46:40 UTC
GRAPH = {"plan": [], "sq": ["plan"], "title": ["sq"], "typed": [], "huge": [], "hostile": [], "boom": []}


def _checkpoint() -> WorkflowCheckpoint:
    return WorkflowCheckpoint.from_dict({
        "format_version": 3, "step_index": 7,
        "outputs": {"plan": {"x": 1, "y": 2}, "sq[x]": 10, "sq[y]": HOSTILE, "sq": {"x": 10, "y": HOSTILE},
                    "typed": TYPED, "huge": HUGE, "hostile": {HOSTILE: [HOSTILE]}},
        "cost": {"input_tokens": 1200, "output_tokens": 345, "llm_calls": 6},
        "context": {}, "graph": GRAPH, "shapes": {"sq": {"map_over": "plan"}},
        "step_usage": {"plan": {"input_tokens": 1000, "output_tokens": 300, "llm_calls": 4},
                       "sq[x]": {"input_tokens": 200, "output_tokens": 45, "llm_calls": 2}},
        "failures": {"boom": {"error_type": "RuntimeError", "message": "the model said " + "no " * 200,
                              "attempts": 3}},
        "asked": {"title": [
            {"kind": "value", "prompt": "Title?", "answer": {"by": "ann", "at": AT, "value": {"t": HOSTILE}}},
            {"kind": "approval", "prompt": "Ship <it>?", "answer": {"by": HOSTILE, "approved": False,
                                                                  "reason": "not <b>yet</b>"}},
        ]},
    })


def _served(tmp_path: Any) -> SqliteQueue:
    q = SqliteQueue(str(tmp_path / "q.db"))
    q.submit("wf", {}, run_id="r")
    lease = q.claim("w", {"wf": None}, 60)
    assert lease is not None
    q.save(lease, _checkpoint(), 60)
    return q


def _rows(html: str, table: str) -> dict[str, str]:
    body = re.search(rf'<table id="{table}">.*?<tbody>(.*?)</tbody>', html, re.S)
    assert body is not None, table
    return {unescape(name): row for name, row in
            re.findall(r'<tr data-step="([^"]*)">(.*?)</tr>', body.group(1), re.S)}


def test_every_output_is_shown_escaped_shortened_and_whole(tmp_path: Any) -> None:
    q = _served(tmp_path)
    with serving(QueueSource(q, "q.db")) as server:
        page = fetch(server, "/run/r").body
        api = fetch(server, "/api/run/r").json()["parts"]
        for html in (page, api["run-outputs"]):
            unsafe, _ = unsafe_markup(html)
            assert unsafe == []
            rows = _rows(html, "outputs")
            # Steps and items, in the order the checkpoint records them.
            assert list(rows) == ["plan", "sq[x]", "sq[y]", "sq", "typed", "huge", "hostile"]
            assert '<code class="output-line">{&quot;x&quot;: 1, &quot;y&quot;: 2}</code>' in rows["plan"]
            assert "<details" not in rows["plan"]  # short: one line, nothing to open
            assert "1,000/300/4" in rows["plan"] and "200/45/2" in rows["sq[x]"]
            # A typed output: its tagged plain data, its type named beside it.
            assert '<span class="type">app.models:Summary</span>' in rows["typed"]
            assert "app.models:Source" in unescape(rows["typed"])
            # Markup in an output is text.
            assert json.dumps(HOSTILE) in unescape(rows["sq[y]"])
            # A long output: a line of PREVIEW characters, and the page holds INLINE of it.
            huge = rows["huge"]
            summary = re.search(r"<summary><code class=\"output-line\">(.*?)</code>", huge, re.S)
            assert summary is not None and len(unescape(summary.group(1))) == PREVIEW + 1  # and "…"
            full = re.search(r'<pre class="output-full">(.*?)</pre>', huge, re.S)
            assert full is not None and unescape(full.group(1)) == json.dumps(HUGE)[:INLINE]
            link = re.search(r'<a href="([^"]+)">all of it \(50,002 characters\)</a>', huge)
            assert link is not None
        assert link is not None
        whole = fetch(server, unescape(link.group(1)))
        assert whole.status == 200 and whole.headers["Content-Type"].startswith("text/plain")
        assert json.loads(whole.body) == HUGE
        item = fetch(server, "/run/r/output/" + urllib.parse.quote("sq[y]", safe=""))
        assert json.loads(item.body) == HOSTILE
        assert fetch(server, "/run/r/output/nope").status == 404
        assert fetch(server, "/run/nope/output/plan").status == 404


def test_answers_name_who_answered_what_and_when_and_usage_and_failures_show(tmp_path: Any) -> None:
    q = _served(tmp_path)
    with serving(QueueSource(q, "q.db")) as server:
        page = fetch(server, "/run/r").body
        api = fetch(server, "/api/run/r").json()["parts"]
        for answers in (page, api["run-answers"]):
            table = re.search(r'<table id="answers">.*?</table>', answers, re.S)
            assert table is not None
            rows = re.findall(r'<tr data-step="title">(.*?)</tr>', table.group(0), re.S)
            assert len(rows) == 2
            value, approval = rows
            assert "Title?" in value and '<td class="by">ann</td>' in value
            assert '<td class="at">2025-12-06 05:46:40 UTC</td>' in value
            assert json.dumps({"t": HOSTILE}) in unescape(value)
            assert "Ship &lt;it&gt;?" in approval and "verdict-denied" in approval
            assert "not &lt;b&gt;yet&lt;/b&gt;" in approval
            assert f'<td class="by">{HOSTILE.replace("&", "&amp;").replace("<", "&lt;")}' not in approval
            assert unsafe_markup(answers)[0] == []
        for usage in (page, api["run-usage"]):
            assert re.search(r"<b>1,200</b> input tokens, <b>345</b> output tokens, <b>6</b> LLM calls",
                             usage)
            bars = re.findall(r'<g class="usage-bar" data-step="([^"]*)">', usage)
            assert bars == ["plan", "sq[x]"]  # most tokens first
        failure = _rows(page, "steps")["boom"]
        assert "RuntimeError: the model said no no" in unescape(failure)
        assert "<details" in failure  # a long message: a line, and all of it under details
        assert unescape(failure).count("no ") >= 200


def test_a_lone_surrogate_in_a_store_file_is_shown_as_its_escape(tmp_path: Any) -> None:
    """JSON may spell a lone surrogate (``"\\udc80"``), which no page can encode: it is shown escaped."""
    data = _checkpoint().to_dict()
    data["outputs"] = {"plan": "\udc80 lone " + HOSTILE, "sq": ["\ud800"] * 100}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data))  # (ensure_ascii: the file holds the escapes)
    with serving(FileSource(str(path))) as server:
        page = fetch(server, "/run/run.json")
        assert page.status == 200
        rows = _rows(page.body, "outputs")
        assert "\\udc80 lone " in unescape(rows["plan"])
        whole = re.search(r'<pre class="output-full">(.*?)</pre>', rows["sq"], re.S)
        assert whole is not None and unescape(whole.group(1)).count("\\ud800") == 100
        assert unsafe_markup(page.body)[0] == []
        # The live update shows what the page shows: the escape, never the surrogate itself.
        live = fetch(server, "/api/run/run.json").json()["parts"]["run-outputs"]
        assert live.count("\\ud800") == 124 and "\ud800" not in live
        assert _rows(live, "outputs") == rows


class SavesBetweenReads(SqliteQueue):
    """A queue on which a worker's save lands just after the dashboard reads a run's record."""

    between: Any = None

    def status(self, run_id: str) -> RunInfo:
        info = super().status(run_id)
        between, self.between = self.between, None
        if between is not None:
            between()
        return info


def test_the_outputs_answers_and_usage_are_of_the_pages_one_reading(tmp_path: Any) -> None:
    q = SavesBetweenReads(str(tmp_path / "q.db"))
    q.submit("wf", {}, run_id="r")
    lease = q.claim("w", {"wf": None}, 60)
    assert lease is not None
    first = _checkpoint()
    q.save(lease, first, 60)
    more = first.to_dict()
    more["outputs"]["boom"] = "made it"
    more["failures"] = {}
    more["step_index"] += 1
    more["step_usage"]["boom"] = {"input_tokens": 5000, "output_tokens": 1, "llm_calls": 1}
    more["cost"] = {"input_tokens": 6200, "output_tokens": 346, "llm_calls": 7}
    with serving(QueueSource(q, "q.db")) as server:
        q.between = lambda: q.save(lease, WorkflowCheckpoint.from_dict(more), 60)
        page = fetch(server, "/run/r").body
        assert q.between is None  # the save did land between two reads
        # The graph, the outputs, the usage and the record all show the save.
        assert '<g class="node state-recorded" data-step="boom">' in page
        assert "boom" in _rows(page, "outputs")
        assert "<b>6,200</b> input tokens" in page and "<td>6,200/346/7</td>" in page
        assert re.findall(r'<g class="usage-bar" data-step="([^"]*)">', page)[0] == "boom"
