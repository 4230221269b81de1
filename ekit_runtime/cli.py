"""The ``ekit`` command line: audit and replay recorded checkpoints, print graphs.

This module owns the command line's contract: its subcommands, the files it
reads, and its exit codes. The decisions themselves are the pure
:func:`ekit_core.audit` and :func:`ekit_core.replay`; this is the shell that
reads files, imports workflows and prints.

- ``ekit audit CHECKPOINT.json [--workflow MODULE:ATTR | --graph GRAPH.json]
  [--budget IN/OUT/CALLS] [--json]``
- ``ekit replay CHECKPOINTS.jsonl [--workflow MODULE:ATTR | --graph GRAPH.json] [--json]``
- ``ekit graph (--workflow MODULE:ATTR | --checkpoint CHECKPOINT.json)``
- ``ekit demo [ARGS...]`` runs :mod:`ekit_runtime.demo`, when installed.

Exit codes: ``0`` clean, ``1`` anomalies or violations found, ``2`` bad usage
or unreadable input. An input problem (a missing file, invalid JSON, a
malformed checkpoint or graph, a workflow that cannot be imported) prints one
line naming the file and the problem to stderr, never a traceback; so does
a ``--workflow`` module that raises anything at all (a ``BaseException``
such as ``GeneratorExit`` included) or calls ``sys.exit()`` while it is
imported, read or asked for its graph. A file name of ``-`` reads standard
input. An unexpected error is a bug: it prints one ``ekit: internal
error: ...`` line and exits ``2`` too, so that it can never be taken for
``1``. Ctrl-C (``KeyboardInterrupt``, also while a workflow
module is being imported) exits ``130``; a closed standard output (``| head``)
``141``, quietly.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TextIO

from ekit_core import GraphSpec, TokenUsage, WorkflowCheckpoint, audit, replay
from ekit_core.audit import graph_of, recorded_graph
from ekit_runtime.queue import cli as queue_cli

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_CLEAN",
    "EXIT_FOUND",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "InputError",
    "main",
]

EXIT_CLEAN = 0
"""Nothing to report."""
EXIT_FOUND = 1
"""The audit found anomalies, or the replay found violations."""
EXIT_USAGE = 2
"""Bad usage or unreadable input (and, with ``ekit: internal error``, a bug)."""
EXIT_INTERRUPTED = 130
"""Interrupted by Ctrl-C (128 + SIGINT, as shells report it)."""
EXIT_BROKEN_PIPE = 141
"""Standard output was closed by its reader (128 + SIGPIPE, as shells report it)."""


class InputError(Exception):
    """An input the command cannot use; its message is the one line printed to stderr."""


class _Parser(argparse.ArgumentParser):
    # argparse exits by itself on bad usage; raising instead lets ``main``
    # return the exit code, so that it can be called from tests and scripts.
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        raise InputError(f"{self.prog.removeprefix('ekit').strip() or 'usage'}: {message}")


def _read_text(path: str) -> str:
    if path == "-":
        return _read_stdin()
    try:
        # newline="": JSONL lines are split on "\n" alone (see
        # _load_checkpoints), so a "\r" must not be turned into a line break.
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, not a file") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _read_stdin() -> str:
    # Decode the bytes ourselves: the files are UTF-8 whatever the locale says,
    # and a decoding error must be an input error, not a traceback.
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:  # replaced by a text-only stream (a test, an embedding)
        return sys.stdin.read()
    try:
        return bytes(stream.read()).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"-: not UTF-8 text ({exc.reason})") from None


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{where}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise InputError(f"{where}: invalid JSON: nested too deeply") from None
    except ValueError as exc:
        # Not a syntax error but a value json refuses to build, such as an int
        # longer than sys.get_int_max_str_digits() digits.
        raise InputError(f"{where}: unreadable JSON: {exc}") from None


def _checkpoint(data: Any, where: str) -> WorkflowCheckpoint:
    try:
        return WorkflowCheckpoint.from_dict(data)
    except ValueError as exc:
        raise InputError(f"{where}: {exc}") from None


def _load_checkpoint(path: str) -> WorkflowCheckpoint:
    return _checkpoint(_parse_json(_read_text(path), path), path)


def _load_checkpoints(path: str) -> list[WorkflowCheckpoint]:
    text = _read_text(path)
    checkpoints = []
    # Split on "\n" only: str.splitlines() also breaks at U+2028, U+2029 and
    # \x85, which JSON allows raw inside strings (the stores write
    # ensure_ascii=False), and would cut such a checkpoint in two.
    for number, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        where = f"{path} line {number}"
        checkpoints.append(_checkpoint(_parse_json(line, where), where))
    if not checkpoints:
        raise InputError(f"{path}: holds no checkpoint (expected one JSON object per line)")
    return checkpoints


def _load_graph(path: str) -> GraphSpec:
    data = _parse_json(_read_text(path), path)
    try:
        if isinstance(data, dict) and isinstance(data.get("steps"), list):
            graph = GraphSpec.from_dict(data)
            recorded = data.get("fingerprint")
            if recorded is not None and recorded != graph.fingerprint:
                raise InputError(
                    f"{path}: recorded fingerprint {recorded} does not match its steps "
                    f"({graph.fingerprint})"
                )
            return graph
        if isinstance(data, dict) and all(isinstance(v, list) for v in data.values()):
            # The ``graph`` table a checkpoint records: step -> dependencies.
            return GraphSpec.of(data)
    except ValueError as exc:
        raise InputError(f"{path}: {exc}") from None
    raise InputError(
        f"{path}: not a graph (expected the output of 'ekit graph': "
        '{"steps": [{"name": ..., "depends_on": [...]}, ...]})'
    )


def _import_graph(spec: str) -> GraphSpec:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InputError(f"--workflow {spec}: expected MODULE:ATTR, e.g. myflows:workflow")
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    # The workflow's module is arbitrary code: besides raising, it may call
    # sys.exit() while being imported, which would otherwise end the command
    # with that code and no output, reading as a clean audit, or raise a
    # BaseException of its own (GeneratorExit, a custom subclass), which would
    # otherwise end it with a traceback and exit 1, reading as "anomalies
    # found". Only Ctrl-C is let through, to exit 130 as everywhere else.
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise InputError(f"--workflow {spec}: no module named {exc.name!r}") from None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        raise InputError(
            f"--workflow {spec}: importing {module_name!r} {_raised(exc)}"
        ) from None
    finally:
        if added:
            # The module may have edited sys.path itself.
            with contextlib.suppress(ValueError):
                sys.path.remove(cwd)
    return _graph_in(module, spec, module_name, attr)


def _graph_in(module: object, spec: str, module_name: str, attr: str) -> GraphSpec:
    """The graph of attribute ``attr`` (dotted) of ``module``; any failure is an InputError."""
    # Attribute reads run code too (properties, module __getattr__).
    obj: object = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise InputError(f"--workflow {spec}: {module_name!r} has no attribute {attr!r}") from None
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            raise InputError(f"--workflow {spec}: reading {attr!r} {_raised(exc)}") from None
    try:
        return graph_of(obj)
    except ValueError as exc:
        raise InputError(f"--workflow {spec}: {attr!r}: {_text_of(exc)}") from None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        raise InputError(f"--workflow {spec}: reading {attr}.graph {_raised(exc)}") from None


def _raised(exc: BaseException) -> str:
    """What ``exc`` says, as the end of a one-line message: ``raised KeyError: 'x'``."""
    if isinstance(exc, SystemExit):
        return f"called sys.exit({_text_of(exc.code, repr)})"
    text = _text_of(exc)
    name = type(exc).__name__
    return f"raised {_one_line(f'{name}: {text}' if text else name)}"


def _text_of(value: object, show: Callable[[object], str] = str) -> str:
    # An exception from arbitrary code may have a __str__ (or an exit code a
    # __repr__) that raises in turn; the one-line message must still come out.
    try:
        return show(value)
    except Exception:
        return f"<{type(value).__name__} whose {show.__name__}() raised>"


def _one_line(text: str) -> str:
    # Error messages go to stderr as exactly one line, whatever the exception
    # or file name held.
    return " ".join(text.splitlines())


def _budget(text: str) -> TokenUsage:
    """``--budget IN/OUT/CALLS``: input tokens, output tokens, LLM calls, as the audit prints usage."""
    parts = text.split("/")
    if len(parts) != 3 or not all(p.isascii() and p.isdigit() for p in parts):
        # argparse turns this into "argument --budget: ..." on one line, exit 2.
        raise argparse.ArgumentTypeError(
            f"expected IN/OUT/CALLS, three non-negative integers such as 10000/2000/0 "
            f"(0 = no limit), got {text!r}"
        )
    return TokenUsage(*(int(p) for p in parts))


def _graph_option(args: argparse.Namespace) -> GraphSpec | None:
    if args.workflow is not None:
        return _import_graph(args.workflow)
    if args.graph is not None:
        return _load_graph(args.graph)
    return None


def _print_json(data: object, out: TextIO) -> None:
    # ensure_ascii (the default) keeps the output encodable whatever the
    # stream's encoding, lone surrogates included.
    json.dump(data, out, indent=2, sort_keys=False)
    out.write("\n")


def _print_text(text: str, out: TextIO) -> None:
    """Write ``text`` and a newline, escaping what ``out``'s encoding cannot hold.

    Step names and file names come from the input: a lone surrogate
    (``"\\ud800"`` in the JSON, or a file name that is not UTF-8) or a name
    outside a non-UTF-8 locale's charset would make a plain ``print`` raise
    ``UnicodeEncodeError``. Escaping it as ``\\ud800`` keeps the report whole.
    """
    encoding = getattr(out, "encoding", None) or "utf-8"
    text += "\n"
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        text = text.encode(encoding, "backslashreplace").decode(encoding)
    except LookupError:  # an encoding name codecs does not know: leave it to the stream
        pass
    out.write(text)


def _cmd_audit(args: argparse.Namespace) -> int:
    checkpoint = _load_checkpoint(args.checkpoint)
    graph = _graph_option(args)
    if graph is None and checkpoint.graph is None:
        raise InputError(
            f"{args.checkpoint}: the checkpoint records no graph; pass --workflow or --graph"
        )
    try:
        report = audit(graph, checkpoint, budget=args.budget)
    except ValueError as exc:
        raise InputError(f"{args.checkpoint}: {exc}") from None
    if args.json:
        _print_json({"checkpoint": args.checkpoint, **report.to_dict()}, sys.stdout)
    else:
        _print_text(f"audit of {args.checkpoint}\n{report.format()}", sys.stdout)
    return EXIT_CLEAN if report.clean else EXIT_FOUND


def _cmd_replay(args: argparse.Namespace) -> int:
    checkpoints = _load_checkpoints(args.checkpoints)
    graph = _graph_option(args)
    if graph is None and all(cp.graph is None for cp in checkpoints):
        raise InputError(
            f"{args.checkpoints}: no checkpoint records a graph; pass --workflow or --graph"
        )
    try:
        report = replay(graph, checkpoints)
    except ValueError as exc:
        raise InputError(f"{args.checkpoints}: {exc}") from None
    if args.json:
        _print_json({"checkpoints_file": args.checkpoints, **report.to_dict()}, sys.stdout)
    else:
        _print_text(f"replay of {args.checkpoints}\n{report.format()}", sys.stdout)
    return EXIT_CLEAN if report.ok else EXIT_FOUND


def _cmd_graph(args: argparse.Namespace) -> int:
    if args.workflow is not None:
        graph = _import_graph(args.workflow)
    else:
        checkpoint = _load_checkpoint(args.checkpoint)
        # recorded_graph's own message advises giving the workflow's graph,
        # which is beside the point for this command.
        if checkpoint.graph is None:
            raise InputError(f"{args.checkpoint}: the checkpoint records no graph")
        try:
            graph = recorded_graph(checkpoint)
        except ValueError as exc:
            raise InputError(f"{args.checkpoint}: recorded graph: {exc}") from None
    _print_json(graph.to_dict(), sys.stdout)
    return EXIT_CLEAN


def _cmd_demo(args: argparse.Namespace) -> int:
    try:
        demo = importlib.import_module("ekit_runtime.demo")
    except ModuleNotFoundError as exc:
        if exc.name != "ekit_runtime.demo":
            raise
        raise InputError("demo: this installation has no ekit_runtime.demo module") from None
    code: int = demo.main(list(args.args))
    return code


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ekit",
        description="Audit and replay recorded ekit checkpoints.",
        epilog="Exit codes: 0 clean, 1 anomalies or violations found, "
        "2 bad usage or unreadable input.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def graph_options(p: argparse.ArgumentParser) -> None:
        group = p.add_mutually_exclusive_group()
        group.add_argument(
            "--workflow", metavar="MODULE:ATTR",
            help="import the workflow (or GraphSpec) ATTR of MODULE (current dir on sys.path)",
        )
        group.add_argument(
            "--graph", metavar="GRAPH.json", help="a graph written by 'ekit graph'"
        )
        p.add_argument("--json", action="store_true", help="print JSON for machines")

    p = sub.add_parser(
        "audit", help="what a resume from a checkpoint would skip and run, and why",
        description="Explain, step by step, what resuming CHECKPOINT would skip and run. "
        "Without --workflow or --graph, audit against the graph the checkpoint records.",
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT.json")
    graph_options(p)
    p.add_argument(
        "--budget", metavar="IN/OUT/CALLS", type=_budget,
        help="the budget a resume would be given (0 = no limit): report a checkpoint "
        "whose usage already reaches it",
    )
    p.set_defaults(func=_cmd_audit)

    p = sub.add_parser(
        "replay", help="check a recorded sequence of checkpoints is a legal execution",
        description="Check that the checkpoints (one JSON object per line, in the order "
        "recorded) are a legal execution of the graph; print the timeline and violations.",
    )
    p.add_argument("checkpoints", metavar="CHECKPOINTS.jsonl")
    graph_options(p)
    p.set_defaults(func=_cmd_replay)

    p = sub.add_parser(
        "graph", help="print a workflow's graph as JSON",
        description="Print the graph as JSON, so audits can run without the workflow's code.",
    )
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--workflow", metavar="MODULE:ATTR")
    group.add_argument("--checkpoint", metavar="CHECKPOINT.json", help="the graph it records")
    p.set_defaults(func=_cmd_graph)

    p = sub.add_parser("demo", help="run the demo (arguments go to it)", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_demo)
    queue_cli.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ekit`` command with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["demo"]:
            # Everything after ``demo`` belongs to the demo, options included,
            # which argparse's REMAINDER does not reliably pass through.
            return _cmd_demo(argparse.Namespace(args=argv[1:]))
        args = _parser().parse_args(argv)
        code: int = args.func(args)
        # Flush here so that a write error surfaces below, not at interpreter exit.
        sys.stdout.flush()
        return code
    except InputError as exc:
        _error(str(exc))
        return EXIT_USAGE
    except SystemExit as exc:
        # ``--help`` exits through argparse; keep its code.
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except KeyboardInterrupt:
        _error("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (``ekit replay run.jsonl | head``): stop quietly.
        # Point stdout at devnull so the interpreter's final flush does not
        # raise again and print "Exception ignored".
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, sys.stdout.fileno())
            finally:
                os.close(devnull)
        return EXIT_BROKEN_PIPE
    except BaseException as exc:
        # A bug (ours or an unforeseen input), or a BaseException such as
        # GeneratorExit from code we called: it must not exit 1, which would
        # read as "anomalies found", nor print a traceback.
        _error(f"internal error: {_one_line(f'{type(exc).__name__}: {_text_of(exc)}')}")
        return EXIT_USAGE


def _error(message: str) -> None:
    # stderr escapes what its encoding cannot hold ("backslashreplace"), but
    # it may have been replaced (tests, embedding), so escape here as well.
    _print_text(f"ekit: {_one_line(message)}", sys.stderr)
