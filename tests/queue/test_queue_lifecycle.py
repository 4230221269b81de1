"""The queue's lifecycle rules (ekit_runtime/queue/lifecycle.py), checked as pure values.

Every rule over every (status, lease state, cancel flag, epoch, who); the SQL
pieces against the pure functions on random rows (evaluated by SQLite in
memory); how a drive ended over every combination of the worker's flags.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sqlite3

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_core import WorkflowCheckpoint
from ekit_core.human import Question
from ekit_runtime.errors import RunWaiting
from ekit_runtime.queue import lifecycle as lc
from ekit_runtime.queue.options import check_run_options
from ekit_runtime.queue.records import FINAL_STATUSES, STATUSES, LeaseLostError, Limits
from ekit_runtime.queue.sqlite import _DIALECT as SQLITE_DIALECT
from ekit_runtime.stores.codec import default_dumps

NOW = 1000.0
LEASES = {"none": None, "live": NOW + 5.0, "expired": NOW - 5.0, "edge": NOW}
HOLDER_VERBS = {"save", "renew", "finish", "release", "park", "join"}
ANSWERING_VERBS = {"answer", "approve", "deny"}
REOPENING_VERBS = {"retry", "rewind", *ANSWERING_VERBS}


def _cases() -> list[tuple[str, str, bool, int]]:
    return list(itertools.product(STATUSES, LEASES, (False, True), (-1, 0, 1)))


@pytest.mark.parametrize(("status", "lease", "cancel", "delta"), _cases())
def test_each_rule_over_status_lease_cancel_and_epoch(
    status: str, lease: str, cancel: bool, delta: int
) -> None:
    until = LEASES[lease]
    is_live = status == "running" and lease == "live"
    assert lc.live(status, until, NOW) is is_live
    # A holder writes only at its own epoch, on a running run whose lease is unexpired.
    assert lc.fenced(status, 7, until, 7 + delta, NOW) is (is_live and delta == 0)
    # A running run always has a lease (a claim sets it; every write that clears it leaves running).
    is_expired = lease in ("expired", "edge")
    assert lc.expired(until, NOW) is is_expired
    expected_claimable = status == "queued" or (status == "running" and is_expired and not cancel)
    assert lc.claimable(status, until, cancel, NOW) is expected_claimable
    assert lc.abandoned(status, until, cancel, NOW) is (status == "running" and is_expired and cancel)
    # Never two writers: a run some holder may write to is claimable by no one, nor cancelled by a claim.
    if lc.fenced(status, 7, until, 7, NOW):
        assert not lc.claimable(status, until, cancel, NOW)
        assert not lc.abandoned(status, until, cancel, NOW)
    effect = lc.cancel_effect(status, lc.live(status, until, NOW))
    assert effect == ("ended" if status in FINAL_STATUSES else "flag" if is_live else "cancel")
    if status in FINAL_STATUSES:
        assert not lc.claimable(status, until, cancel, NOW) and not lc.live(status, until, NOW)


def test_the_transition_table_is_coherent() -> None:
    rows = lc.TRANSITIONS
    assert len(set(rows)) == len(rows)
    # A final status is left only when a person reopens the run: back to queued, for a worker to claim.
    assert {(t.target, t.who, t.verb) for t in rows if t.source in FINAL_STATUSES} <= {
        ("queued", "submitter", v) for v in REOPENING_VERBS
    }
    # Only a claim or a cancel can end a lease other than by its holder, and every verb has one actor.
    actors = {t.verb: {u.who for u in rows if u.verb == t.verb} for t in rows}
    assert actors == {
        "submit": {"submitter"},
        "fork": {"submitter"},
        "claim": {"anyone"},
        "cancel": {"submitter"},
        "spawn": {"holder"},
        "wake": {"anyone"},
        "close": {"anyone"},
        **{v: {"holder"} for v in HOLDER_VERBS},
        **{v: {"submitter"} for v in REOPENING_VERBS},
    }
    # Every reopening goes to queued, from a run no live lease holds (running only once it expired).
    assert all(t.target == "queued" for t in rows if t.verb in REOPENING_VERBS)
    assert {t.source for t in rows if t.verb == "retry"} == lc.RETRYABLE
    assert {t.source for t in rows if t.verb == "rewind"} == set(STATUSES)
    assert [t.source for t in rows if t.verb in ("submit", "fork")] == [None, None]
    # A person's answer takes a waiting run, and only a waiting one, back to queued.
    assert {(t.source, t.target) for t in rows if t.verb in ANSWERING_VERBS} == {("waiting", "queued")}
    # Only a holder parks a run (never a claim or a person); a parked run holds no lease: no claim takes it.
    assert {(t.source, t.who) for t in rows if t.target == "waiting"} == {("running", "holder")}
    assert not [t for t in rows if t.source == "waiting" and t.verb == "claim"]
    # A holder acts only on a running run (a spawn: its own, making a child run); every final
    # status is reached by finish.
    assert all(t.source == "running" for t in rows if t.who == "holder" and t.verb != "spawn")
    assert [(t.source, t.target) for t in rows if t.verb == "spawn"] == [(None, "queued")]
    # A child's end wakes only a parent that waits, and only back to queued (a claim takes it next).
    assert [(t.source, t.target) for t in rows if t.verb == "wake"] == [("waiting", "queued")]
    # A parent's early end closes its children as a cancel would: the cancel's rows, made by anyone.
    assert {(t.source, t.target, t.lease) for t in rows if t.verb == "close"} == {
        (t.source, t.target, t.lease) for t in rows if t.verb == "cancel"
    }
    assert {t.target for t in rows if t.verb == "finish"} == FINAL_STATUSES
    assert {t.source for t in rows} - {None} | {t.target for t in rows} == set(STATUSES)


@pytest.mark.parametrize(("status", "lease", "cancel"), [c[:3] for c in _cases() if c[3] == 0])
def test_the_pure_rules_only_make_transitions_of_the_table(status: str, lease: str, cancel: bool) -> None:
    until = LEASES[lease]
    table = {(t.source, t.target, t.verb) for t in lc.TRANSITIONS}
    if lc.claimable(status, until, cancel, NOW):
        assert (status, "running", "claim") in table
    if lc.abandoned(status, until, cancel, NOW):
        assert (status, "cancelled", "claim") in table
    effect = lc.cancel_effect(status, lc.live(status, until, NOW))
    if effect != "ended":
        target = "running" if effect == "flag" else "cancelled"
        assert (status, target, "cancel") in table
    if lc.fenced(status, 1, until, 1, NOW):
        for verb in HOLDER_VERBS:
            assert any(t.source == status and t.verb == verb for t in lc.TRANSITIONS)
    for verb in REOPENING_VERBS:
        if lc.reopen_refusal(verb, status, lc.live(status, until, NOW)) is None:
            assert (status, "queued", verb) in table


VERBS = ("claim", "cancel", "close", "spawn", "wake", *sorted(HOLDER_VERBS), *sorted(REOPENING_VERBS))
WHO = {
    "claim": "anyone",
    "spawn": "holder",
    "wake": "anyone",
    "close": "anyone",
    "cancel": "submitter",
    **{v: "holder" for v in HOLDER_VERBS},
    **{v: "submitter" for v in REOPENING_VERBS},
}


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize(("status", "lease", "cancel", "delta"), _cases())
def test_who_may_make_each_transition(verb: str, status: str, lease: str, cancel: bool, delta: int) -> None:
    until = LEASES[lease]
    table = {(t.source, t.target, t.who, t.verb) for t in lc.TRANSITIONS}
    # A holder's epoch is 7 + delta; only the holder at the run's own epoch (delta 0) is fenced in.
    for final in sorted(FINAL_STATUSES):
        target = lc.next_status(
            verb,
            status,
            until,
            cancel,
            NOW,
            fenced_ok=lc.fenced(status, 7, until, 7 + delta, NOW),
            final=final,
        )
        if target is None:
            continue
        assert (status, target, WHO[verb], verb) in table
        if WHO[verb] == "holder" and verb != "spawn":
            assert delta == 0 and lc.live(status, until, NOW)
    # No one but a verb's actor appears in the table for it.
    assert {t.who for t in lc.TRANSITIONS if t.verb == verb} == {WHO[verb]}


@pytest.mark.parametrize("status", STATUSES)
@pytest.mark.parametrize("lease", LEASES)
def test_who_may_reopen_a_run_and_what_a_refusal_advises(status: str, lease: str) -> None:
    until = LEASES[lease]
    lease_live = lc.live(status, until, NOW)
    retry = lc.reopen_refusal("retry", status, lease_live)
    rewind = lc.reopen_refusal("rewind", status, lease_live)
    # Retry: a run that ended without finishing; rewind: any run no worker is driving.
    assert (retry is None) is (status in ("failed", "cancelled"))
    assert (rewind is None) is (not lease_live)
    assert lc.next_status("retry", status, until, False, NOW) == (None if retry else "queued")
    assert lc.next_status("rewind", status, until, True, NOW) == (None if rewind else "queued")
    # Each refusal says what to do instead.
    advice = {"queued": "a worker will claim it", "running": "cancel it first", "finished": "rewind"}
    if retry is not None and status in advice:
        assert advice[status] in retry
    if rewind is not None:
        assert "cancel it first" in rewind
    # An answer, approval or denial takes only a waiting run.
    for verb in sorted(ANSWERING_VERBS):
        refusal = lc.reopen_refusal(verb, status, lease_live)
        assert (refusal is None) is (status == "waiting")
        assert refusal is None or f"it is {status}, not waiting for an answer" == refusal
    with pytest.raises(ValueError, match="not a verb that reopens"):
        lc.reopen_refusal("claim", status, lease_live)


def test_the_reason_a_parked_run_shows_names_the_step_and_its_question() -> None:
    value, approval = Question("value", "Which colour?"), Question("approval", "Pay $3?")
    assert lc.waiting_reason({"pick": value}) == "waiting for an answer to step 'pick': Which colour?"
    assert lc.waiting_reason({"pay": approval}) == (
        "waiting for an answer to step 'pay' (approve or deny): Pay $3?"
    )
    assert lc.waiting_reason({"a": value, "b[2]": approval}) == "waiting for answers to steps 'a', 'b[2]'"


@pytest.mark.parametrize("cancel", [False, True])
@pytest.mark.parametrize("ended", [False, True])
def test_a_join_parks_unless_a_child_ended_or_a_cancel_was_asked(cancel: bool, ended: bool) -> None:
    target = lc.next_status("join", "running", NOW + 5, cancel, NOW, child_ended=ended)
    assert target == ("cancelled" if cancel else "queued" if ended else "waiting")
    rows = {(t.source, t.target, t.who, t.verb) for t in lc.TRANSITIONS}
    assert ("running", target, "holder", "join") in rows
    assert lc.children_reason(["p/a"]) == "waiting for child run 'p/a'"
    assert lc.children_reason(["p/a", "p/b"]).startswith(lc.CHILDREN_REASON)


def test_next_status_refuses_an_unknown_verb() -> None:
    with pytest.raises(ValueError, match="not a verb"):
        lc.next_status("steal", "running", NOW + 1, False, NOW)


WAITING = RunWaiting(WorkflowCheckpoint(step_index=0, outputs={}), {"s": Question("value", "which?")})


def _errors() -> st.SearchStrategy[BaseException | None]:
    return st.sampled_from(
        [
            None,
            ValueError("boom"),
            asyncio.CancelledError(),
            LeaseLostError("r", 1),
            ExceptionGroup("g", [ValueError("x"), LeaseLostError("r", 1)]),
            ExceptionGroup("g", [ValueError("x")]),
            WAITING,
        ]
    )


@given(st.booleans(), st.booleans(), st.booleans(), st.booleans(), _errors())
@settings(max_examples=300, deadline=None)
def test_how_a_drive_ended(
    lost: bool, stopping: bool, cancel_asked: bool, cancelled: bool, error: BaseException | None
) -> None:
    if cancelled:
        error = None  # a cancelled task has no exception
    ending = lc.drive_ending(
        lost=lost, stopping=stopping, cancel_asked=cancel_asked, cancelled=cancelled, error=error
    )
    refused = isinstance(error, LeaseLostError) or (
        isinstance(error, BaseExceptionGroup) and any(isinstance(e, LeaseLostError) for e in error.exceptions)
    )
    if lost or refused:
        assert ending == "lost"
    elif isinstance(error, RunWaiting):
        # A run waiting for a person is parked (even while its worker stops), unless cancelled.
        assert ending == ("cancelled" if cancel_asked else "parked")
    elif stopping and not cancel_asked:
        assert ending == "released"
    elif cancel_asked and (cancelled or isinstance(error, asyncio.CancelledError)):
        assert ending == "cancelled"
    elif error is None and not cancelled:
        assert ending == "finished"
    else:
        assert ending == "failed"


def test_a_cancel_nobody_asked_for_is_a_failure_and_a_refusal_wins_over_everything() -> None:
    assert (
        lc.drive_ending(lost=False, stopping=False, cancel_asked=False, cancelled=True, error=None)
        == "failed"
    )
    assert (
        lc.drive_ending(
            lost=False, stopping=True, cancel_asked=True, cancelled=False, error=LeaseLostError("r", 2)
        )
        == "lost"
    )
    assert (
        lc.drive_ending(lost=False, stopping=True, cancel_asked=True, cancelled=True, error=None)
        == "cancelled"
    )


_COUNTS = st.integers(min_value=0, max_value=50)
_LIMIT = st.none() | st.integers(min_value=1, max_value=40)


@given(_LIMIT, _LIMIT, _COUNTS, _COUNTS, st.floats(0, 100), st.floats(0.5, 100))
def test_the_usage_window(
    calls_limit: int | None, tokens_limit: int | None, calls: int, tokens: int, age: float, window: float
) -> None:
    limits = Limits(llm_calls_per_minute=calls_limit, tokens_per_minute=tokens_limit, window=window)
    over = (calls_limit is not None and calls >= calls_limit) or (
        tokens_limit is not None and tokens >= tokens_limit
    )
    assert lc.usage_over(limits, calls, tokens) is over
    assert lc.usage_limited(limits) is (calls_limit is not None or tokens_limit is not None)
    wait = lc.usage_wait(limits, calls, tokens, NOW - age, NOW)
    if not over:
        assert wait == 0.0
    else:
        # Until the oldest entry leaves the window, and never a busy loop.
        assert wait == max(NOW - age + window - NOW, 0.01)


@given(st.none() | st.integers(1, 5), st.none() | st.integers(1, 5), st.integers(0, 6), st.integers(0, 6))
def test_the_claim_limits(cap: int | None, rate: int | None, leases: int, started: int) -> None:
    limits = Limits(max_in_flight=cap, runs_per_minute=rate)
    assert lc.at_cap(limits, leases) is (cap is not None and leases >= cap)
    assert lc.at_start_rate(limits, started) is (rate is not None and started >= rate)


# -- the SQL pieces say what the functions say ------------------------------

_ROW = st.tuples(
    st.sampled_from(STATUSES),
    st.sampled_from(list(LEASES.values())),
    st.booleans(),
    st.integers(0, 3),
    st.sampled_from(["a", "b"]),
    st.sampled_from([None, "f1", "f2"]),
    # Stored options as submit writes them, and a step name that only looks like the option.
    st.sampled_from([
        default_dumps(check_run_options(o))
        for o in ({}, {"allow_graph_change": True}, {"allow_graph_change": False},
                  {"only": ['"allow_graph_change":true'], "durations": True})
    ]),
)
_NAMED = {
    **{name: f":{name}" for name in ("now", "since", "run_id", "epoch", "workflow", "fingerprint")},
    "graph_change": SQLITE_DIALECT["graph_change"],
}


@pytest.fixture(scope="module")
def memory() -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:")
    conn.execute(
        "CREATE TABLE ekit_queue_runs (seq INTEGER PRIMARY KEY, run_id TEXT, workflow TEXT, status TEXT, "
        "epoch INTEGER, lease_until REAL, cancel_requested INTEGER, fingerprint TEXT, priority INTEGER, "
        "options TEXT)"
    )
    return conn


def _ask(conn: sqlite3.Connection, template: str, row: tuple[object, ...], **args: object) -> bool:
    status, until, cancel, epoch, workflow, fp, options = row
    conn.execute("DELETE FROM ekit_queue_runs")
    conn.execute(
        "INSERT INTO ekit_queue_runs (run_id, workflow, status, epoch, lease_until, cancel_requested, "
        "fingerprint, priority, options) VALUES ('r', ?, ?, ?, ?, ?, ?, 0, ?)",
        (workflow, status, epoch, until, int(bool(cancel)), fp, options),
    )
    sql = f"SELECT count(*) FROM ekit_queue_runs WHERE {lc.render(template, _NAMED)}"
    return bool(conn.execute(sql, {"now": NOW, **args}).fetchone()[0])


@given(row=_ROW, lease_epoch=st.integers(0, 3), fingerprint=st.sampled_from([None, "f1", "f2"]))
@settings(max_examples=300, deadline=None)
def test_the_sql_pieces_agree_with_the_functions(
    memory: sqlite3.Connection, row: tuple[object, ...], lease_epoch: int, fingerprint: str | None
) -> None:
    status, until, cancel, epoch, workflow, fp, options = row
    assert isinstance(options, str)
    assert isinstance(status, str) and isinstance(epoch, int) and isinstance(workflow, str)
    assert until is None or isinstance(until, float)
    assert fp is None or isinstance(fp, str)
    assert _ask(memory, lc.LIVE, row) is lc.live(status, until, NOW)
    assert _ask(memory, lc.HELD, row, run_id="r", epoch=lease_epoch) is lc.fenced(
        status, epoch, until, lease_epoch, NOW
    )
    # A claim cancels the abandoned runs first; then the claimable condition is the SQL's.
    assert _ask(memory, lc.ABANDONED, row) is lc.abandoned(status, until, bool(cancel), NOW)
    if not lc.abandoned(status, until, bool(cancel), NOW):
        assert _ask(memory, lc.CLAIMABLE, row) is lc.claimable(status, until, bool(cancel), NOW)
    assert _ask(memory, lc.MATCHES, row, workflow="a", fingerprint=fingerprint) is lc.matches(
        workflow, fp, {"a": fingerprint}, graph_change=lc.graph_change_allowed(options)
    )
    assert lc.graph_change_allowed(options) is (json.loads(options).get("allow_graph_change") is True)
    assert _ask(memory, lc.FINAL, row) is (status in FINAL_STATUSES)
    # A person's write (retry, rewind) lands only on the run as read: same epoch, no live lease.
    assert _ask(memory, lc.UNCHANGED, row, run_id="r", epoch=lease_epoch) is (
        epoch == lease_epoch and not lc.live(status, until, NOW)
    )


@given(st.floats(0, 2000), st.floats(0.5, 100))
def test_the_window_pieces_split_entries_at_the_window_start(at: float, window: float) -> None:
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE w (at REAL)")
    conn.execute("INSERT INTO w VALUES (?)", (at,))
    since = NOW - window
    inside = conn.execute(f"SELECT count(*) FROM w WHERE {lc.render(lc.IN_WINDOW, _NAMED)}", {"since": since})
    left = conn.execute(f"SELECT count(*) FROM w WHERE {lc.render(lc.LEFT_WINDOW, _NAMED)}", {"since": since})
    assert (inside.fetchone()[0], left.fetchone()[0]) == ((1, 0) if at > since else (0, 1))


def test_render_maps_every_name_and_refuses_a_missing_one() -> None:
    assert lc.render(lc.HELD, {"run_id": "?", "epoch": "?", "now": "now()"}) == (
        "run_id = ? AND epoch = ? AND status = 'running' AND lease_until > now()"
    )
    with pytest.raises(KeyError):
        lc.render(lc.HELD, {"run_id": "?"})


def test_the_docstring_table_is_the_transitions_value() -> None:
    doc = lc.__doc__ or ""
    body = doc.split("    ---------  ---------  ---------  -------  ", 1)[1].split("\n\n", 1)[0]
    rows = set()
    for line in body.splitlines()[1:]:
        source, target, who, verb = line.split()[:4]
        rows.add((None if source == "(none)" else source, target, who, verb))
    assert rows == {(t.source, t.target, t.who, t.verb) for t in lc.TRANSITIONS}
