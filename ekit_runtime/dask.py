"""Steps on a Dask cluster: :class:`DaskExecutor`, the ``dask`` extra.

``distributed`` is imported only when a :class:`DaskExecutor` (or
:func:`local_cluster`) is built, so ``import ekit_runtime`` and even
``import ekit_runtime.dask`` keep the core install free of dependencies.

One attempt of a step is one Dask task (``pure=False``, ``retries=0``): the
driver pickles the step's function and its context, a worker runs the
function (an ``async def`` one under its own ``asyncio.run`` in the worker's
task thread) and pickles what it returned, and the driver unpickles that. The
runner stays the only owner of the run's state and the only caller of
``checkpoint_fn``; retries and timeouts stay the step's :class:`RetryPolicy`
and ``timeout``. Cancelling the awaiting task cancels the Dask future. A
worker that dies mid-attempt fails that attempt with :class:`WorkerLostError`,
provided the scheduler does not re-run the task itself: its
``distributed.scheduler.allowed-failures`` must be 0, which
:func:`local_cluster` sets and :class:`DaskExecutor` checks once (warning
with :class:`DaskConfigWarning` otherwise).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import os
import socket
import threading
import uuid
import warnings
from collections.abc import Awaitable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from ekit_runtime import attempt as attempts
from ekit_runtime.attempt import Attempt, AttemptKey
from ekit_runtime.executors import Executor

if TYPE_CHECKING:
    from distributed import Client, LocalCluster

    from ekit_runtime.step import Step

__all__ = ["DaskConfigWarning", "DaskExecutor", "WorkerLostError", "local_cluster"]

# Seconds a finished attempt's future is kept, at most, waiting for a submission to ride with.
_RELEASE_AFTER = 0.05

_INSTALL = "DaskExecutor needs the 'distributed' package: pip install 'ekit-workflows[dask]'"


class WorkerLostError(Exception):
    """The Dask worker running an attempt of ``step`` died before the attempt finished.

    It is that attempt's failure like any other exception: the step's
    :class:`RetryPolicy` decides whether it runs again (on another worker).
    ``worker`` is the lost worker's address when Dask reported it.
    """

    def __init__(self, step: str, worker: str | None) -> None:
        where = f"worker {worker}" if worker else "its worker"
        super().__init__(
            f"step {step!r}: the Dask {where} died while running this attempt "
            "(killed, out of memory, or its machine went away); the step's retry policy decides"
        )
        self.step = step
        self.worker = worker

    def __reduce__(self) -> tuple[type[WorkerLostError], tuple[str, str | None]]:
        # Rebuilt from its fields, so that it pickles (to a store, a process pool).
        return type(self), (self.step, self.worker)


class DaskConfigWarning(UserWarning):
    """The Dask scheduler re-runs a task whose worker died, so an attempt may run twice.

    Raised once per :class:`DaskExecutor` when the scheduler's
    ``distributed.scheduler.allowed-failures`` is above 0: Dask then retries
    the task on another worker on its own before ekit hears of the death.
    """


def _import_distributed() -> Any:
    try:
        import distributed
    except ImportError as exc:
        raise ImportError(_INSTALL) from exc
    return distributed


def _pickle() -> Any:
    from distributed.protocol import pickle

    return pickle


def local_cluster(
    n_workers: int = 2, *, threads_per_worker: int = 1, processes: bool = True, **kwargs: Any
) -> LocalCluster:
    """A ``distributed.LocalCluster`` set up for ekit.

    Its scheduler's ``allowed_failures`` is 0 (a dead worker fails the
    attempt instead of Dask re-running it), it listens on 127.0.0.1 only
    (the scheduler's plain HTTP routes on a free port) and has no dashboard
    unless ``dashboard_address`` is passed. Other keyword arguments go to
    ``LocalCluster`` (``asynchronous=True`` gives one to ``await``). Close
    it when done (``with local_cluster() as cluster:``).
    """
    distributed = _import_distributed()
    scheduler: dict[str, Any] = {"allowed_failures": 0}
    if "dashboard_address" not in kwargs:
        # The scheduler always serves its plain HTTP routes (health, metrics);
        # keep them on a free loopback port and leave the dashboard off.
        kwargs["dashboard_address"] = "127.0.0.1:0"
        scheduler["dashboard"] = False
    if processes:
        # Worker processes talk TCP: on loopback only. In-process workers use
        # Dask's in-memory transport, which takes no host.
        kwargs.setdefault("host", "127.0.0.1")
    kwargs["scheduler_kwargs"] = {**scheduler, **kwargs.get("scheduler_kwargs", {})}
    cluster: LocalCluster = distributed.LocalCluster(
        n_workers=n_workers, threads_per_worker=threads_per_worker, processes=processes, **kwargs
    )
    return cluster


class DaskExecutor(Executor):
    """Runs each attempt of a step as one task on a Dask cluster.

    ``client`` is a ``distributed.Client``, asynchronous or not, which the
    executor uses and never closes; or anything ``Client()`` accepts as its
    address (``"tcp://host:8786"``, a cluster object), for which the executor
    opens its own (synchronous) client on first use and closes it in
    :meth:`close` (or at the end of a ``with`` block).

    An asynchronous client must belong to the loop the run is on; a
    synchronous one (its own loop in a thread) works from any loop, so one
    executor can serve many ``run_sync`` calls.

    Rules: step functions and their contexts are pickled with Dask's
    pickler (pickle, then cloudpickle), so the workers must be able to import
    whatever a function refers to by module (ekit itself, the step's module);
    :meth:`check` refuses, before anything runs, a step whose function cannot
    be pickled and a step with ``inline=True`` (a worker has no event loop to
    be inline on). A context or output that cannot be pickled fails that
    attempt with a ``TypeError`` naming the step.
    """

    def __init__(self, client: Any) -> None:
        distributed = _import_distributed()
        self._own = not isinstance(client, distributed.Client)
        # distributed is only partly typed: its client is handled as Any here.
        self._client: Any = None if self._own else client
        self._address = client if self._own else None
        self._lock = threading.Lock()
        self._pickled: dict[str, tuple[object, bytes]] = {}
        self._config_checked = False
        self._killed_worker: type[Exception] = distributed.KilledWorker
        self._pickle = _pickle()
        # Futures of finished attempts, released with the next submission; see
        # _release_later. Touched only on the client's loop.
        self._finished: list[Any] = []
        self._flush: asyncio.TimerHandle | None = None

    # -- the protocol --------------------------------------------------------

    def check(self, steps: Sequence[Step]) -> None:
        """Refuse a step whose function Dask cannot pickle, or one marked ``inline=True``."""
        for step in steps:
            if step.inline:
                raise ValueError(
                    f"step {step.name!r}: inline=True asks for the driver's event loop, which a "
                    "DaskExecutor does not run steps on; drop inline or give the step "
                    "executor=LocalExecutor()"
                )
            if inspect.isasyncgenfunction(step.run):
                raise ValueError(
                    f"step {step.name!r} is an async generator (a streaming step), whose partial "
                    "output has no way back from a Dask worker; give the step "
                    "executor=LocalExecutor(), or make it return its output"
                )
            self._function_bytes(step)

    async def run(self, attempt: Attempt) -> Any:
        """Run ``attempt`` on a worker and return what the step returned.

        The step receives a plain ``dict`` copy of the attempt's context on
        the worker, where :func:`~ekit_runtime.attempt.attempt_key` answers
        with the attempt's key. The function travels pickled once per step
        (cached), the key beside it as plain data.
        """
        step, context = attempt.step, attempt.context
        name = step.name
        function = self._function_bytes(step)
        try:
            # A StepContext is a view over the run's ledger: ship its keys only.
            packed_context = self._pickle.dumps(context if type(context) is dict else dict(context))
        except Exception as exc:
            raise TypeError(
                f"step {name!r}: DaskExecutor cannot serialise its context for the workers "
                f"({type(exc).__name__}: {exc}); keep the initial context and outputs picklable"
            ) from exc
        client = self._client
        if client is None:
            client = await asyncio.to_thread(self._connect)
        packed = await self._on_client_loop(
            client, self._attempt(client, name, function, packed_context, attempt.key)
        )
        if isinstance(packed, _Raised):
            # Raised here, in the attempt's task, as a local step's would be: the
            # run ends by it exactly as it does under the LocalExecutor.
            raise packed.rebuild(self._pickle)
        try:
            return self._pickle.loads(packed)
        except Exception as exc:
            raise TypeError(
                f"step {name!r}: its output came back from the worker but cannot be unpickled "
                f"here ({type(exc).__name__}: {exc}); the driver must be able to import its type"
            ) from exc

    # -- lifecycle -----------------------------------------------------------

    @property
    def client(self) -> Client | None:
        """The client in use: the one passed in, or the executor's own once opened (else None)."""
        client: Client | None = self._client
        return client

    def close(self) -> None:
        """Close the client this executor opened for an address (a passed client stays open)."""
        if not self._own:
            return
        with self._lock:
            client, self._client = self._client, None
            self._finished = []  # closing the client releases them
        if client is not None:
            client.close()

    def __enter__(self) -> DaskExecutor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- helpers -------------------------------------------------------------

    def _connect(self) -> Any:
        # Runs in a thread: a synchronous Client blocks while it connects.
        with self._lock:
            if self._client is None:
                distributed = _import_distributed()
                self._client = distributed.Client(self._address, set_as_default=False)
            return self._client

    def _function_bytes(self, step: Step) -> bytes:
        """The pickled ``step.run``, cached per step name while the function stays the same."""
        cached = self._pickled.get(step.name)
        if cached is not None and cached[0] is step.run:
            return cached[1]
        try:
            data: bytes = self._pickle.dumps(step.run)
        except Exception as exc:
            raise ValueError(
                f"step {step.name!r}: DaskExecutor cannot serialise its function "
                f"({type(exc).__name__}: {exc}); use a function the workers can import, and keep "
                "locks, clients and open files out of its closure"
            ) from exc
        self._pickled[step.name] = (step.run, data)
        return data

    @staticmethod
    async def _on_client_loop(
        client: Any, work: Coroutine[Any, Any, bytes | _Raised]
    ) -> bytes | _Raised:
        """Await ``work`` on the client's event loop, from whichever loop this run is on."""
        loop = client.loop.asyncio_loop
        if loop is asyncio.get_running_loop():
            return await work
        if not loop.is_running():
            work.close()
            raise RuntimeError(
                "DaskExecutor: the asynchronous Dask client belongs to an event loop that is not "
                "running; create it inside the run's loop or pass a synchronous Client"
            )
        # A synchronous client's loop runs in its own thread. Cancelling the
        # wrapper cancels the task there, which cancels the Dask future.
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work, loop))

    async def _attempt(
        self, client: Any, name: str, function: bytes, context: bytes, key: AttemptKey | None
    ) -> bytes | _Raised:
        """Submit one task and wait for it, on the client's loop; cancelling it cancels the task."""
        if not self._config_checked:
            await self._check_config(client)
        task_key = f"ekit-{name}-{uuid.uuid4().hex}"
        # Released just before the submission, so that both travel in one batch;
        # releases first measured about 1 ms a step faster than after.
        self._release_finished()
        future = client.submit(
            _run_on_worker, name, function, context, key, key=task_key, pure=False, retries=0
        )
        try:
            packed: bytes | _Raised = await future
            return packed
        except asyncio.CancelledError:
            # The run was cancelled, halted or timed out: stop the task too (a
            # task already running finishes in its thread; its result is dropped).
            await client.cancel([future])
            raise
        except self._killed_worker as exc:
            worker = getattr(getattr(exc, "last_worker", None), "address", None)
            raise WorkerLostError(name, worker) from exc
        finally:
            self._release_later(future)

    def _release_later(self, future: Any) -> None:
        """Let go of a finished attempt's future with the next submission, or soon after.

        Releasing it at once costs a message of its own on the client's
        batched stream to the scheduler, and the next submission then waits
        out the stream's interval (10 ms): a third more per step in a chain.
        Until it is released the worker keeps the (already fetched) output.
        """
        self._finished.append(future)
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(_RELEASE_AFTER, self._release_finished)

    def _release_finished(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        finished, self._finished = self._finished, []
        for future in finished:
            future.release()

    async def _check_config(self, client: Any) -> None:
        """Warn once if the scheduler would re-run a task whose worker died."""
        self._config_checked = True
        try:
            # A lambda is pickled by value, so the scheduler need not import ekit.
            allowed = await client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.allowed_failures)
        except Exception:
            return  # a scheduler that refuses to run functions: nothing to tell
        if isinstance(allowed, int) and allowed > 0:
            warnings.warn(
                DaskConfigWarning(
                    f"the Dask scheduler re-runs a task whose worker died up to {allowed} time(s) "
                    "(distributed.scheduler.allowed-failures): an attempt may run again before ekit "
                    "hears of it; set it to 0 so that a lost worker fails the attempt with "
                    "WorkerLostError and the step's RetryPolicy decides"
                ),
                stacklevel=2,
            )


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


