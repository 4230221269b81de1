"""``ekit worker`` and ``ekit queue``: drain a run queue, and submit to and inspect it.

- ``ekit worker --queue URL --workflows MODULE:ATTR [--max-runs N] [--lease S]
  [--heartbeat S] [--until-idle]`` drives runs until SIGTERM or Ctrl-C (then
  it cancels the runs in flight, each saving a final checkpoint, gives them
  back to the queue, and exits without waiting for a sync step's thread,
  which Python cannot stop: 0 after a SIGTERM, 130 after a Ctrl-C, as any
  command a person interrupts; a second SIGTERM or Ctrl-C exits at once, with
  ``128 + signal``, leaving its runs to be taken over when their leases
  expire) or, with ``--until-idle``, until nothing is claimable: it exits 0
  if no run is left waiting in the queue, else ``3``, with a warning line
  per run left (queued or running) saying why this worker did not take it.
  It prints ekit's log records on stderr (``--log-format text|json``, ``-v``
  for DEBUG, ``-q`` for warnings only: see :mod:`ekit_runtime.logs`).
  What every run it drives gets: ``--max-concurrency N``, ``--budget-calls
  N`` / ``--budget-input-tokens N`` / ``--budget-output-tokens N``,
  ``--isolate-failures`` (defaults a run's own options override),
  ``--executor MODULE:ATTR`` and ``--trace otel|progress|MODULE:ATTR``.
  ``--stream-cap N`` (events each run's stream keeps) and ``--no-stream``
  (publish none: see :mod:`ekit_runtime.queue.streams`).
- ``ekit queue --queue URL submit WORKFLOW [--context JSON] [--run-id ID]
  [--priority N] [--option KEY=VALUE]... [--options JSON]``, ``status RUN``,
  ``list [--status S] [--workflow W] [--json]`` (a table, or JSON), ``cancel RUN``,
  ``prune --older-than AGE`` (``90``, ``15m``, ``2h``, ``1d``, ``1h30m``: see
  :mod:`ekit_runtime.durations`), ``checkpoint RUN`` (the checkpoint as JSON;
  ``ekit audit QUEUE --run-id RUN`` reads it in place), ``limits [--max-in-flight N] [--runs-per-minute N]
  [--llm-calls-per-minute N] [--tokens-per-minute N] [--resource NAME=N ...]``.
- ``ekit queue --queue URL watch RUN [--after N] [--json]``: the run's live
  stream (:mod:`ekit_runtime.cli.watch`), until the run ends.
- ``ekit queue --queue URL retry RUN`` (a failed or cancelled run, queued again
  from its checkpoint), ``rewind RUN STEP...`` (those steps and everything
  downstream run again, in place), ``fork RUN [STEP...] [--run-id NEW]
  [--priority N]`` (a copy under a new id, rewound at the steps): see
  :meth:`RunQueue.retry`, :meth:`RunQueue.rewind`, :meth:`RunQueue.fork`. A
  refusal (a running run, a finished one to retry) is one line, exit 2.
- ``ekit queue --queue URL answer RUN STEP VALUE_JSON [--by NAME]``,
  ``approve RUN STEP [--by NAME]``, ``deny RUN STEP [--reason TEXT] [--by
  NAME]``: answer the question a waiting run's step asked (``status RUN``
  shows it, ``list`` its step and prompt); the run is queued again.

``URL`` is ``sqlite:///PATH``, a file path, or ``postgresql://...``.
Registered with the ``ekit`` command by :func:`add_parsers`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

from ekit_core.times import iso_utc
from ekit_runtime import logs
from ekit_runtime.cli.common import EXIT_INTERRUPTED, InputError
from ekit_runtime.cli.watch import watch
from ekit_runtime.durations import parse_duration
from ekit_runtime.executors import Executor, busy_sync_steps
from ekit_runtime.queue import FINAL_STATUSES, STATUSES, Lease, RunInfo, RunQueue, Worker, open_queue
from ekit_runtime.queue.options import RUN_OPTIONS
from ekit_runtime.queue.streams import DEFAULT_CAP
from ekit_runtime.queue.worker import TraceFactory
from ekit_runtime.redaction import redacted
from ekit_runtime.sources import SourceError, pick_workflow, workflow_entries, workflow_spec
from ekit_runtime.workflow import Workflow

__all__ = ["EXIT_LEFT", "add_parsers"]

EXIT_LEFT = 3
"""``ekit worker --until-idle`` went idle with runs still waiting in the queue that it did not take."""

log = logging.getLogger("ekit.worker")


def _add_log_options(p: argparse.ArgumentParser) -> None:
    """``ekit worker``'s options for its log lines (see :func:`_print_logs`)."""
    g = p.add_argument_group("log lines (on stderr)")
    g.add_argument(
        "--log-format", choices=("text", "json"), default="text",
        help="text: one human line per record (time, level, logger, message naming worker, run, step "
        "and attempt); json: one JSON object per line, with the record's attributes (run_id, step, "
        "attempt, workflow, worker, epoch, event, ...). Default text",
    )
    verbosity = g.add_mutually_exclusive_group()
    verbosity.add_argument(
        "-v", "--verbose", action="store_true",
        help="also each attempt's start and success (ekit's DEBUG records)",
    )
    verbosity.add_argument(
        "-q", "--quiet", action="store_true", help="only warnings and errors (lost leases, failed runs)"
    )


