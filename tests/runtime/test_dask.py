"""DaskExecutor against a real ``LocalCluster`` of worker processes (loopback only).

One cluster of two single-threaded worker processes serves the module. Worker
processes are other processes, so attempts are counted with files in
``tmp_path`` and cross-process events are awaited by polling with a deadline.
Without ``distributed`` installed these tests FAIL; a developer who cannot
install it sets ``EKIT_SKIP_DASK=1`` to skip them (CI never does).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("EKIT_SKIP_DASK") == "1":
    pytest.skip("EKIT_SKIP_DASK=1: Dask tests skipped", allow_module_level=True)
try:
    import distributed
except ImportError:  # pragma: no cover - CI installs it with the test extra
    pytest.fail(
        "distributed is not installed: pip install -e '.[test]' (or set EKIT_SKIP_DASK=1)",
        pytrace=False,
    )

from ekit_core import Event, StepRetried
from ekit_runtime import RetryPolicy, Step, StepCancelledError, Workflow, WorkflowCheckpoint
from ekit_runtime.dask import DaskConfigWarning, DaskExecutor, WorkerLostError, local_cluster

# Cluster start-up (two spawned worker processes) counts against the first test.
pytestmark = pytest.mark.timeout(60)

DEADLINE = 15.0


# -- step bodies: module level, so that workers import them by reference ---------


def _mark(ctx: dict[str, Any], name: str) -> None:
    """Record one attempt of ``name`` as a new file (workers are other processes)."""
    (Path(ctx["dir"]) / f"{name}.{uuid.uuid4().hex}.attempt").touch()


def _wait_for_file(path: Path) -> None:
    deadline = time.monotonic() + DEADLINE
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.005)


def plain(name: str, ctx: dict[str, Any]) -> dict[str, Any]:
    _mark(ctx, name)
    deps = sorted(k for k in ctx if isinstance(ctx[k], dict))
    return {"value": f"{name}({','.join(ctx[d]['value'] for d in deps)})", "pid": os.getpid()}


async def async_plain(name: str, ctx: dict[str, Any]) -> dict[str, Any]:
    await asyncio.sleep(0)
    return plain(name, ctx)


def rendezvous(name: str, other: str, ctx: dict[str, Any]) -> dict[str, Any]:
    """Start, then wait until ``other`` has started too: the two overlap in time."""
    (Path(ctx["dir"]) / f"started-{name}").touch()
    _wait_for_file(Path(ctx["dir"]) / f"started-{other}")
    return plain(name, ctx)


def held(name: str, ctx: dict[str, Any]) -> dict[str, Any]:
    """Start, then hold until the test writes ``release``."""
    _mark(ctx, name)
    (Path(ctx["dir"]) / f"started-{name}").touch()
    _wait_for_file(Path(ctx["dir"]) / "release")
    return plain(name, {**ctx, "dir": ctx["dir"] + "/held"})


def dies_first_time(name: str, ctx: dict[str, Any]) -> dict[str, Any]:
    """SIGKILL this worker process on the first attempt, succeed on the next."""
    first = not list(Path(ctx["dir"]).glob(f"{name}.*.attempt"))
    _mark(ctx, name)
    if first:
        os.kill(os.getpid(), signal.SIGKILL)
    return plain(name, {**ctx, "dir": ctx["dir"] + "/held"})


def returns_a_lock(ctx: dict[str, Any]) -> Any:
    return threading.Lock()


class Custom(BaseException):
    """A BaseException of the user's own: not an Exception, not one asyncio or Dask special-cases."""


