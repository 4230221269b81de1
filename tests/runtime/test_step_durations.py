"""Checkpoints record how long each recorded step's attempt took (``durations``).

Timed with the Runner's injectable clock, which the step bodies move on:
every figure is exact. Pins that a run records one duration per timed
output (and a mapped step's collected output none), that a resume keeps
the recorded ones, that a rewound or outdated step loses its duration,
that a malformed one is refused naming it, that every store writes and
reads them (the journal and the SQL rows as deltas), and that ``ekit
audit`` and the dashboard's run page show them.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from ekit_core import CheckpointError, WorkflowCheckpoint, audit, checkpoint_of, rewind
from ekit_runtime import JournalStore, SqliteStore, Step, Workflow
from ekit_runtime.stores.rows import decode_checkpoint, encode_checkpoint
from ekit_runtime.ui import FileSource
from tests.support.dashboard_http import fetch, serving
from tests.support.store_helpers import store_factories

FACTORIES = store_factories("run-1")


class Clock:
    """The Runner's clock: it reads ``now``, which the step bodies move on."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def taking(clock: Clock, seconds: float, value: Any = None, *, fail: list[bool] | None = None
           ) -> Callable[[Any], Awaitable[Any]]:
    """A step body that takes ``seconds`` on ``clock``; with ``fail=[True]``, its first call raises."""

    async def body(context: Any) -> Any:
        clock.now += seconds
        if fail and fail.pop():
            raise RuntimeError("down")
        return value

    return body


def chain(clock: Clock, times: dict[str, float], *, fail: str | None = None,
          versions: dict[str, str] | None = None) -> Workflow:
    names = list(times)
    failing: dict[str, list[bool]] = {fail: [True]} if fail else {}
    return Workflow([
        Step(n, taking(clock, times[n], n.upper(), fail=failing.get(n)), (names[i - 1],) if i else (),
             version=(versions or {}).get(n))
        for i, n in enumerate(names)
    ])


def run(workflow: Workflow, clock: Clock, **options: Any
        ) -> tuple[WorkflowCheckpoint, list[WorkflowCheckpoint]]:
    """The run's last checkpoint and every one it saved (``checkpoint_fn`` too, if given).

    With ``durations=True`` unless ``options`` say otherwise: what these tests pin.
    """
    options.setdefault("durations", True)
    saved: list[WorkflowCheckpoint] = []
    given = options.pop("checkpoint_fn", None)

    def save(cp: WorkflowCheckpoint) -> None:
        saved.append(cp)
        if given is not None:
            given(cp)

    state = asyncio.run(workflow.runner(clock=clock, checkpoint_fn=save, max_concurrency=1,
                                        **options).run())
    return checkpoint_of(state), saved


TIMES = {"a": 0.25, "b": 1.5, "c": 2.0}


def test_a_run_records_the_seconds_each_steps_attempt_took() -> None:
    final, saved = run(*_timed_chain())
    assert dict(final.durations) == TIMES
    for cp in saved:  # every checkpoint: one duration per recorded output, in completion order
        assert list(cp.durations) == list(cp.outputs)
    data = final.to_dict()
    assert data["durations"] == TIMES
    assert data["format_version"] == 1  # an optional key: no new format (see the format doc)
    assert WorkflowCheckpoint.from_dict(json.loads(json.dumps(data))) == final


def _timed_chain(times: dict[str, float] = TIMES, **kw: Any) -> tuple[Workflow, Clock]:
    clock = Clock()
    return chain(clock, times, **kw), clock


def test_durations_are_recorded_in_whole_microseconds() -> None:
    workflow, clock = _timed_chain({"a": 0.000_002_4, "b": 1 / 3})
    final, _ = run(workflow, clock)
    assert dict(final.durations) == {"a": 2e-06, "b": 0.333333}
    assert json.dumps(final.to_dict()["durations"]) == '{"a": 2e-06, "b": 0.333333}'


def test_a_clock_that_goes_back_or_is_not_a_number_records_nothing() -> None:
    workflow, clock = _timed_chain({"a": -1.0, "b": math.nan, "c": 0.5})
    final, _ = run(workflow, clock)
    assert list(final.outputs) == ["a", "b", "c"]
    # b started at -1 and ended at nan; c started at nan: no number of seconds.
    assert dict(final.durations) == {}