# What _print_logs changed, undone once the command is over (it may run in-process, in a test).
_UNDO_LOGS: list[Callable[[], None]] = []


def _worker_printing_logs(args: argparse.Namespace) -> int:
    """``ekit worker``: :func:`_cmd_worker`, then the logging it set up (:func:`_print_logs`) undone."""
    try:
        return _cmd_worker(args)
    finally:
        while _UNDO_LOGS:
            _UNDO_LOGS.pop()()


def _print_logs(args: argparse.Namespace) -> None:
    """Print ekit's log records on stderr, as ``--log-format``, ``-v`` and ``-q`` say.

    ekit's loggers get a handler of their own (INFO; DEBUG with ``-v``,
    WARNING with ``-q``) and do not propagate, so a handler the workflows'
    module installed does not print them twice. Other libraries' records
    print as WARNING and above, in the same format, unless that module
    configured logging itself (the root logger has a handler): then it
    stands. The password of ``--queue`` is masked in the records'
    attributes too (their messages are masked as they are made: see
    :class:`~ekit_runtime.redaction.Redactor`).
    """
    formatter: logging.Formatter = logs.JsonFormatter() if args.log_format == "json" else logs.TextFormatter()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    handler.addFilter(_masking(args.queue))
    ekit = logging.getLogger("ekit")
    level, propagate = ekit.level, ekit.propagate
    ekit.addHandler(handler)
    ekit.setLevel(logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO)
    ekit.propagate = False

    def undo() -> None:
        ekit.removeHandler(handler)
        ekit.setLevel(level)
        ekit.propagate = propagate

    _UNDO_LOGS.append(undo)
    root = logging.getLogger()
    if not root.handlers:
        other = logging.StreamHandler(sys.stderr)
        other.setFormatter(formatter)
        other.addFilter(_masking(args.queue))
        root_level = root.level
        root.addHandler(other)
        root.setLevel(logging.WARNING)

        def undo_root() -> None:
            root.removeHandler(other)
            root.setLevel(root_level)

        _UNDO_LOGS.append(undo_root)


def _masking(queue_url: str) -> Callable[[logging.LogRecord], bool]:
    """A handler filter masking the password of ``queue_url`` in a record's ekit attributes."""
    from ekit_runtime.redaction import Redactor

    redactor = Redactor.of([queue_url])

    def mask(record: logging.LogRecord) -> bool:
        for name in (*logs.FIELDS, *logs.DETAILS):
            value = getattr(record, name, None)
            if isinstance(value, str):
                setattr(record, name, redactor.scrub(value))
        return True

    return mask