class Unpicklable(KeyboardInterrupt):
    """A KeyboardInterrupt that holds a lock, so that it cannot travel back from a worker."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


FATAL: dict[str, type[BaseException]] = {
    "SystemExit": SystemExit,
    "KeyboardInterrupt": KeyboardInterrupt,
    "GeneratorExit": GeneratorExit,
    "Custom": Custom,
    "CancelledError": asyncio.CancelledError,
    "Unpicklable": Unpicklable,
}


def save_names(path: Path, checkpoint: WorkflowCheckpoint) -> None:
    """The checkpoint_fn of the raising scenario: the recorded names, readable by the workers."""
    partial_path = path.with_suffix(".part")
    partial_path.write_text(" ".join(sorted(checkpoint.outputs)))
    os.replace(partial_path, path)


def _sibling_saved(ctx: dict[str, Any]) -> bool:
    saved = Path(ctx["dir"]) / "saved"
    return "sib" in (saved.read_text().split() if saved.exists() else ())


def _raise(kind: str, ctx: dict[str, Any]) -> None:
    (Path(ctx["dir"]) / "raiser-pid").write_text(str(os.getpid()))
    raise FATAL[kind]("gave up")


def raises_once_sibling_saved(kind: str, ctx: dict[str, Any]) -> None:
    """Wait until the sibling's output is saved, note this process, raise a ``FATAL[kind]``."""
    deadline = time.monotonic() + DEADLINE
    while not _sibling_saved(ctx):
        if time.monotonic() > deadline:
            raise TimeoutError("the sibling's output was never saved")
        time.sleep(0.005)
    _raise(kind, ctx)


async def async_raises_once_sibling_saved(kind: str, ctx: dict[str, Any]) -> None:
    """The same as an ``async def`` step (locally on the loop, on a worker under asyncio.run)."""
    deadline = time.monotonic() + DEADLINE
    while not _sibling_saved(ctx):
        if time.monotonic() > deadline:
            raise TimeoutError("the sibling's output was never saved")
        await asyncio.sleep(0.005)
    _raise(kind, ctx)


def _processing(dask_scheduler: Any) -> list[str]:
    return [str(ts.key) for ws in dask_scheduler.workers.values() for ts in ws.processing]


# -- fixtures and helpers -----------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[distributed.LocalCluster]:
    with local_cluster(n_workers=2, processes=True, threads_per_worker=1) as started:
        yield started


def test_the_cluster_listens_on_loopback_only(cluster: distributed.LocalCluster) -> None:
    import psutil  # a dependency of distributed

    me = psutil.Process()
    listening = [
        conn.laddr
        for process in (me, *me.children(recursive=True))
        for conn in process.net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    ]
    assert len(listening) >= 3  # scheduler, its HTTP routes, a worker and a nanny at least
    assert {addr.ip for addr in listening} == {"127.0.0.1"}, listening


@pytest.fixture(scope="module")
def client(cluster: distributed.LocalCluster) -> Iterator[distributed.Client]:
    with distributed.Client(cluster, set_as_default=False) as opened:
        yield opened


@pytest.fixture(autouse=True)
def two_workers(client: distributed.Client) -> None:
    # A test that killed a worker leaves the nanny restarting it.
    client.wait_for_workers(2, timeout=DEADLINE)


def step(name: str, run: Any, *deps: str, **options: Any) -> Step:
    # Outputs name their dependencies, so a step sees only those.
    return Step(name, run, depends_on=deps, context="dependencies", **options)


def attempts(directory: Path, name: str) -> int:
    return len(list(directory.glob(f"{name}.*.attempt")))


def counts(directory: Path, names: str) -> dict[str, int]:
    return {name: attempts(directory, name) for name in names.split()}


async def until(condition: Callable[[], bool]) -> None:
    """Poll a cross-process condition, bounded by a deadline."""
    deadline = time.monotonic() + DEADLINE
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition never became true")
        await asyncio.sleep(0.01)


def diamond() -> Workflow:
    return Workflow(
        [
            step("src", partial(plain, "src")),
            step("left", partial(rendezvous, "left", "right"), "src"),
            step("right", partial(rendezvous, "right", "left"), "src"),
            step("join", partial(async_plain, "join"), "left", "right"),
        ]
    )


def values(outputs: Any) -> dict[str, str]:
    return {name: out["value"] for name, out in outputs.items()}


# -- the tests ------------------------------------------------------------------------


