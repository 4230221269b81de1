"""A workflow with a child workflow runs under a DaskExecutor (issue 44: "the Dask executor").

The child's steps are shipped to worker processes as any step (their context
wrapper is picklable); the step that hands on its child's output runs on the
driver, as cheap inline work must (DaskExecutor refuses ``inline=True``).
A resume on a fresh cluster runs only what is not recorded.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("EKIT_SKIP_DASK") == "1":
    pytest.skip("EKIT_SKIP_DASK=1: Dask tests skipped", allow_module_level=True)

import distributed

from ekit_runtime import Step, Workflow, WorkflowCheckpoint
from ekit_runtime.dask import DaskExecutor, local_cluster

pytestmark = pytest.mark.timeout(120)


def _topic(ctx: dict[str, Any]) -> str:
    return "cats"


def _fetch(ctx: Any) -> str:
    (Path(ctx["dir"]) / f"fetch.{uuid.uuid4().hex}").touch()  # (one file per attempt)
    return f"pages on {ctx['topic']}"


def _parse(ctx: Any) -> str:
    return f"{ctx['fetch'].upper()} in {os.getpid()}"


def _workflow() -> Workflow:
    child = Workflow([Step("fetch", _fetch), Step("parse", _parse, ("fetch",))])
    return Workflow([Step("topic", _topic), Step("research", depends_on=("topic",), child=child)])


@pytest.fixture(scope="module")
def cluster() -> Iterator[distributed.LocalCluster]:
    with local_cluster(n_workers=1, processes=True, threads_per_worker=1) as started:
        yield started


def test_a_child_workflow_runs_on_dask_workers_and_resumes(
        cluster: distributed.LocalCluster, tmp_path: Path) -> None:
    saved: list[WorkflowCheckpoint] = []
    with DaskExecutor(cluster.scheduler_address) as executor:
        workflow = _workflow()
        result = workflow.run_sync({"dir": str(tmp_path)}, executor=executor,
                                   checkpoint_fn=saved.append)
    parsed = result.outputs["research"]
    assert parsed.startswith("PAGES ON CATS in ") and parsed != f"PAGES ON CATS in {os.getpid()}", \
        "the child's step did not run on a worker process"
    at = next(cp for cp in saved if "research/fetch" in cp.outputs and "research/parse" not in cp.outputs)
    with DaskExecutor(cluster.scheduler_address) as executor:
        again = workflow.run_sync({"dir": str(tmp_path)}, executor=executor, resume_from=at)
    assert again.outputs["research"].startswith("PAGES ON CATS in ")
    assert len(list(tmp_path.glob("fetch.*"))) == 1, "a recorded child step ran again"


async def _streaming(ctx: Any) -> Any:
    yield "a"


def test_a_streaming_step_in_a_child_is_refused_by_name_as_it_is_alone(
        cluster: distributed.LocalCluster) -> None:
    nested = Workflow([Step("research", child=Workflow([Step("s", _streaming)]))])
    assert nested.run_sync().outputs["research"] == "a"  # (it streams, run locally)
    with DaskExecutor(cluster.scheduler_address) as executor, \
            pytest.raises(ValueError, match="step 'research/s' is an async generator"):
        nested.run_sync(executor=executor)
