"""The dashboard's HTML: the runs page, a run's page, and error pages.

Everything that comes from a run (ids, workflow names, step names,
errors, reasons, questions, answers) goes through :func:`esc`
(``html.escape`` with ``quote=True``) before it reaches the page; no JSON
is embedded in a page (the script fetches it), and the only script is
``/static/app.js``.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any
from urllib.parse import quote, urlencode

from ekit_core.audit import StepAudit
from ekit_core.human import Question
from ekit_core.report import seconds_text, usage_text
from ekit_core.usage import TokenUsage
from ekit_runtime.child_runs import child_run_of
from ekit_runtime.queue import RunInfo
from ekit_runtime.ui.graph_svg import STATES, svg
from ekit_runtime.ui.outputs import answers_html, outputs_html, text_html, usage_html
from ekit_runtime.ui.sources import RunView, view_progress
from ekit_runtime.ui.timeline_svg import OUTCOMES, held_text, timeline_svg, utc_text

__all__ = [
    "PAGE_SIZE", "age_text", "child_wait_html", "error_page", "esc", "part_versions", "run_href", "run_json",
    "run_page", "run_parts", "runs_page", "runs_tbody", "steps_tbody", "token_field",
]

PAGE_SIZE = 50
"""Runs per page of the runs page."""


def esc(value: object) -> str:
    """``value`` as text, HTML-escaped (quotes too): safe in an element and in an attribute."""
    return escape(str(value), quote=True)


def run_href(run_id: str) -> str:
    """The run page's path, the id URL-quoted."""
    return "/run/" + quote(run_id, safe="")


def _usage(u: TokenUsage | None) -> str:
    return "-" if u is None else usage_text(u)


def age_text(seconds: float) -> str:
    """A time span as the pages show ages: ``42s``, ``12m``, ``5h``, ``3d``."""
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"


def _progress(info: RunInfo) -> str:
    return f"{info.steps_done:,}/{'?' if info.steps_total is None else f'{info.steps_total:,}'}"


def _owner(info: RunInfo, now: float) -> str:
    if info.owner is None:
        return "-"
    if info.status == "running" and info.lease_until is not None:
        left = info.lease_until - now
        lease = f"lease {left:.0f}s left" if left > 0 else "lease expired"
        return f"{esc(info.owner)} <small>({lease})</small>"
    return esc(info.owner)


def runs_tbody(runs: Sequence[RunInfo], now: float | None = None) -> str:
    """The rows of the runs table, one ``<tr data-run-id=...>`` per run."""
    now = time.time() if now is None else now
    out = []
    for r in runs:
        reason = r.error if r.status == "failed" and r.error else r.reason
        cancel = " <small>(cancel requested)</small>" if r.cancel_requested else ""
        out.append(
            f'<tr data-run-id="{esc(r.run_id)}">'
            f'<td class="run-id"><a href="{esc(run_href(r.run_id))}">{esc(r.run_id)}</a></td>'
            f'<td class="status status-{esc(r.status)}">{esc(r.status)}{cancel}</td>'
            f'<td class="workflow">{esc(r.workflow)}</td>'
            f'<td class="num progress">{esc(_progress(r))}</td>'
            f'<td class="num cost">{esc(_usage(r.cost))}</td>'
            f'<td class="owner">{_owner(r, now)}</td>'
            f'<td class="num age">{esc(age_text(now - r.created_at))}</td>'
            f'<td class="reason">{esc(reason or "")}</td>'
            "</tr>"
        )
    return "\n".join(out)


def _layout(title: str, body: str, source: str) -> str:
    return (
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{esc(title)} - ekit</title>"
        '<link rel="stylesheet" href="/static/app.css"></head><body>'
        f'<header><h1><a href="/">ekit runs</a></h1><span class="source">{esc(source)}</span></header>'
        f"<main>{body}</main>"
        '<script src="/static/app.js"></script></body></html>\n'
    )