def _imported(flag: str, spec: str, what: str) -> Any:
    """The object ``MODULE:ATTR`` names (the current folder importable), or an input error naming ``flag``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InputError(f"{flag} {spec}: expected MODULE:ATTR naming {what}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (Exception, SystemExit) as exc:
        raise InputError(f"{flag} {spec}: cannot import it ({type(exc).__name__}: {exc})") from None
    return obj


def _registry(spec: str) -> Mapping[str, Workflow]:
    """The workflows ``--workflows spec`` names, read as every ``ekit`` command reads a workflow
    source (:func:`~ekit_runtime.sources.workflow_spec`): ``:NAME`` serves that entry alone."""
    try:
        module, attr, name = workflow_spec(spec)
    except SourceError as exc:
        raise InputError(f"--workflows {exc}") from None
    obj = _imported("--workflows", f"{module}:{attr}", "a dict of name -> Workflow")
    entries = workflow_entries(obj, attr)
    if name is not None:
        try:
            entries = {name: pick_workflow(entries, name, spec)}
        except SourceError as exc:
            raise InputError(f"--workflows {exc}") from None
    if not entries or not all(isinstance(w, Workflow) for w in entries.values()):
        raise InputError(f"--workflows {spec}: not a Workflow nor a dict of name -> Workflow")
    return {k: w for k, w in entries.items() if isinstance(w, Workflow)}


def _open(args: argparse.Namespace) -> RunQueue:
    try:
        return open_queue(args.queue)
    except ValueError as exc:
        raise InputError(f"--queue {args.queue}: {exc}") from None


def _worker_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """The run options ``ekit worker``'s flags give every run (a run's own override them)."""
    defaults: dict[str, Any] = {}
    if args.max_concurrency is not None:
        defaults["max_concurrency"] = args.max_concurrency
    budget = {
        field: value
        for field, value in (
            ("llm_calls", args.budget_calls),
            ("input_tokens", args.budget_input_tokens),
            ("output_tokens", args.budget_output_tokens),
        )
        if value is not None
    }
    if budget:
        defaults["budget"] = budget
    if args.isolate_failures:
        defaults["isolate_failures"] = True
    if args.no_durations:
        defaults["durations"] = False
    return defaults


def _executor(spec: str | None) -> Executor | None:
    if spec is None:
        return None
    obj = _imported("--executor", spec, "an ekit Executor")
    if not isinstance(obj, Executor):
        raise InputError(f"--executor {spec}: not an ekit Executor (got {type(obj).__name__})")
    return obj


def _trace(spec: str | None, registry: Mapping[str, Workflow]) -> TraceFactory | None:
    """``--trace``: an OpenTelemetry tracer per run, a progress printer per run, or a factory of yours."""
    if spec is None:
        return None
    if spec == "otel":
        from ekit_runtime.otel import OtelTracer

        try:
            OtelTracer()  # says now, not at the first run, what to install
        except ImportError as exc:
            raise InputError(f"--trace otel: {exc}") from None
        return lambda lease: OtelTracer()
    if spec == "progress":
        from ekit_runtime.progress import ProgressPrinter

        def printer(lease: Lease) -> ProgressPrinter:
            # Several runs print to one stream at once: each line names its run.
            graph = registry[lease.workflow].graph
            return ProgressPrinter(sys.stderr, tty=False, graph=graph, tick=None, label=f"run {lease.run_id}")

        return printer
    obj = _imported("--trace", spec, "a factory of trace callbacks (otel, progress or MODULE:ATTR)")
    if not callable(obj):
        raise InputError(f"--trace {spec}: not callable (got {type(obj).__name__})")
    return obj  # type: ignore[no-any-return]


def _cmd_worker(args: argparse.Namespace) -> int:
    registry = _registry(args.workflows)
    executor = _executor(args.executor)
    trace = _trace(args.trace, registry)
    _print_logs(args)
    queue = _open(args)
    try:
        worker = Worker(
            queue,
            registry,
            max_runs=args.max_runs,
            lease_seconds=args.lease,
            heartbeat=args.heartbeat,
            name=args.name,
            executor=executor,
            trace=trace,
            defaults=_worker_defaults(args),
            stream=not args.no_stream,
            stream_cap=args.stream_cap,
        )
    except ValueError as exc:
        queue.close()
        raise InputError(f"worker: {exc}") from None

    received: list[int] = []  # the signals that reached the worker, in order

    async def main() -> None:
        _on_signals(worker, received)
        # Announced once before saying so, so that "started" is true: a queue
        # that refuses this worker (no privilege, not a queue) gives its one
        # error line instead.
        await asyncio.to_thread(queue.announce, worker.name, worker.fingerprints, worker.lease_seconds)
        _log_started(worker, args)
        if args.until_idle:
            await worker.run_until_idle()
        else:
            await worker.run()

    try:
        asyncio.run(main())
        left = _left_behind(queue, worker) if args.until_idle else {}
    finally:
        queue.close()
    for run_id, why in left.items():
        log.warning(
            "worker %s: run %r was left in the queue: %s", worker.name, run_id, why,
            extra={**dict.fromkeys(logs.FIELDS), "event": "left", "worker": worker.name, "run_id": run_id},
        )
    counts: dict[str, int] = {}
    for outcome in worker.outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    summary: dict[str, Any] = {"worker": worker.name, "runs": counts}
    if args.until_idle:
        summary["left"] = left
    print(json.dumps(summary))
    code = _exit_code(received, left)
    _exit_past_stuck_threads(worker, code)
    return code


def _log_started(worker: Worker, args: argparse.Namespace) -> None:
    """Say the worker is up before its first claim, which may be long in coming on a quiet queue."""
    logs.log_event(
        log, logging.INFO, "worker_started",
        "worker %s: started on %s, serving %s (up to %d runs at once, %g s leases)%s",
        worker.name, redacted(args.queue), ", ".join(sorted(worker.registry)), worker.max_runs,
        worker.lease_seconds, ", until the queue is idle" if args.until_idle else "", worker=worker.name,
    )


def _exit_code(received: list[int], left: Mapping[str, str]) -> int:
    """130 if a Ctrl-C stopped the worker, as for any command it interrupts; else 3 or 0.

    A SIGTERM is the ordinary way to stop a worker (a deploy, a scale-down),
    so a worker it stopped cleanly exits 0. A Ctrl-C is a person interrupting
    it, which shells and scripts expect to see as 128 + SIGINT.
    """
    if received[:1] == [signal.SIGINT]:
        return EXIT_INTERRUPTED
    return EXIT_LEFT if left else 0


def _on_signals(worker: Worker, received: list[int]) -> None:
    """SIGTERM / Ctrl-C: the first stops the worker, the second exits at once.

    The loop's own handler wakes it whichever thread received the signal
    (and calls ``worker.stop``); the Python-level handler, which runs in the
    main thread even while a step blocks the loop, records each signal in
    ``received``.
    """
    loop = asyncio.get_running_loop()

    def count(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        if len(received) == 1:
            # os.write: a signal handler must not take the locks print or logging take.
            os.write(2, b"ekit worker: stopping, giving the runs in flight back (again: exit at once)\n")
            return
        os.write(2, b"ekit worker: exiting at once; its runs are taken over when their leases expire\n")
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, worker.stop)
            signal.signal(sig, count)


def _exit_past_stuck_threads(worker: Worker, code: int) -> None:
    """Exit now, with ``code``, if a sync step still runs in a thread: its run was given back.

    Python cannot stop a thread, and the interpreter waits for the step pool's
    threads at exit: without this a stopped worker would linger until the step
    returned on its own, which may be never.
    """
    stuck = busy_sync_steps()
    if not stuck:
        return
    log.warning(
        "worker %s: %d sync step(s) still running in their threads, which Python cannot stop; "
        "their runs were given back, so exiting without waiting for them",
        worker.name,
        stuck,
    )
    logging.shutdown()
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _left_behind(queue: RunQueue, worker: Worker) -> dict[str, str]:
    """``run id -> why this worker did not take it``, for every run still waiting in the queue."""
    now = time.time()
    waiting = [*queue.runs("queued"), *queue.runs("running")]
    return {i.run_id: _why_left(i, worker, now) for i in waiting if i.status not in FINAL_STATUSES}


def _why_left(info: RunInfo, worker: Worker, now: float) -> str:
    name = info.workflow
    if name not in worker.registry:
        known = ", ".join(repr(k) for k in sorted(worker.registry))
        return f"{info.status}; its workflow {name!r} is not one this worker has (it has {known})"
    mine = worker.fingerprints[name]
    changeable = info.options.get("allow_graph_change", False)
    if info.fingerprint is not None and info.fingerprint != mine and not changeable:
        return (
            f"{info.status}; it was begun by another version of workflow {name!r} (graph "
            f"fingerprint {info.fingerprint[:12]}, this worker's is {mine[:12]}): only a worker "
            "with that version resumes it"
        )
    if info.status == "running" and info.lease_until is not None and info.lease_until > now:
        return (
            f"running; leased to {info.owner!r} (epoch {info.epoch}) for {info.lease_until - now:.1f} s "
            "more: a live worker, or a dead one whose lease has not expired yet"
        )
    return (
        f"{info.status}; claimable, but held back by the fleet's limits, or submitted after this "
        "worker went idle"
    )


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        # argparse shows an ArgumentTypeError's own words; a ValueError's would be lost.
        raise argparse.ArgumentTypeError(str(exc)) from None


_TIMES = ("created_at", "updated_at", "lease_until")
"""RunInfo's instants, printed for people as ISO 8601 UTC (``RunInfo`` keeps the numbers)."""