def test_a_dag_runs_as_it_does_locally_on_two_worker_processes(
    client: distributed.Client, tmp_path: Path
) -> None:
    local_dir, dask_dir = tmp_path / "local", tmp_path / "dask"
    local_dir.mkdir()
    dask_dir.mkdir()
    local = diamond().run_sync({"dir": str(local_dir)})
    saver_pids: list[int] = []
    remote = diamond().run_sync(
        {"dir": str(dask_dir)},
        executor=DaskExecutor(client),
        checkpoint_fn=lambda _: saver_pids.append(os.getpid()),
    )
    assert values(remote.outputs) == values(local.outputs)
    assert values(remote.outputs)["join"] == "join(left(src()),right(src()))"
    pids = {name: out["pid"] for name, out in remote.outputs.items()}
    assert os.getpid() not in pids.values()
    assert pids["left"] != pids["right"], "the overlapping steps ran in two worker processes"
    assert set(pids.values()) <= set(client.run(os.getpid).values())
    # The driver alone saves checkpoints, once per group of completions.
    assert saver_pids and set(saver_pids) == {os.getpid()}
    assert counts(dask_dir, "src left right join") == dict.fromkeys(["src", "left", "right", "join"], 1)


def test_a_worker_killed_mid_step_fails_that_attempt_and_the_retry_policy_decides(
    client: distributed.Client, tmp_path: Path
) -> None:
    (tmp_path / "held").mkdir()
    retried: list[StepRetried] = []

    def trace(event: Event) -> None:
        if isinstance(event, StepRetried):
            retried.append(event)

    workflow = Workflow(
        [
            step("a", partial(plain, "a")),
            step(
                "victim",
                partial(dies_first_time, "victim"),
                "a",
                retry=RetryPolicy(max_attempts=2, backoff_base=0.0),
            ),
            step("b", partial(plain, "b"), "a"),
            step("c", partial(plain, "c"), "victim", "b"),
        ]
    )
    result = workflow.run_sync({"dir": str(tmp_path)}, executor=DaskExecutor(client), trace=trace)
    assert result.outputs["c"]["value"] == "c(b(a()),victim(a()))"
    assert counts(tmp_path, "a victim b c") == {"a": 1, "victim": 2, "b": 1, "c": 1}
    assert [(e.name, e.attempt, e.error_type) for e in retried] == [("victim", 1, "WorkerLostError")]
    assert "died while running this attempt" in retried[0].message


def test_a_worker_lost_without_retries_is_the_steps_failure(
    client: distributed.Client, tmp_path: Path
) -> None:
    workflow = Workflow([step("victim", partial(dies_first_time, "victim"))])
    with pytest.raises(WorkerLostError) as caught:
        workflow.run_sync({"dir": str(tmp_path)}, executor=DaskExecutor(client))
    assert caught.value.step == "victim" and caught.value.worker
    again = pickle.loads(pickle.dumps(caught.value))
    assert (again.step, again.worker, str(again)) == ("victim", caught.value.worker, str(caught.value))
    assert attempts(tmp_path, "victim") == 1


def chain() -> Workflow:
    return Workflow(
        [
            step("s1", partial(plain, "s1")),
            step("s2", partial(plain, "s2"), "s1"),
            step("s3", partial(held, "s3"), "s2"),
            step("s4", partial(plain, "s4"), "s3"),
        ]
    )


@pytest.mark.timeout(90)
def test_a_stopped_driver_resumes_on_a_fresh_cluster_without_rerunning_recorded_steps(
    cluster: distributed.LocalCluster, tmp_path: Path
) -> None:
    (tmp_path / "held").mkdir()
    checkpoints: list[WorkflowCheckpoint] = []
    saver_pids: list[int] = []

    def save(checkpoint: WorkflowCheckpoint) -> None:
        saver_pids.append(os.getpid())
        checkpoints.append(checkpoint)

    async def first_run() -> None:
        async with distributed.Client(cluster.scheduler_address, asynchronous=True) as client:
            run = asyncio.ensure_future(
                chain().run({"dir": str(tmp_path)}, executor=DaskExecutor(client), checkpoint_fn=save)
            )
            await until(lambda: (tmp_path / "started-s3").exists())
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run

    asyncio.run(first_run())
    (tmp_path / "release").touch()  # let the abandoned attempt's thread end
    assert set(checkpoints[-1].outputs) == {"s1", "s2"}
    with local_cluster(n_workers=1) as fresh, DaskExecutor(fresh.scheduler_address) as executor:
        result = chain().run_sync(executor=executor, checkpoint_fn=save, resume_from=checkpoints[-1])
        assert executor.client is not None and executor.client.scheduler.address == fresh.scheduler_address
    assert result.outputs["s4"]["value"] == "s4(s3(s2(s1())))"
    assert counts(tmp_path, "s1 s2 s3 s4") == {"s1": 1, "s2": 1, "s3": 2, "s4": 1}
    assert set(saver_pids) == {os.getpid()}


