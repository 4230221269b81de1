"""``ekit queue list`` prints a table people read; ``--json`` the records machines read.

One line per run: id, workflow, status, steps done/total, calls and tokens,
age since submitted (``5s``, ``3m``, ``2h``, ``4d``), owner and why it waits
(or a failed run's error); ``--status`` and ``--workflow`` filter it.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from ekit_core import TokenUsage
from ekit_runtime.cli import main
from ekit_runtime.queue import RunInfo, Worker, open_queue
from ekit_runtime.queue.cli import age_text, runs_table
from tests.support.queue_backends import queue_url
from tests.support.queue_options_child import REGISTRY

__all__ = ["queue_url"]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (5.9, "5s"), (59, "59s"), (60, "1m"), (199, "3m"), (3599, "59m"), (7200, "2h"),
     (86_399, "23h"), (4 * 86_400 + 5, "4d"), (-3, "0s")],
)
def test_ages_are_short_whole_units(seconds: float, text: str) -> None:
    assert age_text(seconds) == text


def _info(run_id: str, **changes: object) -> RunInfo:
    fields: dict[str, object] = {
        "run_id": run_id, "workflow": "digest", "status": "queued", "priority": 0, "epoch": 0, "owner": None,
        "lease_until": None, "cancel_requested": False, "error": None, "created_at": 1000.0,
        "updated_at": 1000.0, "fingerprint": None,
    }
    fields.update(changes)
    return RunInfo(**fields)  # type: ignore[arg-type]


def test_the_table_lines_up_and_says_why_runs_wait() -> None:
    runs = [
        _info("doc-1", status="running", owner="host:12", steps_done=2, steps_total=5,
              cost=TokenUsage(100, 20, 3), reason="rate limit llm_calls_per_minute", created_at=1000 - 175),
        _info("doc-22", reason="no worker has workflow digest", created_at=1000 - 7300),
        _info("doc-3", status="failed", steps_done=1, steps_total=5, error="ValueError: bad\ninput",
              created_at=995),
    ]
    lines = runs_table(runs, 1000.0).splitlines()
    header = ["RUN", "WORKFLOW", "STATUS", "STEPS", "CALLS", "TOKENS", "AGE", "OWNER", "REASON"]
    assert lines[0].split() == header
    assert lines[1].split() == ["doc-1", "digest", "running", "2/5", "3", "120", "2m", "host:12", "rate",
                                "limit", "llm_calls_per_minute"]
    assert lines[2].split()[:8] == ["doc-22", "digest", "queued", "0/?", "0", "0", "2h", "-"]
    assert lines[2].endswith("no worker has workflow digest")
    assert lines[3].endswith("error: ValueError: bad input")  # one line per run, whatever the error holds
    starts = {line.index(line.split()[1]) for line in lines}  # the WORKFLOW column starts at one place
    assert len(starts) == 1
    assert runs_table([], 0.0).splitlines()[1] == "(no runs)"


@pytest.mark.timeout(120)
def test_list_filters_and_json(queue_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with open_queue(queue_url) as q:
        q.submit("mapped", {}, run_id="m1")
        asyncio.run(Worker(q, REGISTRY, poll=0.02).run_until_idle())
        q.submit("mapped", {}, run_id="m2", options={"max_concurrency": 1})
        q.submit("ghost", {}, run_id="g1")
    base = ["queue", "--queue", queue_url, "list"]
    assert main(base) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["RUN", "m1", "m2", "g1"]
    assert lines[1].split()[2:4] == ["finished", "6/6"]
    assert lines[3].endswith("no worker has workflow ghost")
    assert main([*base, "--status", "queued", "--workflow", "mapped"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["RUN", "m2"]
    assert main([*base, "--json", "--status", "queued"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["run_id"] for r in records] == ["m2", "g1"]
    assert records[0]["options"] == {"max_concurrency": 1}
    assert records[0]["cost"] == {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0}
    assert records[1]["reason"] == "no worker has workflow ghost"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", records[0]["created_at"])  # ISO 8601, UTC
    assert main([*base, "--last", "2"]) == 0  # the newest two, oldest first
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["RUN", "m2", "g1"]
    assert main([*base, "--last", "1", "--workflow", "mapped", "--json"]) == 0
    assert [r["run_id"] for r in json.loads(capsys.readouterr().out)] == ["m2"]
    assert main([*base, "--last", "-1"]) == 2
    assert "--last must be a whole number from 0, got -1" in capsys.readouterr().err
    assert main([*base, "--help"]) == 0
    assert "--json a JSON list of the runs' records instead of a table" in " ".join(
        capsys.readouterr().out.split()
    )