def _info(info: RunInfo) -> dict[str, Any]:
    data = {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}
    data["options"] = json.loads(json.dumps(dict(info.options)))
    data["cost"] = dataclasses.asdict(info.cost)
    for name in _TIMES:
        if data[name] is not None:
            data[name] = iso_utc(data[name])
    return data


def _cmd_queue(args: argparse.Namespace) -> int:
    queue = _open(args)
    if args.action == "watch":
        return _watch(queue, args)
    try:
        out = _queue_action(queue, args)
    except LookupError as exc:
        raise InputError(str(exc).strip("'\"")) from None
    except ValueError as exc:
        raise InputError(f"queue {args.action}: {exc}") from None
    finally:
        queue.close()
    if isinstance(out, _Table):
        print(out.text)
        return 0
    print(json.dumps(out, indent=2, ensure_ascii=True))
    return 0


def _watch(queue: RunQueue, args: argparse.Namespace) -> int:
    """``ekit queue watch``: the run's stream as it goes (see :mod:`ekit_runtime.cli.watch`)."""
    try:
        try:
            events = queue.stream(args.run_id, args.after)
        except LookupError as exc:
            raise InputError(str(exc).strip("'\"")) from None
        except ValueError as exc:
            raise InputError(f"queue watch: {exc}") from None
        try:
            return watch(events, sys.stdout, as_json=args.json)
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            return EXIT_INTERRUPTED
    finally:
        queue.close()


class _Table:
    """Text ``ekit queue list`` prints as it is (not JSON)."""

    def __init__(self, text: str) -> None:
        self.text = text


def age_text(seconds: float) -> str:
    """A short age: ``"5s"``, ``"3m"``, ``"2h"``, ``"4d"`` (whole units, rounded down; never negative)."""
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86_400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


_COLUMNS = ("RUN", "WORKFLOW", "STATUS", "STEPS", "CALLS", "TOKENS", "AGE", "OWNER", "REASON")


