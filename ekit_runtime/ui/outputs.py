"""What a run made and what people told it, as HTML: its outputs, the answers given, its usage by step.

An output is shown as the checkpoint holds it, as JSON (a typed output is its
tagged plain data, ``{"$ekit": "type", "type": ..., "value": ...}``, with
the type's name beside it): a line of at most :data:`PREVIEW` characters,
and, when that cuts it, the whole of it under a ``<details>`` (no script
needed) up to :data:`INLINE` characters, past which a link serves it all
(``/run/<id>/output/<name>``, as text). Everything is HTML-escaped; text no
page can encode (a lone surrogate) is sent as ``\\udcxx``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any
from urllib.parse import quote

from ekit_core import WorkflowCheckpoint
from ekit_core.human import Answer, Exchange
from ekit_core.report import usage_text
from ekit_core.usage import TokenUsage

__all__ = [
    "INLINE", "PREVIEW", "answers_html", "output_href", "output_html", "output_json", "outputs_html",
    "text_html", "usage_html", "when_text",
]

PREVIEW = 120
"""The characters of an output shown on its line."""

INLINE = 20_000
"""The characters of an output the page holds; a longer one is linked to in full."""

_TAG = "$ekit"  # (ekit_runtime.typed.TAG: not imported, the dashboard needs no codec)
_TOP_USAGE = 10


def _esc(value: object) -> str:
    return escape(str(value), quote=True)


_LINE = json.JSONEncoder(ensure_ascii=False, separators=(", ", ": "), default=repr)
_OPEN = 3  # the levels of an output laid out one entry a line; deeper ones stay on the line


def output_json(value: Any, indent: int | None = 2) -> str:
    """``value`` as JSON text (``indent=None``: on one line); what JSON cannot hold as its ``repr``.

    Indented, the first levels are laid out one entry a line and deeper ones
    kept on their line: each line is written by the C encoder (``json.dumps``
    with ``indent`` is the pure-Python one, three times slower, which a page of
    2,000 outputs feels).
    """
    try:
        if indent is None:
            return _LINE.encode(value)
        return _laid_out(value, _OPEN, "\n")
    except RecursionError:
        return "(nested too deeply to show)"
    except (TypeError, ValueError):  # a key JSON cannot hold, a circular value
        return repr(value)


def _key(key: Any) -> str:
    """A dict's key as JSON writes it (``1``, ``true``, ``null``); a ``TypeError`` for one it refuses."""
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, bool | int | float):
        return json.dumps(key)
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")


def _laid_out(value: Any, levels: int, newline: str) -> str:
    if levels and isinstance(value, dict) and value:
        inner = newline + "  "
        return ("{" + inner + ("," + inner).join(
            _LINE.encode(_key(k)) + ": " + _laid_out(v, levels - 1, inner)
            for k, v in value.items()) + newline + "}")
    if levels and isinstance(value, list | tuple) and value:
        inner = newline + "  "
        entries = ("," + inner).join(_laid_out(v, levels - 1, inner) for v in value)
        return "[" + inner + entries + newline + "]"
    return _LINE.encode(value)


def output_href(run_id: str, name: str) -> str:
    """The path that serves one output of a run in full."""
    return f"/run/{quote(run_id, safe='')}/output/{quote(name, safe='')}"


def _type_of(value: Any) -> str | None:
    if isinstance(value, dict) and value.get(_TAG) == "type" and isinstance(value.get("type"), str):
        return str(value["type"])
    return None


def output_html(value: Any, run_id: str, name: str) -> str:
    """An output's cell: its type (a typed output), a line of it and, when cut, all of it."""
    kind = _type_of(value)
    label = "" if kind is None else f'<span class="type">{_esc(kind)}</span> '
    line = output_json(value, None)
    if len(line) <= PREVIEW and "\n" not in line:
        return f'{label}<code class="output-line">{_esc(line)}</code>'
    # (A text is its line: the indented form, which the slower pure-Python encoder writes, adds nothing.)
    full = line if isinstance(value, str) else output_json(value)
    shown = full if len(full) <= INLINE else full[:INLINE]
    more = "" if len(full) <= INLINE else (
        f'<p class="more"><a href="{_esc(output_href(run_id, name))}">all of it '
        f"({len(full):,} characters)</a></p>")
    return (f'{label}<details class="output"><summary><code class="output-line">'
            f"{_esc(line[:PREVIEW])}\u2026</code> <small>({len(line):,} characters)</small></summary>"
            f'<pre class="output-full">{_esc(shown)}</pre>{more}</details>')


def text_html(text: str) -> str:
    """A text (a failure's message), escaped: whole when short, else a line, and all of it
    under ``<details>``."""
    if len(text) <= PREVIEW * 2 and "\n" not in text:
        return _esc(text)
    shown = text if len(text) <= INLINE else text[:INLINE] + "\u2026"
    return (f'<details class="text"><summary>{_esc(text[:PREVIEW])}\u2026 <small>({len(text):,} characters)'
            f"</small></summary><pre>{_esc(shown)}</pre></details>")


