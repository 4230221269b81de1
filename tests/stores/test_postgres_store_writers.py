"""``PostgresStore``: one writer per run id by fencing, NaN refused, each output encoded once.

Against the real server (``. .ci/postgres``). The process tests drive
children through pipes, a line each way, never sleeps: a second writer's
first save claims the run, the first writer is refused at its next save
and writes nothing, a reader loading all along never sees a mix of the two;
a SIGKILLed writer's run is taken over by the next one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType
from typing import Any

import psycopg
import pytest

from ekit_runtime import CorruptStoreError, PostgresStore, StoreLockedError, WorkflowCheckpoint
from tests.support.queue_backends import postgres_url

__all__ = ["postgres_url"]

ROOT = Path(__file__).resolve().parents[2]
RUN = "shared-run"

# A writer: "save N" saves the checkpoint of N outputs, each tagged with the
# writer's tag, and answers "saved N" or "refused <message>".
WRITER = """
import sys
from types import MappingProxyType
from ekit_runtime import PostgresStore, StoreLockedError, WorkflowCheckpoint
url, run, tag = sys.argv[1:]
store = PostgresStore(url, run_id=run)
print("ready", flush=True)
for line in sys.stdin:
    n = int(line.split()[1])
    cp = WorkflowCheckpoint(n, MappingProxyType({f"s{i}": f"{tag}{i}" for i in range(n)}))
    try:
        store(cp)
    except StoreLockedError as exc:
        print("refused", str(exc).replace("\\n", " "), flush=True)
    else:
        print("saved", n, flush=True)
"""

# A reader: loads until its stdin closes, then prints what it saw as JSON.
READER = """
import json, sys, threading
from ekit_runtime import PostgresStore
url, run = sys.argv[1:]
store = PostgresStore(url, run_id=run)
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
seen, mixed, loads = set(), [], 0
def look():
    global loads
    cp = store.load()
    loads += 1
    if cp is None:
        return
    tags = {v[0] for v in cp.outputs.values()}
    good = cp.step_index == len(cp.outputs) and len(tags) == 1 and all(
        cp.outputs[f"s{i}"] == f"{next(iter(tags))}{i}" for i in range(cp.step_index))
    if not good:
        mixed.append(dict(cp.outputs))
    seen.add(f"{next(iter(tags))}{cp.step_index}")
look()
print("reading", flush=True)
while not done.is_set():
    look()
look()
print(json.dumps({"loads": loads, "mixed": mixed, "seen": sorted(seen)}))
"""


class Child:
    """A Python child running ``code``, spoken to one line at a time."""

    def __init__(self, code: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, *args], cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )

    def ask(self, line: str, prefix: str) -> str:
        """Send ``line`` (if any) and return the answer, which must start with ``prefix``."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if line:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        answer = self.proc.stdout.readline().decode().rstrip("\n")
        if not answer.startswith(prefix):
            _, err = self.proc.communicate(timeout=30)
            pytest.fail(f"expected {prefix!r}, got {answer!r}; stderr:\n{err.decode()}")
        return answer

    def finish(self) -> str:
        out, err = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, err.decode()
        return out.decode()


def _stored(url: str, run: str = RUN) -> list[tuple[str, str]]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT name, value FROM ekit_entries WHERE run_id = %s AND kind = 'output' ORDER BY seq", (run,)
        ).fetchall()
    return [(r[0], json.loads(r[1])) for r in rows]


def _cp(outputs: dict[str, Any], **fields: Any) -> WorkflowCheckpoint:
    return WorkflowCheckpoint(len(outputs), MappingProxyType(dict(outputs)), **fields)


# -- real processes -----------------------------------------------------------------


@pytest.mark.timeout(120)
def test_the_second_claim_wins_and_the_first_writer_is_refused_for_good(postgres_url: str) -> None:
    url = postgres_url
    PostgresStore(url, run_id=RUN).close()  # the schema, before three processes race to make it
    reader = Child(READER, url, RUN)
    reader.ask("", "reading")
    first, second = Child(WRITER, url, RUN, "A"), Child(WRITER, url, RUN, "B")
    first.ask("", "ready")
    second.ask("", "ready")
    for n in (1, 2, 3):
        first.ask(f"save {n}", f"saved {n}")
    second.ask("save 2", "saved 2")  # its first save claims the run, rewriting it whole
    refused = first.ask("save 4", "refused ")
    assert f"run {RUN!r}" in refused and "claimed by another writer" in refused
    assert _stored(url) == [("s0", "B0"), ("s1", "B1")]  # nothing of the refused save
    second.ask("save 3", "saved 3")  # the winner goes on, one delta at a time
    first.ask("save 5", "refused ")  # refused from then on, whatever it saves
    assert _stored(url) == [("s0", "B0"), ("s1", "B1"), ("s2", "B2")]
    first.finish()
    second.finish()
    summary = json.loads(reader.finish())
    assert summary["mixed"] == []  # every load was one writer's whole checkpoint
    assert set(summary["seen"]) <= {"A1", "A2", "A3", "B2", "B3"}
    assert "B3" in summary["seen"]  # its last load came after the last save
    loaded = PostgresStore(url, run_id=RUN).load()
    assert loaded is not None and dict(loaded.outputs) == {"s0": "B0", "s1": "B1", "s2": "B2"}


