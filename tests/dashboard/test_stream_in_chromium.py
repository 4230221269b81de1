"""In a real browser, a queued run's page shows the tokens its worker's step streams, as they arrive.

The promise (docs/streams.md, docs/dashboard.md): the run page's "Live stream"
shows each step's ``partial()`` output in order while the step runs, and its
events as lines; the browser's ``EventSource`` reconnects after any dropped
response with the offset of the last event it got, and the server resumes
after it, so that nothing is shown twice or skipped.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import Step, Workflow, partial
from ekit_runtime.queue import SqliteQueue
from ekit_runtime.queue.streams import Published
from ekit_runtime.ui import QueueSource
from ekit_runtime.ui.server import make_server
from tests.support.browser import (
    UiServer,
    chrome,
    require_browser,
    run_url,
    severe_console_errors,
    wait_for_status,
    wait_until,
)
from tests.support.stream_workflows import tokens
from tests.support.ui_flows import WorkerThread

pytestmark = pytest.mark.timeout(150)

PHASE = 200
PHASES = 3
GATES = [threading.Event() for _ in range(PHASES - 1)]
FIRST = PHASE


def _open_gates() -> None:
    for gate in GATES:
        gate.set()


async def _stream(ctx: Any) -> str:
    for phase in range(PHASES):
        if phase:
            await asyncio.to_thread(GATES[phase - 1].wait, 60)  # the test says when the next come
        for i in range(phase * PHASE, (phase + 1) * PHASE):
            partial(f"t{i} ")
            if i % 10 == 9:
                await asyncio.sleep(0.005)  # a model's next chunk
    return "done"


STREAMING = Workflow([Step("write", _stream)])


def shown(driver: Any) -> dict[str, Any]:
    state: dict[str, Any] = driver.execute_script(
        "var box = document.getElementById('stream');"
        "var texts = []; box.querySelectorAll('pre.stream-text').forEach(function (p) {"
        "  texts.push([p.dataset.step, p.textContent]); });"
        "var lines = []; box.querySelectorAll('.stream-event').forEach(function (d) {"
        "  lines.push(d.textContent); });"
        "return {texts: texts, lines: lines, ended: box.dataset.ended || '',"
        "        opens: Number(box.dataset.opens || 0), last: box.dataset.last || ''};"
    )
    return state


@pytest.fixture
def queue(tmp_path: Path) -> Iterator[SqliteQueue]:
    require_browser()
    for gate in GATES:
        gate.clear()
    q = SqliteQueue(str(tmp_path / "runs.db"))
    q.submit("streaming", {}, run_id="stream-1")
    try:
        yield q
    finally:
        _open_gates()
        q.close()


def _check_the_whole_stream(state: dict[str, Any]) -> None:
    assert state["texts"] == [["write", tokens(PHASES * PHASE)]]  # in order, none lost, none twice
    assert state["lines"][0].startswith("claimed by ")
    assert state["lines"][1:] == [
        "started write (attempt 1)", "finished write (attempt 1)", "the run finished",
    ]


def test_tokens_a_workers_step_streams_appear_on_the_run_page_in_order(
    queue: SqliteQueue, tmp_path: Path
) -> None:
    with WorkerThread(queue, {"streaming": STREAMING}, release=_open_gates), \
            UiServer(["--queue", str(tmp_path / "runs.db"), "--port", "0"]) as server, chrome() as driver:
        driver.get(run_url(server, "stream-1"))
        # The first tokens are on the page while the step is still running.
        wait_until(driver, lambda d: shown(d)["texts"] == [["write", tokens(FIRST)]], 30,
                   "the first tokens on the page")
        assert queue.status("stream-1").status == "running"
        _open_gates()
        wait_for_status(queue, "stream-1", "finished")
        state = wait_until(driver, lambda d: (s := shown(d))["ended"] and s, 30, "the stream's end")
        _check_the_whole_stream(state)
        assert not severe_console_errors(driver)


def test_an_eventsource_reconnect_resumes_from_its_offset_without_gap_or_repeat(queue: SqliteQueue) -> None:
    # The server's own dashboard, each response of the stream cut after a quarter of a second:
    # the browser reconnects again and again while the tokens arrive.
    server = make_server(QueueSource(queue, "test queue"), port=0)
    server.stream_seconds = 0.25
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    try:
        with WorkerThread(queue, {"streaming": STREAMING}, release=_open_gates), chrome() as driver:
            driver.get(f"{server.url}run/stream-1")
            for phase, gate in enumerate(GATES, 1):
                # This phase's tokens are shown, and the browser has reconnected since: the
                # next ones come after a reconnect that resumes from the last event it got.
                wait_until(driver, lambda d, p=phase: shown(d)["texts"] == [["write", tokens(p * PHASE)]],
                           30, f"the tokens of phase {phase} on the page")
                opens = shown(driver)["opens"]
                wait_until(driver, lambda d, o=opens: shown(d)["opens"] > o, 30, "a reconnect")
                gate.set()
            state = wait_until(driver, lambda d: (s := shown(d))["ended"] and s, 60, "the stream's end")
            assert state["opens"] >= PHASES, state["opens"]
            _check_the_whole_stream(state)
            assert not severe_console_errors(driver)
    finally:
        server.shutdown()
        server.server_close()
        serving.join(10)


HOSTILE = '<img src=x onerror="document.body.dataset.owned=1">\u2028</pre><b>bold</b>'


def test_a_hostile_token_is_shown_as_text(tmp_path: Path) -> None:
    require_browser()
    queue = SqliteQueue(str(tmp_path / "runs.db"))
    queue.submit("w", {}, run_id="hostile-1")
    lease = queue.claim("w1", {"w": None}, 30)
    assert lease is not None
    queue.publish_many([(lease, [Published("partial", "<s>", json.dumps(HOSTILE), time.time())])], 100)
    queue.finish(lease, "finished")
    try:
        with UiServer(["--queue", str(tmp_path / "runs.db"), "--port", "0"]) as server, chrome() as driver:
            driver.get(run_url(server, "hostile-1"))
            state = wait_until(driver, lambda d: (s := shown(d))["ended"] and s, 30, "the stream's end")
            assert state["texts"] == [["<s>", HOSTILE]]
            made = driver.execute_script(
                "return [document.querySelectorAll('#stream img, #stream b').length,"
                " document.body.dataset.owned || ''];")
            assert made == [0, ""]
    finally:
        queue.close()