def _usage(u: TokenUsage | None) -> str:
    return "-" if u is None else usage_text(u)


def outputs_html(checkpoint: WorkflowCheckpoint | None, run_id: str) -> str:
    """The outputs section: each recorded output (steps and items, ``step[key]``) in the order recorded."""
    if checkpoint is None or not checkpoint.outputs:
        return ""
    usage = checkpoint.step_usage
    rows = "".join(
        f'<tr data-step="{_esc(name)}"><td class="step">{_esc(name)}</td>'
        f'<td class="num usage">{_esc(_usage(usage.get(name)))}</td>'
        f'<td class="output">{output_html(value, run_id, name)}</td></tr>'
        for name, value in checkpoint.outputs.items()
    )
    return ('<section><h2>Outputs</h2><table id="outputs"><thead><tr><th>step or item</th>'
            f"<th>usage in/out/calls</th><th>output</th></tr></thead><tbody>{rows}</tbody></table></section>")


def when_text(at: str | float | None) -> str:
    """When an answer was given: a time in seconds as UTC, text as given, ``-`` when unknown."""
    if at is None:
        return "-"
    if isinstance(at, str):
        return at
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))
    except (OverflowError, OSError, ValueError):
        return repr(at)


def _given(answer: Answer, run_id: str, name: str) -> str:
    if answer.approved is None:
        return f'answered <span class="answer">{output_html(answer.value, run_id, name)}</span>'
    verdict = "approved" if answer.approved else "denied"
    reason = f': <span class="reason">{_esc(answer.reason)}</span>' if answer.reason else ""
    return f'<span class="verdict verdict-{verdict}">{verdict}</span>{reason}'


def answers_html(asked: Mapping[str, Sequence[Exchange]], run_id: str) -> str:
    """Every question the run's steps asked that a person answered: who answered what, and when."""
    rows = []
    for step, exchanges in asked.items():
        for i, ex in enumerate(exchanges, 1):
            if ex.answer is None:
                continue  # (pending: the questions section shows it, with its form)
            a = ex.answer
            rows.append(
                f'<tr data-step="{_esc(step)}"><td class="step">{_esc(step)}'
                + (f" <small>(question {i:,})</small>" if len(exchanges) > 1 else "")
                + f'</td><td class="prompt">{_esc(ex.question.prompt)}</td>'
                f'<td class="given">{_given(a, run_id, step)}</td>'
                f'<td class="by">{_esc(a.by or "-")}</td><td class="at">{_esc(when_text(a.at))}</td></tr>'
            )
    if not rows:
        return ""
    return ('<section><h2>Answers given</h2><table id="answers"><thead><tr><th>step</th><th>question</th>'
            f"<th>answer</th><th>by</th><th>when</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
            "</section>")


def usage_html(checkpoint: WorkflowCheckpoint | None) -> str:
    """The run's usage, and the steps (or items) that used the most tokens, as bars."""
    if checkpoint is None:
        return ""
    total = checkpoint.cost
    spent = sorted(((u.input_tokens + u.output_tokens, u.llm_calls, name)
                    for name, u in checkpoint.step_usage.items()
                    if u.input_tokens or u.output_tokens or u.llm_calls), reverse=True)
    head = (f'<p id="run-usage">in all: <b>{_esc(f"{total.input_tokens:,}")}</b> input tokens, '
            f'<b>{_esc(f"{total.output_tokens:,}")}</b> output tokens, '
            f'<b>{_esc(f"{total.llm_calls:,}")}</b> LLM calls')
    if not spent:
        return f"<section><h2>Usage</h2>{head}</p></section>"
    shown = spent[:_TOP_USAGE]
    most = max(tokens for tokens, _, _ in shown) or 1
    bars = []
    for i, (tokens, calls, name) in enumerate(shown):
        y = 4 + i * 22
        width = max(1.0, 420 * tokens / most)
        u = checkpoint.step_usage[name]
        short = name if len(name) <= 30 else name[:29] + "\u2026"
        bars.append(
            f'<g class="usage-bar" data-step="{_esc(name)}"><title>{_esc(name)}: {_esc(usage_text(u))}'
            f'</title><text x="0" y="{y + 14}">{_esc(short)}'
            f'</text><rect x="230" y="{y}" width="{width:.1f}" height="16"/>'
            f'<text x="{236 + width:.1f}" y="{y + 14}">{tokens:,} tokens, {calls:,} call(s)</text></g>'
        )
    height = 8 + len(shown) * 22
    more = (f" (the {len(shown):,} steps or items that used the most tokens of {len(spent):,})"
            if len(spent) > len(shown) else "")
    return (f"<section><h2>Usage</h2>{head}{_esc(more)}</p>"
            f'<svg xmlns="http://www.w3.org/2000/svg" id="usage-chart" class="chart" width="860" '
            f'height="{height}" viewBox="0 0 860 {height}" role="img" aria-label="usage by step">'
            f'{"".join(bars)}</svg></section>')