@pytest.mark.timeout(120)
def test_a_sigkilled_writers_run_is_taken_over_by_the_next(postgres_url: str) -> None:
    url = postgres_url
    writer = Child(WRITER, url, RUN, "A")
    writer.ask("", "ready")
    writer.ask("save 2", "saved 2")
    os.kill(writer.proc.pid, signal.SIGKILL)
    writer.proc.communicate(timeout=30)
    assert writer.proc.returncode == -signal.SIGKILL
    store = PostgresStore(url, run_id=RUN)
    resumed = store.load()
    assert resumed is not None and dict(resumed.outputs) == {"s0": "A0", "s1": "A1"}
    store(_cp({**resumed.outputs, "s2": "C2"}))  # nothing to wait for: it claims at once
    # The claim extended what it loaded: one new row, not the run rewritten.
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT max(seq) FROM ekit_entries").fetchone() == (3,)
    assert _stored(url) == [("s0", "A0"), ("s1", "A1"), ("s2", "C2")]
    store.close()


# -- one process --------------------------------------------------------------------


def test_load_never_claims_and_a_new_store_takes_over(postgres_url: str) -> None:
    with PostgresStore(postgres_url, run_id=RUN) as first, PostgresStore(postgres_url, run_id=RUN) as other:
        first(_cp({"a": 1}))
        assert other.load() == _cp({"a": 1})  # a reader: nothing claimed
        first(_cp({"a": 1, "b": 2}))
        other(_cp({"x": 9}))  # a save claims: the run is other's now
        with pytest.raises(StoreLockedError, match=rf"run {RUN!r}.*claimed by another writer") as info:
            first(_cp({"a": 1, "b": 2, "c": 3}))
        assert info.value.run_id == RUN
        first.load()  # loading does not give the run back
        with pytest.raises(StoreLockedError):
            first(_cp({"x": 9, "y": 8}))
        assert dict(PostgresStore(postgres_url, run_id=RUN).load().outputs) == {"x": 9}  # type: ignore[union-attr]


def test_a_full_rewrite_is_fenced_too(postgres_url: str) -> None:
    with PostgresStore(postgres_url, run_id=RUN) as first, PostgresStore(postgres_url, run_id=RUN) as other:
        first(_cp({"a": 1}, context=MappingProxyType({"k": 1})))
        other(_cp({"x": 9}))
        with pytest.raises(StoreLockedError):  # another context: a rewrite, not a delta
            first(_cp({"a": 1, "b": 2}, context=MappingProxyType({"k": 2})))
        assert _stored(postgres_url) == [("x", 9)]


def test_deleting_a_run_fences_its_writer_and_not_the_deleter(postgres_url: str) -> None:
    with PostgresStore(postgres_url, run_id=RUN) as writer, PostgresStore(postgres_url, run_id=RUN) as other:
        writer(_cp({"a": 1}))
        assert other.delete(RUN)
        with pytest.raises(StoreLockedError, match="deleted"):
            writer(_cp({"a": 1, "b": 2}))  # not even a new row: the run stays deleted
        assert other.load() is None
        other(_cp({"x": 1}))
        assert other.delete(RUN)  # its own run: its next save claims it again
        other(_cp({"y": 2}))
        assert dict(other.load().outputs) == {"y": 2}  # type: ignore[union-attr]


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", '{"x": [1, NaN]}'])
def test_load_refuses_what_save_would_refuse(postgres_url: str, value: str) -> None:
    with PostgresStore(postgres_url, run_id=RUN) as store:
        store(_cp({"a": 1}))
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute("UPDATE ekit_entries SET value = %s WHERE name = 'a'", (value,))
        with pytest.raises(CorruptStoreError, match=r"output of step 'a' does not decode.*no NaN"):
            store.load()


def test_each_output_is_encoded_once_and_stored_as_first_saved(postgres_url: str) -> None:
    encoded: list[Any] = []

    def dumps(data: Any) -> str:
        encoded.append(data)
        return json.dumps(data, allow_nan=False)

    value = {"items": [1]}
    with PostgresStore(postgres_url, run_id=RUN, dumps=dumps, loads=json.loads) as store:
        store(_cp({"a": value}, context=MappingProxyType({"k": 1})))
        value["items"].append(2)  # a later step mutates the output it was given
        store(_cp({"a": value, "b": "B"}, context=MappingProxyType({"k": 1})))  # a delta
        store(_cp({"a": value, "b": "B", "c": "C"}, context=MappingProxyType({"k": 2})))  # a rewrite
    assert sum(data is value for data in encoded) == 1
    assert sum(data == "B" for data in encoded) == 1
    loaded = PostgresStore(postgres_url, run_id=RUN).load()
    assert loaded is not None and dict(loaded.outputs) == {"a": {"items": [1]}, "b": "B", "c": "C"}
    assert dict(loaded.context) == {"k": 2}
