"""The run-queue contract, in one process, on SQLite and PostgreSQL alike.

Submission, status, listing, results, cancel and prune; leases and fencing
driven by hand (short leases, expiry awaited by polling the database); the
fingerprint rule; attempt keys; and the fleet's rate limits.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from ekit_core import RetryPolicy
from ekit_runtime import PatternResult, Step, TokenUsage, Workflow
from ekit_runtime.queue import (
    LeaseLostError,
    Limits,
    RunQueue,
    UnknownRunError,
    Worker,
    attempt_key,
    open_queue,
)
from tests.support.queue_backends import chain_checkpoints, queue, queue_url, wait_for

__all__ = ["queue", "queue_url"]

FP = {"two": "fp-unused"}


def _two(log: list[str] | None = None) -> Workflow:
    def step(name: str) -> Any:
        async def run(ctx: dict[str, Any]) -> str:
            if log is not None:
                log.append(f"{name}:{attempt_key()}")
            return f"<{name}:{ctx.get('x')}>"

        return run

    return Workflow([Step("a", step("a")), Step("b", step("b"), ("a",))])


def _fingerprints(wf: Workflow) -> dict[str, str | None]:
    return {"two": wf.graph.fingerprint}


def _drain(q: RunQueue, registry: dict[str, Workflow], **kw: Any) -> int:
    return asyncio.run(Worker(q, registry, poll=0.01, **kw).run_until_idle())


def test_submit_status_result_and_listing(queue: RunQueue) -> None:
    first = queue.submit("two", {"x": 1})
    second = queue.submit("two", {"x": 2}, run_id="second", priority=5)
    assert second == "second" and len(first) == 32
    assert [r.status for r in queue.runs()] == ["queued", "queued"]
    assert queue.status("second").priority == 5 and queue.status("second").epoch == 0
    assert queue.checkpoint(first) is None and queue.result(first) is None
    assert _drain(queue, {"two": _two()}) == 2
    assert [r.run_id for r in queue.runs("finished")] == [first, "second"]
    assert queue.runs("queued") == []
    result = queue.result("second")
    assert result is not None and dict(result.outputs) == {"a": "<a:2>", "b": "<b:2>"}
    assert queue.status("second").status == "finished" and queue.status("second").lease_until is None
    with pytest.raises(UnknownRunError, match="nope"):
        queue.status("nope")


def test_retried_submit_is_idempotent(queue: RunQueue, queue_url: str) -> None:
    assert queue.submit("two", {"x": 1}, run_id="once") == "once"
    # Retried, and raced from two other connections at once: still one run.
    others = [open_queue(queue_url) for _ in range(2)]
    threads = [
        threading.Thread(target=o.submit, args=("two", {"x": 1}), kwargs={"run_id": "once"}) for o in others
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.run_id for r in queue.runs()] == ["once"]
    with pytest.raises(ValueError, match="already submitted for workflow 'two'"):
        queue.submit("other", run_id="once")
    log: list[str] = []
    _drain(queue, {"two": _two(log)})
    queue.submit("two", {"x": 1}, run_id="once")  # after it finished: nothing runs again
    assert _drain(queue, {"two": _two(log)}) == 0
    assert len(log) == 2 and queue.status("once").status == "finished"
    for o in others:
        o.close()


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda q: q.submit(""), "workflow"),
        (lambda q: q.submit("two", run_id=""), "run_id"),
        (lambda q: q.submit("two", priority="high"), "priority"),
        (lambda q: q.submit("two", ["not", "a", "mapping"]), "context"),
        (lambda q: q.submit("two", {"when": object()}), "context key 'when'"),
        (lambda q: q.runs("done"), "status"),
        (lambda q: q.prune(-1), "older_than"),
        (lambda q: q.claim("w", {}, 1.0), "workflows"),
        (lambda q: q.claim("w", {"two": None}, 0), "lease_seconds"),
        # Under the clock's resolution a lease would end when it began (see MIN_LEASE_SECONDS).
        (lambda q: q.claim("w", {"two": None}, 1e-7), "lease_seconds must be at least 0.001"),
        (lambda q: Worker(q, {"two": _two()}, lease_seconds=1e-4, heartbeat=1e-5), "lease_seconds"),
        (lambda q: q.set_limits({"max_in_flight": 1}), "limits"),
        (lambda q: Limits(max_in_flight=0), "max_in_flight"),
        (lambda q: Limits(window=-1), "window"),
        (lambda q: Worker(q, {"two": "not a workflow"}), "registry"),
        (lambda q: Worker(q, {"two": _two()}, lease_seconds=1, heartbeat=2), "heartbeat"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_field(queue: RunQueue, call: Any, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        call(queue)


def test_a_lease_too_short_to_move_the_clock_is_refused_before_a_save_writes(queue: RunQueue) -> None:
    # A review found it: with 1e-7 s added to a clock of 1.7e9, a save's new
    # lease_until equalled its now, and the fence refused what the save
    # believed made: its output was silently not stored (SQLite's narrow
    # view), or stored unfenced (the general one). Now refused up front.
    wf = _two()
    queue.submit("two", {"x": 1}, run_id="tiny")
    lease = queue.claim("w", _fingerprints(wf), 60)
    assert lease is not None
    first = wf.run_sync({"x": 1}).checkpoint
    assert first is not None
    for write in (
        lambda: queue.save(lease, first, 1e-7),
        lambda: queue.save_many([(lease, first)], 1e-7),
        lambda: queue.renew(lease, 1e-7),
    ):
        with pytest.raises(ValueError, match=r"lease_seconds must be at least 0\.001"):
            write()
    assert queue.checkpoint("tiny") is None
    assert queue.save(lease, first, 0.001) is False  # the shortest lease granted still saves
    assert queue.checkpoint("tiny") == first


def test_a_lease_taken_over_refuses_every_write_of_its_old_holder(queue: RunQueue) -> None:
    wf = _two()
    run = queue.submit("two", {"x": 1})
    old = queue.claim("old", _fingerprints(wf), 0.3)
    assert old is not None and old.epoch == 1 and old.checkpoint is None
    first = wf.run_sync({"x": 1}).checkpoint
    assert first is not None
    queue.save(old, first, 0.3)
    assert queue.claim("new", _fingerprints(wf), 5) is None  # the lease is live
    wait_for(lambda: queue.claim("new", _fingerprints(wf), 5), timeout=5, what="the lease to expire")
    new = queue.status(run)
    assert new.epoch == 2 and new.owner == "new"
    for write in (
        lambda: queue.save(old, first, 5),
        lambda: queue.renew(old, 5),
        lambda: queue.finish(old, "finished"),
    ):
        with pytest.raises(LeaseLostError, match="epoch 1"):
            write()
    assert queue.release(old) is False
    assert queue.status(run).status == "running" and queue.status(run).epoch == 2


def test_an_expired_lease_is_lost_even_before_anyone_takes_it(queue: RunQueue) -> None:
    wf = _two()
    run = queue.submit("two")
    lease = queue.claim("w", _fingerprints(wf), 0.2)
    assert lease is not None
    wait_for(lambda: queue.status(run).lease_until < time.time(), timeout=5, what="expiry")  # type: ignore[operator]
    with pytest.raises(LeaseLostError):
        queue.renew(lease, 5)
    assert queue.checkpoint(run) is None


def test_claims_take_higher_priority_first_then_the_oldest(queue: RunQueue) -> None:
    for name, priority in (("low", 0), ("high", 9), ("low2", 0), ("mid", 3)):
        queue.submit("two", run_id=name, priority=priority)
    order = []
    while (lease := queue.claim("w", {"two": None}, 30)) is not None:
        order.append(lease.run_id)
    assert order == ["high", "mid", "low", "low2"]


def test_cancel_and_prune(queue: RunQueue) -> None:
    queued = queue.submit("two")
    assert queue.cancel(queued) is True and queue.status(queued).status == "cancelled"
    assert queue.cancel(queued) is False
    running = queue.submit("two")
    lease = queue.claim("w", {"two": None}, 30)
    assert lease is not None and lease.run_id == running
    assert queue.cancel(running) is True
    assert queue.renew(lease, 30) is True  # the worker learns at its next write
    queue.finish(lease, "cancelled")
    done = queue.submit("two")
    _drain(queue, {"two": _two()})
    assert queue.prune(3600) == 0
    time.sleep(0.01)  # let "older than 5 ms" cover runs updated just now
    assert queue.prune(0.005) == 3
    assert queue.runs() == []
    with pytest.raises(UnknownRunError):
        queue.checkpoint(done)


def test_runs_resume_only_on_a_matching_graph(queue: RunQueue) -> None:
    v1 = _two()
    v2 = Workflow([*v1.steps, Step("c", lambda ctx: "c", ("b",))])
    run = queue.submit("two", {"x": 1})
    lease = queue.claim("v1", _fingerprints(v1), 0.2)
    assert lease is not None
    partial = Workflow(v1.steps[:1]).run_sync({"x": 1}).checkpoint
    assert partial is not None
    queue.save(lease, partial.__class__(**{**_fields(partial), "fingerprint": v1.graph.fingerprint}), 0.2)
    wait_for(lambda: queue.status(run).lease_until < time.time(), timeout=5, what="expiry")  # type: ignore[operator]
    assert _drain(queue, {"two": v2}) == 0  # another version leaves it alone
    assert queue.status(run).status == "running"
    log: list[str] = []
    assert _drain(queue, {"two": _two(log)}) == 1
    assert log == [f"b:{run}/b/1"]  # a was recorded: only b ran
    assert queue.status(run).fingerprint == v1.graph.fingerprint


def _fields(cp: Any) -> dict[str, Any]:
    return {
        f: getattr(cp, f)
        for f in ("step_index", "outputs", "cost", "context", "step_usage", "failures", "graph")
    }


def test_attempt_keys_count_retries_and_survive_an_unsaved_finish(queue: RunQueue) -> None:
    seen: list[str] = []
    gate = asyncio.Event()
    second_attempt = asyncio.Event()

    async def flaky(ctx: dict[str, Any]) -> str:
        seen.append(str(attempt_key()))
        if len(seen) == 1:
            raise RuntimeError("first attempt fails")
        if len(seen) == 2:
            second_attempt.set()
            await gate.wait()  # the worker stops here: this attempt is never saved
        return "done"

    wf = Workflow([Step("s", flaky, retry=RetryPolicy(max_attempts=3, backoff_base=0))])
    run = queue.submit("two", run_id="keyed")

    async def first_worker() -> None:
        worker = Worker(queue, {"two": wf}, poll=0.01)
        task = asyncio.create_task(worker.run())
        await second_attempt.wait()
        worker.stop()
        await task
        assert worker.outcomes == {run: "released"}

    asyncio.run(first_worker())
    gate.set()
    assert _drain(queue, {"two": wf}) == 1
    assert seen == ["keyed/s/1", "keyed/s/2", "keyed/s/2"]
    with pytest.raises(LookupError, match="run id"):
        attempt_key()


def test_a_queued_run_runs_blocking_steps_in_the_default_threads_with_their_key(
    queue: RunQueue,
) -> None:
    names: list[str] = []

    def blocking(ctx: dict[str, Any]) -> str:
        names.append(threading.current_thread().name + "|" + str(attempt_key()))
        return "ok"

    wf = Workflow([Step("a", blocking, blocking=True)])
    queue.submit("two", run_id="r")
    assert _drain(queue, {"two": wf}) == 1
    assert dict(queue.result("r").outputs) == {"a": "ok"}  # type: ignore[union-attr]
    # The default executor's threads, as in a plain run, with the key set there.
    assert names == [names[0]] and names[0].startswith("ekit-step") and names[0].endswith("|r/a/1")


def test_runs_per_minute_holds_across_workers(queue: RunQueue, queue_url: str) -> None:
    queue.set_limits(Limits(runs_per_minute=3))
    for i in range(5):
        queue.submit("two", run_id=f"r{i}")
    other = open_queue(queue_url)

    async def two_workers() -> list[int]:
        return list(
            await asyncio.gather(
                Worker(queue, {"two": _two()}, poll=0.01).run_until_idle(),
                Worker(other, {"two": _two()}, poll=0.01).run_until_idle(),
            )
        )

    assert sum(asyncio.run(two_workers())) == 3
    assert len(queue.runs("finished")) == 3 and len(queue.runs("queued")) == 2
    other.close()


def test_a_token_rate_limit_holds_steps_back_until_the_window_moves(queue: RunQueue) -> None:
    window, limit = 0.6, 100
    queue.set_limits(Limits(tokens_per_minute=limit, window=window))
    spans: list[tuple[float, float]] = []

    async def spend(ctx: dict[str, Any]) -> Any:
        began = time.time()
        await asyncio.sleep(0.01)
        spans.append((began, time.time()))
        return PatternResult("x", cost=TokenUsage(40, 20, 1))  # 60 tokens

    for i in range(3):
        queue.submit("one", run_id=f"t{i}")
    assert _drain(queue, {"one": Workflow([Step("s", spend)])}, max_runs=1) == 3
    (_, e1), (s2, _), (s3, _) = spans
    assert s2 < e1 + window  # 60 < 100: the second starts at once
    assert s3 >= e1 + window - 0.05  # 120 >= 100: the third waits for the first to age out
    assert queue.limits() == Limits(tokens_per_minute=limit, window=window)


def test_max_in_flight_caps_claims(queue: RunQueue) -> None:
    queue.set_limits(Limits(max_in_flight=2))
    for i in range(3):
        queue.submit("two", run_id=f"c{i}")
    leases = [queue.claim("w", {"two": None}, 30) for _ in range(3)]
    assert [lease is not None for lease in leases] == [True, True, False]
    assert leases[0] is not None
    queue.finish(leases[0], "finished")
    assert queue.claim("w", {"two": None}, 30) is not None


def test_a_full_rewrite_replaces_the_stored_entries_in_the_new_order(queue: RunQueue) -> None:
    run = queue.submit("two")
    lease = queue.claim("w", {"two": None}, 30)
    assert lease is not None
    only_b = Workflow([Step("b", lambda ctx: "old b")]).run_sync().checkpoint
    both = _two().run_sync({"x": 1}).checkpoint
    only_a = Workflow([Step("a", lambda ctx: "new a")]).run_sync().checkpoint
    assert only_b is not None and both is not None and only_a is not None
    queue.save(lease, only_b, 30)
    # Another graph, so written in full: b, already stored, is rewritten after a.
    queue.save(lease, both, 30)
    stored = queue.checkpoint(run)
    assert stored is not None and list(stored.outputs.items()) == [("a", "<a:1>"), ("b", "<b:1>")]
    queue.save(lease, only_a, 30)  # in full again: b is gone
    stored = queue.checkpoint(run)
    assert stored is not None and list(stored.outputs.items()) == [("a", "new a")]
    assert stored == only_a


def test_the_contract_is_one_class_that_every_backend_completes() -> None:
    from ekit_runtime.queue import SqliteQueue, base, contract
    from ekit_runtime.queue.postgres import PostgresQueue

    assert contract.RunQueue is base.RunQueue is RunQueue
    with pytest.raises(TypeError):
        RunQueue()  # type: ignore[abstract]
    for backend in (SqliteQueue, PostgresQueue):
        assert issubclass(backend, RunQueue) and not backend.__abstractmethods__
        public = {n for n in vars(backend) if not n.startswith("_") and callable(vars(backend)[n])}
        # A backend adds no public method of its own: what a caller may use is the contract.
        assert public <= set(dir(RunQueue)), public - set(dir(RunQueue))


def test_a_made_save_leaves_at_least_its_share_of_the_lease_ahead(queue: RunQueue) -> None:
    # PostgreSQL renews the whole lease with each save; SQLite's usual save only once less than
    # half is left (it writes the step's entry alone). A worker counts on save_renews either way.
    checkpoints = chain_checkpoints(4)
    run = queue.submit("chain")
    lease = queue.claim("w", {"chain": None}, 600)
    assert lease is not None
    queue.save(lease, checkpoints[0], 600)
    for k, left in ((1, 500.0), (2, 100.0), (3, 20.0)):
        queue.renew(lease, left)
        asked = time.time()
        assert queue.save(lease, checkpoints[k], 600) is False
        until = queue.status(run).lease_until
        assert until is not None and until >= asked + 600 * queue.save_renews
        if left < 300:  # less than half was left: renewed in full on every backend
            assert until >= asked + 600
    assert queue.checkpoint(run) == checkpoints[3]
    assert 0 < queue.save_renews <= 1