def runs_table(runs: list[RunInfo], now: float, parents: Mapping[str, str] | None = None) -> str:
    """The table ``ekit queue list`` prints: a header, then one line per run, columns aligned.

    ``parents`` (child run id -> its parent's): when a listed run is a child run, a PARENT
    column follows RUN (``-`` for the runs that are none).
    """
    parents = parents or {}
    rows = [list(_COLUMNS)]
    for r in runs:
        total = "?" if r.steps_total is None else str(r.steps_total)
        reason = r.reason or (f"error: {r.error}" if r.status == "failed" and r.error else "")
        rows.append([
            r.run_id, r.workflow,
            r.status + (" (cancel asked)" if r.cancel_requested and r.status == "running" else ""),
            f"{r.steps_done}/{total}", str(r.cost.llm_calls), str(r.cost.total_tokens),
            age_text(now - r.created_at), r.owner or "-", " ".join(reason.split())[:120] or "-",
        ])
    if parents:
        for row, run in zip(rows, [None, *runs], strict=True):
            row.insert(1, "PARENT" if run is None else parents.get(run.run_id, "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]
             for row in rows]
    if len(rows) == 1:
        lines.append("(no runs)")
    return "\n".join(line.rstrip() for line in lines)


_TOO_DEEP = "JSON nested too deeply to read"


def _loads(text: str, flag: str) -> Any:
    """``text`` read as JSON, else a ValueError naming ``flag`` (``json.loads`` raises
    RecursionError, no ValueError, for JSON nested past Python's recursion limit)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} is not JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{flag}: {_TOO_DEEP}") from None


def _submit_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--options JSON`` with each ``--option KEY=VALUE`` over it (VALUE read as JSON, else as text)."""
    options: dict[str, Any] = {}
    if args.options is not None:
        options = _loads(args.options, "--options")
        if not isinstance(options, dict):
            raise ValueError(f"--options must be a JSON object, got {type(options).__name__}")
    for item in args.option or ():
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--option {item}: expected KEY=VALUE, such as max_concurrency=2")
        try:
            options[key.strip()] = json.loads(text)
        except json.JSONDecodeError:
            options[key.strip()] = text
        except RecursionError:
            raise ValueError(f"--option {key.strip()}: {_TOO_DEEP}") from None
    return options or None


def _queue_action(queue: RunQueue, args: argparse.Namespace) -> Any:
    action = args.action
    if action == "submit":
        context = _loads(args.context, "--context") if args.context is not None else None
        options = _submit_options(args)
        return {
            "run_id": queue.submit(
                args.workflow, context, run_id=args.run_id, priority=args.priority, options=options
            )
        }
    if action == "status":
        info = queue.status(args.run_id)
        data = _info(info)
        parent, children = queue.family(args.run_id)
        if parent is not None:
            data["parent"] = parent
        if children:
            data["children"] = {step: child for child, step in children}
        if info.status == "waiting":  # what the person is asked, step by step
            data["questions"] = {k: q.to_dict() for k, q in queue.questions(args.run_id).items()}
        return data
    if action == "list":
        if args.last is not None and args.last < 0:
            raise ValueError(f"--last must be a whole number from 0, got {args.last}")
        # Filtered and cut in the database: a long queue costs the lines shown, not every run.
        runs = queue.runs_page(
            args.status, workflow=args.workflow, limit=args.last, newest_first=args.last is not None
        ).runs
        if args.last is not None:
            runs.reverse()  # the newest N, listed oldest first like the rest
        parents = queue.parents([r.run_id for r in runs])
        if args.json:
            return [{**_info(r), **({"parent": parents[r.run_id]} if r.run_id in parents else {})}
                    for r in runs]
        return _Table(runs_table(runs, time.time(), parents))
    if action == "cancel":
        return {"run_id": args.run_id, "cancelled": queue.cancel(args.run_id)}
    if action == "prune":
        return {"deleted": queue.prune(args.older_than)}
    if action == "checkpoint":
        checkpoint = queue.checkpoint(args.run_id)
        if checkpoint is None:
            raise ValueError(f"run {args.run_id!r} has no checkpoint yet")
        return checkpoint.to_dict()
    if action in _REOPENING:
        return _REOPENING[action](queue, args)
    fields = {
        k: getattr(args, k)
        for k in ("max_in_flight", "runs_per_minute", "llm_calls_per_minute", "tokens_per_minute")
        if getattr(args, k) is not None
    }
    if fields or args.resource:
        limits = queue.limits()
        if args.resource:
            fields["resources"] = _resource_caps(limits.resources, args.resource)
        queue.set_limits(dataclasses.replace(limits, **fields))
    return queue.limits().to_dict()


def _resource_cap(text: str) -> tuple[str, int | None]:
    """``--resource NAME=N`` as ``(NAME, N)``; ``NAME=none`` as ``(NAME, None)``: no cap."""
    name, sep, cap = text.rpartition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=N (such as openai=4) or NAME=none, got {text!r}")
    if cap.strip().lower() == "none":
        return name, None
    try:
        return name, int(cap)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"the cap of {name!r} must be a positive int or none, got {cap!r}"
        ) from None


def _resource_caps(stored: Mapping[str, int], given: list[tuple[str, int | None]]) -> dict[str, int]:
    """The stored caps with those given on the command line set (or, given ``none``, removed)."""
    caps = dict(stored)
    for name, cap in given:
        if cap is None:
            caps.pop(name, None)
        else:
            caps[name] = cap  # checked (naming the resource) by Limits
    return caps

def _retry(queue: RunQueue, args: argparse.Namespace) -> dict[str, Any]:
    info = queue.retry(args.run_id)
    return {"run_id": info.run_id, "status": info.status, "epoch": info.epoch}


def _rewind(queue: RunQueue, args: argparse.Namespace) -> dict[str, Any]:
    checkpoint = queue.rewind(args.run_id, args.steps)
    return {
        "run_id": args.run_id,
        "status": "queued",
        "kept": list(checkpoint.outputs),
        "runs_again": _to_run(checkpoint),
    }


