"""``/api/run/<id>/stream``: a queued run's stream as server-sent events, resumable, refusing bad input.

Over real HTTP (urllib, as a client would): a response carries each event as
``id: OFFSET``, ``event: KIND`` and one line of JSON, and ends with ``end``
once the run has ended; a request with ``Last-Event-ID: N`` (what a
reconnecting ``EventSource`` sends) gets exactly the events after N. A bad
offset, an unknown run or a dashboard of a store file is a plain HTTP error
before any event.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime.queue import SqliteQueue
from ekit_runtime.queue.streams import Published
from ekit_runtime.ui import FileSource, QueueSource
from tests.support.dashboard_http import fetch, serving

pytestmark = pytest.mark.timeout(60)

HOSTILE = '<img src=x onerror="alert(1)">\u2028</script>'


def events_of(body: str) -> list[dict[str, Any]]:
    found = []
    for block in body.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in fields:
            found.append({"id": int(fields["id"]), "event": fields["event"], **json.loads(fields["data"])})
    return found


@pytest.fixture
def ended_run(tmp_path: Path) -> Iterator[SqliteQueue]:
    queue = SqliteQueue(str(tmp_path / "runs.db"))
    queue.submit("w", {}, run_id="run-1")
    lease = queue.claim("w1", {"w": None}, 30)
    assert lease is not None
    tokens = [Published("partial", "s", json.dumps(f"t{i} "), time.time()) for i in range(20)]
    queue.publish_many([(lease, [*tokens, Published("partial", "s", json.dumps(HOSTILE), time.time())])], 100)
    queue.finish(lease, "finished")
    yield queue
    queue.close()


def test_the_stream_is_sent_as_events_and_resumes_after_last_event_id(ended_run: SqliteQueue) -> None:
    with serving(QueueSource(ended_run, "q")) as server:
        whole = fetch(server, "/api/run/run-1/stream")
        assert whole.status == 200 and whole.headers["Content-Type"].startswith("text/event-stream")
        assert whole.headers["X-Content-Type-Options"] == "nosniff"
        events = events_of(whole.body)
        assert [e["id"] for e in events] == [*range(1, 22), 21]
        assert events[-1]["event"] == "end" and events[-1]["data"]["status"] == "finished"
        assert events[20]["data"] == HOSTILE  # JSON text, never HTML: the page writes it as text
        resumed = events_of(fetch(server, "/api/run/run-1/stream", headers={"Last-Event-ID": "7"}).body)
        assert [e["id"] for e in resumed] == [*range(8, 22), 21]
        assert [e["data"] for e in resumed[:2]] == ["t7 ", "t8 "]
        by_query = events_of(fetch(server, "/api/run/run-1/stream?after=19").body)
        assert [e["id"] for e in by_query] == [20, 21, 21]


@pytest.mark.parametrize(("headers", "path", "code", "said"), [
    ({"Last-Event-ID": "abc"}, "/api/run/run-1/stream", 400, "whole number"),
    ({"Last-Event-ID": "-1"}, "/api/run/run-1/stream", 400, "whole number"),
    ({"Last-Event-ID": "9" * 40}, "/api/run/run-1/stream", 400, "whole number"),
    ({}, "/api/run/run-1/stream?after=1&after=2", 400, "one Last-Event-ID"),
    ({}, "/api/run/run-1/stream?after=22", 400, "past the last event"),
    ({}, "/api/run/no-such-run/stream", 404, "no run"),
    ({}, "/api/run/run-1/streams", 404, "no such page"),
])
def test_bad_offsets_and_runs_are_refused_before_any_event(
    ended_run: SqliteQueue, headers: dict[str, str], path: str, code: int, said: str
) -> None:
    with serving(QueueSource(ended_run, "q")) as server:
        page = fetch(server, path, headers=headers)
        assert page.status == code and said in page.json()["error"], page.body


def test_a_store_files_dashboard_has_no_stream(tmp_path: Path) -> None:
    path = tmp_path / "cp.json"
    path.write_text(json.dumps({"step_index": 0, "outputs": {}, "cost": {}}))
    with serving(FileSource(str(path))) as server:
        page = fetch(server, "/api/run/cp.json/stream")
        assert page.status == 404 and "only a queue's runs" in page.json()["error"]
