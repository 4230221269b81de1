"""A step's exception that Dask treats as "stop the worker" ends the run as it does locally.

Dask re-raises any ``SystemExit`` or ``KeyboardInterrupt`` out of a task,
killing the worker, which the driver then sees as a lost worker (a
retryable ``WorkerLostError``): the step runs again, paid twice. That holds
for a class that is also an ``Exception`` (``class Exiting(SystemExit,
Exception)``), for the exception a step's ``BaseException`` raises when it
is pickled, and for one an output's pickling raises. Locally the first two
end the run and the last is no problem at all; on a real cluster of worker
processes each must end the run (or fail the step) once, the worker alive.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("EKIT_SKIP_DASK") == "1":
    pytest.skip("EKIT_SKIP_DASK=1: Dask tests skipped", allow_module_level=True)
import distributed

from ekit_runtime import Step, Workflow
from ekit_runtime.dask import DaskExecutor, local_cluster

pytestmark = pytest.mark.timeout(120)


class ExitingError(SystemExit, Exception):
    """Both an Exception and a SystemExit: Dask's worker takes it as an order to stop."""


class PicklingExits(KeyboardInterrupt):
    """A KeyboardInterrupt whose pickling raises SystemExit (it is tied to this process)."""

    def __reduce__(self) -> Any:
        raise SystemExit("cannot leave this process")


class OutputExits:
    """A step output whose pickling raises SystemExit."""

    def __reduce__(self) -> Any:
        raise SystemExit("cannot leave this process")


def returns_output_exits(directory: str, ctx: Any) -> OutputExits:
    with open(os.path.join(directory, "attempts"), "a") as f:
        f.write(f"{os.getpid()}\n")
    return OutputExits()


KINDS: dict[str, type[BaseException]] = {"ExitingError": ExitingError, "PicklingExits": PicklingExits}


def raises(kind: str, directory: str, ctx: Any) -> None:
    """Count the attempt in a file (workers are other processes), then raise ``KINDS[kind]``."""
    with open(os.path.join(directory, "attempts"), "a") as f:
        f.write(f"{os.getpid()}\n")
    raise KINDS[kind]("gave up")


@pytest.fixture(scope="module")
def client() -> Iterator[distributed.Client]:
    with (
        local_cluster(n_workers=1, processes=True, threads_per_worker=1) as cluster,
        distributed.Client(cluster, set_as_default=False) as opened,
    ):
        yield opened


def _run(kind: str, directory: Path, executor: DaskExecutor | None) -> tuple[BaseException, list[int]]:
    directory.mkdir()
    workflow = Workflow([Step("raiser", functools.partial(raises, kind, str(directory)))])
    with pytest.raises(BaseException) as caught:
        workflow.run_sync(executor=executor)
    return caught.value, [int(pid) for pid in (directory / "attempts").read_text().split()]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_an_exit_like_exception_ends_the_run_once_and_the_worker_lives(
    client: distributed.Client, tmp_path: Path, kind: str
) -> None:
    local, local_attempts = _run(kind, tmp_path / "local", None)
    remote, remote_attempts = _run(kind, tmp_path / "dask", DaskExecutor(client))
    assert (len(local_attempts), len(remote_attempts)) == (1, 1)
    assert isinstance(local, KINDS[kind])
    # The same kind of exception ends the run (the unpicklable one as its built-in base).
    assert isinstance(remote, KeyboardInterrupt if kind == "PicklingExits" else ExitingError), repr(remote)
    assert str(remote) == str(local)
    # The worker that ran the step serves the next task: it was not killed (a
    # killed one is restarted under another pid, or leaves none to serve it).
    assert client.submit(os.getpid, pure=False).result(timeout=60) == remote_attempts[0]


def test_an_output_whose_pickling_exits_fails_the_step_by_name_and_the_worker_lives(
    client: distributed.Client, tmp_path: Path
) -> None:
    workflow = Workflow([Step("maker", functools.partial(returns_output_exits, str(tmp_path)))])
    with pytest.raises(TypeError, match=r"step 'maker' returned a OutputExits that Dask cannot serialise"):
        workflow.run_sync(executor=DaskExecutor(client))
    attempts = [int(pid) for pid in (tmp_path / "attempts").read_text().split()]
    assert len(attempts) == 1
    assert client.submit(os.getpid, pure=False).result(timeout=60) == attempts[0]
