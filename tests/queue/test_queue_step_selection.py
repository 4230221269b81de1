"""A queued run with the ``only`` option runs just the selection, by a real ``ekit worker``.

``submit(options={"only": [...]})`` (or ``ekit queue submit --option
'only=[...]'``) stores the selection with the run; the worker process that
drives it runs exactly the selected steps and what they need, and the run
ends ``finished``. A fork of it without ``only`` (``fork(..., options={})``,
``ekit queue fork RUN --options '{}'``) resumes its checkpoint and pays for
just the rest. A selection that is not a list of names is refused at submit,
naming the option; one that names no step of the workflow fails the run
before any step starts, naming the step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime.cli import main
from ekit_runtime.queue import RunQueue, open_queue
from tests.support.queue_backends import queue, queue_url
from tests.support.queue_only_child import starts

__all__ = ["queue", "queue_url"]

ROOT = Path(__file__).resolve().parents[2]
FLOWS = "tests.support.queue_only_child:REGISTRY"
REST = ["translate", "polish", "chunks", "chunks", "report"]  # (chunks: once per item)


def _worker(url: str) -> dict[str, Any]:
    """Run ``ekit worker --until-idle`` as its own process; its JSON summary."""
    done = subprocess.run(
        [sys.executable, "-m", "ekit_runtime", "worker", "--queue", url, "--workflows", FLOWS,
         "--until-idle", "--lease", "10"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def _paid(logdir: Path, run_id: str) -> list[str]:
    return [step for run, step in starts(str(logdir)) if run == run_id]


@pytest.mark.timeout(180)
def test_a_queued_selection_runs_its_closure_and_a_fork_without_it_runs_the_rest(
    queue_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with open_queue(queue_url) as q:
        q.submit("branches", {"logdir": str(tmp_path)}, run_id="sel", options={"only": ["summary"]})
    assert _worker(queue_url)["runs"] == {"finished": 1}
    with open_queue(queue_url) as q:
        info = q.status("sel")
        assert info.status == "finished" and info.error is None
        assert dict(info.options) == {"only": ["summary"]}
        assert info.steps_done == 2 and info.steps_total > 6  # (and the items fetch's pages make)
        checkpoint = q.checkpoint("sel")
        assert checkpoint is not None and set(checkpoint.outputs) == {"fetch", "summary"}
    assert _paid(tmp_path, "sel") == ["fetch", "summary"]

    # The rest, from its checkpoint: a fork without the selection (here through the CLI).
    assert main(["queue", "--queue", queue_url, "fork", "sel", "--run-id", "rest", "--options", "{}"]) == 0
    capsys.readouterr()
    with open_queue(queue_url) as q:
        assert dict(q.status("rest").options) == {}
    assert _worker(queue_url)["runs"] == {"finished": 1}
    assert sorted(_paid(tmp_path, "rest")) == sorted(REST)  # nothing paid twice
    with open_queue(queue_url) as q:
        result = q.result("rest")
        assert result is not None and result.outputs["report"] == (
            "report<summary<['p1', 'p2']>,polish<translate<['p1', 'p2']>>,['chunk of p1', 'chunk of p2']>"
        )
        assert q.status("rest").steps_done == q.status("rest").steps_total
        # A fork keeps the source's options unless told otherwise.
        again = q.fork("sel", new_run_id="same")
        assert dict(q.status("same").options) == {"only": ["summary"]}
        with pytest.raises(ValueError, match="run option 'only' must name at least one step"):
            q.fork("sel", options={"only": []})
        assert q.cancel(again)


@pytest.mark.timeout(180)
def test_ekit_queue_submit_takes_only_and_a_bad_name_fails_the_run_before_any_step(
    queue_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    context = json.dumps({"logdir": str(tmp_path)})
    assert main(["queue", "--queue", queue_url, "submit", "branches", "--context", context,
                 "--run-id", "cli", "--option", 'only=["polish"]']) == 0
    assert main(["queue", "--queue", queue_url, "submit", "branches", "--context", context,
                 "--run-id", "json", "--options", '{"only": ["chunks", "summary"]}']) == 0
    assert main(["queue", "--queue", queue_url, "submit", "branches", "--context", context,
                 "--run-id", "typo", "--option", 'only=["sumary"]']) == 0
    capsys.readouterr()
    assert _worker(queue_url)["runs"] == {"failed": 1, "finished": 2}
    assert _paid(tmp_path, "cli") == ["fetch", "translate", "polish"]
    assert sorted(_paid(tmp_path, "json")) == ["chunks", "chunks", "fetch", "summary"]
    assert _paid(tmp_path, "typo") == []
    with open_queue(queue_url) as q:
        typo = q.status("typo")
        assert typo.status == "failed" and typo.error is not None
        assert "only names unknown step 'sumary'" in typo.error and "'summary'" in typo.error


@pytest.mark.parametrize(
    ("only", "message"),
    [
        ("summary", "run option 'only' must be a list of step names"),
        ([], "run option 'only' must name at least one step"),
        (["summary", 3], r"run option 'only': \[1\] must be a step name"),
        ([""], r"run option 'only': \[0\] must be a step name"),
    ],
)
def test_a_bad_only_is_refused_at_submit_naming_it(queue: RunQueue, only: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        queue.submit("branches", {}, run_id="bad", options={"only": only})
    assert queue.runs() == []


def test_the_cli_refuses_a_bare_name_saying_what_to_write(
    queue_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["queue", "--queue", queue_url, "submit", "branches", "--option", "only=summary"]) != 0
    assert 'such as ["summary"]' in capsys.readouterr().err
