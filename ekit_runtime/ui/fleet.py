"""The top of the runs page: the runs waiting for a person (with a form to answer), and the fleet's chart.

Both are drawn from the page's one reading (:class:`~ekit_runtime.ui.sources.RunsView`).
A form is offered only when the server acts (``--allow-actions``: ``token``
given); it posts to the run's own ``answer`` (``approve``, ``deny``) action,
guarded as every action is, with ``back=runs`` so that the answer brings
the person back to this page. Every value from a run is escaped.
"""

from __future__ import annotations

import json
import time

from ekit_core.human import Question
from ekit_core.report import usage_text
from ekit_core.usage import NO_USAGE
from ekit_runtime.queue import STATUSES
from ekit_runtime.ui.fleet_svg import fleet_svg
from ekit_runtime.ui.outputs import when_text
from ekit_runtime.ui.pages import child_wait_html, esc, run_href, token_field
from ekit_runtime.ui.sources import CHART_RUNS, RunsView, Waiting

__all__ = ["chart_html", "runs_parts", "waiting_html"]


def _form(run_id: str, verb: str, token: str, fields: str, label: str) -> str:
    return (f'<form class="inline action" method="post" action="{esc(run_href(run_id))}/{verb}">'
            f"{token_field(token)}"
            f'<input type="hidden" name="back" value="runs">{fields}'
            f'<button type="submit" class="action-{verb}">{esc(label)}</button></form>')


def _forms(run_id: str, step: str, q: Question, token: str) -> str:
    step_field = f'<input type="hidden" name="step" value="{esc(step)}">'
    by = '<input name="by" placeholder="your name" value="dashboard" aria-label="your name">'
    if q.kind == "approval":
        return (_form(run_id, "approve", token, step_field + by, "approve")
                + _form(run_id, "deny", token, step_field + by
                        + '<input name="reason" placeholder="why" aria-label="why">', "deny"))
    return _form(run_id, "answer", token, step_field + by
                 + '<input name="value" class="answer-value" placeholder="answer (JSON, or text)" '
                   'aria-label="answer">', "answer")


def _run(w: Waiting, token: str | None) -> str:
    info = w.info
    asks = []
    for step, q in w.questions.items():
        waits = child_wait_html(step, q)
        if waits is not None:
            asks.append(waits)
            continue
        details = ("" if q.details is None else
                   f'<pre class="details">{esc(json.dumps(q.details, indent=2, default=str))}</pre>')
        forms = "" if token is None else _forms(info.run_id, step, q, token)
        asks.append(f'<div class="question" data-step="{esc(step)}"><p><b>{esc(step)}</b> asks '
                    f'({esc(q.kind)}): <span class="prompt">{esc(q.prompt)}</span></p>'
                    f"{details}{forms}</div>")
    if not asks:  # (answered or rewound as it was read: its page says what it waits on now)
        asks.append('<p class="none">its question was just answered or withdrawn: see its page</p>')
    return (f'<div class="waiting-run" data-run-id="{esc(info.run_id)}"><p>'
            f'<a href="{esc(run_href(info.run_id))}">{esc(info.run_id)}</a> '
            f"<small>({esc(info.workflow)}, submitted {esc(when_text(info.created_at))})</small></p>"
            f'{"".join(asks)}</div>')


def waiting_html(view: RunsView, token: str | None, can_act: bool) -> str:
    """The "waiting for you" section: each waiting run's questions, a form each when ``token`` is given;
    when the source could act but the server does not (``can_act``), how to let it."""
    if not view.waiting_total:
        return ('<section id="waiting"><h2>Waiting for you</h2>'
                '<p class="none">no run waits for a person</p></section>')
    hint = ""
    if token is None:
        hint = ('<p class="hint" id="answer-hint">To answer from this page, start the dashboard with '
                "<code>--allow-actions</code> (<code>ekit ui --queue URL --allow-actions</code>); "
                "or answer with <code>ekit queue --queue URL answer RUN STEP VALUE_JSON</code>.</p>"
                if can_act else
                '<p class="hint" id="answer-hint">A store file is read-only here: resume the run with '
                "its answer from your program (<code>ekit_core.human.answer</code>).</p>")
    more = ""
    if view.waiting_total > len(view.waiting):
        more = (f'<p class="more">and {view.waiting_total - len(view.waiting):,} more: '
                '<a href="/?status=waiting">every waiting run</a></p>')
    return (f'<section id="waiting"><h2>Waiting for you ({view.waiting_total:,})</h2>{hint}'
            f'{"".join(_run(w, token) for w in view.waiting)}{more}</section>')


def chart_html(view: RunsView, now: float | None = None) -> str:
    """The chart of the newest runs of the whole queue (not only the page's), with what it covers."""
    recent = view.recent
    if not recent:
        return ""
    usage = sum((r.cost for r in recent), NO_USAGE)
    which = (f"the {len(recent):,} runs" if view.fleet_total <= len(recent) else
             f"the newest {len(recent):,} of {view.fleet_total:,} runs (at most {CHART_RUNS:,})")
    legend = "".join(f'<li class="status-{esc(s)}">{esc(s)}</li>'
                     for s in sorted({r.status for r in recent}, key=_status_order))
    return (f'<section id="fleet"><h2>Runs and usage over time</h2>'
            f'<p id="fleet-summary">{esc(which)}, by when they were submitted: bars count the runs '
            f"by status, the line their tokens (in + out); their usage in/out/calls "
            f"<b>{esc(usage_text(usage))}</b></p>"
            f'<ul class="legend chart-legend">{legend}<li class="tokens">tokens</li></ul>'
            f'<div class="chart-box">{fleet_svg(recent, now)}</div></section>')


def _status_order(status: str) -> int:
    return STATUSES.index(status) if status in STATUSES else len(STATUSES)


def runs_parts(view: RunsView, token: str | None, can_act: bool, now: float | None = None) -> dict[str, str]:
    """The parts of the runs page above its table, by element id, from the one reading ``view``."""
    at = time.time() if now is None else now
    return {"runs-waiting": waiting_html(view, token, can_act), "runs-chart": chart_html(view, at)}