def test_a_resume_keeps_the_recorded_durations_and_adds_the_new_ones() -> None:
    workflow, clock = _timed_chain(fail="c")
    stopped, _ = run(workflow, clock)
    assert "c" in stopped.failures
    # The failed attempt of c is no output, so no duration: a and b are recorded.
    assert dict(stopped.durations) == {"a": 0.25, "b": 1.5}
    again, clock = _timed_chain({"a": 9.0, "b": 9.0, "c": 4.0})
    final, resumed = run(again, clock, resume_from=stopped)
    assert dict(final.durations) == {"a": 0.25, "b": 1.5, "c": 4.0}
    assert all(cp.durations["a"] == 0.25 for cp in resumed)


def test_a_rewound_or_outdated_step_loses_its_duration() -> None:
    workflow, clock = _timed_chain()
    final, _ = run(workflow, clock)
    rewound = rewind(workflow, final, "b")
    assert dict(rewound.durations) == {"a": 0.25}
    assert rewound.to_dict()["durations"] == {"a": 0.25}
    again, clock = _timed_chain({"a": 9.0, "b": 3.0, "c": 5.0})
    assert dict(run(again, clock, resume_from=rewound)[0].durations) == {"a": 0.25, "b": 3.0, "c": 5.0}
    # A bumped version tag: b and what follows run again, with new durations.
    bumped, clock = _timed_chain({"a": 9.0, "b": 7.0, "c": 8.0}, versions={"b": "2"})
    assert dict(run(bumped, clock, resume_from=final)[0].durations) == {"a": 0.25, "b": 7.0, "c": 8.0}


def _mapped(clock: Clock) -> Workflow:
    per_item = {1: 0.5, 2: 0.25, 3: 1.0}

    async def square(context: Any) -> int:
        clock.now += per_item[context["split"]]
        return int(context["split"]) ** 2

    return Workflow([
        Step("split", taking(clock, 0.125, [1, 2, 3])),
        Step("square", square, ("split",), map_over="split", context="dependencies"),
    ])


def test_each_item_of_a_mapped_step_has_its_duration_and_the_collected_output_none() -> None:
    clock = Clock()
    final, _ = run(_mapped(clock), clock)
    assert dict(final.durations) == {"split": 0.125, "square[0]": 0.5, "square[1]": 0.25,
                                     "square[2]": 1.0}
    assert "square" in final.outputs and "square" not in final.durations
    assert dict(rewind(_mapped(Clock()), final, "square[1]").durations) == {
        "split": 0.125, "square[0]": 0.5, "square[2]": 1.0}


# -- untrusted input -------------------------------------------------------------------


def _with(durations: object) -> dict[str, Any]:
    return {"step_index": 1, "outputs": {"judge": 1, "b": 2},
            "cost": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0}, "durations": durations}


@pytest.mark.parametrize(("durations", "field"), [
    ({"judge": -0.5}, "durations.judge"),
    ({"b": 1.0, "judge": math.nan}, "durations.judge"),
    ({"judge": math.inf}, "durations.judge"),
    ({"judge": True}, "durations.judge"),
    ({"judge": "1.5"}, "durations.judge"),
    ({"judge": None}, "durations.judge"),
    ({"judge": [1.0]}, "durations.judge"),
    ({"": 1.0}, "durations"),
    ([1.0], "durations"),
    ({1: 1.0}, "durations"),
    ({"b": 1e308, "judge": 1e308}, "durations"),
])
def test_from_dict_refuses_a_malformed_duration_naming_it(durations: object, field: str) -> None:
    with pytest.raises(CheckpointError) as caught:
        WorkflowCheckpoint.from_dict(_with(durations))
    assert caught.value.field == field


