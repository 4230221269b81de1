"""Disagreements the differential test (``test_runtime_agrees_with_the_model.py``) found
between the runtime and the reference model, each cut down to a minimal reproducer.

Each is a bug of the runtime by the docs; none is fixed here. ``xfail(strict=True)``:
the test fails the day the bug is fixed, so that its mark is taken off.
"""

from __future__ import annotations

import contextlib

import pytest

from ekit_core import replay
from ekit_runtime import RunWaiting, Step, Workflow, ask


def _mapped(version: str) -> Workflow:
    return Workflow([
        Step("a", lambda ctx: [1, 2]),
        Step("m", lambda ctx: ask("ok?"), ("a",), version=version, map_over="a"),
    ])


@pytest.mark.xfail(strict=True, reason="replay calls the legal resume step_index_decreased")
def test_replay_accepts_a_bumped_mapped_step_with_questions() -> None:
    """A bump of a mapped step whose items asked (one answered and recorded, one waiting)
    is a legal resume: the recorded item is outdated and runs again (docs/checkpoint-format.md,
    "A changed step is not done"). The resume's first save records fewer outputs than the
    checkpoint it resumed, as every resume that lets go of outdated outputs does, and replay
    accepts that elsewhere (a collected mapped step, a failed item); here it reports
    ``step_index_decreased`` at that save (found by the model with questions on items)."""
    saved = []
    for version, answers in (("v0", None), ("v0", {"m[0]": "yes"}), ("v1", None)):
        with contextlib.suppress(RunWaiting):
            _mapped(version).run_sync(resume_from=saved[-1] if saved else None,
                                      checkpoint_fn=saved.append, answers=answers)
    assert [cp.step_index for cp in saved] == [1, 1, 1, 2, 1]
    assert dict(saved[-1].redone) == {"m": 1, "m[0]": 1, "m[1]": 1}
    report = replay(_mapped("v1"), saved)
    assert report.ok, [v.to_dict() for v in report.violations]
