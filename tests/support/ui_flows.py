"""Workflows for the dashboard's browser tests (tests/dashboard/test_ui_browser.py).

The test process drives the runs with a worker (``ekit ui`` over a queue
draws each graph from the run's checkpoint; over a store file it can take
``--workflow tests.support.ui_flows:SIMPLE``). ``GATE`` and ``AFTER`` hold the ``live``
workflow's steps (after a first step, ``start``, whose checkpoint gives the run its graph) until the
test sets them: the test's worker runs in the test process, so the events
are shared with it (the ``ekit ui`` process only reads the queue).
"""

from __future__ import annotations

import threading
from typing import Any

from ekit_runtime import Step, Workflow, approve, ask

HOSTILE = "<img src=x onerror=alert(1)>"
"""A step name (and a context value) that must render as text, never as markup."""

TIMED = {"durations": True}
"""The workers' defaults here: they record how long each step took."""

GATE = threading.Event()
AFTER = threading.Event()


def _gate(ctx: Any) -> str:
    if not GATE.wait(60):
        raise TimeoutError("the test never opened the gate")
    return "through the gate"


def _after(ctx: Any) -> str:
    if not AFTER.wait(60):
        raise TimeoutError("the test never let the last step finish")
    return "after"


async def _draft(ctx: Any) -> str:
    return f"draft of {ctx.get('doc', '?')}"


async def _publish(ctx: Any) -> str:
    return f"published: {ctx['draft']}"


async def _extra(ctx: Any) -> str:
    return "never runs"


async def _explode(ctx: Any) -> str:
    raise RuntimeError("the model refused: <b>not bold</b>")


async def _title(ctx: Any) -> str:
    return f"{ask('Title for this summary?')}: {ctx['draft']}"


async def _hostile(ctx: Any) -> str:
    return HOSTILE


async def _ship(ctx: Any) -> str:
    approve("Ship it?")
    return f"shipped: {ctx['draft']}"


SIMPLE = Workflow(
    [
        Step("draft", _draft),
        Step("publish", _publish, ("draft",)),
        Step("extra", _extra, ("draft",), when=lambda ctx: False),
    ]
)
"""draft -> publish, and a step its condition skips: every node ends recorded or skipped."""

WORKFLOWS = {
    "simple": SIMPLE,
    "broken": Workflow([Step("draft", _draft), Step("explode", _explode, ("draft",))]),
    "asks": Workflow([Step("draft", _draft), Step("title", _title, ("draft",))]),
    "live": Workflow(
        [Step("start", _draft), Step("gate", _gate, ("start",)), Step("after", _after, ("gate",))]
    ),
    "hostile": Workflow([Step("draft", _draft), Step(HOSTILE, _hostile, ("draft",))]),
    "approves": Workflow([Step("draft", _draft), Step("ship", _ship, ("draft",))]),
}
"""Every workflow the tests submit, by name (``elsewhere`` is left out on purpose: its runs stay queued)."""


def populate(queue: Any) -> dict[str, str]:
    """Fill ``queue`` with a run in every status but ``running``; return run ids by role.

    Drives the runs to their statuses with a worker (``run_until_idle``):
    ``finished`` (``simple``: recorded and skipped nodes), ``failed``,
    ``waiting`` (a step asked a person), ``cancelled`` (cancelled while
    queued), two ``queued`` runs of a workflow no worker has (one for the
    cancel button), and a finished run whose run id, step name and context
    are markup. ``live`` is submitted too; :class:`LiveWorker` drives it.
    For the approve, deny and retry buttons: two runs waiting for an
    approval (``to_approve``, ``to_deny``) and a second failed run (``to_retry``).
    """
    import asyncio

    from ekit_runtime.queue import Worker

    ids = {
        "finished": queue.submit("simple", {"doc": "a.txt"}, run_id="simple-finished"),
        "failed": queue.submit("broken", {"doc": "b.txt"}, run_id="broken-failed"),
        "waiting": queue.submit("asks", {"doc": "c.txt"}, run_id="asks-waiting"),
        "hostile": queue.submit(
            "hostile", {"doc": HOSTILE, "<b>key</b>": "<script>alert(2)</script>"}, run_id=HOSTILE
        ),
        "cancelled": queue.submit("simple", {"doc": "d.txt"}, run_id="simple-cancelled"),
        "queued": queue.submit("elsewhere", {"doc": "e.txt"}, run_id="elsewhere-queued"),
        "to_cancel": queue.submit("elsewhere", {"doc": "f.txt"}, run_id="elsewhere-to-cancel"),
        "to_approve": queue.submit("approves", {"doc": "h.txt"}, run_id="approves-to-approve"),
        "to_deny": queue.submit("approves", {"doc": "i.txt"}, run_id="approves-to-deny"),
        "to_retry": queue.submit("broken", {"doc": "j.txt"}, run_id="broken-to-retry"),
    }
    queue.cancel(ids["cancelled"])
    registry = {k: v for k, v in WORKFLOWS.items() if k != "live"}
    # A fleet that records durations (ekit worker --durations): the step tables show them.
    asyncio.run(Worker(queue, registry, poll=0.05, defaults=TIMED).run_until_idle())
    ids["running"] = queue.submit("live", {"doc": "g.txt"}, run_id="live-running")
    return ids


