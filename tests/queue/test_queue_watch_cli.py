"""``ekit queue watch RUN``: a run's tokens as they arrive and its events as lines, until it ends.

Real processes: an ``ekit worker`` drives the runs while ``ekit queue watch``
follows them; the exit code says how the run ended (0 finished, 1 failed),
and a run or an offset it cannot follow is one line on stderr, exit 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ekit_runtime.queue import open_queue
from tests.support.queue_backends import queue_url
from tests.support.stream_workflows import tokens

__all__ = ["queue_url"]

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT))}


def ekit(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "ekit_runtime", *args], cwd=ROOT, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_watch_prints_the_tokens_in_order_and_exits_as_the_run_ended(queue_url: str) -> None:
    queue = open_queue(queue_url)
    talk = queue.submit("talk", {"n": 400})
    fail = queue.submit("fail", {})
    queue.close()
    # Started first: the watchers wait for the runs' first events.
    watchers = [ekit("queue", "--queue", queue_url, "watch", run) for run in (talk, fail)]
    worker = ekit("worker", "--queue", queue_url, "--workflows", "tests.support.stream_workflows:WORKFLOWS",
                  "--until-idle", "-q")
    (out, err), (failed_out, _) = (w.communicate(timeout=180) for w in watchers)
    worker.communicate(timeout=180)
    assert watchers[0].returncode == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("#1 claimed by ") and lines[1] == "#2 started talk (attempt 1)"
    assert lines[2] == "talk: " + tokens(400)
    assert lines[3] == "#403 finished talk (attempt 1)" and lines[4] == "#403 end: the run finished"
    assert watchers[1].returncode == 1
    assert failed_out.splitlines()[-1] == "#4 end: the run failed: ValueError: the step failed on purpose"
    # Resumed from an offset, as JSON: exactly the events after it.
    resumed = ekit("queue", "--queue", queue_url, "watch", talk, "--after", "400", "--json")
    got, _ = resumed.communicate(timeout=60)
    assert resumed.returncode == 0
    assert [json.loads(line)["offset"] for line in got.splitlines()] == [401, 402, 403, 403]


@pytest.mark.parametrize(("args", "said"), [
    (["no-such-run"], "no run 'no-such-run'"),
    (["RUN", "--after", "-1"], "after must be a whole number from 0"),
    (["RUN", "--after", "5"], "past the last event"),
])
def test_watch_refuses_what_it_cannot_follow_in_one_line(queue_url: str, args: list[str], said: str) -> None:
    queue = open_queue(queue_url)
    run = queue.submit("talk", {})
    queue.close()
    proc = ekit("queue", "--queue", queue_url, "watch", *[run if a == "RUN" else a for a in args])
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and said in err and len(err.strip().splitlines()) == 1, (out, err)
