"""Retry, rewind and fork a queued run, on SQLite and PostgreSQL, with real worker processes.

Each run is driven by ``ekit worker --until-idle`` processes over the
workflows of :mod:`tests.support.queue_reopen_flows`, whose steps log every attempt
they start (run, step, attempt number as ``attempt_key()`` gives it, pid).
What users rely on: a failed run is retried once its cause is fixed, from
its checkpoint, its attempt numbers carrying on; a cancelled run restarts
where it stopped; a rewind in place re-runs exactly the rewound steps and
their dependents, and is refused while a worker holds the run; a rewind
fenced on the epoch it read never lands on a run claimed meanwhile; a fork
runs under its new id and leaves its source as it was.
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

from ekit_core import WorkflowCheckpoint
from ekit_runtime import Step, Workflow
from ekit_runtime.queue import Lease, RunQueue, RunStateError, open_queue
from ekit_runtime.queue import base as queue_base
from tests.support.queue_backends import entry_epochs, expire_lease, open_writes, queue, queue_url, wait_for
from tests.support.queue_reopen_flows import WORKFLOWS, starts

__all__ = ["queue", "queue_url"]

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
FLOWS = "tests.support.queue_reopen_flows:WORKFLOWS"
FINGERPRINTS = {name: w.graph.fingerprint for name, w in WORKFLOWS.items()}


def _env(logdir: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "EKIT_TEST_LOGDIR": str(logdir)}


def _worker_argv(url: str) -> list[str]:
    return [
        sys.executable, "-m", "ekit_runtime", "worker", "--queue", url, "--workflows", FLOWS,
        "--until-idle", "--lease", "5", "--heartbeat", "0.2",
    ]


def _drain(url: str, logdir: Path) -> subprocess.CompletedProcess[str]:
    """A worker process that drives every claimable run, then exits."""
    done = subprocess.run(
        _worker_argv(url), cwd=ROOT, env=_env(logdir), capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr
    return done


def _start_worker(url: str, logdir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        _worker_argv(url), cwd=ROOT, env=_env(logdir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )


def _ekit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ekit_runtime", *args], cwd=ROOT, env=_env(ROOT),
        capture_output=True, text=True, timeout=60,
    )


def _pids(rows: list[tuple[str, str, int, int]]) -> set[int]:
    return {pid for *_, pid in rows}


def test_a_failed_run_is_retried_once_its_cause_is_fixed_and_its_attempts_carry_on(
    queue: RunQueue, queue_url: str, tmp_path: Path
) -> None:
    queue.submit("chain", {}, run_id="r")
    _drain(queue_url, tmp_path)
    failed = queue.status("r")
    assert failed.status == "failed" and failed.error is not None and "'fixed' is missing" in failed.error
    first = starts(str(tmp_path))
    assert [(s, a) for _, s, a, _ in first if s == "b"] == [("b", 1), ("b", 2)]  # its policy's two attempts
    recorded = queue.checkpoint("r")
    assert recorded is not None and recorded.failures["b"].attempts == 2

    (tmp_path / "fixed").touch()  # the cause, fixed
    again = queue.retry("r")
    assert (again.status, again.epoch, again.error, again.cancel_requested, again.lease_until) == (
        "queued", failed.epoch + 1, None, False, None
    )
    assert queue.checkpoint("r") == recorded  # resumed from, not replaced
    _drain(queue_url, tmp_path)

    assert queue.status("r").status == "finished"
    later = starts(str(tmp_path))[len(first):]
    # b's attempt numbers carry on (3, after the two recorded), a is not paid for again,
    # and d only if the failure stopped the run before it was recorded.
    expected = {("b", 3), ("c", 1)} | (set() if "d" in recorded.outputs else {("d", 1)})
    assert {(s, a) for r, s, a, _ in later if r == "r"} == expected and len(later) == len(expected)
    assert not _pids(later) & _pids(first)  # another worker process
    result = queue.result("r")
    assert result is not None and result.outputs["a"] == recorded.outputs["a"]
    assert str(result.outputs["b"]).endswith("#3")


def test_a_cancelled_run_is_restarted_from_its_checkpoint(
    queue: RunQueue, queue_url: str, tmp_path: Path
) -> None:
    queue.submit("hold", {}, run_id="r")
    proc = _start_worker(queue_url, tmp_path)
    try:
        wait_for(lambda: (tmp_path / "holding").exists(), timeout=60, what="step b to start")
        assert queue.cancel("r") is True
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    cancelled = queue.status("r")
    assert cancelled.status == "cancelled" and cancelled.cancel_requested
    recorded = queue.checkpoint("r")
    assert recorded is not None and set(recorded.outputs) == {"a"}
    first = starts(str(tmp_path))

    again = queue.retry("r")
    assert (again.status, again.cancel_requested, again.epoch) == ("queued", False, cancelled.epoch + 1)
    (tmp_path / "go").touch()
    _drain(queue_url, tmp_path)

    assert queue.status("r").status == "finished"
    later = starts(str(tmp_path))[len(first):]
    # Only b runs again; a cancelled attempt is no failure, so b's number is the one it had.
    assert [(r, s, a) for r, s, a, _ in later] == [("r", "b", 1)]
    assert not _pids(later) & _pids(first)


def test_retry_is_refused_for_a_queued_running_or_finished_run(queue: RunQueue) -> None:
    queue.submit("hold", {}, run_id="queued")
    with pytest.raises(RunStateError, match="cannot retry run 'queued': it is queued already") as refused:
        queue.retry("queued")
    assert (refused.value.run_id, refused.value.status) == ("queued", "queued")
    lease = queue.claim("w", FINGERPRINTS, 30)
    assert lease is not None and lease.run_id == "queued"
    with pytest.raises(RunStateError, match="it is running: cancel it first") as refused:
        queue.retry("queued")
    assert refused.value.status == "running"
    queue.finish(lease, "finished")
    with pytest.raises(RunStateError, match="it finished: to run steps again, rewind them"):
        queue.retry("queued")
    info = queue.status("queued")
    assert (info.status, info.epoch) == ("finished", lease.epoch)  # nothing written
    with pytest.raises(LookupError):
        queue.retry("nope")
    with pytest.raises(ValueError, match="run_id"):
        queue.retry("")


def test_rewind_in_place_reruns_exactly_the_rewound_steps_and_their_dependents(
    queue: RunQueue, queue_url: str, tmp_path: Path
) -> None:
    (tmp_path / "fixed").touch()
    queue.submit("chain", {}, run_id="r")
    _drain(queue_url, tmp_path)
    finished = queue.status("r")
    before = queue.checkpoint("r")
    assert finished.status == "finished" and before is not None
    first = starts(str(tmp_path))

    rewound = queue.rewind("r", "b")
    assert set(rewound.outputs) == {"a", "d"}  # b and what needs it (c) dropped, the rest kept
    assert queue.checkpoint("r") == rewound
    info = queue.status("r")
    assert (info.status, info.epoch, info.error) == ("queued", finished.epoch + 1, None)
    _drain(queue_url, tmp_path)

    assert queue.status("r").status == "finished"
    later = starts(str(tmp_path))[len(first):]
    assert sorted(s for _, s, _, _ in later) == ["b", "c"]
    # Other work: no attempt key an earlier attempt had (a stale deduplicated result otherwise).
    assert not {(s, a) for _, s, a, _ in later} & {(s, a) for _, s, a, _ in first}
    result = queue.result("r")
    assert result is not None
    assert {k: result.outputs[k] for k in ("a", "d")} == {k: before.outputs[k] for k in ("a", "d")}
    assert result.outputs["b"] != before.outputs["b"] and result.outputs["c"] != before.outputs["c"]
    # b and c written under the lease of the claim after the rewind (epoch + 2); a and d, kept
    # (their values above), as the rewind wrote the run (epoch + 1): that claim's first save
    # appends its drive as a row rather than writing the run again (docs/queue.md).
    epochs = entry_epochs(queue_url, "r")
    assert epochs == {**dict.fromkeys("ad", finished.epoch + 1), **dict.fromkeys("bc", finished.epoch + 2)}


def test_rewind_is_refused_while_a_worker_holds_a_live_lease(
    queue: RunQueue, queue_url: str, tmp_path: Path
) -> None:
    queue.submit("hold", {}, run_id="r")
    proc = _start_worker(queue_url, tmp_path)
    try:
        wait_for(lambda: (tmp_path / "holding").exists(), timeout=60, what="step b to start")
        held = queue.status("r")
        stored = queue.checkpoint("r")
        with pytest.raises(RunStateError, match=r"live lease.*cancel it first") as refused:
            queue.rewind("r", "a")
        assert (refused.value.run_id, refused.value.status) == ("r", "running")
        now = queue.status("r")
        assert (now.status, now.epoch, now.owner) == ("running", held.epoch, held.owner)
        assert queue.checkpoint("r") == stored
        (tmp_path / "go").touch()
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert queue.status("r").status == "finished"  # its worker was never disturbed


def _saved_run(queue: RunQueue, url: str) -> tuple[Lease, WorkflowCheckpoint]:
    """Run ``r`` of ``hold``, running with a saved checkpoint (a done), its lease expired: a dead worker's."""
    queue.submit("hold", {}, run_id="r")
    lease = queue.claim("dead worker", FINGERPRINTS, 30)
    assert lease is not None
    checkpoint = _checkpoint_with_a()
    queue.save(lease, checkpoint, 30)
    expire_lease(url, "r")
    return lease, checkpoint