def _fork(queue: RunQueue, args: argparse.Namespace) -> dict[str, Any]:
    given = args.options is not None or bool(args.option)  # (--options '{}': the copy has none)
    options = (_submit_options(args) or {}) if given else None
    new = queue.fork(
        args.run_id, args.steps, new_run_id=args.new_run_id, priority=args.priority, options=options
    )
    checkpoint = queue.checkpoint(new)
    return {
        "run_id": new,
        "forked_from": args.run_id,
        "status": "queued",
        "kept": [] if checkpoint is None else list(checkpoint.outputs),
        "runs_again": None if checkpoint is None else _to_run(checkpoint),
    }


def _to_run(checkpoint: Any) -> list[str]:
    """The declared steps a resume of ``checkpoint`` still runs (those with no output and no skip)."""
    graph = checkpoint.graph or {}
    return [n for n in graph if n not in checkpoint.outputs and n not in checkpoint.skipped]


def _answered(info: RunInfo, args: argparse.Namespace) -> dict[str, Any]:
    return {"run_id": info.run_id, "step": args.step, "status": info.status, "epoch": info.epoch,
            "by": args.by}


def _answer(queue: RunQueue, args: argparse.Namespace) -> dict[str, Any]:
    try:
        value = json.loads(args.value)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"VALUE_JSON is not JSON ({exc}): give a JSON value such as '\"blue\"', 3 or '{{\"n\": 1}}'"
        ) from None
    except RecursionError:
        raise ValueError(f"VALUE_JSON: {_TOO_DEEP}") from None
    return _answered(queue.answer(args.run_id, args.step, value, by=args.by), args)


def _approve(queue: RunQueue, args: argparse.Namespace) -> dict[str, Any]:
    return _answered(queue.approve(args.run_id, args.step, by=args.by), args)


def _deny(queue: RunQueue, args: argparse.Namespace) -> dict[str, Any]:
    return _answered(queue.deny(args.run_id, args.step, args.reason, by=args.by), args)


_REOPENING = {
    "retry": _retry, "rewind": _rewind, "fork": _fork, "answer": _answer, "approve": _approve, "deny": _deny
}


def add_parsers(sub: Any) -> None:
    """Add ``worker`` and ``queue`` to the ``ekit`` command's subparsers ``sub``."""
    p = sub.add_parser(
        "worker",
        help="drive runs from a queue",
        description="Claim runs from the queue and "
        "drive them, under a lease, until SIGTERM/Ctrl-C or (--until-idle) nothing is left.",
    )
    p.add_argument(
        "--queue", required=True, metavar="URL", help="sqlite:///PATH, a file path, or postgresql://..."
    )
    p.add_argument("--workflows", required=True, metavar="MODULE:ATTR", help="a dict of name -> Workflow")
    p.add_argument("--max-runs", type=int, default=4, help="runs driven at once (default 4)")
    p.add_argument("--lease", type=float, default=30.0, help="lease length in seconds (default 30)")
    p.add_argument("--heartbeat", type=float, default=None, help="renewal interval (default lease/3)")
    p.add_argument("--name", default=None, help="how this worker signs its claims (default host:pid)")
    p.add_argument("--until-idle", action="store_true", help="return once nothing is claimable")
    p.add_argument("--no-stream", action="store_true",
                   help="publish no run streams (ekit queue watch and the dashboard then show no tokens)")
    p.add_argument("--stream-cap", type=int, default=DEFAULT_CAP, metavar="N",
                   help=f"events each run's stream keeps, oldest dropped first (default {DEFAULT_CAP})")
    _add_run_settings(p)
    _add_log_options(p)
    p.set_defaults(func=_worker_printing_logs)
    _add_queue_parser(sub)


def _add_run_settings(p: argparse.ArgumentParser) -> None:
    """``ekit worker``'s settings for every run it drives (a run's own options override the first ones)."""
    g = p.add_argument_group(
        "every run this worker drives",
        "defaults for each run's options (a run submitted with its own, --option or submit(options=...), "
        "overrides them name by name), and what is code, which only a worker can give",
    )
    g.add_argument("--max-concurrency", type=int, metavar="N",
                   help="at most N steps of a run in flight at once (default: no limit)")
    g.add_argument("--budget-calls", type=int, metavar="N",
                   help="stop starting a run's steps once they reported N LLM calls; the run ends failed "
                   "with BudgetExceeded, its checkpoint kept")
    g.add_argument("--budget-input-tokens", type=int, metavar="N",
                   help="the same, once a run's steps reported N input tokens")
    g.add_argument("--budget-output-tokens", type=int, metavar="N",
                   help="the same, once a run's steps reported N output tokens")
    g.add_argument("--isolate-failures", action="store_true",
                   help="a failed step stops only the steps that depend on it; the rest run to completion "
                   "and the run ends failed naming the failed steps")
    g.add_argument("--no-durations", action="store_true",
                   help="do not record how long each step took, nor when it began (recorded by default: "
                   "the dashboard's durations and timeline); a run's own durations option overrides this")
    g.add_argument("--durations", action="store_true",
                   help="the default (kept so that scripts that pass it go on working)")
    g.add_argument("--executor", metavar="MODULE:ATTR",
                   help="an ekit Executor every run's steps run on, unless a step names its own")
    g.add_argument("--trace", metavar="otel|progress|MODULE:ATTR",
                   help="trace each run: otel (an OpenTelemetry span per run and per step attempt; needs "
                   "opentelemetry-api), progress (a ProgressPrinter per run, plain lines on stderr), or "
                   "MODULE:ATTR, a factory called with each run's Lease (run_id, workflow, ...) returning "
                   "its trace callback or list of them")


