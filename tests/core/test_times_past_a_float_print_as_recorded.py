"""An answer's time too large for a float is printed as recorded, never an OverflowError.

``Answer(at=...)`` takes any int, and JSON stores one of any size, so a
checkpoint may record ``at=10**400``. :func:`ekit_core.times.iso_utc` says
an instant no calendar holds is printed as the number it is; it converted
the int to a float first (``math.isfinite``), so ``ekit audit`` and
``ekit replay`` of such a run died with ``OverflowError: int too large to
convert to float``.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ekit_core import WorkflowCheckpoint
from ekit_core.audit import StepAudit
from ekit_core.human import Answer, Exchange, Question
from ekit_core.replay import _questions_new
from ekit_core.times import iso_utc, when


@given(st.one_of(st.integers(min_value=2**1024), st.integers(max_value=-(2**1024))))
def test_an_int_past_any_float_prints_as_the_number(at: int) -> None:
    assert iso_utc(at) == repr(at) == when(at)


def test_an_int_too_long_for_text_prints_as_its_size() -> None:
    # Python refuses to write an int of more than 4,300 digits as text: say how large it is.
    assert iso_utc(10**5000) == "an int of 16610 bits"


def test_audit_and_replay_of_an_answer_at_a_huge_int_say_it() -> None:
    answered = (Exchange(Question("value", "who?"), Answer("ann", by="ann", at=10**400)),)
    row = StepAudit("ask", "skip", "recorded", (), asked=answered)
    assert f"answered by ann at {10**400}:" in row.why
    before = WorkflowCheckpoint(0, {}, asked={"ask": (Exchange(Question("value", "who?")),)})
    _, told = _questions_new(WorkflowCheckpoint(0, {}, asked={"ask": answered}), before)
    assert told == {"ask": f"'ann' by ann at {10**400}"}