def test_a_resume_refuses_a_duration_of_no_step_and_drops_one_of_a_step_not_recorded() -> None:
    workflow, clock = _timed_chain()
    final, _ = run(workflow, clock)
    data = final.to_dict()
    hand_rewound = {**data, "outputs": {"a": "A"}, "step_index": 1}  # b's and c's durations stay
    assert WorkflowCheckpoint.from_dict(hand_rewound).durations == TIMES  # (the graph is not known here)
    again, clock = _timed_chain({"a": 9.0, "b": 3.0, "c": 5.0})
    assert dict(run(again, clock, resume_from=hand_rewound)[0].durations) == {"a": 0.25, "b": 3.0, "c": 5.0}
    ran: list[str] = []
    bogus = {**data, "durations": {**data["durations"], "nobody": 1.0}}
    noted = Workflow([Step(n, lambda c, n=n: ran.append(n), (p,) if p else ())
                      for n, p in (("a", None), ("b", "a"), ("c", "b"))])
    with pytest.raises(CheckpointError) as caught:
        noted.run_sync(resume_from={**bogus, "outputs": {"a": "A"}, "step_index": 1})
    assert caught.value.field == "durations.nobody" and ran == []
    # An item of a mapped step is a name of the graph.
    clock = Clock()
    mapped, _ = run(_mapped(clock), clock)
    back = {**mapped.to_dict(), "outputs": {"split": [1, 2, 3]}, "step_index": 1}
    assert set(run(_mapped(clock), clock, resume_from=back)[0].durations) == set(mapped.durations)


def test_whole_seconds_and_no_durations_load() -> None:
    assert dict(WorkflowCheckpoint.from_dict(_with({"judge": 2, "b": 0})).durations) == {"judge": 2, "b": 0}
    data = _with({})
    assert WorkflowCheckpoint.from_dict(data).durations == {}
    del data["durations"]
    cp = WorkflowCheckpoint.from_dict(data)
    assert cp.durations == {} and "durations" not in cp.to_dict()


# -- the stores ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_every_store_writes_and_reads_back_each_checkpoints_durations(kind: str, tmp_path: Path) -> None:
    store = FACTORIES[kind](tmp_path)
    seen: list[WorkflowCheckpoint] = []

    def save(cp: WorkflowCheckpoint) -> None:
        store(cp)
        seen.append(FACTORIES[kind](tmp_path).load())

    workflow, clock = _timed_chain()
    final, saved = run(workflow, clock, checkpoint_fn=save)
    assert seen == saved  # after every save, durations included
    assert dict(seen[-1].durations) == TIMES
    store.close()
    # A resume through the store keeps them and adds the new ones.
    rewound = rewind(workflow, final, "c")
    again = FACTORIES[kind](tmp_path)
    again(rewound)
    workflow, clock = _timed_chain({"a": 1.0, "b": 1.0, "c": 6.0})
    run(workflow, clock, checkpoint_fn=again, resume_from=FACTORIES[kind](tmp_path).load())
    assert dict(FACTORIES[kind](tmp_path).load().durations) == {"a": 0.25, "b": 1.5, "c": 6.0}
    again.close()


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line)["r"] for line in path.read_text().splitlines()]


def test_a_journal_delta_carries_the_new_outputs_durations_once(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    store = JournalStore(path, durable=False)
    workflow, clock = _timed_chain()
    _, saved = run(workflow, clock, checkpoint_fn=store)
    store.close()
    records = _lines(path)
    assert [r["kind"] for r in records] == ["full", "delta", "delta"]
    assert records[0]["durations"] == {"a": 0.25}
    assert [r["durations"] for r in records[1:]] == [{"b": 1.5}, {"c": 2.0}]
    assert list(JournalStore(path).history()) == saved


def test_a_journal_delta_recording_a_duration_twice_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    store = JournalStore(path, durable=False)
    run(*_timed_chain(), checkpoint_fn=store)
    store.close()
    text = path.read_text().replace('"durations":{"c":2.0}', '"durations":{"a":2.0}')
    records = text.splitlines()
    from tests.support.store_helpers import framed_line

    body = json.dumps(json.loads(records[-1])["r"], separators=(",", ":")).encode()
    path.write_bytes(("\n".join(records[:-1]) + "\n").encode() + framed_line(body))
    with pytest.raises(ValueError, match="'durations' records step 'a' a second time"):
        JournalStore(path).load()


def test_sql_rows_hold_a_duration_in_its_steps_usage_row_which_older_readers_ignore() -> None:
    workflow, clock = _timed_chain()
    _, saved = run(workflow, clock)
    full = encode_checkpoint(saved[0], None, json.dumps)
    delta = encode_checkpoint(saved[1], saved[0], json.dumps)
    assert full.full and not delta.full
    assert delta.rows[0] == ("output", "b", '"B"')
    kind, name, text = delta.rows[1]
    assert (kind, name) == ("usage", "b")  # beside the seconds, when its attempt began
    assert json.loads(text) == {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0, "seconds": 1.5,
                                "began": saved[1].began["b"]}
    rows = full.rows + delta.rows
    assert full.header is not None
    back = decode_checkpoint(full.header, delta.counts, delta.failures, rows, json.loads, "test")
    assert back == saved[1] and back.step_usage == {}  # spent nothing: no usage entry
    # A reader that knows no durations takes every usage row as usage: the
    # counts load (the parser ignores a usage's other keys), the seconds are dropped.
    older = {**json.loads(full.header), "step_index": 2, "outputs": {"a": "A", "b": "B"},
             "cost": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0},
             "step_usage": {name: json.loads(value) for kind, name, value in rows if kind == "usage"}}
    assert WorkflowCheckpoint.from_dict(older).outputs == saved[1].outputs