def _checkpoint_with_a() -> WorkflowCheckpoint:
    """A checkpoint of ``hold`` with a's output recorded and b not run."""
    async def a(ctx: dict[str, Any]) -> str:
        return "a@test"

    async def b(ctx: dict[str, Any]) -> str:
        raise RuntimeError("not this time")

    seen: list[WorkflowCheckpoint] = []
    with pytest.raises(RuntimeError):
        Workflow([Step("a", a), Step("b", b, ("a",))]).run_sync(checkpoint_fn=seen.append)
    checkpoint = WorkflowCheckpoint.from_dict({**seen[-1].to_dict(), "failures": {}})
    assert checkpoint.fingerprint == FINGERPRINTS["hold"] and set(checkpoint.outputs) == {"a"}
    return checkpoint


@pytest.mark.parametrize("rival", ["claim", "rewind"])
def test_a_rewind_and_a_write_made_since_its_read_cannot_both_win(
    queue: RunQueue, queue_url: str, monkeypatch: pytest.MonkeyPatch, rival: str
) -> None:
    _, saved = _saved_run(queue, queue_url)
    other = open_queue(queue_url)
    got: list[Any] = []
    errors: list[BaseException] = []
    real = queue_base.rewind_checkpoint  # type: ignore[attr-defined]
    raced = threading.Event()

    def act() -> None:
        try:
            got.append(other.claim("w2", FINGERPRINTS, 30) if rival == "claim" else other.rewind("r", "a"))
        except BaseException as exc:
            errors.append(exc)

    def rewind_then_race(*args: Any) -> WorkflowCheckpoint:
        # Between this rewind's read and its write, the rival writes from another connection.
        if raced.is_set():
            return real(*args)
        raced.set()
        if queue.backend == "sqlite":
            # One BEGIN IMMEDIATE transaction: no other connection can write in between.
            assert open_writes(queue_url) == 1
            rival_thread.start()  # it waits for the write lock, so runs after this rewind
        else:
            rival_thread.start()
            rival_thread.join(timeout=60)  # the read took no lock: the rival commits first
            assert not rival_thread.is_alive() and not errors and got
        return real(*args)

    rival_thread = threading.Thread(target=act)
    monkeypatch.setattr(queue_base, "rewind_checkpoint", rewind_then_race)
    try:
        if queue.backend == "postgres":
            with pytest.raises(RunStateError, match="changed while this call read it"):
                queue.rewind("r", "b")
            stored = queue.checkpoint("r")
            if rival == "claim":
                # The claim won: its holder resumes the checkpoint it was granted, untouched.
                lease = got[0]
                assert lease is not None and lease.checkpoint == saved == stored
                assert queue.status("r").status == "running"
            else:
                assert stored is not None and set(stored.outputs) == set()  # only the rival's rewind of a
        else:
            queue.rewind("r", "b")
            rival_thread.join(timeout=60)
            assert not rival_thread.is_alive() and not errors
            stored = queue.checkpoint("r")
            if rival == "claim":
                # Serialised: the claim came after, and was granted the rewound checkpoint.
                lease = got[0]
                assert lease is not None and lease.checkpoint == stored and lease.epoch == 3
            else:
                assert stored is not None and set(stored.outputs) == set()
    finally:
        other.close()


