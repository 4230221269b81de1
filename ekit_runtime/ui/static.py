"""The dashboard's script and style sheet, served as ``/static/app.js`` and ``/static/app.css``.

Kept as Python strings so that the wheel carries them with no package
data; nothing is fetched from anywhere else. The script only polls the
page's own JSON endpoint (named by the ``data-api`` attribute of the
table or run section) and puts in place HTML the server escaped.
"""

from __future__ import annotations

__all__ = ["APP_CSS", "APP_JS"]

APP_JS = r"""'use strict';
(function () {
  function poll(url, every, apply) {
    var busy = false;
    function tick() {
      if (busy) { return; }
      busy = true;
      fetch(url, {headers: {'Accept': 'application/json'}, credentials: 'same-origin'})
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (data) { if (data) { apply(data); } })
        .catch(function () {})
        .then(function () { busy = false; });
    }
    window.setInterval(tick, every);
  }
  // What a person typed into a part's forms, by form and field: kept when the part is replaced.
  function typed(el) {
    var kept = {};
    el.querySelectorAll('form input:not([type=hidden])').forEach(function (f) {
      var step = f.form.querySelector('input[name=step]');
      kept[f.form.getAttribute('action') + '|' + (step ? step.value : '') + '|' + f.name] = f.value;
    });
    return kept;
  }
  // Put in place, in one go, each part whose version changed, and give its forms the page's token
  // back (the JSON never holds it) and what was typed into them.
  function replaceParts(data, token) {
    var parts = data.parts || {};
    var versions = data.versions || {};
    Object.keys(parts).forEach(function (id) {
      var el = document.getElementById(id);
      if (!el || el.dataset.version === versions[id]) { return; }
      var kept = typed(el);
      el.innerHTML = parts[id];
      el.dataset.version = versions[id];
      el.querySelectorAll('input[name=token]').forEach(function (f) { f.value = token; });
      el.querySelectorAll('form input:not([type=hidden])').forEach(function (f) {
        var step = f.form.querySelector('input[name=step]');
        var key = f.form.getAttribute('action') + '|' + (step ? step.value : '') + '|' + f.name;
        if (Object.prototype.hasOwnProperty.call(kept, key)) { f.value = kept[key]; }
      });
    });
  }
  function setText(id, text) {
    var el = document.getElementById(id);
    if (el && text !== undefined && text !== null) { el.textContent = text; }
  }
  var runs = document.getElementById('runs');
  if (runs && runs.dataset.api) {
    var fleet = document.getElementById('fleet-parts');
    var fleetToken = (fleet && fleet.dataset.token) || '';
    poll(runs.dataset.api, 1500, function (data) {
      replaceParts(data, fleetToken);
      runs.tBodies[0].innerHTML = data.tbody;
      setText('runs-summary', data.summary);
      var nav = document.getElementById('runs-pages');
      if (nav && data.nav !== undefined) { nav.innerHTML = data.nav; }
      document.body.dataset.refreshed = String(Date.now());
    });
  }
  var run = document.getElementById('run');
  if (run && run.dataset.api) {
    var token = run.dataset.token || '';
    // Every part of the page comes from one reading of the run: a poll puts in
    // place, in one go, each part whose version changed, so no part lags another.
    poll(run.dataset.api, 2000, function (data) {
      replaceParts(data, token);
      document.body.dataset.refreshed = String(Date.now());
    });
  }
  // A queued run's live stream (server-sent events): its steps' text as it arrives, its events as
  // lines, all written as text. A reconnect (the browser's own) sends the last event's id, and the
  // server resumes after it: nothing is shown twice or skipped.
  var box = document.getElementById('stream');
  if (box && box.dataset.stream && window.EventSource) {
    var log = document.getElementById('stream-log');
    var state = document.getElementById('stream-state');
    var open = null;  // the block the current step's text goes into
    var source = new EventSource(box.dataset.stream);
    var seen = 0;
    function said(text) { if (state) { state.textContent = text; } }
    function line(kind, text) {
      var div = document.createElement('div');
      div.className = 'stream-event stream-' + kind;
      div.textContent = text;
      log.appendChild(div);
      open = null;
    }
    function describe(kind, e) {
      var d = e.data || {};
      var step = e.step ? ' ' + e.step : '';
      if (kind === 'claimed') { return 'claimed by ' + d.worker + ' (epoch ' + e.epoch + ')'; }
      if (kind === 'failed' || kind === 'retried') { return kind + step + ': ' + d.error; }
      if (kind === 'waiting') { return 'waiting' + step + ': ' + ((d.question || {}).prompt || ''); }
      if (kind === 'gap') { return 'events ' + d.dropped_from + ' to ' + d.dropped_to + ' were dropped'; }
      if (kind === 'dropped') { return 'the worker lost ' + d.events + ' event(s)'; }
      if (kind === 'end') { return 'the run ' + d.status + (d.error ? ': ' + d.error : ''); }
      return kind + step + (d.attempt ? ' (attempt ' + d.attempt + ')' : '');
    }
    function took(ev) {
      seen += 1;
      box.dataset.last = ev.lastEventId;
      box.dataset.events = String(seen);
    }
    function partial(ev, rewritten) {
      var e = JSON.parse(ev.data);
      if (!open || open.dataset.step !== e.step) {
        var block = document.createElement('div');
        block.className = 'stream-step';
        var label = document.createElement('span');
        label.className = 'stream-label';
        label.textContent = e.step;
        open = document.createElement('pre');
        open.className = 'stream-text';
        open.dataset.step = e.step;
        block.appendChild(label);
        block.appendChild(open);
        log.appendChild(block);
      }
      var text = typeof e.data === 'string' ? e.data : JSON.stringify(e.data) + '\n';
      if (rewritten) { open.textContent = text; } else { open.textContent += text; }
      took(ev);
    }
    source.addEventListener('partial', function (ev) { partial(ev, false); });
    source.addEventListener('rewritten', function (ev) { partial(ev, true); });
    ['claimed', 'started', 'finished', 'retried', 'failed', 'waiting', 'dropped', 'gap', 'end']
      .forEach(function (kind) {
        source.addEventListener(kind, function (ev) {
          var e = JSON.parse(ev.data);
          line(kind, describe(kind, e));
          took(ev);
          if (kind === 'end') {
            source.close();
            box.dataset.ended = '1';
            said('The run ended; this is everything its worker published.');
          }
        });
      });
    source.onopen = function () {
      box.dataset.opens = String(Number(box.dataset.opens || 0) + 1);
      said('Live: what the run\'s worker publishes, as it comes.');
    };
    source.onerror = function () {
      if (box.dataset.ended !== '1') { said('Reconnecting (from the last event shown)...'); }
    };
  }
})();
"""