def test_cancelling_the_run_cancels_the_remote_tasks(
    cluster: distributed.LocalCluster, tmp_path: Path
) -> None:
    (tmp_path / "held").mkdir()
    workflow = Workflow([step("h1", partial(held, "h1")), step("h2", partial(held, "h2"))])

    async def main() -> None:
        async with distributed.Client(cluster.scheduler_address, asynchronous=True) as client:
            run = asyncio.ensure_future(workflow.run({"dir": str(tmp_path)}, executor=DaskExecutor(client)))
            await until(lambda: all((tmp_path / f"started-{n}").exists() for n in ("h1", "h2")))
            assert len(await client.run_on_scheduler(_processing)) == 2
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run
            deadline = time.monotonic() + DEADLINE
            while await client.run_on_scheduler(_processing):
                assert time.monotonic() < deadline, "the scheduler still runs the cancelled tasks"
                await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
    finally:
        (tmp_path / "release").touch()
    assert counts(tmp_path, "h1 h2") == {"h1": 1, "h2": 1}


def test_a_timeout_fails_the_attempt_and_cancels_the_remote_task(
    client: distributed.Client, tmp_path: Path
) -> None:
    (tmp_path / "held").mkdir()
    workflow = Workflow([step("slow", partial(held, "slow"), timeout=0.5)])
    try:
        with pytest.raises(TimeoutError):
            workflow.run_sync({"dir": str(tmp_path)}, executor=DaskExecutor(client))
        deadline = time.monotonic() + DEADLINE
        while client.run_on_scheduler(_processing):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        (tmp_path / "release").touch()


def _raising_run(
    kind: str, body: Any, directory: Path, executor: DaskExecutor | None
) -> tuple[BaseException, WorkflowCheckpoint]:
    """Run a, then sib beside a raiser that raises ``kind`` once sib is saved."""
    directory.mkdir()
    checkpoints: list[WorkflowCheckpoint] = []

    def save(checkpoint: WorkflowCheckpoint) -> None:
        checkpoints.append(checkpoint)
        save_names(directory / "saved", checkpoint)

    workflow = Workflow(
        [
            step("a", partial(plain, "a")),
            step("sib", partial(plain, "sib"), "a"),
            step("raiser", partial(body, kind), "a"),
        ]
    )
    with pytest.raises(BaseException) as caught:
        workflow.run_sync({"dir": str(directory)}, executor=executor, checkpoint_fn=save)
    return caught.value, checkpoints[-1]


@pytest.mark.parametrize("body", [raises_once_sibling_saved, async_raises_once_sibling_saved])
@pytest.mark.parametrize(
    "kind", ["SystemExit", "KeyboardInterrupt", "GeneratorExit", "Custom", "CancelledError"]
)
def test_a_base_exception_from_a_step_ends_the_run_as_it_does_locally(
    client: distributed.Client, tmp_path: Path, kind: str, body: Any
) -> None:
    """One rule whatever the executor: the same exception ends the run (a step's
    own CancelledError is its failure, StepCancelledError), the final checkpoint
    holds the sibling's output, and the Dask worker lives on to serve the next task."""
    workers = client.run(os.getpid)
    local, local_final = _raising_run(kind, body, tmp_path / "local", None)
    remote, remote_final = _raising_run(kind, body, tmp_path / "dask", DaskExecutor(client))
    assert type(remote) is type(local)
    assert str(remote) == str(local)
    expected = StepCancelledError if kind == "CancelledError" else FATAL[kind]
    assert type(local) is expected
    if kind == "CancelledError":
        assert isinstance(remote.__cause__, asyncio.CancelledError)
    for final in (local_final, remote_final):
        assert dict(final.outputs) == {"a": plain_output("a", final), "sib": plain_output("sib", final)}
        assert set(final.failures) == ({"raiser"} if kind == "CancelledError" else set())
    # The worker that ran the raiser is the same process, and still serves tasks.
    raiser_pid = int((tmp_path / "dask" / "raiser-pid").read_text())
    assert client.run(os.getpid) == workers
    (address,) = [a for a, pid in workers.items() if pid == raiser_pid]
    assert client.submit(os.getpid, workers=[address], pure=False).result(timeout=DEADLINE) == raiser_pid