def test_a_sqlite_store_saves_each_duration_in_a_delta(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "cp.db", run_id="r")
    workflow, clock = _timed_chain()
    final, _ = run(workflow, clock, checkpoint_fn=store)
    store.close()
    assert SqliteStore(tmp_path / "cp.db", run_id="r").load() == final


# -- what people read ---------------------------------------------------------------------


def test_audit_shows_each_recorded_steps_time() -> None:
    workflow, clock = _timed_chain()
    final, _ = run(workflow, clock)
    report = audit(workflow, rewind(workflow, final, "c"))
    assert [(s.name, s.duration) for s in report.steps] == [("a", 0.25), ("b", 1.5), ("c", None)]
    assert report.steps[0].to_dict()["duration"] == 0.25
    lines = report.format().splitlines()
    header = next(line for line in lines if line.startswith("STEP"))
    assert header.split() == ["STEP", "ACTION", "USAGE", "in/out/calls", "TIME", "WHY"]
    assert [line.split()[3] for line in lines if line[:2] in ("a ", "b ", "c ")] == ["250.0ms", "1.50s", "-"]
    # A checkpoint without durations keeps the table it always had.
    untimed = WorkflowCheckpoint.from_dict({k: v for k, v in final.to_dict().items() if k != "durations"})
    assert "TIME" not in audit(workflow, untimed).format()


def test_the_run_page_shows_each_steps_duration_and_a_mapped_steps_items_total_and_slowest(
    tmp_path: Path,
) -> None:
    clock = Clock()
    path = tmp_path / "mapped.jsonl"
    store = JournalStore(path, durable=False)
    run(_mapped(clock), clock, checkpoint_fn=store)
    store.close()
    with serving(FileSource(str(path))) as server:
        page = fetch(server, "/run/mapped.jsonl")
        api = fetch(server, "/api/run/mapped.jsonl").json()
    assert page.status == 200
    for body in (page.body, api["steps_tbody"]):
        split = _row(body, "split")
        assert 'class="num duration" data-seconds="0.125">125.0ms</td>' in split
        square = _row(body, "square")
        assert 'data-seconds="1.75">1.75s <small>(3 items; slowest square[2]: 1.00s)</small>' in square


def test_the_run_page_escapes_the_slowest_items_name_and_says_when_none_is_recorded(tmp_path: Path) -> None:
    evil = "<b>x</b>"
    data = {"step_index": 2, "outputs": {"a": [1], f"m[{evil}]": 1}, "graph": {"a": [], "m": ["a"]},
            "cost": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0}, "format_version": 2,
            "shapes": {"m": {"map_over": "a", "item_key": "k"}}}
    path = tmp_path / "cp.json"
    path.write_text(json.dumps(data))
    with serving(FileSource(str(path))) as server:
        body = fetch(server, "/run/cp.json").body
    assert '<td class="num duration">-</td>' in _row(body, "a")
    timed = dict(data, outputs={"a": [{"k": evil}], f"m[{evil}]": 1},
                 durations={f"m[{evil}]": 0.5})
    path.write_text(json.dumps(timed))
    with serving(FileSource(str(path))) as server:
        body = fetch(server, "/run/cp.json").body
    assert evil not in body
    assert "slowest m[&lt;b&gt;x&lt;/b&gt;]: 500.0ms" in _row(body, "m")


