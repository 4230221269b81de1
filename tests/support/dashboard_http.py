"""Talk to a real ``ekit ui`` server over HTTP, as a browser would, and fill a queue to show.

Shared by the dashboard tests that read pages with urllib (tests/dashboard/).
"""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ekit_core import WorkflowCheckpoint
from ekit_runtime.queue import RunQueue
from ekit_runtime.ui import Dashboard, Source, make_server

USAGE = {"input_tokens": 10, "output_tokens": 5, "llm_calls": 1}


def checkpoint(graph: dict[str, list[str]], outputs: dict[str, Any], **more: Any) -> WorkflowCheckpoint:
    data = {"format_version": 3, "step_index": len(outputs), "outputs": outputs, "cost": USAGE,
            "context": {}, "step_usage": {}, "graph": graph, **more}
    return WorkflowCheckpoint.from_dict(data)


class Page:
    def __init__(self, status: int, headers: Any, body: str) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> Any:
        return json.loads(self.body)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def fetch(server: Dashboard, path: str, data: dict[str, str] | None = None,
          headers: dict[str, str] | None = None) -> Page:
    body = None if data is None else urllib.parse.urlencode(data).encode()
    req = urllib.request.Request(server.url.rstrip("/") + path, data=body, headers=headers or {})
    try:
        with _OPENER.open(req, timeout=30) as r:
            return Page(r.status, r.headers, r.read().decode())
    except urllib.error.HTTPError as e:
        return Page(e.code, e.headers, e.read().decode())


@contextmanager
def serving(source: Source, allow_actions: bool = False) -> Iterator[Dashboard]:
    server = make_server(source, allow_actions=allow_actions)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)


def in_every_status(q: RunQueue) -> None:
    """One run per status, each of its own workflow (so that a claim picks it)."""
    graph = {"a": [], "b": ["a"], "c": ["b"]}
    q.submit("wf-queued", {}, run_id="r-queued")
    q.submit("wf-running", {}, run_id="r-running")
    lease = q.claim("w1", {"wf-running": None}, 60)
    assert lease is not None
    q.save(lease, checkpoint(graph, {"a": 1}), 60)
    q.submit("wf-waiting", {}, run_id="r-waiting")
    lease = q.claim("w1", {"wf-waiting": None}, 60)
    assert lease is not None
    q.save(lease, checkpoint(graph, {"a": 1}, asked={"b": [{"kind": "value", "prompt": "which?"}]}), 60)
    q.park(lease, "step 'b' waits for an answer")
    q.submit("wf-finished", {}, run_id="r-finished")
    lease = q.claim("w1", {"wf-finished": None}, 60)
    assert lease is not None
    q.save(lease, checkpoint(graph, {"a": 1, "b": 2, "c": 3}), 60)
    q.finish(lease, "finished")
    q.submit("wf-failed", {}, run_id="r-failed")
    lease = q.claim("w1", {"wf-failed": None}, 60)
    assert lease is not None
    failure = {"b": {"error_type": "RuntimeError", "message": "the model said no", "attempts": 3}}
    q.save(lease, checkpoint(graph, {"a": 1}, failures=failure), 60)
    q.finish(lease, "failed", "RuntimeError: the model said no")
    q.submit("wf-cancelled", {}, run_id="r-cancelled")
    q.cancel("r-cancelled")


def token_and_cookie(server: Dashboard, path: str) -> tuple[str, str]:
    page = fetch(server, path)
    match = re.search(r'name="token" value="([^"]+)"', page.body)
    assert match is not None
    cookie = page.headers["Set-Cookie"]
    assert "SameSite=Strict" in cookie and "HttpOnly" in cookie
    return match.group(1), cookie.split(";")[0]