def _add_submit_options(a: argparse.ArgumentParser) -> None:
    """``ekit queue submit``'s ``--option`` and ``--options``: the run options stored with the run."""
    names = ", ".join(RUN_OPTIONS)
    a.add_argument(
        "--option", action="append", metavar="KEY=VALUE",
        help=f"a run option stored with the run and applied by the worker that drives it ({names}); "
        "VALUE is read as JSON (2, true, {\"llm_calls\": 10}) or else as text; repeat for several; "
        "over --options and the worker's defaults",
    )
    a.add_argument(
        "--options", metavar="JSON",
        help='the run options as one JSON object, such as \'{"max_concurrency": 2, "budget": '
        '{"llm_calls": 10}}\'; plain data only, unknown names refused before anything is stored',
    )


def _add_list_parser(actions: Any) -> None:
    """``ekit queue list``: a table, or ``--json``."""
    ls = actions.add_parser(
        "list", help="runs as a table (--json for machines)",
        description="One line per run: id, workflow, status, steps done/total, LLM calls and tokens "
        "reported, age since submitted (5s, 3m, 2h, 4d), owner (the worker that last claimed it), "
        "and why it waits (or a failed run's error).",
    )
    ls.add_argument("--status", choices=STATUSES, help="only the runs in this status (default: every run)")
    ls.add_argument("--workflow", metavar="W", help="only the runs of workflow W")
    ls.add_argument("--last", metavar="N", type=int, help="only the N runs submitted last")
    ls.add_argument("--json", action="store_true", help="a JSON list of the runs' records instead of a table")


def _add_watch_parser(actions: Any) -> None:
    """``ekit queue watch RUN [--after N] [--json]``: a run's stream as it goes."""
    w = actions.add_parser(
        "watch", help="follow a run's stream: its steps' tokens as they arrive, its events as lines",
        description="Print a run's stream as its worker publishes it: partial output (text) as it "
        "arrives, every other event as a line '#OFFSET kind step ...'; ends when the run ends (exit 0 "
        "finished, 1 failed or cancelled, 2 no such run or a bad --after, 130 on Ctrl-C).",
    )
    w.add_argument("run_id", metavar="RUN", help="the run's id")
    w.add_argument("--after", type=int, default=0, metavar="N",
                   help="start after offset N (the last one printed, to resume; default 0: from the start)")
    w.add_argument("--json", action="store_true", help="one JSON object per event and line, offsets included")


def _add_queue_parser(sub: Any) -> None:
    q = sub.add_parser("queue", help="submit to and inspect a run queue")
    q.add_argument(
        "--queue", required=True, metavar="URL", help="sqlite:///PATH, a file path, or postgresql://..."
    )
    actions = q.add_subparsers(dest="action", metavar="ACTION", parser_class=type(q))
    actions.required = True
    a = actions.add_parser("submit", help="queue a run")
    a.add_argument("workflow", help="the workflow's name, as the workers' --workflows dict names it")
    a.add_argument(
        "--context", metavar="JSON",
        help='the run\'s initial context, a JSON object such as \'{"topic": "owls"}\' (default: empty); '
        "stored with the run, so plain data only",
    )
    a.add_argument(
        "--run-id", metavar="ID",
        help="the run's id (default: a new random one); an id the queue already has changes "
        "nothing and prints that id, so a retried submit never queues a run twice",
    )
    a.add_argument(
        "--priority", type=int, default=0, metavar="N",
        help="workers claim runs of higher N first, then the oldest (default 0; may be negative)",
    )
    _add_submit_options(a)
    for name, helptext in (
        ("status", "a run's record"),
        ("cancel", "ask a run to stop"),
        ("checkpoint", "a run's latest checkpoint as JSON (or: ekit audit QUEUE --run-id RUN)"),
    ):
        actions.add_parser(name, help=helptext).add_argument("run_id", metavar="RUN", help="the run's id")
    _add_list_parser(actions)
    _add_watch_parser(actions)
    actions.add_parser("prune", help="delete ended runs").add_argument(
        "--older-than", type=_duration, required=True, metavar="AGE",
        help="delete the finished, failed and cancelled runs not updated for AGE: seconds (90) or "
        "a duration such as 90s, 15m, 2h, 1d, 1w or 1h30m; queued and running runs are never deleted",
    )
    _add_reopening_parsers(actions)
    _add_answering_parsers(actions)
    lim = actions.add_parser("limits", help="show or set the fleet's limits")
    for field, helptext in (
        ("max-in-flight", "runs holding a live lease at once, across every worker"),
        ("runs-per-minute", "leases granted per minute"),
        ("llm-calls-per-minute", "LLM calls the fleet's steps report per trailing minute"),
        ("tokens-per-minute", "input plus output tokens the fleet's steps report per trailing minute"),
    ):
        lim.add_argument(f"--{field}", type=int, metavar="N", help=f"at most N {helptext}")
    lim.add_argument(
        "--resource", type=_resource_cap, action="append", default=[], metavar="NAME=N",
        help="at most N attempts of the steps tagged resource=NAME hold a slot at once, across every "
        "worker (NAME=none removes the cap; repeat for several resources)",
    )
    q.set_defaults(func=_cmd_queue)


