"""Human input in the fleet: a run that waits for a person is parked, answered, and resumed elsewhere.

On SQLite and PostgreSQL, with ``ekit worker --until-idle`` processes over
the ``ask`` workflow of :mod:`tests.support.queue_reopen_flows` (``pick`` asks for a
value, then ``pay`` for an approval). What users rely on: a parked run holds
no lease and no worker (no claim takes it); a person answers it from another
process (``ekit queue answer``); another worker process resumes it and the
step receives the value; who answered is in the checkpoint and in
``ekit audit``; a denial ends the run without running the step; of two
answers given at once exactly one is recorded; an answer that does not fit
is refused, naming the run and the step, writing nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from ekit_core import Answer, WorkflowCheckpoint
from ekit_runtime.queue import RunQueue, RunStateError, Worker, open_queue
from ekit_runtime.queue import base as queue_base
from ekit_runtime.stores.errors import UnencodableError
from tests.support.queue_backends import live_leases, open_writes, queue, queue_url
from tests.support.queue_reopen_flows import WORKFLOWS, lines, starts

__all__ = ["queue", "queue_url"]

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
FLOWS = "tests.support.queue_reopen_flows:WORKFLOWS"
FINGERPRINTS = {name: w.graph.fingerprint for name, w in WORKFLOWS.items()}


def _env(logdir: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "EKIT_TEST_LOGDIR": str(logdir)}


def _drain(url: str, logdir: Path) -> dict[str, Any]:
    """A worker process that drives every claimable run, then exits; its JSON summary."""
    done = subprocess.run(
        [sys.executable, "-m", "ekit_runtime", "worker", "--queue", url, "--workflows", FLOWS,
         "--until-idle", "--lease", "5", "--heartbeat", "0.5"],
        cwd=ROOT, env=_env(logdir), capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr  # a parked run is not a run left behind
    summary: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return summary


def _ekit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ekit_runtime", *args], cwd=ROOT, env=_env(ROOT),
        capture_output=True, text=True, timeout=60,
    )


def _park(queue: RunQueue, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_id: str = "r") -> None:
    """Run ``run_id`` of ``ask`` in this process until it parks at ``pick``."""
    import asyncio

    monkeypatch.setenv("EKIT_TEST_LOGDIR", str(tmp_path))
    queue.submit("ask", {}, run_id=run_id)
    worker = Worker(queue, WORKFLOWS, poll=0.01)
    asyncio.run(worker.run_until_idle())
    assert worker.outcomes[run_id] == "parked"


def test_a_parked_run_holds_no_lease_and_is_resumed_on_another_worker_with_the_answer(
    queue: RunQueue, queue_url: str, tmp_path: Path
) -> None:
    queue.submit("ask", {}, run_id="r")
    assert _drain(queue_url, tmp_path)["runs"] == {"parked": 1}
    parked = queue.status("r")
    assert (parked.status, parked.lease_until, parked.owner) == ("waiting", None, None)
    assert parked.reason == "waiting for an answer to step 'pick': Which colour?"
    assert live_leases(queue_url) == 0
    assert queue.claim("any worker", FINGERPRINTS, 30) is None  # no claim takes a parked run
    assert queue.status("r") == parked
    first_pid = {pid for *_, pid in starts(str(tmp_path))}

    # What a person sees, from another process.
    status = _ekit("queue", "--queue", queue_url, "status", "r")
    assert status.returncode == 0, status.stderr
    shown = json.loads(status.stdout)
    assert shown["status"] == "waiting" and shown["questions"] == {
        "pick": {"kind": "value", "prompt": "Which colour?", "details": {"choices": ["red", "blue"]}}
    }
    listed = _ekit("queue", "--queue", queue_url, "list", "--status", "waiting")
    assert listed.returncode == 0 and "waiting for an answer to step 'pick': Which colour?" in listed.stdout

    answered = _ekit("queue", "--queue", queue_url, "answer", "r", "pick", '"blue"', "--by", "alice")
    assert answered.returncode == 0, answered.stderr
    assert json.loads(answered.stdout) == {
        "run_id": "r", "step": "pick", "status": "queued", "epoch": parked.epoch + 1, "by": "alice"
    }

    # Another worker process resumes it: pick receives the value, then pay asks its approval.
    assert _drain(queue_url, tmp_path)["runs"] == {"parked": 1}
    got = lines(str(tmp_path), "got")
    assert len(got) == 1 and got[0][:3] == ["r", "pick", "blue"] and int(got[0][3]) not in first_pid
    again = queue.status("r")
    assert (again.status, again.lease_until, again.owner) == ("waiting", None, None)
    assert again.reason == "waiting for an answer to step 'pay' (approve or deny): Pay $3 for the call?"
    assert _ekit("queue", "--queue", queue_url, "approve", "r", "pay", "--by", "bob").returncode == 0
    assert _drain(queue_url, tmp_path)["runs"] == {"finished": 1}

    result = queue.result("r")
    assert result is not None and dict(result.outputs) == {
        "a": result.outputs["a"], "pick": "picked blue", "pay": "paid"
    }
    assert len(lines(str(tmp_path), "paid")) == 1
    assert [s for _, s, _, _ in starts(str(tmp_path))].count("a") == 1  # never paid for twice
    checkpoint = queue.checkpoint("r")
    assert checkpoint is not None
    (pick,) = checkpoint.asked["pick"]
    (pay,) = checkpoint.asked["pay"]
    assert pick.answer is not None and (pick.answer.value, pick.answer.by) == ("blue", "alice")
    assert pay.answer is not None and (pay.answer.approved, pay.answer.by) == (True, "bob")
    assert isinstance(pick.answer.at, float)  # when, on the queue's clock
    audit = _ekit("audit", queue_url, "--run-id", "r")
    assert audit.returncode == 0, audit.stderr
    assert "answered by alice" in audit.stdout and "'blue'" in audit.stdout
    assert "answered by bob" in audit.stdout and "approved" in audit.stdout


def test_a_denied_approval_ends_the_run_failed_and_the_step_never_runs(
    queue: RunQueue, queue_url: str, tmp_path: Path
) -> None:
    queue.submit("ask", {}, run_id="r")
    _drain(queue_url, tmp_path)
    queue.answer("r", "pick", "red", by="alice")
    _drain(queue_url, tmp_path)
    denied = _ekit("queue", "--queue", queue_url, "deny", "r", "pay", "--reason", "too dear", "--by", "bob")
    assert denied.returncode == 0, denied.stderr
    assert _drain(queue_url, tmp_path)["runs"] == {"failed": 1}
    info = queue.status("r")
    assert info.status == "failed" and info.error is not None
    assert "ApprovalDenied" in info.error and "too dear" in info.error
    assert lines(str(tmp_path), "paid") == []
    checkpoint = queue.checkpoint("r")
    assert checkpoint is not None and "pay" not in checkpoint.outputs
    (pay,) = checkpoint.asked["pay"]
    assert pay.answer is not None and (pay.answer.approved, pay.answer.reason, pay.answer.by) == (
        False, "too dear", "bob"
    )


def test_two_people_answering_at_once_exactly_one_wins(
    queue: RunQueue, queue_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two processes answer the same question at once.
    _park(queue, tmp_path, monkeypatch)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ekit_runtime", "queue", "--queue", queue_url, "answer", "r", "pick",
             json.dumps(colour), "--by", colour],
            cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for colour in ("red", "blue")
    ]
    ends = [(p.wait(timeout=60), *p.communicate()) for p in procs]
    won = [i for i, (code, _, _) in enumerate(ends) if code == 0]
    assert len(won) == 1, ends
    loser = ends[1 - won[0]]
    assert loser[0] == 2 and "cannot answer run 'r' at step 'pick'" in loser[2] and loser[2].count("\n") == 1
    checkpoint = queue.checkpoint("r")
    assert checkpoint is not None
    (pick,) = checkpoint.asked["pick"]
    assert pick.answer is not None and pick.answer.by == ("red", "blue")[won[0]]


def test_an_answer_given_between_another_answers_read_and_write_wins_alone(
    queue: RunQueue, queue_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Deterministically: the rival answers while the first call is inside its transaction.
    _park(queue, tmp_path, monkeypatch)
    parked = queue.status("r")
    other = open_queue(queue_url)
    real = queue_base.answer_checkpoint  # type: ignore[attr-defined]
    rival_ends: list[Any] = []

    def rival() -> None:
        try:
            rival_ends.append(other.answer("r", "pick", "blue", by="bob"))
        except BaseException as exc:
            rival_ends.append(exc)

    thread = threading.Thread(target=rival)
    calls = [0]

    def answer_then_race(checkpoint: WorkflowCheckpoint, step: str, given: Answer) -> WorkflowCheckpoint:
        calls[0] += 1
        if calls[0] == 1:
            if queue.backend == "sqlite":
                assert open_writes(queue_url) == 1  # the rival waits for this transaction
                thread.start()
            else:
                thread.start()
                thread.join(timeout=60)  # the read took no lock: the rival commits first
                assert not thread.is_alive()
        return real(checkpoint, step, given)

    monkeypatch.setattr(queue_base, "answer_checkpoint", answer_then_race)
    try:
        if queue.backend == "postgres":
            with pytest.raises(RunStateError, match="changed while this call read it") as lost:
                queue.answer("r", "pick", "red", by="alice")
            assert rival_ends[0].status == "queued"
            winner = "bob"
        else:
            assert queue.answer("r", "pick", "red", by="alice").status == "queued"
            thread.join(timeout=60)
            assert isinstance(rival_ends[0], RunStateError)
            lost_error = rival_ends[0]
            assert "it is queued, not waiting for an answer" in str(lost_error)
            winner = "alice"
        if queue.backend == "postgres":
            assert (lost.value.run_id, lost.value.step) == ("r", "pick")
    finally:
        other.close()
    checkpoint = queue.checkpoint("r")
    assert checkpoint is not None
    (pick,) = checkpoint.asked["pick"]
    assert pick.answer is not None and pick.answer.by == winner
    assert queue.status("r").epoch == parked.epoch + 1  # one write, not two


def test_an_answer_that_does_not_fit_is_refused_naming_the_run_and_the_step(
    queue: RunQueue, queue_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue.submit("ask", {}, run_id="fresh")
    with pytest.raises(RunStateError, match="cannot answer run 'fresh' at step 'pick': it is queued") as e:
        queue.answer("fresh", "pick", "red")
    assert (e.value.run_id, e.value.step, e.value.status) == ("fresh", "pick", "queued")
    _park(queue, tmp_path, monkeypatch)
    parked = queue.status("r")
    with pytest.raises(RunStateError, match="step 'pay' has no pending question; steps waiting: 'pick'"):
        queue.answer("r", "pay", "red")
    with pytest.raises(RunStateError, match="asks for a value"):
        queue.approve("r", "pick", by="bob")
    with pytest.raises(UnencodableError, match="the answer to step 'pick'"):
        queue.answer("r", "pick", object())
    with pytest.raises(ValueError, match="by"):
        queue.answer("r", "pick", "red", by="x\x00y")
    with pytest.raises(RunStateError, match="it is waiting for a person: answer it"):
        queue.retry("r")
    assert queue.status("r") == parked  # nothing written by any refusal
    bad = _ekit("queue", "--queue", queue_url, "answer", "r", "pick", "{not json")
    assert bad.returncode == 2 and "VALUE_JSON is not JSON" in bad.stderr and bad.stderr.count("\n") == 1
    refused = _ekit("queue", "--queue", queue_url, "approve", "r", "pick")
    assert refused.returncode == 2 and "cannot approve run 'r' at step 'pick'" in refused.stderr
    assert queue.status("r") == parked


def test_a_parked_run_is_cancelled_or_rewound_like_any_other(
    queue: RunQueue, queue_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _park(queue, tmp_path, monkeypatch)
    _park(queue, tmp_path, monkeypatch, run_id="c")
    assert queue.cancel("c") is True
    assert queue.status("c").status == "cancelled"
    with pytest.raises(RunStateError, match="it is cancelled, not waiting"):
        queue.answer("c", "pick", "red")
    # Rewinding the step drops its question: the next drive asks it again, and parks.
    rewound = queue.rewind("r", "pick")
    assert rewound.asked == {} and queue.status("r").status == "queued"
    assert _drain(queue_url, tmp_path)["runs"] == {"parked": 1}
    assert queue.status("r").reason == "waiting for an answer to step 'pick': Which colour?"
