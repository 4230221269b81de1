"""``delta_driving``: a new drive extends the checkpoint before it, for a writer that keeps drives as rows.

What a writer that stores each drive as an entry (the run queues) relies on:
a checkpoint whose ``drives`` extend the previous one's is a delta holding
the new drives, whatever else it adds, while ``delta_since`` (every other
writer) still sees a change of the run's tables and writes it in full; drives
that do not extend (another run's, or one dropped) are never a delta.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

from ekit_core import DriveRecord, WorkflowCheckpoint
from ekit_runtime import Step, Workflow


def _resumed() -> tuple[WorkflowCheckpoint, list[WorkflowCheckpoint]]:
    """A chain's checkpoint as loaded at a claim (after drive ``a``), and the saves of drive ``b``."""
    chain = Workflow([Step(f"s{i}", lambda ctx, i=i: i, (f"s{i - 1}",) if i else ()) for i in range(6)])
    first: list[WorkflowCheckpoint] = []
    chain.run_sync(checkpoint_fn=first.append, worker="a")
    stored = WorkflowCheckpoint.from_dict(json.loads(json.dumps(first[2].to_dict())))
    later: list[WorkflowCheckpoint] = []
    chain.run_sync(resume_from=stored, checkpoint_fn=later.append, worker="b")
    return stored, later


def test_a_new_drive_is_a_delta_holding_it_for_delta_driving_alone() -> None:
    stored, later = _resumed()
    cp = later[0]
    assert [d.worker for d in cp.drives] == ["a", "b"]
    driving = cp.delta_driving(stored)
    assert driving.extends and driving.drives == cp.drives[1:]
    assert [name for name, _ in driving.outputs] == [n for n in cp.outputs if n not in stored.outputs]
    assert not cp.delta_since(stored).extends  # (every other writer: in full, as before)
    assert cp.delta_compacting(stored, drive_rows=True) == driving
    # Saves after the first of the drive share its drives: no drive in their deltas.
    for before, after in itertools.pairwise(later):
        assert after.delta_driving(before).drives == ()
        assert after.delta_driving(before) == after.delta_since(before)


def test_drives_that_do_not_extend_are_never_a_delta() -> None:
    stored, later = _resumed()
    cp = later[0]
    other = dataclasses.replace(cp, drives=(DriveRecord("z", 1.0), *cp.drives[1:]))
    assert not other.delta_driving(stored).extends
    fewer = dataclasses.replace(cp, drives=())
    assert not fewer.delta_driving(stored).extends
    assert stored.delta_driving(None).extends  # (nothing stored: all of it)