def _add_reopening_parsers(actions: Any) -> None:
    """``retry``, ``rewind`` and ``fork``: a person reopens a run, or copies it."""
    a = actions.add_parser(
        "retry", help="queue a failed or cancelled run again, from its last checkpoint",
        description="Queue a failed or cancelled run again: it resumes from its last checkpoint "
        "(finished steps are not run again; attempt numbers carry on), its error and cancel flag "
        "cleared. A queued, running or finished run is refused.",
    )
    a.add_argument("run_id", metavar="RUN", help="the run's id")
    a = actions.add_parser(
        "rewind", help="run steps of a run again, and everything downstream of them, in place",
        description="Drop the outputs of STEP... and of every step downstream of them from the run's "
        "checkpoint (on the graph it records, as 'ekit rewind' does) and queue the run again: the next "
        "worker runs exactly those steps. Any run no live lease holds is rewound; a running run is "
        "refused (cancel it first).",
    )
    a.add_argument("run_id", metavar="RUN", help="the run's id")
    a.add_argument("steps", nargs="+", metavar="STEP", help="a step to run again, or an item (step[key])")
    a = actions.add_parser(
        "fork", help="queue a copy of a run under a new id, rewound at steps",
        description="Queue a new run with the workflow, context and priority of RUN and its latest "
        "checkpoint, without the outputs of STEP... and of everything downstream (no STEP: all of it). "
        "RUN itself is only read.",
    )
    a.add_argument("run_id", metavar="RUN", help="the run to copy")
    a.add_argument(
        "steps", nargs="*", metavar="STEP", help="a step the copy runs again, or an item (step[key])"
    )
    a.add_argument(
        "--run-id", dest="new_run_id", metavar="NEW",
        help="the new run's id (default: a new random one); an id the queue already has is refused",
    )
    a.add_argument(
        "--priority", type=int, default=None, metavar="N", help="the new run's priority (default: RUN's)"
    )
    a.add_argument(
        "--option", action="append", metavar="KEY=VALUE",
        help="a run option of the copy (VALUE read as JSON, else as text), over --options; "
        "given any, the copy has these instead of RUN's",
    )
    a.add_argument(
        "--options", metavar="JSON",
        help="the copy's run options as one JSON object instead of RUN's ('{}': none, such as a "
        "copy of a run with only that runs the rest)",
    )


def _add_answering_parsers(actions: Any) -> None:
    """``answer``, ``approve`` and ``deny``: a person answers the question a waiting run's step asked."""
    after = (
        "The answer is recorded in the run's checkpoint (with --by and the time) and the run is queued "
        "again: the next worker to claim it resumes it. Refused unless the run is waiting and STEP has a "
        "question pending (see 'ekit queue status RUN'); of two answers given at once, one wins."
    )
    a = actions.add_parser(
        "answer", help="answer the question a waiting run's step asked, with a JSON value",
        description=f"Answer the value question STEP of the waiting run RUN asked. {after}",
    )
    a.add_argument("run_id", metavar="RUN", help="the run's id")
    a.add_argument("step", metavar="STEP", help="the step (or item, step[key]) that asked")
    a.add_argument("value", metavar="VALUE_JSON", help='the answer, as JSON: \'"blue"\', 3, \'{"n": 1}\'')
    a.add_argument("--by", metavar="NAME", help="who answers (recorded; audit shows it)")
    a = actions.add_parser(
        "approve", help="approve what a waiting run's step asked approval for",
        description=f"Approve the approval STEP of the waiting run RUN asked for. {after}",
    )
    a.add_argument("run_id", metavar="RUN", help="the run's id")
    a.add_argument("step", metavar="STEP", help="the step (or item, step[key]) that asked")
    a.add_argument("--by", metavar="NAME", help="who approves (recorded; audit shows it)")
    a = actions.add_parser(
        "deny", help="deny what a waiting run's step asked approval for: the run ends failed",
        description=f"Deny the approval STEP of the waiting run RUN asked for: the next worker ends "
        f"the run failed (ApprovalDenied), and the step never runs. {after}",
    )
    a.add_argument("run_id", metavar="RUN", help="the run's id")
    a.add_argument("step", metavar="STEP", help="the step (or item, step[key]) that asked")
    a.add_argument("--reason", default="", help="why (recorded, and in the run's error)")
    a.add_argument("--by", metavar="NAME", help="who denies (recorded; audit shows it)")
