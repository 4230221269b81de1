"""A run's page shows one reading of the run, all of it, and so does each live update.

The promise (docs/dashboard.md, "A run's page"): every part of a run's page
(its heading and progress, its record and usage, the graph with its items'
counts, the running attempts, the step table, what a resume would do, the
timeline) comes from the same reading of the run, even when a worker saves
between the dashboard's reads; ``/api/run/<id>`` gives every part of the
page from one reading too (``parts``, each with a ``version``), and never
the actions' token. The browser side (the page replacing every part) is
pinned in tests/dashboard/test_ui_browser_one_reading.py.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from ekit_core.report import usage_text
from ekit_core.usage import TokenUsage
from ekit_runtime.queue import RunInfo, SqliteQueue
from ekit_runtime.ui import QueueSource
from tests.support.dashboard_http import checkpoint, fetch, serving

GRAPH = {"a": [], "b": ["a"], "c": ["b"]}


class SavesBetweenReads(SqliteQueue):
    """A queue on which a worker's save lands just after the dashboard reads a run's record."""

    between: Callable[[], None] | None = None

    def status(self, run_id: str) -> RunInfo:
        info = super().status(run_id)
        between, self.between = self.between, None
        if between is not None:
            between()
        return info


def _running(q: SqliteQueue) -> Any:
    q.submit("wf", {}, run_id="r")
    lease = q.claim("w1", {"wf": None}, 60)
    assert lease is not None
    cost = {"input_tokens": 10, "output_tokens": 5, "llm_calls": 1}
    q.save(lease, checkpoint(GRAPH, {"a": 1}, cost=cost), 60)
    return lease


def _save_b(q: SqliteQueue, lease: Any) -> Callable[[], None]:
    def save() -> None:
        q.save(lease, checkpoint(GRAPH, {"a": 1, "b": 2}, step_index=2,
                                 cost={"input_tokens": 30, "output_tokens": 15, "llm_calls": 2}), 60)
    return save


def _facts_usage(html: str) -> str:
    found = re.search(r"<th>usage in/out/calls</th><td>([^<]*)</td>", html)
    assert found is not None, html
    return found.group(1)


def test_a_save_between_the_dashboards_reads_never_mixes_two_readings(tmp_path: Any) -> None:
    q = SavesBetweenReads(str(tmp_path / "q.db"))
    lease = _running(q)
    with serving(QueueSource(q, "q.db")) as server:
        q.between = _save_b(q, lease)
        page = fetch(server, "/run/r").body
        assert q.between is None  # the save did land between two reads
        # b is recorded in the graph and the table: the heading and the record say so too.
        assert '<g class="node state-recorded" data-step="b">' in page
        assert re.search(r'<small id="run-progress">2/3 ', page), page
        assert _facts_usage(page) == usage_text(TokenUsage(30, 15, 2))

        q.between = _save_b(q, lease)  # the same save again: the reading is the same one
        data = fetch(server, "/api/run/r").json()
        assert data["states"]["b"] == "recorded"
        assert data["progress"].startswith("2/3 ")
        assert _facts_usage(data["parts"]["run-facts"]) == usage_text(TokenUsage(30, 15, 2))
        assert 'state-recorded" data-step="b"' in data["parts"]["run-graph"]


def test_the_json_gives_every_part_of_the_page_with_its_version_and_no_token(tmp_path: Any) -> None:
    q = SqliteQueue(str(tmp_path / "q.db"))
    _running(q)
    q.submit("wf2", {}, run_id="queued")
    with serving(QueueSource(q, "q.db"), allow_actions=True) as server:
        for run_id in ("r", "queued"):
            page = fetch(server, f"/run/{run_id}").body
            token = re.search(r'name="token" value="([^"]+)"', page)
            assert token is not None
            data = fetch(server, f"/api/run/{run_id}").json()
            part = r'<div id="(run-[a-z-]+)" class="part" data-version="([0-9a-f]+)">'
            on_page = dict(re.findall(part, page))
            assert set(data["parts"]) == set(on_page) == set(data["versions"])
            # Nothing changed between the two reads: every part's version is the page's.
            for key, version in on_page.items():
                if key != "run-now":  # its ages move with the clock
                    assert data["versions"][key] == version, key
            assert token.group(1) not in str(data)
            assert 'name="token" value=""' in data["parts"]["run-actions"]



def test_the_runs_json_gives_the_page_links_its_own_count_calls_for(tmp_path: Any) -> None:
    """The runs page redraws its rows, its count and its page links from one reading."""
    q = SqliteQueue(str(tmp_path / "q.db"))
    with serving(QueueSource(q, "q.db")) as server:
        q.submit("wf", {}, run_id="only")
        first = fetch(server, "/api/runs").json()
        assert first["pages"] == 1 and first["nav"] == ""
        for i in range(50):
            q.submit("wf", {}, run_id=f"more-{i}")
        grown = fetch(server, "/api/runs").json()
        assert grown["pages"] == 2 and grown["summary"] == "51 run(s), page 1 of 2"
        assert grown["nav"] == '<a rel="next" href="/?page=2">next</a>'
        assert fetch(server, "/api/runs?page=2").json()["nav"] == '<a rel="prev" href="/?page=1">previous</a>'
        assert 'id="runs-pages"><a rel="next" href="/?page=2">next</a></nav>' in fetch(server, "/").body


def test_an_attempt_still_announced_after_its_output_was_saved_is_not_shown_running(tmp_path: Any) -> None:
    """A worker's announcement may be a second older than the checkpoint: the reading's checkpoint wins."""
    q = SqliteQueue(str(tmp_path / "q.db"))
    lease = _running(q)
    now = time.time()
    q.announce("w1", {"wf": None}, 60, {"r": (lease.epoch, {"a": (now - 3, 1), "b": (now, 1)})})
    with serving(QueueSource(q, "q.db")) as server:
        for html in (fetch(server, "/run/r").body, fetch(server, "/api/run/r").json()["parts"]["run-now"]):
            assert '<li data-step="b">' in html
            assert '<li data-step="a">' not in html  # a is recorded
        assert fetch(server, "/api/run/r").json()["states"] == {"a": "recorded", "b": "running",
                                                                 "c": "not-started"}
