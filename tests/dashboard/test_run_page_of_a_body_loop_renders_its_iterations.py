"""The run page of a loop whose body is a child workflow renders, escaped, parked and finished.

A body loop records names no other run has (``agent/tool#2[0]``, with ``/``, ``#``
and ``[`` in one name) and its outputs are the model's text, markup included:
the page and its live update answer 200, list every iteration's steps and
items, hold no live markup, serve an item's output whole by its name, and
show the question asked in iteration 2 while the run waits on it.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.parse
from html import unescape
from pathlib import Path
from typing import Any

from ekit_runtime import Done, Repeat, Step, Workflow, ask
from ekit_runtime.queue import SqliteQueue, Worker
from ekit_runtime.ui import QueueSource
from tests.support.dashboard_http import fetch, serving
from tests.support.ui_hostile import unsafe_markup

HOSTILE = "<script>alert(1)</script>\"><img src=x onerror=alert(2)>'"


def _agent() -> Workflow:
    def plan(ctx: Any) -> list[str]:
        return [f"{HOSTILE} {ctx['agent'].number}", "<b>x</b>"]

    def tool(ctx: Any) -> str:
        if ctx["agent"].number == 2 and ctx["plan"] == "<b>x</b>":
            return f"{ask('<i>allow</i>?', details={'why': HOSTILE})}"
        return ctx["plan"].upper()

    def fold(ctx: Any) -> Any:
        k = ctx["agent"].number
        return Done(ctx["tool"]) if k == 3 else ctx["tool"]

    body = Workflow([Step("plan", plan), Step("tool", tool, ("plan",), map_over="plan"),
                     Step("fold", fold, ("tool",))])
    return Workflow([Step("agent", child=body, repeat=Repeat(5))])


def _rows(html: str) -> dict[str, str]:
    body = re.search(r'<table id="outputs">.*?<tbody>(.*?)</tbody>', html, re.S)
    assert body is not None
    found = re.findall(r'<tr data-step="([^"]*)">(.*?)</tr>', body.group(1), re.S)
    return {unescape(n): row for n, row in found}


def _check_page(q: SqliteQueue) -> tuple[str, dict[str, Any]]:
    with serving(QueueSource(q, "q.db")) as server:
        page = fetch(server, "/run/r")
        assert page.status == 200, page.body[-2000:]
        api = fetch(server, "/api/run/r")
        assert api.status == 200, api.body[-2000:]
        parts = api.json()["parts"]
        for html in (page.body, *parts.values()):
            if isinstance(html, str):
                assert unsafe_markup(html)[0] == []
        rows = _rows(page.body)
        first = {"agent/plan#1", "agent/tool#1[0]", "agent/tool#1[1]", "agent/tool#1", "agent/fold#1"}
        assert first <= rows.keys()
        item = fetch(server, "/run/r/output/" + urllib.parse.quote("agent/tool#1[0]", safe=""))
        assert item.status == 200 and json.loads(item.body) == f"{HOSTILE} 1".upper()
        return page.body, parts


def test_a_body_loops_run_page_renders_escaped_while_it_waits_and_once_it_ends(tmp_path: Path) -> None:
    q = SqliteQueue(str(tmp_path / "q.db"))
    workflows = {"wf": _agent()}
    q.submit("wf", {}, run_id="r")
    assert asyncio.run(Worker(q, workflows, poll=0.01).run_until_idle()) == 1
    assert q.status("r").status == "waiting"
    page, _ = _check_page(q)
    assert "agent/tool#2[1]" in unescape(page) and "&lt;i&gt;allow&lt;/i&gt;?" in page
    q.answer("r", "agent/tool#2[1]", HOSTILE)
    assert asyncio.run(Worker(q, workflows, poll=0.01).run_until_idle()) == 1
    assert q.status("r").status == "finished", q.status("r").error
    page, _ = _check_page(q)
    assert {"agent/fold#3", "agent"} <= _rows(page).keys()
    q.close()
