"""On PostgreSQL, a claim locks only the runs it leases, so a claim beside it never finds "nothing" in error.

Claims skip the rows other claims have locked (``FOR UPDATE SKIP LOCKED``).
A pick that locked a run it then did not lease (one version read the queued
and the expired runs in two scans, each locking up to the limit, and kept
the first of both) hid that run from every other claim until it committed:
a worker told "nothing to claim" waits a poll for nothing, and
``run_until_idle`` returns with a claimable run left behind.
"""

from __future__ import annotations

import threading

import pytest

from ekit_runtime.queue import Lease, RunQueue, open_queue
from tests.support.queue_backends import expire_lease, postgres_url

__all__ = ["postgres_url"]

pytest.importorskip("psycopg")


def _expired_and_queued(url: str, tag: str) -> None:
    """Run ``E<tag>``, running under a lease that ran out, and ``Q<tag>``, queued and ahead of it."""
    setup = open_queue(url)
    try:
        setup.submit("w", run_id=f"E{tag}")
        lease = setup.claim("gone", {"w": None}, 60)
        assert lease is not None and lease.run_id == f"E{tag}"
        expire_lease(url, f"E{tag}")
        setup.submit("w", run_id=f"Q{tag}", priority=5)
    finally:
        setup.close()


def test_a_claim_in_progress_hides_only_the_run_it_takes(postgres_url: str) -> None:
    _expired_and_queued(postgres_url, "")
    first, second = open_queue(postgres_url), open_queue(postgres_url)
    try:
        # The claim in full holds its locks until its transaction ends (it
        # reads the run's checkpoint first): the other claim runs meanwhile.
        with first.db.transaction() as conn:  # type: ignore[attr-defined]
            taken = first._claim(conn, "first", [("w", None)], 60)  # type: ignore[attr-defined]
            assert taken is not None and taken[0][0] == "Q"
            lease = second.claim("second", {"w": None}, 60)
            assert lease is not None and lease.run_id == "E"
        assert second.claim("second", {"w": None}, 60) is None  # (and nothing is left)
    finally:
        first.close()
        second.close()


def _claim_at(gate: threading.Barrier, got: list[Lease | None], k: int, queue: RunQueue) -> None:
    gate.wait(timeout=30)  # (both claims released together)
    got[k] = queue.claim(f"c{k}", {"w": None}, 60)


def test_two_claims_at_once_over_two_claimable_runs_each_get_one(postgres_url: str) -> None:
    claimers = [open_queue(postgres_url) for _ in range(2)]
    try:
        for queue in claimers:  # the quick claim, what a worker makes after its first
            assert queue.claim_many("warm", {"w": None}, 60, 4) == []
            queue.submit("w", run_id=f"warm-{id(queue)}")
            assert len(queue.claim_many("warm", {"w": None}, 60, 4)) == 1
        for round_ in range(60):
            _expired_and_queued(postgres_url, str(round_))
            gate = threading.Barrier(2)
            got: list[Lease | None] = [None, None]

            threads = [
                threading.Thread(target=_claim_at, args=(gate, got, k, q)) for k, q in enumerate(claimers)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            taken = sorted(lease.run_id for lease in got if lease is not None)
            assert taken == [f"E{round_}", f"Q{round_}"], (round_, taken)
    finally:
        for queue in claimers:
            queue.close()
