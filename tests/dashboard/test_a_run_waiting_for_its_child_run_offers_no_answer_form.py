"""A queued run parked for its child run (decision 022) is shown waiting for that child, never
offered a form to answer: the child's end resumes it, and the queue refuses a person's answer.

The wait is a question whose details name the child run
(:data:`ekit_runtime.child_runs.CHILD_RUN`); with ``--allow-actions`` the run
page and the runs page's "waiting for you" list link to the child instead of
a form, while a person's question beside it keeps its form.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from ekit_runtime.child_runs import CHILD_RUN
from ekit_runtime.queue import SqliteQueue
from ekit_runtime.ui import QueueSource
from tests.support.dashboard_http import checkpoint, fetch, serving

GRAPH = {"brief": [], "write": ["brief"], "check": ["brief"]}
CHILD = "p1/write"


@pytest.fixture
def queue(tmp_path: Any) -> Iterator[SqliteQueue]:
    with SqliteQueue(str(tmp_path / "q.db")) as q:
        q.submit("wf-p", {}, run_id="p1")
        lease = q.claim("w1", {"wf-p": None}, 60)
        assert lease is not None
        asked = {
            "write": [{"kind": "value", "prompt": f"waiting for child run {CHILD!r}",
                       "details": {CHILD_RUN: CHILD}}],
            "check": [{"kind": "value", "prompt": "is the brief right?", "details": None}],
        }
        q.save(lease, checkpoint(GRAPH, {"brief": "b"}, asked=asked), 60)
        q.park(lease, "waiting for child run 'p1/write'")
        yield q


def _question(page: str, step: str) -> str:
    found = re.search(rf'<div class="question[^"]*" data-step="{step}">.*?</div>', page, re.S)
    assert found is not None, f"no question of {step!r} on the page"
    return found.group(0)


@pytest.mark.parametrize("path", ["/run/p1", "/"])
def test_a_child_wait_links_to_the_child_and_has_no_form(queue: SqliteQueue, path: str) -> None:
    with serving(QueueSource(queue, "q"), allow_actions=True) as server:
        page = fetch(server, path).body
    child = _question(page, "write")
    assert "child-wait" in child and 'href="/run/p1%2Fwrite"' in child, child
    assert "<form" not in child
    # A person's question of the same run keeps its form.
    assert "<form" in _question(page, "check")
