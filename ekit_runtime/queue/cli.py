"""``ekit worker`` and ``ekit queue``: drain a run queue, and submit to and inspect it.

- ``ekit worker --queue URL --workflows MODULE:ATTR [--max-runs N] [--lease S]
  [--heartbeat S] [--until-idle]`` drives runs until SIGTERM or Ctrl-C (then
  it cancels the runs in flight, each saving a final checkpoint, and gives
  them back to the queue) or, with ``--until-idle``, until nothing is left.
- ``ekit queue --queue URL submit WORKFLOW [--context JSON] [--run-id ID]
  [--priority N]``, ``status RUN``, ``list [--status S]``, ``cancel RUN``,
  ``prune --older-than SECONDS``, ``checkpoint RUN`` (the checkpoint as JSON;
  ``ekit audit QUEUE --run-id RUN`` reads it in place), ``limits [--max-in-flight N] [--runs-per-minute N]
  [--llm-calls-per-minute N] [--tokens-per-minute N]``.

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
from collections.abc import Mapping
from typing import Any

from ekit_runtime.queue import RunQueue, Worker, open_queue
from ekit_runtime.workflow import Workflow

__all__ = ["add_parsers"]


def _input_error(message: str) -> Exception:
    from ekit_runtime.cli import InputError  # the ekit command's own; imported late to avoid a cycle

    return InputError(message)


def _registry(spec: str) -> Mapping[str, Workflow]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise _input_error(f"--workflows {spec}: expected MODULE:ATTR naming a dict of name -> Workflow")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (Exception, SystemExit) as exc:
        raise _input_error(f"--workflows {spec}: cannot import it ({type(exc).__name__}: {exc})") from None
    if isinstance(obj, Workflow):
        return {attr.rsplit(".", 1)[-1]: obj}
    if not isinstance(obj, Mapping) or not all(isinstance(w, Workflow) for w in obj.values()):
        raise _input_error(f"--workflows {spec}: not a Workflow nor a dict of name -> Workflow")
    return obj


def _open(args: argparse.Namespace) -> RunQueue:
    try:
        return open_queue(args.queue)
    except ValueError as exc:
        raise _input_error(f"--queue {args.queue}: {exc}") from None


def _cmd_worker(args: argparse.Namespace) -> int:
    registry = _registry(args.workflows)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    queue = _open(args)
    try:
        worker = Worker(
            queue,
            registry,
            max_runs=args.max_runs,
            lease_seconds=args.lease,
            heartbeat=args.heartbeat,
            name=args.name,
        )
    except ValueError as exc:
        raise _input_error(f"worker: {exc}") from None

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, worker.stop)
        if args.until_idle:
            await worker.run_until_idle()
        else:
            await worker.run()

    try:
        asyncio.run(main())
    finally:
        queue.close()
    counts: dict[str, int] = {}
    for outcome in worker.outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    print(json.dumps({"worker": worker.name, "runs": counts}))
    return 0


def _info(info: Any) -> dict[str, Any]:
    return dataclasses.asdict(info)


def _cmd_queue(args: argparse.Namespace) -> int:
    queue = _open(args)
    try:
        out = _queue_action(queue, args)
    except LookupError as exc:
        raise _input_error(str(exc).strip("'\"")) from None
    except ValueError as exc:
        raise _input_error(f"queue {args.action}: {exc}") from None
    finally:
        queue.close()
    print(json.dumps(out, indent=2, ensure_ascii=True))
    return 0


def _queue_action(queue: RunQueue, args: argparse.Namespace) -> Any:
    action = args.action
    if action == "submit":
        try:
            context = json.loads(args.context) if args.context is not None else None
        except json.JSONDecodeError as exc:
            raise ValueError(f"--context is not JSON: {exc}") from None
        return {"run_id": queue.submit(args.workflow, context, run_id=args.run_id, priority=args.priority)}
    if action == "status":
        return _info(queue.status(args.run_id))
    if action == "list":
        return [_info(r) for r in queue.runs(args.status)]
    if action == "cancel":
        return {"run_id": args.run_id, "cancelled": queue.cancel(args.run_id)}
    if action == "prune":
        return {"deleted": queue.prune(args.older_than)}
    if action == "checkpoint":
        checkpoint = queue.checkpoint(args.run_id)
        if checkpoint is None:
            raise ValueError(f"run {args.run_id!r} has no checkpoint yet")
        return checkpoint.to_dict()
    fields = {
        k: getattr(args, k)
        for k in ("max_in_flight", "runs_per_minute", "llm_calls_per_minute", "tokens_per_minute")
        if getattr(args, k) is not None
    }
    if fields:
        queue.set_limits(dataclasses.replace(queue.limits(), **fields))
    return queue.limits().to_dict()


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
    p.set_defaults(func=_cmd_worker)

    q = sub.add_parser("queue", help="submit to and inspect a run queue")
    q.add_argument("--queue", required=True, metavar="URL")
    actions = q.add_subparsers(dest="action", metavar="ACTION", parser_class=type(q))
    actions.required = True
    a = actions.add_parser("submit", help="queue a run")
    a.add_argument("workflow")
    a.add_argument("--context", metavar="JSON")
    a.add_argument("--run-id")
    a.add_argument("--priority", type=int, default=0)
    for name, helptext in (
        ("status", "a run's record"),
        ("cancel", "ask a run to stop"),
        ("checkpoint", "a run's latest checkpoint as JSON (or: ekit audit QUEUE --run-id RUN)"),
    ):
        actions.add_parser(name, help=helptext).add_argument("run_id")
    actions.add_parser("list", help="runs, by status").add_argument("--status")
    actions.add_parser("prune", help="delete ended runs").add_argument(
        "--older-than", type=float, required=True
    )
    lim = actions.add_parser("limits", help="show or set the fleet's limits")
    for field in ("max-in-flight", "runs-per-minute", "llm-calls-per-minute", "tokens-per-minute"):
        lim.add_argument(f"--{field}", type=int)
    q.set_defaults(func=_cmd_queue)
