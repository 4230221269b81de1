"""Times people read are ISO 8601 in UTC, never seconds since the epoch.

``ekit audit`` and ``ekit replay`` say who answered a question and when,
and ``ekit queue status`` (and ``list --json``) say when a run was made,
last changed and until when it is leased: each as ``2026-12-07T03:04:12Z``.
The core (which may not import ``datetime``) formats them with
:func:`ekit_core.times.iso_utc`, which agrees with ``datetime`` everywhere
it can.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ekit_core import WorkflowCheckpoint
from ekit_core.audit import StepAudit
from ekit_core.human import Answer, Exchange, Question
from ekit_core.replay import _questions_new
from ekit_core.times import iso_utc
from ekit_runtime.queue import open_queue
from tests.support.cli_runs import ekit

ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


@given(st.floats(-62_135_596_800, 253_402_300_799.9, allow_nan=False))
def test_iso_utc_agrees_with_datetime(at: float) -> None:
    d = dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=int(at // 1))
    expected = f"{d.year:04d}-{d.month:02d}-{d.day:02d}T{d.hour:02d}:{d.minute:02d}:{d.second:02d}Z"
    assert iso_utc(at) == expected


@given(st.one_of(st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e300, -1e300]),
                 st.integers(253_402_300_800, 10**30)))
def test_an_instant_no_calendar_holds_prints_as_the_number(at: float) -> None:
    assert iso_utc(at) == repr(at)


def test_audit_and_replay_say_when_an_answer_was_given_in_iso_utc() -> None:
    answered = (Exchange(Question("value", "who?"), Answer("ann", by="ann", at=1796603380.9)),)
    row = StepAudit("ask", "skip", "recorded", (), asked=answered)
    assert "answered by ann at 2026-12-07T" in row.why and "1796603380" not in row.why
    text = Exchange(Question("value", "who?"), Answer("bob", by="bob", at="yesterday"))
    assert "answered by bob at yesterday:" in StepAudit("ask", "skip", "recorded", (), asked=(text,)).why
    before = WorkflowCheckpoint(0, {}, asked={"ask": (Exchange(Question("value", "who?")),)})
    after = WorkflowCheckpoint(0, {}, asked={"ask": answered})
    _, told = _questions_new(after, before)
    assert told == {"ask": "'ann' by ann at 2026-12-07T" + told["ask"].split("T", 1)[1]}
    assert "1796603380" not in told["ask"]


@pytest.mark.timeout(120)  # two processes, seconds each on a loaded machine
def test_queue_status_prints_its_times_in_iso_utc(tmp_path: Path) -> None:
    url = str(tmp_path / "q.db")
    with open_queue(url) as q:
        q.submit("w", run_id="r1")
    status = ekit(tmp_path, "queue", "--queue", url, "status", "r1")
    assert status.returncode == 0, status.stderr
    data = json.loads(status.stdout)
    assert ISO.fullmatch(data["created_at"]) and ISO.fullmatch(data["updated_at"])
    assert data["lease_until"] is None
    listed = ekit(tmp_path, "queue", "--queue", url, "list", "--json")
    assert ISO.fullmatch(json.loads(listed.stdout)[0]["created_at"])
