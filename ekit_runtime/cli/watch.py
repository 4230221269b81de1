"""``ekit queue watch RUN [--after N] [--json]``: follow a queued run's stream as it goes.

Partial output that is text is printed as it arrives, token after token on
one line; any other event is a line of its own (``#OFFSET kind step ...``),
so a person sees the run's steps start, stream and finish. ``--json``
prints each event as one JSON object per line instead (for machines). It
ends when the run ends: exit 0 if it finished, 1 if it failed or was
cancelled, 2 for an unknown run or a bad offset, 130 on Ctrl-C. To resume
after an interruption, pass the offset of the last event printed as
``--after`` (``--json`` prints every offset; the text form prints them on
its event lines).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any, TextIO

from ekit_runtime.cli.common import EXIT_CLEAN, EXIT_FOUND
from ekit_runtime.queue.streams import StreamEvent

__all__ = ["event_line", "watch"]

# Control characters other than a newline or a tab, which a step's text could
# use to rewrite the person's terminal (ANSI escapes): printed as \xNN.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _shown(text: str) -> str:
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def event_line(event: StreamEvent) -> str:
    """One event as the line ``ekit queue watch`` prints for it (without the newline)."""
    data: Any = event.data
    step = f" {event.step}" if event.step is not None else ""
    head = f"#{event.offset} {event.kind}{step}"
    if event.kind == "claimed" and isinstance(data, dict):
        resumed = " (resuming from its checkpoint)" if data.get("resumed") else ""
        return f"{head} by {data.get('worker')} at epoch {event.epoch}{resumed}"
    if event.kind in ("started", "finished") and isinstance(data, dict):
        return f"{head} (attempt {data.get('attempt')})"
    if event.kind in ("failed", "retried") and isinstance(data, dict):
        return f"{head} (attempt {data.get('attempt')}): {data.get('error')}"
    if event.kind == "waiting" and isinstance(data, dict):
        question = data.get("question")
        prompt = question.get("prompt") if isinstance(question, dict) else question
        return f"{head}: {prompt}"
    if event.kind == "gap" and isinstance(data, dict):
        return (f"#{event.offset} gap: events {data.get('dropped_from')} to {data.get('dropped_to')} "
                "were dropped (the stream keeps only its newest events)")
    if event.kind == "dropped" and isinstance(data, dict):
        return f"{head}: the worker's buffer lost {data.get('events')} event(s)"
    if event.kind == "end" and isinstance(data, dict):
        error = f": {data.get('error')}" if data.get("error") else ""
        return f"#{event.offset} end: the run {data.get('status')}{error}"
    return f"{head} {json.dumps(data, ensure_ascii=False)}"


def watch(events: Iterable[StreamEvent], out: TextIO, *, as_json: bool = False) -> int:
    """Print ``events`` to ``out`` as they come (see the module docstring); the exit code at the end."""
    mid_line: str | None = None  # the step whose text tokens the current line holds
    code = EXIT_CLEAN
    for event in events:
        if as_json:
            out.write(json.dumps(event.to_dict(), ensure_ascii=False) + "\n")
        elif event.kind in ("partial", "rewritten") and isinstance(event.data, str):
            # A rewritten text starts a line of its own: a terminal cannot take back what it printed.
            if mid_line != event.step or event.kind == "rewritten":
                if mid_line is not None:
                    out.write("\n")
                out.write(_shown(f"{event.step}: "))
                mid_line = event.step
            out.write(_shown(event.data))
        else:
            if mid_line is not None:
                out.write("\n")
                mid_line = None
            out.write(_shown(event_line(event)).replace("\n", "\\n") + "\n")
        out.flush()
        if event.kind == "end":
            status = event.data.get("status") if isinstance(event.data, dict) else None
            code = EXIT_CLEAN if status == "finished" else EXIT_FOUND
    if mid_line is not None:
        out.write("\n")
        out.flush()
    return code
