"""The runs page puts the runs waiting for a person first, with their questions, and charts the fleet.

The promise (docs/dashboard.md, "The runs page"): above the table, each run
waiting for a person (the first submitted first), each question it waits on,
and, with ``--allow-actions``, a form per question that answers through the
run's own guarded action and leads back to the runs page; without it, the
page says how to allow it. Under them a chart of the newest runs of the
whole queue by when they were submitted, by status, with their usage.
Everything comes from one reading of the queue, in the page and in its live
update (``/api/runs``, whose parts never hold the token). Over HTTP on
both backends; the form in Chromium: tests/dashboard/test_answer_from_the_runs_page_in_chromium.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from html import unescape
from typing import Any

import pytest

from ekit_core.report import usage_text
from ekit_core.usage import TokenUsage
from ekit_runtime.queue import RunQueue, RunsPage, SqliteQueue, open_queue
from ekit_runtime.ui import FileSource, QueueSource
from tests.support.dashboard_http import checkpoint, fetch, in_every_status, serving
from tests.support.queue_backends import queue_url
from tests.support.ui_hostile import unsafe_markup

__all__ = ["queue_url"]  # a fixture, used by name

GRAPH = {"a": [], "b": ["a"], "c": ["b"]}
EVIL = "<script>alert(1)</script>\"'><img src=x onerror=alert(2)>"


@pytest.fixture
def any_queue(queue_url: str) -> Iterator[RunQueue]:
    """An empty queue on each backend (SQLite, and the test PostgreSQL server)."""
    with open_queue(queue_url) as q:
        yield q


@pytest.fixture
def queue(tmp_path: Any) -> Iterator[SqliteQueue]:
    with SqliteQueue(str(tmp_path / "q.db")) as q:
        yield q


def _waiting(q: RunQueue, run_id: str, prompt: str = "which?", kind: str = "value") -> None:
    q.submit("wf-" + run_id, {}, run_id=run_id)
    lease = q.claim("w1", {"wf-" + run_id: None}, 60)
    assert lease is not None
    cost = {"input_tokens": 100, "output_tokens": 10, "llm_calls": 1}
    q.save(lease, checkpoint(GRAPH, {"a": 1}, cost=cost,
                             asked={"b": [{"kind": kind, "prompt": prompt, "details": {"why": EVIL}}]}), 60)
    q.park(lease, "step 'b' waits for an answer")


def _section(html: str) -> str:
    found = re.search(r'<section id="waiting">.*?</section>', html, re.S)
    assert found is not None
    return found.group(0)


def test_waiting_runs_stand_first_with_their_questions_and_a_form(any_queue: RunQueue) -> None:
    q = any_queue
    in_every_status(q)  # r-waiting asks "which?" at step b
    _waiting(q, "second", EVIL)
    _waiting(q, "approval", "Ship it?", "approval")
    with serving(QueueSource(q, "q"), allow_actions=True) as server:
        page = fetch(server, "/").body
        token = re.search(r'data-token="([^"]+)"', page)
        assert token is not None
        assert page.index('id="waiting"') < page.index('id="fleet-chart"') < page.index('id="runs"')
        waiting = _section(page)
        assert "Waiting for you (3)" in waiting
        assert re.findall(r'<div class="waiting-run" data-run-id="([^"]*)">', waiting) == [
            "r-waiting", "second", "approval"]
        assert unsafe_markup(page)[0] == []
        assert EVIL in unescape(waiting)  # the prompt and the details, as text
        forms = re.findall(r'<form class="inline action" method="post" action="([^"]+)">(.*?)</form>',
                           waiting)
        assert [a for a, _ in forms] == ["/run/r-waiting/answer", "/run/second/answer",
                                         "/run/approval/approve", "/run/approval/deny"]
        for _, fields in forms:
            assert f'name="token" value="{token.group(1)}"' in fields
            assert '<input type="hidden" name="back" value="runs">' in fields
            assert '<input type="hidden" name="step" value="b">' in fields
        assert "--allow-actions" not in waiting
        # The live update: the same parts, each with its version, the token's fields empty.
        data = fetch(server, "/api/runs").json()
        assert token.group(1) not in str(data)
        assert data["waiting_total"] == 3
        assert data["parts"]["runs-waiting"] == waiting.replace(f'value="{token.group(1)}"', 'value=""')
        part = r'<div id="(runs-[a-z]+)" class="part" data-version="([0-9a-f]+)">'
        for key, version in re.findall(part, page):
            assert data["versions"][key] == version, key


def test_an_answer_posted_from_the_runs_page_resumes_the_run_and_leads_back(any_queue: RunQueue) -> None:
    q = any_queue
    _waiting(q, "asks")
    with serving(QueueSource(q, "q"), allow_actions=True) as server:
        page = fetch(server, "/")
        token = re.search(r'name="token" value="([^"]+)"', page.body)
        assert token is not None
        cookie = {"Cookie": f"{server.cookie}={token.group(1)}"}
        form = {"token": token.group(1), "back": "runs", "step": "b", "by": "ann", "value": '{"pick": 2}'}
        forged = fetch(server, "/run/asks/answer", {**form, "token": "x" * 43}, cookie)
        assert forged.status == 403 and q.status("asks").status == "waiting"
        done = fetch(server, "/run/asks/answer", form, cookie)
        assert done.status == 303 and done.headers["Location"] == "/"
        assert q.status("asks").status == "queued"  # a worker's next claim resumes it with the answer
        cp = q.checkpoint("asks")
        assert cp is not None
        answer = cp.asked["b"][-1].answer
        assert answer is not None and answer.value == {"pick": 2} and answer.by == "ann"
        after = fetch(server, "/").body
        assert "no run waits for a person" in _section(after)
        # From the run's own page (no back field), an action still leads to the run's page.
        _waiting(q, "other")
        done = fetch(server, "/run/other/answer", {**form, "back": "elsewhere"}, cookie)
        assert done.status == 303 and done.headers["Location"] == "/run/other"


def test_without_actions_the_page_says_how_to_answer_from_it(queue: SqliteQueue, tmp_path: Any) -> None:
    _waiting(queue, "asks")
    with serving(QueueSource(queue, "q")) as server:
        waiting = _section(fetch(server, "/").body)
        assert "<form" not in waiting and "which?" in waiting
        assert "<code>--allow-actions</code>" in waiting
    path = tmp_path / "run.json"
    asked = {"b": [{"kind": "value", "prompt": "which?"}]}
    path.write_text(json.dumps(checkpoint(GRAPH, {"a": 1}, asked=asked).to_dict()))
    with serving(FileSource(str(path)), allow_actions=True) as server:
        waiting = _section(fetch(server, "/").body)
        assert "<form" not in waiting and "which?" in waiting and "read-only" in waiting


def test_the_chart_counts_the_newest_runs_of_the_whole_queue_and_their_usage(any_queue: RunQueue) -> None:
    q = any_queue
    in_every_status(q)
    _waiting(q, "asks")
    with serving(QueueSource(q, "q")) as server:
        # A filtered page still charts the whole queue (its newest runs), not the page's runs.
        for query in ("", "?status=failed"):
            page = fetch(server, "/" + query).body
            buckets = re.findall(r'<g class="bucket" data-start="\d+" data-runs="(\d+)" data-tokens="(\d+)">',
                                 page)
            assert sum(int(n) for n, _ in buckets) == 7
            every = sum((r.cost for r in q.runs()), TokenUsage())
            assert sum(int(t) for _, t in buckets) == every.input_tokens + every.output_tokens
            assert f"<b>{usage_text(every)}</b>" in page
            assert "the 7 runs" in page
            for status in ("queued", "running", "waiting", "finished", "failed", "cancelled"):
                assert f'class="bar status-{status}"' in page


class AnsweredBetweenReads(SqliteQueue):
    """A queue on which a run is answered just after the dashboard reads the waiting runs."""

    between: Callable[[], None] | None = None

    def runs_page(self, status: Any = None, **kwargs: Any) -> RunsPage:
        found = super().runs_page(status, **kwargs)
        if status == "waiting":
            between, self.between = self.between, None
            if between is not None:
                between()
        return found


def _answer(q: RunQueue, run_id: str) -> None:
    q.answer(run_id, "b", 1, by="ann")


def _states(html: str) -> tuple[set[str], dict[str, str]]:
    waiting = set(re.findall(r'<div class="waiting-run" data-run-id="([^"]*)">', html))
    rows = dict(re.findall(r'<tr data-run-id="([^"]*)">.*?<td class="status status-([a-z]+)">', html, re.S))
    return waiting, rows


def test_an_answer_between_the_dashboards_reads_never_mixes_two_readings(tmp_path: Any) -> None:
    q = AnsweredBetweenReads(str(tmp_path / "q.db"))
    _waiting(q, "asks")
    with serving(QueueSource(q, "q")) as server:
        q.between = lambda: _answer(q, "asks")
        page = fetch(server, "/").body
        assert q.between is None  # the answer did land between two reads
        waiting, rows = _states(page)
        # The table and the waiting runs are of one moment: after the answer, in both.
        assert rows["asks"] == "queued" and waiting == set()
        _waiting(q, "again")
        q.between = lambda: _answer(q, "again")
        data = fetch(server, "/api/runs").json()
        assert q.between is None
        waiting, _ = _states(data["parts"]["runs-waiting"])
        rows = {r["run_id"]: r["status"] for r in data["runs"]}
        assert rows["again"] == "queued" and waiting == set() and data["waiting_total"] == 0



class CountsQuestions(SqliteQueue):
    asked: list[str]

    def questions(self, run_id: str) -> Any:
        self.asked.append(run_id)
        return super().questions(run_id)


def test_a_poll_reads_a_waiting_runs_checkpoint_only_when_its_record_changed(tmp_path: Any) -> None:
    """The runs page polls every 1.5 s: a waiting run's checkpoint (maybe large) is read once, not
    on every poll."""
    q = CountsQuestions(str(tmp_path / "q.db"))
    q.asked = []
    _waiting(q, "one")
    _waiting(q, "two")
    with serving(QueueSource(q, "q")) as server:
        for _ in range(3):
            assert fetch(server, "/api/runs").json()["waiting_total"] == 2
        assert sorted(q.asked) == ["one", "two"]
        q.answer("one", "b", 1)
        _waiting(q, "three")
        data = fetch(server, "/api/runs").json()
        assert re.findall(r'data-run-id="([^"]*)"', data["parts"]["runs-waiting"]) == ["two", "three"]
        assert sorted(q.asked) == ["one", "three", "two"]
