"""Runs whose every user-controlled field is markup, for the dashboard's escaping tests.

:data:`PAYLOAD` breaks out of an element (``<script>``), out of a double- and a
single-quoted attribute (``"><img onerror>``, ``'><svg onload>``). :func:`populate`
puts it in every field a run's pages show: run ids, the workflow's name,
step names, a mapped step's item keys (its slowest item is named in the
duration cell), the worker's name (the owner, "Running now"), a question's
prompt and details, an answer's value and who gave it, a denial's reason,
an error's type and message, a running run's reason, and its context.
:func:`unsafe_markup` says what of an HTML text is markup the payload made.
"""

from __future__ import annotations

import asyncio
import time
from html.parser import HTMLParser
from typing import Any

from ekit_core import WorkflowCheckpoint
from ekit_runtime import Step, Workflow, approve, ask

PAYLOAD = "<script>alert(1)</script>\"><img src=x onerror=alert(2)>'><svg onload=alert(3)>"

# A step's error type is its exception's class name: this one's is the payload.
HostileError = type(PAYLOAD, (RuntimeError,), {})

PAGE_SVGS = ("graph", "fleet-chart", "usage-chart", "timeline-chart")
"""The ids of the SVGs the pages draw themselves (the run's graph, the fleet's chart, a run's
usage and its timeline)."""

MAPPED = PAYLOAD + " mapped"
ITEM = f"{MAPPED}[{PAYLOAD}]"
"""The name of the mapped step's item keyed by the payload (the slowest: it sleeps)."""


def _split(ctx: Any) -> dict[str, int]:
    return {PAYLOAD: 1, "plain": 2}


def _mapped(ctx: Any) -> int:
    value = int(ctx["split"])
    if value == 1:
        time.sleep(0.05)  # the slowest item, so that the duration cell names its key
    return value * 10


def _asks(ctx: Any) -> str:
    return str(ask(PAYLOAD, details={PAYLOAD: [PAYLOAD]}))


def _fails(ctx: Any) -> str:
    raise HostileError(PAYLOAD)


def _approved(ctx: Any) -> str:
    approve(PAYLOAD)
    return "shipped"


WORKFLOWS = {
    PAYLOAD: Workflow([
        Step("split", _split),
        Step(MAPPED, _mapped, ("split",), map_over="split"),
        Step(PAYLOAD + " asks", _asks, (MAPPED,)),
    ]),
    PAYLOAD + " fails": Workflow([Step("split", _split), Step(PAYLOAD + " boom", _fails, ("split",))]),
    PAYLOAD + " approves": Workflow([Step(PAYLOAD + " ship", _approved)]),
}


def _running(queue: Any, run_id: str) -> None:
    """A running run held by a worker named by the payload, its reason the payload, an item in flight."""
    queue.submit(PAYLOAD + " held", {PAYLOAD: PAYLOAD}, run_id=run_id)
    lease = queue.claim(PAYLOAD, {PAYLOAD + " held": None}, 600)
    assert lease is not None and lease.run_id == run_id
    graph = {"split": [], MAPPED: ["split"]}
    queue.save(lease, WorkflowCheckpoint.from_dict({
        "format_version": 3, "step_index": 1, "outputs": {"split": {PAYLOAD: 1}},
        "cost": {"input_tokens": 1, "output_tokens": 1, "llm_calls": 1},
        "context": {PAYLOAD: PAYLOAD}, "step_usage": {}, "graph": graph}), 600)
    queue.set_reason(lease, PAYLOAD)
    queue.announce(PAYLOAD, {PAYLOAD + " held": None}, 600,
                   {run_id: (lease.epoch, {ITEM: (time.time() - 2, 1)})})


def populate(queue: Any) -> dict[str, str]:
    """Fill ``queue`` with a run per kind of field; return the run ids by role (each holds the payload)."""
    from ekit_runtime.queue import Worker

    ids = {role: f"{PAYLOAD} {role}" for role in ("waiting", "answered", "failed", "denied", "running")}
    context = {PAYLOAD: PAYLOAD}
    for role in ("waiting", "answered"):
        queue.submit(PAYLOAD, context, run_id=ids[role])
    queue.submit(PAYLOAD + " fails", context, run_id=ids["failed"])
    queue.submit(PAYLOAD + " approves", context, run_id=ids["denied"])
    worker = Worker(queue, WORKFLOWS, name=PAYLOAD, poll=0.05, defaults={"durations": True})
    asyncio.run(worker.run_until_idle())
    queue.answer(ids["answered"], PAYLOAD + " asks", PAYLOAD, by=PAYLOAD)
    queue.deny(ids["denied"], PAYLOAD + " ship", PAYLOAD, by=PAYLOAD)
    asyncio.run(Worker(queue, {PAYLOAD + " approves": WORKFLOWS[PAYLOAD + " approves"]},
                       name=PAYLOAD, poll=0.05).run_until_idle())
    _running(queue, ids["running"])
    return ids


class _Markup(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.unsafe: list[str] = []
        self.text: list[str] = []
        self.svgs = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        names = {name for name, _ in attrs}
        if tag in ("img", "iframe", "object", "embed") or (tag == "script" and "src" not in names):
            self.unsafe.append(f"<{tag} {attrs}>")
        if tag == "svg":
            self.svgs += 1
            if dict(attrs).get("id") not in PAGE_SVGS:
                self.unsafe.append(f"<svg {attrs}>")
        self.unsafe.extend(f"<{tag} {name}=...>" for name in names if name.startswith("on"))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def unsafe_markup(html: str) -> tuple[list[str], str]:
    """The elements and attributes in ``html`` no page of the dashboard makes (a script without
    ``src``, an ``img``, an ``on*`` handler, an ``svg`` the pages do not draw), and its text,
    decoded, as a person reads it (one line per piece of text)."""
    parser = _Markup()
    parser.feed(html)
    parser.close()
    return parser.unsafe, "\n".join(parser.text)