def plain_output(name: str, checkpoint: WorkflowCheckpoint) -> Any:
    output = checkpoint.outputs[name]
    assert output["value"] == f"{name}({'a()' if name == 'sib' else ''})"
    return output


def test_a_base_exception_that_cannot_travel_back_is_raised_as_its_builtin_base(
    client: distributed.Client, tmp_path: Path
) -> None:
    """An exception Dask cannot pickle still ends the run, as the nearest built-in
    class, with its message and a note naming the original type and the worker."""
    workers = client.run(os.getpid)
    error, final = _raising_run(
        "Unpicklable", raises_once_sibling_saved, tmp_path / "dask", DaskExecutor(client)
    )
    assert type(error) is KeyboardInterrupt and str(error) == "gave up"
    (note,) = error.__notes__
    assert "step 'raiser' raised this on a Dask worker (pid" in note
    assert "it was a tests.runtime.test_dask.Unpicklable, raised here as a KeyboardInterrupt" in note
    assert set(final.outputs) == {"a", "sib"} and not final.failures
    assert client.run(os.getpid) == workers


def test_a_step_dask_cannot_serialise_is_refused_before_anything_runs(
    client: distributed.Client, tmp_path: Path
) -> None:
    lock = threading.Lock()
    workflow = Workflow(
        [
            step("fine", partial(plain, "fine")),
            step("locked", lambda ctx: lock, "fine"),
        ]
    )
    with pytest.raises(ValueError, match=r"step 'locked': DaskExecutor cannot serialise its function"):
        workflow.run_sync({"dir": str(tmp_path)}, executor=DaskExecutor(client))
    assert attempts(tmp_path, "fine") == 0


def test_an_inline_step_is_refused_by_a_dask_executor(client: distributed.Client) -> None:
    workflow = Workflow([step("cheap", returns_a_lock, inline=True)])
    with pytest.raises(ValueError, match=r"step 'cheap': inline=True"):
        workflow.run_sync(executor=DaskExecutor(client))


def test_an_output_dask_cannot_serialise_fails_the_step_by_name(client: distributed.Client) -> None:
    workflow = Workflow([step("lockmaker", returns_a_lock)])
    with pytest.raises(TypeError, match=r"step 'lockmaker' returned a lock that Dask cannot serialise"):
        workflow.run_sync(executor=DaskExecutor(client))


def test_a_context_dask_cannot_serialise_fails_the_step_by_name(
    client: distributed.Client, tmp_path: Path
) -> None:
    workflow = Workflow([step("fine", partial(plain, "fine"))])
    with pytest.raises(TypeError, match=r"step 'fine': DaskExecutor cannot serialise its context"):
        workflow.run_sync({"dir": str(tmp_path), "lock": threading.Lock()}, executor=DaskExecutor(client))
    assert attempts(tmp_path, "fine") == 0


def test_a_scheduler_that_reruns_lost_tasks_gets_a_warning(tmp_path: Path) -> None:
    # Dask's default allowed-failures (3) would re-run an attempt on its own.
    with distributed.LocalCluster(
        n_workers=1, processes=False, dashboard_address="127.0.0.1:0"
    ) as cluster, DaskExecutor(cluster) as executor:
        workflow = Workflow([step("one", partial(plain, "one"))])
        with pytest.warns(DaskConfigWarning, match="allowed-failures"):
            workflow.run_sync({"dir": str(tmp_path)}, executor=executor)