def test_fork_leaves_the_source_untouched_and_runs_under_the_new_id(
    queue: RunQueue, queue_url: str, tmp_path: Path
) -> None:
    (tmp_path / "fixed").touch()
    queue.submit("chain", {"topic": "owls"}, run_id="r", priority=3)
    _drain(queue_url, tmp_path)
    source, source_cp = queue.status("r"), queue.checkpoint("r")
    assert source.status == "finished" and source_cp is not None
    first = starts(str(tmp_path))

    assert queue.fork("r", ["c"], new_run_id="r2") == "r2"
    assert queue.status("r") == source and queue.checkpoint("r") == source_cp  # only read
    fork = queue.status("r2")
    assert (fork.status, fork.epoch, fork.workflow, fork.priority, fork.owner, fork.error) == (
        "queued", 0, "chain", 3, None, None
    )
    assert fork.fingerprint == source.fingerprint
    forked = queue.checkpoint("r2")
    assert forked is not None and set(forked.outputs) == {"a", "b", "d"}
    assert forked.context == source_cp.context and dict(forked.context)["topic"] == "owls"
    _drain(queue_url, tmp_path)

    later = starts(str(tmp_path))[len(first):]
    assert [(r, s, a) for r, s, a, _ in later] == [("r2", "c", 1)]  # its own attempt keys
    result = queue.result("r2")
    assert result is not None and result.outputs["c"] != source_cp.outputs["c"]
    assert {k: result.outputs[k] for k in "abd"} == {k: source_cp.outputs[k] for k in "abd"}
    assert queue.status("r") == source

    # Another id for each fork (a new random one by default), a priority of its own, an id taken refused.
    other = queue.fork("r", priority=-1)
    assert other not in ("r", "r2") and queue.status(other).priority == -1
    assert queue.checkpoint(other) == source_cp
    with pytest.raises(ValueError, match="'r2' is a run the queue already has"):
        queue.fork("r", new_run_id="r2")
    with pytest.raises(ValueError, match="cannot fork run 'r': cannot rewind unknown step"):
        queue.fork("r", ["nope"])
    with pytest.raises(LookupError):
        queue.fork("nope")