class _Raised:
    """What a step raised on a worker that Dask would let out of the task, sent back instead.

    Dask lets ``SystemExit`` and ``KeyboardInterrupt`` out of a task to stop
    the worker, even of a class that derives from ``Exception`` too, and the
    driver would then see a lost worker (a retryable :class:`WorkerLostError`);
    other ones it ships as the task's error. So the task returns this for
    those two and for every ``BaseException`` that is not an ``Exception``,
    and the driver raises the exception again.
    ``pickled`` is the exception itself, when Dask's pickler took it; else
    (or when the driver cannot unpickle it) the nearest built-in class
    (``base``) is raised with its message, and a note names the original.
    """

    __slots__ = ("base", "kind", "message", "pickled", "step", "where")

    def __init__(self, step: str, exc: BaseException, pickled: bytes | None) -> None:
        self.step = step
        self.kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
        self.base = next(c for c in type(exc).__mro__ if c in _BASES).__name__
        self.message = _message_of(exc)
        self.pickled = pickled
        self.where = f"pid {os.getpid()} on {socket.gethostname()}"

    def rebuild(self, pickle: Any) -> BaseException:
        """The exception to raise on the driver."""
        note = f"ekit: step {self.step!r} raised this on a Dask worker ({self.where})"
        exc: object = None
        why = "it could not be pickled there"
        if self.pickled is not None:
            try:
                exc = pickle.loads(self.pickled)
            except Exception as error:
                why = f"unpickling it here raised {type(error).__name__}: {error}"
        if not isinstance(exc, BaseException):
            exc = _BASES_BY_NAME[self.base](self.message)
            note += f"; it was a {self.kind}, raised here as a {self.base} since {why}"
        exc.add_note(note)
        return exc