def runs_summary(total: int, page: int, pages: int) -> str:
    """``10,000 run(s), page 1 of 200``."""
    return f"{total:,} run(s), page {page:,} of {pages:,}"


def runs_nav(page: int, pages: int, status: str, workflow: str) -> str:
    """The links to the previous and next pages of the runs (as many pages as the same reading counts)."""
    query = {k: v for k, v in (("status", status), ("workflow", workflow)) if v}
    nav = []
    if page > 1:
        nav.append(f'<a rel="prev" href="/?{esc(urlencode({**query, "page": page - 1}))}">previous</a>')
    if page < pages:
        nav.append(f'<a rel="next" href="/?{esc(urlencode({**query, "page": page + 1}))}">next</a>')
    return "".join(nav)


def runs_page(
    source: str, shown: Sequence[RunInfo], total: int, page: int, status: str, workflow: str,
    statuses: Sequence[str], workflows: Sequence[str] = (), parts: Mapping[str, str] | None = None,
    token: str | None = None,
) -> str:
    """The runs page: ``parts`` (the runs waiting for a person, the chart), filters, the table of
    one page of runs, and links to the other pages.

    ``workflows`` are offered as the workflow filter's suggestions (a ``<datalist>``);
    any name may still be typed. ``parts`` are drawn from the same reading as the
    table, each in a ``<div class="part">`` with its version, as on a run's page;
    ``token`` is the actions' token their forms carry (put back by the script
    into the forms a live update replaces).
    """
    pages = max(1, -(-total // PAGE_SIZE))
    query = {k: v for k, v in (("status", status), ("workflow", workflow)) if v}
    api = "/api/runs?" + urlencode({**query, "page": page})
    options = "".join(
        f'<option value="{esc(s)}"{" selected" if s == status else ""}>{esc(s or "any status")}</option>'
        for s in ("", *statuses)
    )
    names = "".join(f'<option value="{esc(name)}"></option>' for name in workflows)
    parts = dict(parts or {})
    versions = part_versions(parts, token)
    held = "" if token is None else f' data-token="{esc(token)}"'
    body = (
        f'<section id="fleet-parts"{held}>'
        + "".join(f'<div id="{key}" class="part" data-version="{versions[key]}">{html}</div>'
                  for key, html in parts.items())
        + "</section>"
        '<form class="filters" method="get" action="/">'
        f'<label>status <select name="status" id="filter-status">{options}</select></label>'
        f'<label>workflow <input name="workflow" id="filter-workflow" list="workflow-names" '
        f'value="{esc(workflow)}"></label><datalist id="workflow-names">{names}</datalist>'
        '<button type="submit">filter</button></form>'
        f'<p id="runs-summary">{esc(runs_summary(total, page, pages))}</p>'
        f'<table id="runs" data-api="{esc(api)}"><thead><tr>'
        "<th>run</th><th>status</th><th>workflow</th><th>steps</th><th>usage in/out/calls</th>"
        "<th>owner</th><th>age</th><th>reason</th></tr></thead>"
        f"<tbody>{runs_tbody(shown)}</tbody></table>"
        f'<nav class="pages" id="runs-pages">{runs_nav(page, pages, status, workflow)}</nav>'
    )
    return _layout("runs", body, source)


def _state_of(view: RunView, name: str) -> str:
    return view.states.get(name, "not-started")


def _item_times(rows: Sequence[StepAudit]) -> dict[str, list[tuple[float, str]]]:
    """Mapped step -> ``(seconds, item)`` of each of its items with a recorded duration."""
    times: dict[str, list[tuple[float, str]]] = {}
    for row in rows:
        if row.item_of is not None and row.duration is not None:
            times.setdefault(row.item_of, []).append((row.duration, row.name))
    return times


def _item_usage(rows: Sequence[StepAudit]) -> dict[str, tuple[TokenUsage, int]]:
    """Mapped step -> the usage its items recorded, summed, and how many items recorded one."""
    rolled: dict[str, tuple[TokenUsage, int]] = {}
    for row in rows:
        if row.item_of is not None and row.usage is not None:
            total, count = rolled.get(row.item_of, (None, 0))
            rolled[row.item_of] = (row.usage if total is None else total + row.usage, count + 1)
    return rolled


def _usage_cell(row: StepAudit, item_usage: dict[str, tuple[TokenUsage, int]]) -> str:
    """The step table's usage: the step's own; a mapped step's, rolled up from its items."""
    if row.usage is not None or row.name not in item_usage:
        return f'<td class="num usage">{esc(_usage(row.usage))}</td>'
    total, count = item_usage[row.name]
    return (f'<td class="num usage">{esc(_usage(total))} '
            f"<small>({esc(f'{count:,}')} item{'s' if count != 1 else ''})</small></td>")


def _held_note(holds: Mapping[str, float] | None) -> str:
    """What held a recorded attempt before it began (the checkpoint's ``held``), under its duration."""
    if not holds:
        return ""
    return (f'<small class="held" data-limits="{esc(" ".join(holds))}">'
            f'{esc("; ".join(held_text(limit, s) for limit, s in holds.items()))}</small>')


def _items_held(rows: Sequence[StepAudit], held: Mapping[str, Mapping[str, float]]
                ) -> dict[str, list[tuple[float, str]]]:
    """Mapped step -> ``(seconds held, item)`` of each of its items a limit held."""
    found: dict[str, list[tuple[float, str]]] = {}
    if held:
        for row in rows:
            holds = held.get(row.name) if row.item_of is not None else None
            if holds:
                found.setdefault(row.item_of, []).append((sum(holds.values()), row.name))  # type: ignore[arg-type]
    return found


def _items_held_note(name: str, items_held: dict[str, list[tuple[float, str]]],
                     held: Mapping[str, Mapping[str, float]]) -> str:
    """A mapped step's items that a limit held: how many, and the longest hold's limits."""
    found = items_held.get(name)
    if not found:
        return ""
    _, which = max(found)
    holds = held[which]
    return (f'<small class="held" data-limits="{esc(" ".join(holds))}">'
            f"{esc(f'{len(found):,}')} item{'s' if len(found) != 1 else ''} held; longest "
            f'{esc(which)}: {esc("; ".join(held_text(lim, s) for lim, s in holds.items()))}</small>')


def _duration_cell(row: StepAudit, item_times: dict[str, list[tuple[float, str]]],
                   held: Mapping[str, Mapping[str, float]],
                   items_held: dict[str, list[tuple[float, str]]]) -> str:
    """The step table's duration: the recorded output's attempt's (and what held it before it
    began); a mapped step's items' total and the slowest (and how many a limit held); ``-``
    when none is recorded."""
    if row.duration is not None:
        return (f'<td class="num duration" data-seconds="{esc(repr(row.duration))}">'
                f"{esc(seconds_text(row.duration))}{_held_note(held.get(row.name))}</td>")
    timed = item_times.get(row.name)
    if not timed:
        return '<td class="num duration">-</td>'
    total = sum(seconds for seconds, _ in timed)
    slowest, which = max(timed)
    return (f'<td class="num duration" data-seconds="{esc(repr(total))}">'
            f"{esc(seconds_text(total))} <small>({esc(f'{len(timed):,}')} items; slowest "
            f"{esc(which)}: {esc(seconds_text(slowest))})</small>"
            f"{_items_held_note(row.name, items_held, held)}</td>")


def steps_tbody(view: RunView) -> str:
    """The rows of a run's step table: steps, and the items that failed or wait."""
    report = view.report
    if report is None:
        return ""
    out = []
    item_times = _item_times(report.steps)
    item_usage = _item_usage(report.steps)
    changed = view.changed or {}
    held = view.checkpoint.held if view.checkpoint is not None else {}
    items_held = _items_held(report.steps, held)
    for row in report.steps:
        if row.item_of is not None and row.action != "wait" and row.reason != "failed":
            continue
        state = _state_of(view, row.name) if row.item_of is None else (
            "waiting" if row.action == "wait" else "failed")
        failure = row.failure
        attempts = "-" if failure is None else f"{failure.attempts:,}"
        message = "" if failure is None else f"{failure.error_type}: {failure.message}"
        items = view.items.get(row.name)
        shown = "" if items is None else f"{items[0]:,}/{'?' if items[1] is None else f'{items[1]:,}'}"
        how = changed.get(row.name)
        mark = cls = ""
        if how is not None:
            mark = f' <span class="changed-mark" title="{esc(how)}">changed since recorded</span>'
            cls = ' class="changed"'
        out.append(
            f'<tr data-step="{esc(row.name)}"{cls}>'
            f'<td class="step">{esc(row.name)}</td>'
            f'<td class="state state-{esc(state)}">{esc(state)}{mark}</td>'
            f'<td class="action">{esc(row.action)}</td>'
            f'<td class="num items">{esc(shown)}</td>'
            f'<td class="num attempts">{esc(attempts)}</td>'
            f"{_usage_cell(row, item_usage)}"
            f"{_duration_cell(row, item_times, held, items_held)}"
            f'<td class="failure error">{text_html(message)}</td>'
            f'<td class="why">{esc(row.why)}</td></tr>'
        )
    return "\n".join(out)


def _legend() -> str:
    return '<ul class="legend" id="legend">' + "".join(
        f'<li class="state-{esc(key)}">{esc(words)}</li>' for key, words in STATES) + "</ul>"


def token_field(token: str) -> str:
    """The hidden field that carries the actions' token in a form."""
    return f'<input type="hidden" name="token" value="{esc(token)}">'


def _button(view: RunView, verb: str, token: str, extra: str = "", label: str = "") -> str:
    return (
        f'<form class="inline action" method="post" action="{esc(run_href(view.run_id))}/{verb}">'
        f'{token_field(token)}{extra}'
        f'<button type="submit" id="action-{verb}">{esc(label or verb)}</button></form>'
    )


def _actions(view: RunView, token: str | None) -> str:
    if token is None or view.info is None:
        return ""
    buttons = []
    if view.status not in ("finished", "failed", "cancelled"):
        buttons.append(_button(view, "cancel", token))
    if view.status in ("failed", "cancelled"):
        buttons.append(_button(view, "retry", token))
    return f'<div class="actions">{"".join(buttons)}</div>' if buttons else ""


def child_wait_html(step: str, q: Question) -> str | None:
    """A step's wait for its queued child run (decision 022), as a line linking to the child; or
    ``None`` for a person's question. No form: the child's end resumes the step, and the queue
    refuses a person's answer to it."""
    child = child_run_of(q.details)
    if child is None:
        return None
    return (f'<div class="question child-wait" data-step="{esc(step)}"><p><b>{esc(step)}</b> waits for '
            f'its child run <a href="{esc(run_href(child))}">{esc(child)}</a>: nothing to answer, its '
            "end resumes this run</p></div>")


def _questions(view: RunView, token: str | None) -> str:
    if not view.questions:
        return ""
    out = ['<section id="questions"><h2>Waiting for a person</h2>']
    for step, q in view.questions.items():
        waits = child_wait_html(step, q)
        if waits is not None:
            out.append(waits)
            continue
        details = ""
        if q.details is not None:
            details = f"<pre class=\"details\">{esc(json.dumps(q.details, indent=2, default=str))}</pre>"
        forms = ""
        if token is not None and view.info is not None and view.status == "waiting":
            step_field = f'<input type="hidden" name="step" value="{esc(step)}">'
            by = '<input name="by" placeholder="your name" value="dashboard">'
            if q.kind == "approval":
                forms = (_button(view, "approve", token, step_field + by)
                         + _button(view, "deny", token, step_field
                                   + '<input name="reason" placeholder="why">', "deny"))
            else:
                forms = _button(view, "answer", token, step_field + by
                                + '<input name="value" placeholder="answer (JSON, or text)">')
        out.append(
            f'<div class="question" data-step="{esc(step)}"><p><b>{esc(step)}</b> asks '
            f'({esc(q.kind)}): <span class="prompt">{esc(q.prompt)}</span></p>{details}{forms}</div>'
        )
    out.append("</section>")
    return "".join(out)


def in_flight_html(view: RunView, now: float | None = None) -> str:
    """The list of attempts the run's worker runs now (the ``running`` nodes), or a line saying none."""
    if not view.in_flight:
        return '<p class="none">nothing: no attempt of this run has begun on a live worker</p>'
    at = time.time() if now is None else now
    rows = "".join(
        f'<li data-step="{esc(f.name)}"><b>{esc(f.name)}</b>: attempt {f.attempt:,} on worker '
        f"{esc(f.worker)}, for {esc(age_text(max(0.0, at - f.since)))}</li>"
        for f in sorted(view.in_flight.values(), key=lambda f: (f.since, f.name))
    )
    return f"<ul>{rows}</ul>"


def _timeline(view: RunView) -> str:
    if not view.timeline:
        return ""
    rows = "".join(
        f"<tr><td class=\"num\">{i:,}</td><td class=\"num\">{cp.step_index:,}</td>"
        f"<td class=\"num\">{len(cp.outputs):,}</td><td class=\"num\">{len(cp.failures):,}</td>"
        f"<td class=\"num\">{esc(_usage(cp.cost))}</td></tr>"
        for i, cp in enumerate(view.timeline, 1)
    )
    return (
        '<section><h2>Timeline</h2><table id="timeline"><thead><tr><th>checkpoint</th>'
        "<th>step_index</th><th>outputs</th><th>failures</th><th>usage</th></tr></thead>"
        f"<tbody>{rows}</tbody></table></section>"
    )


def _gantt(view: RunView) -> str:
    """The run's attempts on a time axis (see :mod:`ekit_runtime.ui.timeline_svg`), or how to have it."""
    cp = view.checkpoint
    if cp is None:
        return ""
    worker = view.info.owner if view.info is not None else None
    chart = timeline_svg(cp, worker or None, time.time())
    if not chart:
        return ('<section id="attempts"><h2>Attempts over time</h2><p class="hint">No attempt '
                "times recorded: run with <code>durations=True</code> (queued runs record them "
                "unless their <code>durations</code> option or their worker's "
                "<code>--no-durations</code> says not to) to draw each attempt here.</p></section>")
    legend = "".join(f'<li class="outcome-{o}">{o}</li>' for o in OUTCOMES)
    if cp.drives:
        drives = ", ".join(f"<b>{esc(d.worker)}</b> from {esc(utc_text(d.began))}" for d in cp.drives)
        owner = (f' <span id="drives">Driven by {drives}</span>: each attempt ran on the worker of '
                 "the drive it began in.")
    else:
        owner = f" Attempts ran on worker <b>{esc(worker)}</b> (the run's owner)." if worker else ""
    return ('<section id="attempts"><h2>Attempts over time</h2>'
            f'<ul class="legend chart-legend">{legend}</ul>'
            "<p class=\"hint\">One row per step (its items under it), one bar per attempt; hover a bar "
            f"for its times.{owner}</p>"
            f'<div class="chart-box">{chart}</div></section>')


def _changed(view: RunView) -> str:
    """Which recorded steps' version or code changed since (issue 45), or why it cannot be told."""
    if view.checkpoint is None:
        return ""
    head = '<section id="changed"><h2>Changed since recorded</h2>'
    if view.changed is None:
        how = ("start the dashboard with <code>--workflows MODULE:ATTR</code>, the workers' registry"
               if view.info is not None else "start the dashboard with <code>--workflow MODULE:ATTR</code>")
        return (f'{head}<p class="hint" id="changed-unknown">Not known: the dashboard compares a run\'s '
                "recorded steps with its workflow's code and versions only when it knows the workflow "
                f"({how}).</p></section>")
    if not view.changed:
        return (f'{head}<p class="none">nothing: each recorded step\'s version and code are the '
                "workflow's now.</p></section>")
    rows = "".join(f'<li data-step="{esc(name)}"><b>{esc(name)}</b>: {esc(how)}</li>'
                   for name, how in view.changed.items())
    return (f"{head}<p>A resume meets each step's <code>on_code_change</code> policy (a changed "
            f"version runs it again): see what a resume would do, below.</p><ul>{rows}</ul></section>")


def _explanation(view: RunView) -> str:
    report = view.report
    if report is None:
        return ""
    anomalies = "".join(f"<li>{esc(a.kind)}: {esc(a.message)}</li>" for a in report.anomalies)
    return (
        '<section id="audit"><h2>What a resume would do</h2>'
        f"<p>skips {len(report.skipped):,}, runs {len(report.to_run):,}, "
        f"waits on {len(report.waiting):,} (a person's answer); graph from the "
        f"{esc(report.graph_source)}</p>"
        f'<pre id="audit-text">{esc(report.format())}</pre>'
        + (f'<ul class="anomalies">{anomalies}</ul>' if anomalies else "")
        + "</section>"
    )


def progress_text(view: RunView) -> str:
    """``12/40 steps`` for a run page's heading."""
    if view.info is not None:
        return _progress(view.info) + " steps"
    if view.graph is None:
        return ""
    done, total = view_progress(view)  # (the queue's count: a mapped step's items count)
    return f"{done:,}/{'?' if total is None else f'{total:,}'} steps recorded or skipped"


def _heading(view: RunView) -> str:
    return (f'<h2>run {esc(view.run_id)}: <span id="run-status" class="status status-{esc(view.status)}">'
            f'{esc(view.status)}</span> <small id="run-progress">{esc(progress_text(view))}</small></h2>')


def _facts(view: RunView) -> str:
    info = view.info
    if info is None:
        return ""
    facts = [("workflow", info.workflow), ("priority", info.priority), ("epoch", info.epoch),
             ("owner", info.owner or "-"), ("usage in/out/calls", _usage(info.cost)),
             ("reason", info.reason or ""), ("error", info.error or "")]
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in facts)
    return f'<table class="facts">{rows}</table>'


def _graph(view: RunView) -> str:
    if view.graph is None:
        return ""
    return (f'<h2>Graph</h2>{_legend()}<div class="graph-box">'
            f"{svg(view.graph.names, view.graph.deps, view.states, view.items)}</div>")


def _steps(tbody: str) -> str:
    return (
        '<h2>Steps</h2><table id="steps"><thead><tr><th>step</th><th>state</th><th>resume</th>'
        "<th>items</th><th>attempts</th><th>usage in/out/calls</th><th>duration</th>"
        f"<th>failure</th><th>why</th></tr></thead><tbody>{tbody}</tbody></table>"
    )


def run_parts(view: RunView, token: str | None, tbody: str | None = None) -> dict[str, str]:
    """Each part of a run's page, by its element's id, rendered from the one reading ``view``.

    A page and each of its live updates show every part of the same
    reading: a count in the graph can never lag the step table's.
    ``token`` is the actions' token (``None``: no action is offered);
    ``tbody``, the step table's rows when already rendered from ``view``.
    """
    problem = f'<p class="error" id="problem">{esc(view.problem)}</p>' if view.problem else ""
    rows = steps_tbody(view) if tbody is None else tbody
    cp = view.checkpoint
    return {
        "run-heading": _heading(view), "run-actions": _actions(view, token), "run-facts": _facts(view),
        "run-problem": problem, "run-questions": _questions(view, token),
        "run-answers": "" if cp is None else answers_html(cp.asked, view.run_id), "run-graph": _graph(view),
        "run-now": _running_now(view), "run-steps": _steps(rows), "run-changed": _changed(view),
        "run-attempts": _gantt(view),
        "run-usage": usage_html(cp),
        "run-outputs": outputs_html(cp, view.run_id), "run-audit": _explanation(view),
        "run-timeline": _timeline(view),
    }


def _version(html: str) -> str:
    return hashlib.sha256(html.encode("utf-8", "backslashreplace")).hexdigest()[:16]


def part_versions(parts: Mapping[str, str], token: str | None) -> dict[str, str]:
    """Each part's version: a digest of its HTML with the token's fields emptied, as the JSON renders
    them (with ``token=""``), so that the script replaces exactly the parts whose reading changed."""
    field = None if not token else token_field(token)
    return {key: _version(html if field is None else html.replace(field, token_field("")))
            for key, html in parts.items()}


def _versions(view: RunView, parts: dict[str, str], token: str | None) -> dict[str, str]:
    """Each part's version: a digest of its HTML with the token left out, as ``run_json`` renders it,
    so that the script replaces exactly the parts whose reading changed."""
    if token:
        parts = {**parts, "run-actions": _actions(view, ""), "run-questions": _questions(view, "")}
    return {key: _version(html) for key, html in parts.items()}


def run_page(source: str, view: RunView, token: str | None) -> str:
    """A run's page: its record, graph, step table, questions, audit and (journal) timeline."""
    parts = run_parts(view, token)
    versions = _versions(view, parts, token)
    api = "/api" + run_href(view.run_id)
    # The script puts the token back into the forms of the parts it replaces (the JSON never holds it).
    held = "" if token is None else f' data-token="{esc(token)}"'
    body = (
        f'<section id="run" data-api="{esc(api)}" data-run-id="{esc(view.run_id)}"{held}>'
        + "".join(f'<div id="{key}" class="part" data-version="{versions[key]}">{html}</div>'
                  for key, html in parts.items())
        + "</section>"
        + stream_section(view)
    )
    return _layout(f"run {view.run_id}", body, source)


def stream_section(view: RunView) -> str:
    """The live stream of a queued run's page: filled by the script from ``/api/run/<id>/stream``.

    Not a part of the run's reading (the parts above are): it shows what the
    run's worker publishes as it comes, the steps' tokens and events, each
    written into the page as text (never as HTML). A store file has none.
    """
    if view.info is None:
        return ""
    url = "/api" + run_href(view.run_id) + "/stream"
    return (
        f'<section id="stream" data-stream="{esc(url)}"><h2>Live stream</h2>'
        '<p class="hint" id="stream-state">What the run\'s worker publishes: each step\'s partial '
        "output as it arrives, and its events (connecting...).</p>"
        '<div id="stream-log" class="stream-log"></div></section>'
    )


def _running_now(view: RunView) -> str:
    if view.info is None:  # a store file: no worker says what it runs
        return ""
    return f'<section><h2>Running now</h2><div id="in-flight">{in_flight_html(view)}</div></section>'


def run_json(view: RunView, can_act: bool = False) -> dict[str, Any]:
    """What ``/api/run/<id>`` answers, all from the one reading ``view``: status, each step's
    state, the step table's rows, and ``parts`` (each part of the page, by id, with its
    ``versions``), whose forms, when ``can_act``, carry an empty token the page fills in."""
    tbody = steps_tbody(view)
    parts = run_parts(view, "" if can_act else None, tbody)
    return {
        "run_id": view.run_id,
        "status": view.status,
        "progress": progress_text(view),
        "states": view.states,
        "items": {k: list(v) for k, v in view.items.items()},
        "questions": {k: q.to_dict() for k, q in view.questions.items()},
        "problem": view.problem,
        "steps_tbody": tbody,
        "in_flight_html": in_flight_html(view),
        "parts": parts,
        "versions": {key: _version(html) for key, html in parts.items()},
    }


def error_page(source: str, code: int, message: str) -> str:
    """A page saying what went wrong (no traceback, the message escaped)."""
    body = f'<h2 class="error-code">{code}</h2><p class="error" id="error">{esc(message)}</p>'
    return _layout(str(code), body, source)
