"""``ekit ui``: start the dashboard over a queue (``--queue URL``) or one store file."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    """Add ``ui`` to the ``ekit`` command's subparsers ``sub``."""
    p = sub.add_parser(
        "ui", help="a local web dashboard of a run queue or a store file",
        description="Serve a read-only (unless --allow-actions) web dashboard: the runs of --queue, "
        "or the checkpoint of STORE_FILE (a checkpoint JSON, JSON lines or a JournalStore journal). "
        "Prints the URL on the first line.",
    )
    p.add_argument("source", nargs="?", metavar="STORE_FILE",
                   help="a store file to show (instead of --queue)")
    p.add_argument("--queue", metavar="URL", help="sqlite:///PATH, a file path, or postgresql://...")
    p.add_argument("--workflow", metavar="MODULE:ATTR",
                   help="with STORE_FILE: audit against this workflow (default: the recorded graph), "
                   "and show which recorded steps changed since (version, code)")
    p.add_argument("--workflows", metavar="MODULE:ATTR",
                   help="with --queue: the workflows its workers serve (as ekit worker --workflows): "
                   "a run of one of them is audited against it and shows which recorded steps "
                   "changed since (version, code)")
    p.add_argument("--run-id", metavar="RUN",
                   help="with a STORE_FILE that is a database (a SqliteStore file): the run to show")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port (default 0: any free port)")
    p.add_argument("--allow-actions", action="store_true",
                   help="offer cancel, retry, answer, approve and deny (queue only; token and CSRF checked)")
    p.set_defaults(func=_cmd_ui)


def _cmd_ui(args: argparse.Namespace) -> int:
    from ekit_runtime.cli.common import InputError, import_graph, import_workflow
    from ekit_runtime.redaction import redacted
    from ekit_runtime.sources import SourceError, read_checkpoints
    from ekit_runtime.ui.server import make_server, serve
    from ekit_runtime.ui.sources import FileSource, QueueSource, Source

    if (args.queue is None) == (args.source is None):
        raise InputError("ui: give --queue URL or a STORE_FILE (one of them)")
    source: Source
    if args.queue is not None:
        if args.workflow is not None or args.run_id is not None:
            raise InputError("ui: --workflow and --run-id go with a STORE_FILE, not --queue "
                             "(a queue's: --workflows)")
        from ekit_runtime.queue import open_queue

        try:
            queue = open_queue(args.queue)
        except ValueError as exc:
            raise InputError(f"ui: {exc}") from None
        registry = None
        if args.workflows is not None:
            from ekit_runtime.cli.queue import _registry

            registry = _registry(args.workflows)
        source = QueueSource(queue, redacted(args.queue), registry)
    else:
        if args.workflows is not None:
            raise InputError("ui: --workflows goes with --queue (a STORE_FILE's: --workflow)")
        try:
            recorded = read_checkpoints(args.source, run_id=args.run_id)
        except SourceError as exc:
            raise InputError(str(exc)) from None
        graph, versions, workflow = (None, None, None)
        if args.workflow:  # (a dict of workflows: the one whose graph the file records)
            graph, versions = import_graph(args.workflow, recorded.checkpoints)
            workflow = import_workflow(args.workflow, recorded.checkpoints)
        source = FileSource(args.source, graph, versions, run_id=args.run_id, workflow=workflow)
    try:
        server = make_server(source, args.host, args.port, allow_actions=args.allow_actions)
    except OSError as exc:
        raise InputError(f"ui: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    except ValueError as exc:  # a port out of range: the user's to fix, not an internal error
        raise InputError(f"ui: {exc}") from None
    serve(server)  # until Ctrl-C, which ekit's main turns into exit 130
    return 0
