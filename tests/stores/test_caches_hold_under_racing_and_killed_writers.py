"""The ready-made caches hold under real processes racing and dying (issue 45).

What users rely on: two processes filling one cache key at once leave one
entry, and both go on with the same value (a workflow run in each gets the same
output from a step whose calls differ); a process killed with SIGKILL while
writing leaves no torn entry that a later run could be handed.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import Cache, DirectoryCache, SqliteCache, Step, Workflow
from ekit_runtime.cache import CacheEntry
from tests.support.queue_backends import fresh_postgres

KINDS = ("sqlite", "directory", "postgres")
_SPAWN = multiprocessing.get_context("spawn")
_DEADLINE = 120.0  # a deadlock detector only


def open_cache(kind: str, where: str) -> Cache:
    if kind == "postgres":  # ``where`` is then a database URL
        from ekit_runtime.cache.postgres import PostgresCache

        return PostgresCache(where)
    return SqliteCache(Path(where) / "cache.db") if kind == "sqlite" else DirectoryCache(Path(where) / "dir")


@pytest.fixture
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Where the cache of kind ``kind`` lives: a temporary directory, or a fresh database."""
    if request.node.callspec.params["kind"] == "postgres":
        with fresh_postgres() as url:
            yield url
        return
    yield str(tmp_path)


# -- two writers, one key --------------------------------------------------------------------------

def _put_after_barrier(kind: str, where: str, barrier: Any, me: int, rounds: int, out: Any) -> None:
    cache = open_cache(kind, where)
    got = []
    for r in range(rounds):
        barrier.wait(_DEADLINE)
        entry = CacheEntry(f"head{r}", {"draft": "h"}, f'"written by {me}"', step="s")
        got.append(cache.put(entry).output)
    out.put((me, got))


@pytest.mark.parametrize("kind", KINDS)
def test_two_processes_filling_one_key_leave_one_entry_and_read_the_same(kind: str, where: str) -> None:
    # (created once, before the race; opened before any entry, so it indexes none itself)
    before = open_cache(kind, where)
    rounds = 20
    barrier, out = _SPAWN.Barrier(2), _SPAWN.Queue()
    procs = [_SPAWN.Process(target=_put_after_barrier, args=(kind, where, barrier, i, rounds, out))
             for i in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=_DEADLINE) for _ in procs)
    for p in procs:
        p.join(_DEADLINE)
        assert p.exitcode == 0
    assert results[0] == results[1]  # both went on with one value, round after round
    entries = list(before.entries())
    assert len(entries) == rounds
    assert {e.output for e in entries} <= {'"written by 0"', '"written by 1"'}
    # and a lookup, through the index of the keys entries read, finds what both went on with
    # (asked before any other open, which would index what the writers left unindexed)
    in_rounds = sorted(entries, key=lambda e: int(e.head[4:]))
    assert [found_by_lookup(before, e).output for e in in_rounds] == results[0]


def found_by_lookup(cache: Cache, entry: CacheEntry) -> CacheEntry:
    """What a lookup with ``entry``'s inputs finds (:meth:`Cache.find`, by key)."""
    (found,) = cache.find([(entry.head, entry.reads.get)])
    assert found is not None and found.key == entry.key
    return found


_STEP_BARRIER: Any = None


def _draft(ctx: Mapping[str, Any]) -> str:
    _STEP_BARRIER.wait(_DEADLINE)  # both processes are inside the step: neither could hit
    return f"draft {os.getpid()} about {ctx['topic']}"


def _run_workflow(kind: str, where: str, barrier: Any, out: Any) -> None:
    global _STEP_BARRIER
    _STEP_BARRIER = barrier
    wf = Workflow([Step("draft", _draft, cache=True)])
    out.put(wf.run_sync({"topic": "tides"}, cache=open_cache(kind, where)).outputs["draft"])


@pytest.mark.parametrize("kind", KINDS)
def test_two_runs_racing_on_one_step_go_on_with_one_output(kind: str, where: str) -> None:
    open_cache(kind, where)
    barrier, out = _SPAWN.Barrier(2), _SPAWN.Queue()
    procs = [_SPAWN.Process(target=_run_workflow, args=(kind, where, barrier, out)) for _ in range(2)]
    for p in procs:
        p.start()
    outputs = [out.get(timeout=_DEADLINE) for _ in procs]
    for p in procs:
        p.join(_DEADLINE)
        assert p.exitcode == 0
    assert outputs[0] == outputs[1]
    assert len(list(open_cache(kind, where).entries())) == 1


# -- a writer killed mid-write ---------------------------------------------------------------------

def _blob(n: int) -> str:
    body = f"{n}:" + "x" * (150_000 + n % 7 * 10_000)
    return f'"{body}|{hashlib.sha256(body.encode()).hexdigest()}"'


def _whole(output: str) -> bool:
    body, _, digest = output.strip('"').rpartition("|")
    return hashlib.sha256(body.encode()).hexdigest() == digest


def _write_forever(kind: str, where: str, started: Any) -> None:
    cache = open_cache(kind, where)
    n = 0
    while True:
        cache.put(CacheEntry(f"head{n % 5}", {"k": str(n)}, _blob(n), step="s"))
        n += 1
        if n == 3:
            started.set()


@pytest.mark.parametrize("kind", KINDS)
def test_a_writer_killed_mid_write_leaves_no_torn_entry(kind: str, where: str) -> None:
    before = open_cache(kind, where)  # (opened before any entry: it indexes none itself)
    for _round in range(4):
        started = _SPAWN.Event()
        proc = _SPAWN.Process(target=_write_forever, args=(kind, where, started))
        proc.start()
        assert started.wait(_DEADLINE)
        os.kill(proc.pid, signal.SIGKILL)  # while it writes: it does nothing else
        proc.join(_DEADLINE)
        assert proc.exitcode == -signal.SIGKILL
        # each entry indexed (asked before any other open, which would index what it left unindexed)
        assert all(_whole(found_by_lookup(before, e).output) for e in before.entries())
        cache = open_cache(kind, where)
        entries = list(cache.entries())
        assert len(entries) >= 3
        assert all(_whole(e.output) for e in entries)
        for head in {e.head for e in entries}:
            assert all(_whole(e.output) for e in cache.candidates(head))
        cache.close()