def test_a_fork_of_a_run_never_started_carries_its_context_and_options(queue: RunQueue) -> None:
    queue.submit("hold", {"topic": "bats"}, run_id="src", options={"max_concurrency": 2})
    new = queue.fork("src", new_run_id="copy")
    assert queue.checkpoint("copy") is None
    assert dict(queue.status("copy").options) == dict(queue.status("src").options) == {"max_concurrency": 2}
    with pytest.raises(RunStateError, match="has no checkpoint yet"):
        queue.fork("src", ["a"])
    leases = [queue.claim("w", FINGERPRINTS, 30) for _ in range(2)]
    assert {lease.run_id: dict(lease.context) for lease in leases if lease is not None} == {
        "src": {"topic": "bats"}, new: {"topic": "bats"}
    }


def test_rewind_refuses_bad_steps_before_touching_the_run(queue: RunQueue) -> None:
    queue.submit("hold", {}, run_id="r")
    with pytest.raises(RunStateError, match="no checkpoint yet"):
        queue.rewind("r", "a")
    bad_steps: tuple[tuple[Any, str], ...] = (
        ([], "at least one step"), (b"a", "step name"), ([1], "step names"), ([""], "step name")
    )
    for bad, said in bad_steps:
        with pytest.raises(ValueError, match=said):
            queue.rewind("r", bad)
    assert queue.status("r").epoch == 0


def test_the_queue_commands_retry_rewind_and_fork(queue: RunQueue, queue_url: str, tmp_path: Path) -> None:
    queue.submit("chain", {}, run_id="r")
    _drain(queue_url, tmp_path)
    q = ("queue", "--queue", queue_url)
    retried = _ekit(*q, "retry", "r")
    assert retried.returncode == 0, retried.stderr
    assert json.loads(retried.stdout)["status"] == "queued"
    refused = _ekit(*q, "retry", "r")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1 and "cannot retry run 'r': it is queued already" in refused.stderr
    (tmp_path / "fixed").touch()
    _drain(queue_url, tmp_path)
    rewound = _ekit(*q, "rewind", "r", "b")
    assert rewound.returncode == 0, rewound.stderr
    assert json.loads(rewound.stdout) == {"run_id": "r", "status": "queued", "kept": ["a", "d"],
                                          "runs_again": ["b", "c"]}
    forked = _ekit(*q, "fork", "r", "d", "--run-id", "r2", "--priority", "5")
    assert forked.returncode == 0, forked.stderr
    assert json.loads(forked.stdout)["runs_again"] == ["b", "c", "d"]
    assert queue.status("r2").priority == 5
    unknown = _ekit(*q, "rewind", "r", "zz")
    assert unknown.returncode == 2 and "unknown step(s): 'zz'" in unknown.stderr
    assert "Traceback" not in unknown.stderr
    missing = _ekit(*q, "fork", "nope")
    assert missing.returncode == 2 and missing.stderr.strip() == "ekit: no run 'nope' in the queue"
    helped = _ekit(*q, "fork", "--help")
    assert "--run-id NEW" in helped.stdout and "only read" in helped.stdout