_BASES: tuple[type[BaseException], ...] = (
    asyncio.CancelledError, GeneratorExit, KeyboardInterrupt, SystemExit, BaseException,
)
_BASES_BY_NAME = {c.__name__: c for c in _BASES}


def _message_of(exc: BaseException) -> str:
    try:
        return str(exc)
    except BaseException:  # a __str__ that raises (anything: it must not stop the worker)
        return type(exc).__name__


# What Dask's worker lets out of a task to stop itself, even when it is also an
# Exception (a class deriving from SystemExit and Exception, say).
_STOPS_THE_WORKER = (SystemExit, KeyboardInterrupt)


def _call_keyed(key: AttemptKey | None, function: Any, context: Any) -> Any:
    if key is not None:
        attempts.CURRENT.set(key)
    returned = function(context)
    if inspect.isawaitable(returned):
        # asyncio.run copies this context, key included, into its task.
        returned = asyncio.run(_awaited(returned))
    return returned


def _pickled_or_none(pickle: Any, exc: BaseException) -> bytes | None:
    try:
        data: bytes = pickle.dumps(exc)
    except BaseException:  # a __reduce__ may raise anything: out of here it would stop the worker
        return None
    return data


def _run_on_worker(
    name: str, function: bytes, context: bytes, key: AttemptKey | None = None
) -> bytes | _Raised:
    """The Dask task of one attempt: run the step function, return its pickled output.

    Runs in a worker's task thread, where no event loop runs: an ``async def``
    step gets its own ``asyncio.run``. The output is pickled here so that an
    unpicklable one fails the attempt with a message naming the step, rather
    than later inside Dask's transfer. A ``BaseException`` that is not an
    ``Exception`` comes back as a :class:`_Raised` (see there): the worker
    lives on, and the run ends by it as it would locally. ``key`` is set as
    the attempt's key around the call, in a context of its own.
    """
    pickle = _pickle()
    try:
        returned = contextvars.Context().run(_call_keyed, key, pickle.loads(function), pickle.loads(context))
    except BaseException as exc:
        if isinstance(exc, Exception) and not isinstance(exc, _STOPS_THE_WORKER):
            raise  # the attempt's failure: Dask ships it back as it is
        return _Raised(name, exc, _pickled_or_none(pickle, exc))
    try:
        data: bytes = pickle.dumps(returned)
    except BaseException as exc:  # a __reduce__ raising SystemExit would stop the worker
        # The cause is in the message: a chained exception would not survive
        # the trip back to the driver, and may itself not pickle.
        raise TypeError(
            f"step {name!r} returned a {type(returned).__name__} that Dask cannot serialise back "
            f"to the driver ({type(exc).__name__}: {exc})"
        ) from None
    return data
