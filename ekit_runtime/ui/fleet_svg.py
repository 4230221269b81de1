"""The runs page's chart of the fleet, drawn as inline SVG by the server: runs and usage over time.

Time runs left to right in equal intervals (a minute up to a month each, the
smallest that fits the runs in at most :data:`MAX_BUCKETS`); each interval
is a bar of the runs submitted in it, stacked by status (class
``bar status-<status>``, coloured by the style sheet), and a line joins the
tokens (input + output) those runs reported, over the intervals that have runs. Each interval's ``<title>``
gives its figures as text. Nothing of a run but its status, submission time
and usage reaches the SVG, and every text is escaped.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from html import escape

from ekit_runtime.queue import STATUSES, RunInfo

__all__ = ["MAX_BUCKETS", "Bucket", "buckets", "fleet_svg"]

MAX_BUCKETS = 30
"""The most intervals the chart's time axis is cut into."""

_STEPS = (60, 300, 900, 3600, 3 * 3600, 6 * 3600, 86400, 7 * 86400, 30 * 86400)
_W, _H, _LEFT, _RIGHT, _TOP, _BOTTOM = 960, 200, 48, 110, 12, 28


class Bucket:
    """One interval of the chart: when it starts, its runs by status and their usage."""

    __slots__ = ("calls", "counts", "input_tokens", "output_tokens", "start")

    def __init__(self, start: float) -> None:
        self.start = start
        self.counts: dict[str, int] = {}
        self.input_tokens = 0
        self.output_tokens = 0
        self.calls = 0

    @property
    def runs(self) -> int:
        """How many runs were submitted in the interval."""
        return sum(self.counts.values())

    @property
    def tokens(self) -> int:
        """Their input and output tokens."""
        return self.input_tokens + self.output_tokens


def buckets(runs: Sequence[RunInfo], now: float) -> tuple[int, list[Bucket]]:
    """``(seconds per interval, intervals)`` covering the runs' submission times up to ``now``."""
    if not runs:
        return _STEPS[0], []
    first = min(r.created_at for r in runs)
    last = max(now, max(r.created_at for r in runs))
    step = next((s for s in _STEPS if (last - (first - first % s)) / s < MAX_BUCKETS), _STEPS[-1])
    start = first - first % step
    count = max(1, min(MAX_BUCKETS, math.floor((last - start) / step) + 1))
    out = [Bucket(start + i * step) for i in range(count)]
    for r in runs:
        b = out[min(count - 1, max(0, int((r.created_at - start) // step)))]
        b.counts[r.status] = b.counts.get(r.status, 0) + 1
        b.input_tokens += r.cost.input_tokens
        b.output_tokens += r.cost.output_tokens
        b.calls += r.cost.llm_calls
    return step, out


def _when(at: float, step: int) -> str:
    fmt = "%H:%M" if step < 86400 else "%m-%d"
    try:
        return time.strftime(fmt, time.gmtime(at))
    except (OverflowError, OSError, ValueError):
        return "?"


def _title(b: Bucket, step: int) -> str:
    try:
        begins = time.strftime("%Y-%m-%d %H:%M", time.gmtime(b.start))
    except (OverflowError, OSError, ValueError):
        begins = "?"
    statuses = ", ".join(f"{b.counts[s]:,} {s}" for s in STATUSES if b.counts.get(s))
    return (f"from {begins} UTC, {step // 60:,} min: {b.runs:,} run(s)"
            + (f" ({statuses})" if statuses else "")
            + f"; tokens {b.input_tokens:,} in / {b.output_tokens:,} out, {b.calls:,} call(s)")


def fleet_svg(runs: Sequence[RunInfo], now: float | None = None) -> str:
    """The SVG text of the chart of ``runs`` (``""`` when there are none)."""
    at = time.time() if now is None else now
    step, found = buckets(runs, at)
    if not found:
        return ""
    plot_w, plot_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM
    most_runs = max(b.runs for b in found) or 1
    most_tokens = max(b.tokens for b in found)
    width = plot_w / len(found)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" id="fleet-chart" class="chart" width="{_W}" '
        f'height="{_H}" viewBox="0 0 {_W} {_H}" role="img" aria-label="runs and usage over time">',
        f'<line class="axis" x1="{_LEFT}" y1="{_TOP + plot_h}" x2="{_LEFT + plot_w}" y2="{_TOP + plot_h}"/>',
        f'<text class="axis-label" x="{_LEFT - 6}" y="{_TOP + 10}" text-anchor="end">{most_runs:,}</text>',
        f'<text class="axis-label" x="{_LEFT - 6}" y="{_TOP + plot_h}" text-anchor="end">0</text>',
        f'<text class="axis-label runs-label" x="4" y="{_TOP + plot_h // 2}">runs</text>',
    ]
    if most_tokens:
        out.append(f'<text class="axis-label tokens-label" x="{_LEFT + plot_w + 6}" y="{_TOP + 10}">'
                   f"{most_tokens:,} tokens</text>")
    points = []
    label_every = max(1, math.ceil(len(found) / 8))
    for i, b in enumerate(found):
        x = _LEFT + i * width
        group = [f'<g class="bucket" data-start="{b.start:.0f}" data-runs="{b.runs}" '
                 f'data-tokens="{b.tokens}"><title>{escape(_title(b, step), quote=True)}</title>']
        y = float(_TOP + plot_h)
        for status in STATUSES:
            n = b.counts.get(status, 0)
            if not n:
                continue
            h = plot_h * n / most_runs
            y -= h
            group.append(f'<rect class="bar status-{escape(status, quote=True)}" x="{x + 1:.1f}" '
                         f'y="{y:.1f}" width="{max(1.0, width - 2):.1f}" height="{h:.1f}"/>')
        group.append("</g>")
        out.append("".join(group))
        if most_tokens and b.runs:  # (an interval with no run has no point: the line skips it)
            points.append((x + width / 2, _TOP + plot_h - plot_h * b.tokens / most_tokens))
        if i % label_every == 0:
            out.append(f'<text class="axis-label" x="{x + 1:.1f}" y="{_H - 8}">'
                       f"{escape(_when(b.start, step))}</text>")
    if points:
        spelt = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
        out.append(f'<polyline class="tokens" points="{spelt}"/>')
        out.extend(f'<circle class="tokens" cx="{px:.1f}" cy="{py:.1f}" r="2.5"/>' for px, py in points)
    out.append("</svg>")
    return "\n".join(out)