def _row(body: str, step: str) -> str:
    start = body.index(f'<tr data-step="{step}">')
    return body[start:body.index("</tr>", start)]


def test_a_plain_checkpoint_has_no_duration_until_read(tmp_path: Path) -> None:
    """What a run whose checkpoints are never written out pays: no mapping is built."""
    workflow, clock = _timed_chain()
    _, saved = run(workflow, clock)
    from ekit_core.checkpoint import _STORED_DURATIONS

    with pytest.raises(AttributeError):
        _STORED_DURATIONS.__get__(saved[-1], WorkflowCheckpoint)
    assert saved[-1].durations == MappingProxyType(TIMES)


# -- who records them: asked for in one process, on by default in a fleet -------------


def test_a_run_records_no_duration_unless_asked() -> None:
    workflow, clock = _timed_chain()
    final, saved = run(workflow, clock, durations=False)
    assert dict(final.durations) == {} and all(not cp.durations for cp in saved)
    assert "durations" not in final.to_dict()
    plain = workflow.run_sync()  # the default: a checkpoint holds what a resume needs
    assert "durations" not in plain.checkpoint.to_dict()
    # A resume keeps the durations recorded before, whether or not it records its own.
    timed, _ = run(*_timed_chain())
    resumed = workflow.run_sync(resume_from=rewind(workflow, timed, "c"))
    assert dict(resumed.checkpoint.durations) == {"a": TIMES["a"], "b": TIMES["b"]}


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_durations_option_that_is_no_bool_is_refused_before_any_step(value: Any) -> None:
    ran: list[str] = []
    flow = Workflow([Step("a", lambda ctx: ran.append("a"))])
    with pytest.raises(ValueError, match="durations must be True or False"):
        flow.run_sync(durations=value)
    assert ran == []


def test_queue_workers_record_durations_unless_a_run_or_their_defaults_say_not(tmp_path: Path) -> None:
    from ekit_runtime.queue import Worker, open_queue

    flows = {"chain": Workflow([Step("a", lambda ctx: "A"), Step("b", lambda ctx: "B", ("a",))])}
    with open_queue(str(tmp_path / "q.db")) as q:
        q.submit("chain", run_id="timed")
        q.submit("chain", run_id="untimed", options={"durations": False})
        assert asyncio.run(Worker(q, flows, poll=0.01).run_until_idle()) == 2
        timed, untimed = q.checkpoint("timed"), q.checkpoint("untimed")
        assert timed is not None and set(timed.durations) == {"a", "b"} == set(timed.began)
        assert all(0 <= s < 60 for s in timed.durations.values())
        assert untimed is not None and dict(untimed.durations) == {}
        q.submit("chain", run_id="fleet")
        q.submit("chain", run_id="own", options={"durations": True})
        worker = Worker(q, flows, poll=0.01, defaults={"durations": False})
        assert asyncio.run(worker.run_until_idle()) == 2
        assert dict(q.checkpoint("fleet").durations) == {}  # type: ignore[union-attr]
        assert set(q.checkpoint("own").durations) == {"a", "b"}  # type: ignore[union-attr]  # the run's own wins
        with pytest.raises(ValueError, match="'durations'"):
            q.submit("chain", run_id="bad", options={"durations": "yes"})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flag", ["--durations", None, "--no-durations"])
def test_ekit_worker_records_them_for_every_run_unless_told_not_to(tmp_path: Path, flag: str | None) -> None:
    import os
    import subprocess
    import sys

    from ekit_runtime.queue import open_queue

    root = Path(__file__).resolve().parents[2]
    url = str(tmp_path / "q.db")
    with open_queue(url) as q:
        q.submit("mapped", {}, run_id="m")
    done = subprocess.run(
        [sys.executable, "-m", "ekit_runtime", "worker", "--queue", url, "--workflows",
         "tests.support.queue_options_child:REGISTRY", "--until-idle", *([flag] if flag else [])],
        cwd=root, env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(root))},
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    with open_queue(url) as q:
        final = q.checkpoint("m")
        assert q.status("m").status == "finished"
    assert final is not None
    if flag == "--no-durations":
        assert dict(final.durations) == {} and dict(final.began) == {}
        return
    # Every step that ran has one (a mapped step's collected output never runs).
    assert set(final.durations) == set(final.outputs) - {"each"} == set(final.began)