def test_importing_ekit_runtime_does_not_import_dask() -> None:
    code = (
        "import sys, ekit_runtime, ekit_runtime.dask\n"
        "assert ekit_runtime.DaskExecutor is ekit_runtime.dask.DaskExecutor\n"
        "assert ekit_runtime.WorkerLostError is ekit_runtime.dask.WorkerLostError\n"
        "heavy = {'dask', 'distributed', 'cloudpickle', 'tornado'}\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in heavy)\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=DEADLINE)


def test_the_dask_chain_benchmark_runs_at_a_tiny_size(
    cluster: distributed.LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks import dask_chain

    figures = dask_chain.main(
        ["--steps", "3", "--repeats", "1", "--scheduler", cluster.scheduler_address]
    )
    assert figures["steps"] == 3 and figures["ekit"] > 0 and figures["bare"] > 0
    assert figures["ratio"] == figures["ekit"] / figures["bare"]
    assert "ratio" in capsys.readouterr().out


def test_without_distributed_building_an_executor_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "distributed", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'ekit-workflows\[dask\]'"):
        DaskExecutor("tcp://127.0.0.1:1")
    with pytest.raises(ImportError, match=r"pip install 'ekit-workflows\[dask\]'"):
        local_cluster()


def fails_until_third(ctx: dict[str, Any]) -> str:
    """Fail the first two attempts (counted in files the workers share), and say the key on the third."""
    from ekit_runtime.attempt import attempt_key

    key = attempt_key()
    (Path(ctx["dir"]) / f"{key.attempt}.key").write_text(str(key))
    if key.attempt < 3:
        raise RuntimeError(f"attempt {key.attempt} fails")
    return f"{key} in pid {os.getpid()}"


def test_each_attempt_carries_its_key_to_the_worker_and_the_function_travels_once(
    client: distributed.Client, tmp_path: Path
) -> None:
    executor = DaskExecutor(client)
    pickled: list[object] = []
    dumps = executor._pickle.dumps

    def counting(value: object) -> bytes:
        pickled.append(value)
        return dumps(value)

    executor._pickle = type("Spy", (), {"dumps": staticmethod(counting), "loads": executor._pickle.loads})
    wf = Workflow([Step("s", fails_until_third, retry=RetryPolicy(max_attempts=3, backoff_base=0))])
    result = wf.run_sync({"dir": str(tmp_path)}, executor=executor, run_id="far")
    assert result.outputs["s"].startswith("far/s/3 in pid ")
    assert int(result.outputs["s"].rsplit(" ", 1)[1]) != os.getpid()  # it ran on a worker process
    assert sorted(p.read_text() for p in tmp_path.glob("*.key")) == ["far/s/1", "far/s/2", "far/s/3"]
    # Three attempts, one pickled function: only the contexts travel per attempt.
    assert sum(1 for value in pickled if value is fails_until_third) == 1
    assert sum(1 for value in pickled if isinstance(value, dict)) == 3


def shout_piece(ctx: dict[str, Any]) -> str:
    return f"{ctx['pieces'].upper()} from pid {os.getpid()}"


def test_items_of_a_mapped_step_run_on_the_cluster(client: distributed.Client) -> None:
    executor = DaskExecutor(client)
    wf = Workflow([
        Step("pieces", lambda ctx: ["a", "b", "c"]),
        Step("shout", shout_piece, ("pieces",), map_over="pieces", context="dependencies",
             executor=executor),
    ])
    result = wf.run_sync(run_id="mapped")
    outputs = result.outputs["shout"]
    assert [o.split(" ")[0] for o in outputs] == ["A", "B", "C"]
    assert all(int(o.rsplit(" ", 1)[1]) != os.getpid() for o in outputs)  # on worker processes


def asks_a_person(ctx: dict[str, Any]) -> str:
    from ekit_runtime import ask

    return f"named {ask('Name?')}"


def test_a_question_asked_on_a_worker_parks_the_run_and_its_answer_is_refused_clearly(
    client: distributed.Client,
) -> None:
    from ekit_runtime import RunWaiting

    wf = Workflow([step("asks", asks_a_person)])
    # The first question travels back from the worker process: the run parks.
    with pytest.raises(RunWaiting) as parked:
        wf.run_sync(executor=DaskExecutor(client))
    assert parked.value.questions["asks"].prompt == "Name?"
    # The answer cannot reach a worker process: the attempt fails saying so, not asking for ever.
    with pytest.raises(RuntimeError, match="executor=LocalExecutor"):
        wf.run_sync(resume_from=parked.value.checkpoint, executor=DaskExecutor(client),
                    answers={"asks": "Ann"})
    assert wf.run_sync(resume_from=parked.value.checkpoint, answers={"asks": "Ann"}).outputs == {
        "asks": "named Ann"}