APP_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
header { display: flex; gap: 1em; align-items: baseline; border-bottom: 1px solid #ccc; margin-bottom: 1em; }
header .source { color: #666; font-family: monospace; }
table { border-collapse: collapse; width: 100%; font-size: 0.9em; }
th, td { border-bottom: 1px solid #e3e3e3; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.status { font-weight: 600; }
.status-queued { color: #555; } .status-running { color: #0a58ca; } .status-waiting { color: #b35c00; }
.status-finished { color: #1e7b34; } .status-failed { color: #b02a37; } .status-cancelled { color: #777; }
form.filters { margin-bottom: 1em; display: flex; gap: 0.5em; align-items: center; }
form.inline { display: inline; }
nav.pages { margin: 1em 0; display: flex; gap: 1em; }
.graph-box { overflow: auto; border: 1px solid #ddd; max-height: 70vh; background: #fcfcfc; }
svg.graph text { font: 12px monospace; fill: #111; }
svg.graph text.items { font-size: 10px; fill: #333; }
svg.graph line.edge { stroke: #999; stroke-width: 1; }
svg.graph rect { stroke: #555; stroke-width: 1; }
.state-recorded rect, .legend .state-recorded { fill: #b7e4c7; background: #b7e4c7; }
.state-running rect, .legend .state-running { fill: #9ec5fe; background: #9ec5fe; }
.state-ready rect, .legend .state-ready { fill: #e7f1ff; background: #e7f1ff; stroke-dasharray: 4 2; }
.state-failed rect, .legend .state-failed { fill: #f1aeb5; background: #f1aeb5; }
.state-waiting rect, .legend .state-waiting { fill: #ffda6a; background: #ffda6a; }
.state-skipped rect, .legend .state-skipped { fill: #dee2e6; background: #dee2e6; }
.state-not-started rect, .legend .state-not-started { fill: #ffffff; background: #ffffff; }
.legend { display: flex; gap: 1em; margin: 0.5em 0; list-style: none; padding: 0; }
.legend li { padding: 2px 8px; border: 1px solid #555; border-radius: 4px; }
.error { color: #b02a37; white-space: pre-wrap; }
.question { border: 1px solid #ffda6a; padding: 0.5em 1em; margin: 0.5em 0; }
pre { white-space: pre-wrap; }
#waiting { border: 2px solid #ffda6a; background: #fffbeb; padding: 0.25em 1em 0.75em; margin-bottom: 1em; }
#waiting h2 { margin: 0.4em 0; }
.waiting-run { border-top: 1px solid #f0d98a; padding: 0.2em 0; }
.waiting-run > p { margin: 0.3em 0; }
.waiting-run .question { background: #fff; margin: 0.2em 0 0.2em 1.5em; padding: 0.2em 0.75em; }
.waiting-run .question p { margin: 0.2em 0; display: inline-block; margin-right: 1em; }
.hint { color: #555; }
.hint code, code { background: #f4f4f4; padding: 0 3px; }
form.action input { margin: 0 0.25em; }
input.answer-value { min-width: 20em; }
.chart-box { overflow-x: auto; }
svg.chart text { font: 11px system-ui, sans-serif; fill: #333; }
svg.chart line.axis { stroke: #999; }
svg.chart polyline.tokens { fill: none; stroke: #6f42c1; stroke-width: 2; }
svg.chart circle.tokens { fill: #6f42c1; }
svg.chart .usage-bar rect { fill: #6f42c1; opacity: 0.75; }
.bar.status-queued, .chart-legend .status-queued { fill: #adb5bd; background: #adb5bd; }
.bar.status-running, .chart-legend .status-running { fill: #9ec5fe; background: #9ec5fe; }
.bar.status-waiting, .chart-legend .status-waiting { fill: #ffda6a; background: #ffda6a; }
.bar.status-finished, .chart-legend .status-finished { fill: #75b798; background: #75b798; }
.bar.status-failed, .chart-legend .status-failed { fill: #ea868f; background: #ea868f; }
.bar.status-cancelled, .chart-legend .status-cancelled { fill: #dee2e6; background: #dee2e6; }
.chart-legend .tokens { border-color: #6f42c1; color: #6f42c1; }
svg.timeline line.grid { stroke: #e4e4e4; }
svg.timeline text.row-label.item { fill: #666; }
svg.timeline rect.attempt { stroke: #0003; }
.outcome-recorded { fill: #75b798; background: #75b798; }
.outcome-failed { fill: #ea868f; background: #ea868f; }
.outcome-waiting { fill: #ffda6a; background: #ffda6a; }
.outcome-skipped { fill: #adb5bd; background: #adb5bd; }
.outcome-held { fill: #f5c2a0; background: #f5c2a0; }
svg.timeline text.held-label { font-size: 10px; fill: #6b2f0a; pointer-events: none; }
td.duration small.held { display: block; color: #8a4a1a; }
.changed-mark { font-size: 0.8em; color: #8a5300; background: #fff3cd; border-radius: 3px; padding: 0 4px; }
#changed li b { font-family: monospace; }
td.output { max-width: 60em; }
code.output-line { white-space: pre-wrap; word-break: break-all; }
pre.output-full { max-height: 30em; overflow: auto; background: #f8f8f8; padding: 0.5em; }
.type { font-size: 0.8em; color: #6f42c1; font-family: monospace; }
#stream { margin-top: 1em; border-top: 1px solid #ccc; }
.stream-log { max-height: 30em; overflow: auto; font-size: 0.9em; }
.stream-event { font-family: monospace; color: #555; }
.stream-failed, .stream-gap, .stream-dropped { color: #b02a37; }
.stream-end { font-weight: 600; }
.stream-label { font-family: monospace; color: #0a58ca; }
pre.stream-text { margin: 0.1em 0 0.3em 1em; background: #f8f8f8; padding: 0.3em; }
.verdict-approved { color: #1e7b34; font-weight: 600; } .verdict-denied { color: #b02a37; font-weight: 600; }
"""