class LiveWorker:
    """A worker on a thread of its own, driving the ``live`` run (blocked at ``gate``).

    ``started()`` is True once the run's first checkpoint (``start`` recorded) is saved.

    ``with LiveWorker(queue):`` starts it; leaving opens both gates and stops it.
    """

    def __init__(self, queue: Any) -> None:
        self.queue = queue
        self._loop: Any = None
        self._worker: Any = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="ui-live-worker", daemon=True)
        self.error: BaseException | None = None

    def _main(self) -> None:
        import asyncio

        from ekit_runtime.queue import Worker

        async def body() -> None:
            self._loop = asyncio.get_running_loop()
            self._worker = Worker(self.queue, {"live": WORKFLOWS["live"]}, poll=0.05, defaults=TIMED)
            self._ready.set()
            await self._worker.run()

        try:
            asyncio.run(body())
        except BaseException as exc:  # reported by __exit__
            self.error = exc
            self._ready.set()

    def started(self, run_id: str = "live-running") -> bool:
        """True once ``start`` is recorded and the run is still running (blocked at ``gate``)."""
        checkpoint = self.queue.checkpoint(run_id)
        return checkpoint is not None and "start" in checkpoint.outputs

    def __enter__(self) -> LiveWorker:
        GATE.clear()
        AFTER.clear()
        self._thread.start()
        if not self._ready.wait(20):
            raise AssertionError("the live worker did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        GATE.set()
        AFTER.set()
        if self._loop is not None and self._worker is not None:
            self._loop.call_soon_threadsafe(self._worker.stop)
        self._thread.join(30)
        if self.error is not None:
            raise AssertionError(f"the live worker failed: {self.error!r}") from self.error


class WorkerThread:
    """A worker for ``registry`` on a thread of its own, its loop running until the ``with`` block ends.

    Leaving stops the worker (after ``release()``, which the caller passes to
    open whatever its steps wait on) and reports what it raised.
    """

    def __init__(self, queue: Any, registry: dict[str, Any], release: Any = None, **options: Any) -> None:
        self.queue = queue
        self.registry = registry
        self.release = release
        self.options = {"poll": 0.05, "defaults": TIMED, **options}
        self._loop: Any = None
        self._worker: Any = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="ui-worker-thread", daemon=True)
        self.error: BaseException | None = None

    def _main(self) -> None:
        import asyncio

        from ekit_runtime.queue import Worker

        async def body() -> None:
            self._loop = asyncio.get_running_loop()
            self._worker = Worker(self.queue, self.registry, **self.options)
            self._ready.set()
            await self._worker.run()

        try:
            asyncio.run(body())
        except BaseException as exc:  # reported by __exit__
            self.error = exc
            self._ready.set()

    def __enter__(self) -> WorkerThread:
        self._thread.start()
        if not self._ready.wait(20):
            raise AssertionError("the worker thread did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.release is not None:
            self.release()
        if self._loop is not None and self._worker is not None:
            self._loop.call_soon_threadsafe(self._worker.stop)
        self._thread.join(30)
        if self.error is not None:
            raise AssertionError(f"the worker failed: {self.error!r}") from self.error
