"""``ekit ui``: the dashboard's pages, JSON, escaping, actions' guards and store-file sources, over HTTP.

A real server on a real SqliteQueue (or a real store file), in a thread,
read with urllib as a browser would; the browser-level tests are elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from ekit_runtime import JournalStore, JsonFileStore, Step, Workflow
from ekit_runtime.queue import RunQueue, SqliteQueue, open_queue
from ekit_runtime.redaction import redacted
from ekit_runtime.ui import FileSource, QueueSource
from tests.support.dashboard_http import checkpoint, fetch, in_every_status, serving, token_and_cookie
from tests.support.queue_backends import fresh_postgres, queue_url

__all__ = ["queue_url"]  # a fixture, used by name

EVIL = "<img src=x onerror=alert(1)>"


@pytest.fixture
def queue(tmp_path: Any) -> Iterator[SqliteQueue]:
    q = SqliteQueue(str(tmp_path / "q.db"))
    yield q
    q.close()


def rows(html: str) -> list[str]:
    return re.findall(r'<tr data-run-id="([^"]*)"', html)


@pytest.fixture
def any_queue(queue_url: str) -> Iterator[RunQueue]:
    """An empty queue on each backend (SQLite, and the test PostgreSQL server)."""
    with open_queue(queue_url) as q:
        yield q


def test_runs_page_shows_runs_in_every_status(any_queue: RunQueue) -> None:
    queue = any_queue
    in_every_status(queue)
    with serving(QueueSource(queue, "q.db")) as server:
        page = fetch(server, "/")
        assert page.status == 200
        assert 'id="runs"' in page.body
        assert set(rows(page.body)) == {f"r-{s}" for s in
                                        ("queued", "running", "waiting", "finished", "failed", "cancelled")}
        for status in ("queued", "running", "waiting", "finished", "failed", "cancelled"):
            assert f'<td class="status status-{status}">{status}' in page.body
        assert "RuntimeError: the model said no" in page.body  # a failed run's reason is its error
        assert "step &#x27;b&#x27; waits for an answer" in page.body
        assert "1/3" in page.body  # progress of the running run
        data = fetch(server, "/api/runs").json()
        assert data["total"] == 6 and len(data["runs"]) == 6
        assert {r["status"] for r in data["runs"]} == {"queued", "running", "waiting", "finished",
                                                       "failed", "cancelled"}
        assert rows(data["tbody"]) == rows(page.body)


def test_runs_page_filters_by_status_and_workflow(any_queue: RunQueue) -> None:
    queue = any_queue
    in_every_status(queue)
    with serving(QueueSource(queue, "q.db")) as server:
        assert rows(fetch(server, "/?status=failed").body) == ["r-failed"]
        assert rows(fetch(server, "/?workflow=wf-running").body) == ["r-running"]
        assert rows(fetch(server, "/?status=queued&workflow=wf-running").body) == []
        assert fetch(server, "/api/runs?status=waiting").json()["total"] == 1
        bad = fetch(server, "/?status=bogus")
        assert bad.status == 400 and "Traceback" not in bad.body


def test_the_runs_page_reads_one_page_from_the_queue_never_every_run(
    any_queue: RunQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = any_queue
    for i in range(130):
        queue.submit("even" if i % 2 == 0 else "odd", {}, run_id=f"r{i:03d}")
    for i in range(0, 130, 3):
        assert queue.cancel(f"r{i:03d}")

    def every_run(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the runs page read every run")

    monkeypatch.setattr(queue, "runs", every_run)
    newest = [f"r{i:03d}" for i in range(129, -1, -1)]
    with serving(QueueSource(queue, "q")) as server:
        first = fetch(server, "/")
        assert first.status == 200 and rows(first.body) == newest[:50]
        assert "130 run(s), page 1 of 3" in first.body
        assert ('<datalist id="workflow-names"><option value="even"></option><option value="odd">'
                "</option></datalist>") in first.body
        third = fetch(server, "/api/runs?page=3").json()
        assert rows(third["tbody"]) == newest[100:] and third["total"] == 130 and third["pages"] == 3
        assert fetch(server, "/api/runs?page=4").json()["runs"] == []
        cancelled_odd = [r for r in newest if int(r[1:]) % 3 == 0 and int(r[1:]) % 2 == 1]
        both = fetch(server, "/api/runs?status=cancelled&workflow=odd").json()
        assert [r["run_id"] for r in both["runs"]] == cancelled_odd and both["total"] == len(cancelled_odd)
        page = fetch(server, "/?status=queued&workflow=even")
        queued_even = [r for r in newest if int(r[1:]) % 3 and int(r[1:]) % 2 == 0]
        assert rows(page.body) == queued_even and "43 run(s), page 1 of 1" in page.body
        assert rows(fetch(server, "/?status=queued&workflow=even&page=2").body) == []


def test_a_queue_has_no_incomplete_runs_and_a_bad_workflow_filter_is_a_400(queue: SqliteQueue) -> None:
    in_every_status(queue)
    with serving(QueueSource(queue, "q.db")) as server:
        page = fetch(server, "/?status=incomplete")  # a store file's status: no queue run has it
        assert page.status == 200 and rows(page.body) == [] and "0 run(s)" in page.body
        for bad in ("w" * 201, "a\x00b"):
            got = fetch(server, "/?workflow=" + urllib.parse.quote(bad))
            assert got.status == 400 and "workflow must" in got.body and "Traceback" not in got.body
            assert fetch(server, "/api/runs?workflow=" + urllib.parse.quote(bad)).status == 400


@pytest.mark.timeout(300)
def test_10000_runs_are_paginated_50_a_page(queue: SqliteQueue) -> None:
    for i in range(10_000):
        queue.submit("wf", {}, run_id=f"run-{i:05d}")
    with serving(QueueSource(queue, "q.db")) as server:
        first = fetch(server, "/")
        assert rows(first.body)[:2] == ["run-09999", "run-09998"]  # newest first
        assert len(rows(first.body)) == 50
        assert "10,000 run(s), page 1 of 200" in first.body
        assert 'rel="next" href="/?page=2"' in first.body
        last = fetch(server, "/?page=200")
        assert rows(last.body)[-1] == "run-00000" and len(rows(last.body)) == 50
        beyond = fetch(server, "/api/runs?page=201").json()
        assert beyond["total"] == 10_000 and beyond["runs"] == []


@pytest.mark.parametrize("page", ["0", "-1", "x", "1.5", "9" * 40])
def test_a_bad_page_number_is_a_400_page_not_a_traceback(queue: SqliteQueue, page: str) -> None:
    with serving(QueueSource(queue, "q.db")) as server:
        got = fetch(server, "/?page=" + urllib.parse.quote(page))
        assert got.status == 400
        assert "page must be a whole number" in got.body and "Traceback" not in got.body
        assert fetch(server, "/api/runs?page=" + urllib.parse.quote(page)).status == 400
        assert fetch(server, "/?page=").status == 200  # an empty page field is the first page


def test_unknown_run_is_a_404(queue: SqliteQueue) -> None:
    with serving(QueueSource(queue, "q.db")) as server:
        for path in ("/run/nope", "/api/run/nope", "/run/a/b", "/nowhere"):
            got = fetch(server, path)
            assert got.status == 404, path
            assert "Traceback" not in got.body


def test_hostile_names_are_shown_as_text_never_as_markup(queue: SqliteQueue) -> None:
    graph = {"a": [], EVIL: ["a"], "z": [EVIL]}
    queue.submit(EVIL, {EVIL: EVIL}, run_id=EVIL)
    lease = queue.claim(EVIL, {EVIL: None}, 60)
    assert lease is not None
    failure = {"z": {"error_type": EVIL, "message": EVIL, "attempts": 2}}
    queue.save(lease, checkpoint(graph, {"a": EVIL}, asked={EVIL: [{"kind": "value", "prompt": EVIL,
                                                                    "details": {EVIL: EVIL}}]},
                                 failures=failure), 60)
    queue.set_reason(lease, EVIL)
    with serving(QueueSource(queue, EVIL), allow_actions=True) as server:
        run = "/run/" + urllib.parse.quote(EVIL, safe="")
        for path in ("/", run, "/?workflow=" + urllib.parse.quote(EVIL), "/run/" + urllib.parse.quote(EVIL)):
            page = fetch(server, path)
            assert page.status in (200, 404), path
            assert EVIL not in page.body, path
            assert "&lt;img src=x onerror=alert(1)&gt;" in page.body, path
        assert fetch(server, run).status == 200
        assert fetch(server, "/?workflow=" + urllib.parse.quote(EVIL)).body.count("<tr data-run-id") == 1
        for api in ("/api/runs", "/api" + run):
            data = fetch(server, api).json()
            html = data.get("tbody", "") + data.get("steps_tbody", "")
            assert html and EVIL not in html


def test_no_password_of_the_queue_url_is_shown(queue: SqliteQueue) -> None:
    dsn = "postgresql://ekit:s3cr3t-pw@db.example:5432/runs"
    in_every_status(queue)
    with serving(QueueSource(queue, redacted(dsn))) as server:
        for path in ("/", "/run/r-failed", "/nope", "/?page=0"):
            body = fetch(server, path).body
            assert "s3cr3t-pw" not in body
        assert "postgresql://ekit:***@db.example:5432/runs" in fetch(server, "/").body


def test_pages_carry_the_security_headers(queue: SqliteQueue) -> None:
    in_every_status(queue)
    with serving(QueueSource(queue, "q.db")) as server:
        for path in ("/", "/run/r-running", "/api/runs", "/static/app.js", "/nope"):
            page = fetch(server, path)
            assert page.headers["Content-Security-Policy"].startswith("default-src 'self'; script-src 'self'")
            assert page.headers["X-Content-Type-Options"] == "nosniff"
        page = fetch(server, "/")
        assert '<script src="/static/app.js"></script>' in page.body
        assert re.search(r"<script>|<script [^s]", page.body) is None  # no inline script
        assert "http://" not in page.body.replace(server.url, "").replace("http://www.w3.org/2000/svg", "")
        assert fetch(server, "/static/app.js").headers["Content-Type"].startswith("text/javascript")


def test_run_page_shows_graph_states_steps_audit_and_questions(any_queue: RunQueue) -> None:
    queue = any_queue
    in_every_status(queue)
    with serving(QueueSource(queue, "q.db")) as server:
        running = fetch(server, "/run/r-running").body
        assert '<g class="node state-recorded" data-step="a">' in running
        # Its inputs are recorded but no worker says it runs it: ready, not running.
        assert '<g class="node state-ready" data-step="b">' in running
        assert '<g class="node state-not-started" data-step="c">' in running
        assert "nothing: no attempt of this run has begun on a live worker" in running
        queue.announce("w1", {"wf-running": None}, 60, {"r-running": (1, {"b": (time.time() - 5, 2)})})
        running = fetch(server, "/run/r-running").body
        assert '<g class="node state-running" data-step="b">' in running
        assert '<li data-step="b"><b>b</b>: attempt 2 on worker w1, for ' in running
        live = json.loads(fetch(server, "/api/run/r-running").body)
        assert live["states"]["b"] == "running" and "attempt 2 on worker w1" in live["in_flight_html"]
        assert 'id="legend"' in running and 'id="steps"' in running
        assert "What a resume would do" in running and "skips 1, runs 2" in running
        failed = fetch(server, "/run/r-failed").body
        assert '<g class="node state-failed" data-step="b">' in failed
        assert "RuntimeError: the model said no" in failed
        assert '<td class="num attempts">3</td>' in failed
        waiting = fetch(server, "/run/r-waiting").body
        assert '<g class="node state-waiting" data-step="b">' in waiting
        assert 'id="questions"' in waiting and "which?" in waiting
        queued = fetch(server, "/run/r-queued").body
        assert "no checkpoint saved yet" in queued
        data = fetch(server, "/api/run/r-running").json()
        assert data["status"] == "running"
        assert data["states"] == {"a": "recorded", "b": "running", "c": "not-started"}
        assert '<tr data-step="b">' in data["steps_tbody"]


def test_read_only_mode_renders_no_action_and_refuses_every_post(queue: SqliteQueue) -> None:
    in_every_status(queue)
    with serving(QueueSource(queue, "q.db")) as server:
        for path in ("/run/r-queued", "/run/r-waiting", "/run/r-failed"):
            body = fetch(server, path).body
            assert "<form class=\"inline action\"" not in body and 'name="token"' not in body
        got = fetch(server, "/run/r-queued/cancel", {"token": "x"})
        assert got.status == 405
        assert queue.status("r-queued").status == "queued"
        assert "Set-Cookie" not in fetch(server, "/").headers


def test_an_action_is_refused_without_the_token_the_cookie_or_from_another_origin(queue: SqliteQueue) -> None:
    in_every_status(queue)
    with serving(QueueSource(queue, "q.db"), allow_actions=True) as server:
        token, cookie = token_and_cookie(server, "/run/r-queued")
        host = urllib.parse.urlsplit(server.url).netloc
        refused = [
            ({}, {}),  # nothing
            ({"token": token}, {}),  # the form's token without the cookie (a cross-site form)
            ({}, {"Cookie": cookie}),  # the cookie without the token
            ({"token": "wrong"}, {"Cookie": cookie}),
            ({"token": token}, {"Cookie": cookie.split("=")[0] + "=wrong"}),
            ({"token": token}, {"Cookie": "ekit_ui=" + token}),  # another port's cookie name
            ({"token": token}, {"Cookie": cookie, "Origin": "http://evil.example"}),
        ]
        for form, headers in refused:
            got = fetch(server, "/run/r-queued/cancel", form, headers)
            assert got.status == 403, (form, headers)
            assert token not in got.body
        assert queue.status("r-queued").status == "queued"
        got = fetch(server, "/run/r-queued/cancel", {"token": token},
                    {"Cookie": cookie, "Origin": f"http://{host}"})
        assert got.status == 303 and got.headers["Location"] == "/run/r-queued"
        assert queue.status("r-queued").status == "cancelled"


def _approval_waiting(q: RunQueue, run_id: str) -> None:
    q.submit("wf-approval", {}, run_id=run_id)
    lease = q.claim("w1", {"wf-approval": None}, 60)
    assert lease is not None and lease.run_id == run_id
    q.save(lease, checkpoint({"a": [], "b": ["a"]}, {"a": 1},
                             asked={"b": [{"kind": "approval", "prompt": "ship it?"}]}), 60)
    q.park(lease, "approval")


@pytest.mark.parametrize(("verb", "run_id", "form"), [
    ("cancel", "r-queued", {}),
    ("retry", "r-failed", {}),
    ("answer", "r-waiting", {"step": "b", "value": "2"}),
    ("approve", "r-approval", {"step": "b"}),
    ("deny", "r-approval", {"step": "b", "reason": "no"}),
])
def test_every_action_is_refused_without_the_token_and_works_with_it(
    queue: SqliteQueue, verb: str, run_id: str, form: dict[str, str]
) -> None:
    in_every_status(queue)
    _approval_waiting(queue, "r-approval")
    with serving(QueueSource(queue, "q.db"), allow_actions=True) as server:
        token, cookie = token_and_cookie(server, "/run/" + run_id)
        assert f'action="/run/{run_id}/{verb}"' in fetch(server, "/run/" + run_id).body
        before = (queue.status(run_id), queue.checkpoint(run_id))
        for sent, headers in [
            (form, {}),  # no token, no cookie
            ({**form, "token": "wrong"}, {"Cookie": cookie}),  # a forged token with the cookie
            ({**form, "token": token}, {}),  # the token without the cookie
            (form, {"Cookie": cookie}),  # the cookie without the token
            ({**form, "token": token}, {"Cookie": cookie, "Origin": "http://evil.example"}),
        ]:
            got = fetch(server, f"/run/{run_id}/{verb}", sent, headers)
            assert got.status == 403, (verb, sent, headers)
            assert (queue.status(run_id), queue.checkpoint(run_id)) == before  # nothing written
        got = fetch(server, f"/run/{run_id}/{verb}", {**form, "token": token}, {"Cookie": cookie})
        assert got.status == 303, got.body
    after = queue.status(run_id)
    assert after.status == ("cancelled" if verb == "cancel" else "queued")
    if verb in ("answer", "approve", "deny"):
        answer = queue.checkpoint(run_id).asked["b"][-1].answer  # type: ignore[union-attr]
        assert answer is not None and answer.by == "dashboard"
        assert {"answer": answer.value == 2, "approve": answer.approved is True,
                "deny": answer.approved is False and answer.reason == "no"}[verb]


def test_a_request_naming_another_host_is_refused(queue: SqliteQueue) -> None:
    """DNS rebinding: a site whose name now points at 127.0.0.1 reads no page and acts on nothing."""
    in_every_status(queue)
    with serving(QueueSource(queue, "q.db"), allow_actions=True) as server:
        port = urllib.parse.urlsplit(server.url).port
        token, cookie = token_and_cookie(server, "/run/r-queued")
        assert cookie.startswith(f"ekit_ui_{port}=")
        for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1:{port}0"):
            assert fetch(server, "/", headers={"Host": host}).status == 403, host
            assert fetch(server, "/api/runs", headers={"Host": host}).status == 403, host
            got = fetch(server, "/run/r-queued/cancel", {"token": token}, {"Cookie": cookie, "Host": host})
            assert got.status == 403
        assert queue.status("r-queued").status == "queued"
        for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
            assert fetch(server, "/", headers={"Host": host}).status == 200, host


def test_answer_approve_and_retry_through_the_dashboard(any_queue: RunQueue) -> None:
    queue = any_queue
    in_every_status(queue)
    queue.submit("wf-approval", {}, run_id="r-approval")
    lease = queue.claim("w1", {"wf-approval": None}, 60)
    assert lease is not None
    queue.save(lease, checkpoint({"a": [], "b": ["a"]}, {"a": 1},
                                 asked={"b": [{"kind": "approval", "prompt": "ship it?"}]}), 60)
    queue.park(lease, "approval")
    with serving(QueueSource(queue, "q.db"), allow_actions=True) as server:
        token, cookie = token_and_cookie(server, "/run/r-waiting")
        page = fetch(server, "/run/r-waiting").body
        assert 'action="/run/r-waiting/answer"' in page
        got = fetch(server, "/run/r-waiting/answer", {"token": token, "step": "b", "value": '{"pick": 2}',
                                                       "by": "ann"}, {"Cookie": cookie})
        assert got.status == 303
        assert queue.status("r-waiting").status == "queued"
        answer = queue.checkpoint("r-waiting").asked["b"][-1].answer  # type: ignore[union-attr]
        assert answer is not None and answer.value == {"pick": 2} and answer.by == "ann"
        assert 'action="/run/r-approval/approve"' in fetch(server, "/run/r-approval").body
        got = fetch(server, "/run/r-approval/approve", {"token": token, "step": "b"}, {"Cookie": cookie})
        assert got.status == 303 and queue.status("r-approval").status == "queued"
        assert 'action="/run/r-failed/retry"' in fetch(server, "/run/r-failed").body
        got = fetch(server, "/run/r-failed/retry", {"token": token}, {"Cookie": cookie})
        assert got.status == 303 and queue.status("r-failed").status == "queued"
        # A verb the run's status refuses: 409 with the queue's reason, nothing written.
        got = fetch(server, "/run/r-finished/retry", {"token": token}, {"Cookie": cookie})
        assert got.status == 409 and "cannot retry" in got.body
        assert fetch(server, "/run/nope/cancel", {"token": token}, {"Cookie": cookie}).status == 404


def _workflow() -> Workflow:
    return Workflow([Step("draft", lambda c: "d"), Step("review", lambda c: c["draft"] + "!", ("draft",))])


def test_a_json_file_store_is_shown_as_its_checkpoint(tmp_path: Any) -> None:
    path = str(tmp_path / "run.json")
    _workflow().run_sync({}, checkpoint_fn=JsonFileStore(path))
    source = FileSource(path)
    with serving(source, allow_actions=True) as server:
        page = fetch(server, "/")
        assert rows(page.body) == ["run.json"] and "finished" in page.body
        run = fetch(server, "/run/run.json")
        assert run.status == 200
        assert '<g class="node state-recorded" data-step="review">' in run.body
        assert 'id="timeline"' not in run.body and 'name="token"' not in run.body
        assert fetch(server, "/run/other").status == 404
        assert fetch(server, "/run/run.json/cancel", {"token": "x"}).status == 405


def test_a_sqlite_store_file_shows_the_run_picked(tmp_path: Any) -> None:
    from ekit_runtime import SqliteStore

    path = str(tmp_path / "runs.sqlite")
    with SqliteStore(path, run_id="nightly") as store:
        _workflow().run_sync({}, checkpoint_fn=store)
    with serving(FileSource(path, run_id="nightly")) as server:
        assert rows(fetch(server, "/").body) == ["nightly"]
        assert '<g class="node state-recorded" data-step="review">' in fetch(server, "/run/nightly").body


def test_a_store_file_that_goes_away_is_a_503_page_saying_so(tmp_path: Any) -> None:
    path = str(tmp_path / "gone.json")
    _workflow().run_sync({}, checkpoint_fn=JsonFileStore(path))
    with serving(FileSource(path)) as server:
        assert fetch(server, "/run/gone.json").status == 200
        os.remove(path)
        for page in ("/", "/run/gone.json", "/api/run/gone.json"):
            got = fetch(server, page)
            assert got.status == 503 and "no such file" in got.body and "Traceback" not in got.body
        with open(path, "w", encoding="utf-8") as f:
            f.write("{not json")
        got = fetch(server, "/run/gone.json")
        assert got.status == 503 and "invalid JSON" in got.body


def test_a_journal_store_shows_the_timeline_of_its_checkpoints(tmp_path: Any) -> None:
    path = str(tmp_path / "run.jsonl")
    with JournalStore(path) as journal:
        _workflow().run_sync({}, checkpoint_fn=journal)
    history = list(JournalStore(path).history())
    with serving(FileSource(path)) as server:
        body = fetch(server, "/run/run.jsonl").body
        assert 'id="timeline"' in body
        timeline = body.split('id="timeline"')[1].split("</table>")[0]
        assert timeline.count("<tr><td") == len(history) >= 2
        assert fetch(server, "/api/run/run.jsonl").json()["states"] == {"draft": "recorded",
                                                                         "review": "recorded"}


def test_a_2000_step_graph_renders_every_node(tmp_path: Any) -> None:
    names = [f"s{i}" for i in range(2000)]
    graph = {n: ([names[i - 1]] if i % 40 else []) for i, n in enumerate(names)}
    cp = checkpoint(graph, {n: i for i, n in enumerate(names[:700])})
    path = str(tmp_path / "big.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cp.to_dict(), f)
    with serving(FileSource(path)) as server:
        page = fetch(server, "/run/big.json")
        assert page.status == 200
        assert page.body.count('<g class="node ') == 2000
        assert page.body.count("node state-recorded") == 700
        assert len(fetch(server, "/api/run/big.json").json()["states"]) == 2000


@pytest.mark.timeout(60)
def test_ekit_ui_prints_its_url_first_and_serves(tmp_path: Any) -> None:
    db = str(tmp_path / "q.db")
    with SqliteQueue(db) as q:
        q.submit("wf", {}, run_id="r1")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-m", "ekit_runtime", "ui", "--queue", db],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", url), url
        with urllib.request.urlopen(url, timeout=30) as r:
            assert 'data-run-id="r1"' in r.read().decode()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_ekit_ui_refuses_both_or_neither_source(tmp_path: Any, capsys: Any) -> None:
    from ekit_runtime.cli import main

    assert main(["ui"]) == 2
    assert main(["ui", str(tmp_path / "x.json"), "--queue", str(tmp_path / "q.db")]) == 2
    assert main(["ui", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_the_ui_benchmark_runs_and_reports_its_figures(capsys: Any) -> None:
    from benchmarks import ui as ui_bench

    assert ui_bench.main(["--runs", "60", "--steps", "100", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "runs page at 60 runs:" in out and "met" in out
    assert "run page, 100-step graph" in out


def test_mapped_items_and_skips_by_a_condition_are_shown(tmp_path: Any) -> None:
    def summarize(ctx: dict[str, Any]) -> int:
        if ctx["split"] == 2:
            raise RuntimeError("item two broke")
        return int(ctx["split"]) * 10

    workflow = Workflow([
        Step("split", lambda c: [1, 2, 3]),
        Step("summarize", summarize, ("split",), map_over="split"),
        Step("never", lambda c: 1, ("split",), when=lambda c: False),
        Step("after", lambda c: 1, ("summarize",)),
    ])
    path = str(tmp_path / "mapped.json")
    with pytest.raises(RuntimeError, match="item two broke"):
        workflow.run_sync({}, checkpoint_fn=JsonFileStore(path))
    with serving(FileSource(path)) as server:
        body = fetch(server, "/run/mapped.json").body
        assert '<g class="node state-skipped" data-step="never">' in body
        assert '<g class="node state-failed" data-step="summarize">' in body
        assert "2/3 items" in body  # two of its three items recorded
        assert '<tr data-step="summarize[1]">' in body and "item two broke" in body
        assert fetch(server, "/api/run/mapped.json").json()["items"] == {"summarize": [2, 3]}
        runs = fetch(server, "/").body
        assert "failed" in runs
        # Counted as the queue counts: split and two items recorded, never skipped; 4 steps, 3 items.
        assert '<td class="num progress">4/7</td>' in runs
        assert "4/7 steps recorded or skipped" in body


@pytest.mark.timeout(120)
def test_ekit_ui_on_postgres_never_shows_the_password() -> None:
    with fresh_postgres() as url:
        with open_queue(url) as q:
            q.submit("wf", {}, run_id="pg-run")
        secret = "s3cr3t-ui-pw"
        dsn = url + "&password=" + secret
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        proc = subprocess.Popen([sys.executable, "-m", "ekit_runtime", "ui", "--queue", dsn],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            assert proc.stdout is not None
            base = proc.stdout.readline().strip()
            assert base.startswith("http://127.0.0.1:"), base
            for path in ("", "run/pg-run", "api/runs", "api/run/pg-run", "run/nope"):
                try:
                    with urllib.request.urlopen(base + path, timeout=30) as r:
                        body = r.read().decode()
                except urllib.error.HTTPError as e:
                    body = e.read().decode()
                assert secret not in body, path
            with urllib.request.urlopen(base, timeout=30) as r:
                page = r.read().decode()
            assert 'data-run-id="pg-run"' in page and "password=***" in page
        finally:
            proc.terminate()
            _, err = proc.communicate(timeout=30)
        assert secret not in err
