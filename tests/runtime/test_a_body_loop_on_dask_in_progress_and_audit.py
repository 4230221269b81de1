"""A loop whose body is a child workflow, under the Dask executor, ``ProgressPrinter`` and ``ekit audit``.

What users rely on: the body's steps and its map's items run on Dask worker
processes and a resume on a fresh executor pays for no recorded one (one file
per attempt counts them); a resumed run's progress never counts past its total
and ends saying it skipped what it started from; ``ekit audit`` of the
interrupted checkpoint tells, iteration by iteration, what a resume skips and runs.
"""

from __future__ import annotations

import io
import json
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import Done, ProgressPrinter, Repeat, Step, Workflow, WorkflowCheckpoint
from tests.support.cli_runs import ekit

ROOT = Path(__file__).resolve().parents[2]


def _plan(ctx: Any) -> list[int]:
    (Path(ctx["dir"]) / f"plan#{ctx['agent'].number}.{uuid.uuid4().hex}").touch()
    return [ctx["agent"].number, 10]


def _tool(ctx: Any) -> list[int]:
    (Path(ctx["dir"]) / f"tool#{ctx['agent'].number}.{uuid.uuid4().hex}").touch()
    return [ctx["plan"] * 2, os.getpid()]


def _fold(ctx: Any) -> Any:
    k = ctx["agent"].number
    total = sum(t[0] for t in ctx["tool"])
    return Done(total) if k == 3 else total


def workflow() -> Workflow:
    body = Workflow([Step("plan", _plan), Step("tool", _tool, ("plan",), map_over="plan"),
                     Step("fold", _fold, ("tool",))])
    return Workflow([Step("agent", child=body, repeat=Repeat(5)),
                     Step("z", lambda ctx: ctx["agent"], ("agent",))])


def _middle(saved: list[WorkflowCheckpoint]) -> dict[str, Any]:
    cp = next(c for c in saved if "agent/plan#2" in c.outputs and "agent/tool#2" not in c.outputs)
    loaded: dict[str, Any] = json.loads(json.dumps(cp.to_dict()))
    return loaded


def test_progress_of_a_resumed_body_loop_stays_within_its_total_and_ekit_audit_tells_it(
        tmp_path: Path) -> None:
    saved: list[WorkflowCheckpoint] = []
    workflow().run_sync({"dir": str(tmp_path)}, checkpoint_fn=saved.append)
    middle = _middle(saved)
    out = io.StringIO()
    result = workflow().run_sync({"dir": str(tmp_path)}, resume_from=middle, trace=ProgressPrinter(out))
    text = out.getvalue()
    counts = [(int(n), int(t)) for n, t in re.findall(r"\[(\d+)/(\d+) ", text)]
    assert counts and all(n <= total for n, total in counts), text
    recorded = re.search(r"run started: \d+ steps, (\d+) recorded", text)
    assert recorded is not None and f"({recorded.group(1)} skipped)" in text, text
    assert result.outputs["z"] == 2 * 3 + 2 * 10  # the last iteration's fold
    (tmp_path / "mid.json").write_text(json.dumps(middle))
    (tmp_path / "flows.py").write_text(
        f"from {__name__} import workflow\nWF = workflow()\n")
    proc = ekit(tmp_path, "audit", "mid.json", "--workflow", "flows:WF",
                env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
    assert proc.returncode == 0, proc.stderr
    lines = {ln.split()[0]: ln for ln in proc.stdout.splitlines()
             if ln.strip() and ln.split()[0].startswith("agent")}
    audit_text = proc.stdout
    for name in ("agent/plan#1", "agent/tool#1[1]", "agent/fold#1", "agent/plan#2"):
        assert "skip" in lines[name], audit_text
    assert "run" in lines["agent/tool#2[0]"] and "run" in lines["agent/tool#2[1]"], audit_text


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    if os.environ.get("EKIT_SKIP_DASK") == "1":
        pytest.skip("EKIT_SKIP_DASK=1: Dask tests skipped")
    from ekit_runtime.dask import local_cluster

    with local_cluster(n_workers=1, processes=True, threads_per_worker=1) as started:
        yield started


@pytest.mark.timeout(180)
def test_a_body_loop_runs_on_dask_workers_and_a_resume_pays_for_nothing_recorded(
        cluster: Any, tmp_path: Path) -> None:
    from ekit_runtime.dask import DaskExecutor

    saved: list[WorkflowCheckpoint] = []
    with DaskExecutor(cluster.scheduler_address) as executor:
        whole = workflow().run_sync({"dir": str(tmp_path)}, executor=executor, checkpoint_fn=saved.append)
    pids = {t[1] for k in (1, 2, 3) for t in saved[-1].outputs[f"agent/tool#{k}"]}
    assert os.getpid() not in pids, "the body's map items did not run on a worker process"
    for f in tmp_path.iterdir():
        f.unlink()
    with DaskExecutor(cluster.scheduler_address) as executor:
        middle = _middle(saved)
        done = [n for n in middle["outputs"] if n.startswith("agent/tool#2[")]
        again = workflow().run_sync({"dir": str(tmp_path)}, executor=executor, resume_from=middle)
    assert again.outputs["z"] == whole.outputs["z"]
    ran = sorted(p.name.split(".")[0] for p in tmp_path.iterdir())
    assert ran == ["plan#3", *["tool#2"] * (2 - len(done)), "tool#3", "tool#3"], ran
