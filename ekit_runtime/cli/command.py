"""The ``ekit`` command line: inspect and repair recorded runs, print graphs, drive a run queue.

This module owns the command line's contract: its subcommands, the inputs
it reads, and its exit codes. The decisions themselves are the pure
:func:`ekit_core.audit`, :func:`ekit_core.replay` and
:func:`ekit_core.rewind`; this is the shell that reads inputs (through
:mod:`ekit_runtime.sources`), imports workflows and prints.

- ``ekit audit SOURCE [--run-id RUN] [--workflow MODULE:ATTR | --graph GRAPH.json]
  [--budget IN/OUT/CALLS] [--json]``: what a resume from the latest
  checkpoint would skip and run, and why.
- ``ekit replay SOURCE [--run-id RUN] [--workflow ... | --graph ...] [--json]``:
  whether the recorded checkpoints are a legal execution, and their timeline.
- ``ekit rewind SOURCE --step NAME [--step NAME ...] (--workflow ... | --graph ...
  | --graph-from-checkpoint) [-o OUT [--output-run-id RUN]]``: the latest
  checkpoint without the outputs of those steps (or items, ``step[key]``) and
  everything downstream, as JSON; ``-o`` writes it through the store that owns ``OUT``
  (:mod:`ekit_runtime.targets`), or refuses.
- ``ekit graph (--workflow MODULE:ATTR | --checkpoint SOURCE) [--format json|mermaid|dot]``.
- ``ekit demo [ARGS...]`` runs :mod:`ekit_runtime.demo`, when installed;
  ``ekit worker`` and ``ekit queue`` come from :mod:`ekit_runtime.cli.queue`,
  ``ekit ui`` (the web dashboard) from :mod:`ekit_runtime.cli.ui`.

``SOURCE`` is anything :func:`~ekit_runtime.sources.read_checkpoints` reads:
a checkpoint JSON, JSON lines, a ``JournalStore`` journal, a SQLite or
PostgreSQL store or run queue (``--run-id`` picks the run; without it the
runs are listed on standard output), told apart by content. ``-`` reads
standard input. Numbers print with thousands separators everywhere.

Exit codes: ``0`` clean, ``1`` anomalies or violations found, ``2`` bad usage
or unreadable input. An input problem (a missing file, invalid JSON, a
malformed checkpoint or graph, a workflow that cannot be imported) prints one
line naming the input and the problem to stderr, never a traceback; so does
a ``--workflow`` module that raises anything at all (a ``BaseException``
such as ``GeneratorExit`` included) or calls ``sys.exit()`` while it is
imported, read or asked for its graph. An unexpected error is a bug: it
prints one ``ekit: internal error: ...`` line and exits ``2`` too, so that
it can never be taken for ``1``. A database driver's error (an unreachable
server, a file that is not a database) is an input problem: one line, exit
``2``. No password of a DSN among the arguments is printed or logged
(:class:`~ekit_runtime.redaction.Redactor`). Ctrl-C (``KeyboardInterrupt``, also while a
workflow module is being imported) exits ``130``; a closed standard output
(``| head``) ``141``, quietly. ``ekit worker --until-idle`` exits ``3`` when
it went idle with runs left waiting in the queue (each named on stderr with
the reason it was not taken). ``ekit worker`` stopped by a Ctrl-C gives its
runs back and exits ``130`` too (``0`` when a SIGTERM stopped it), and a
second SIGTERM or Ctrl-C makes it exit at once with ``143`` or ``130``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TextIO

from ekit_core import GraphSpec, TokenUsage, WorkflowCheckpoint, audit, replay, rewind
from ekit_core.children import parent_of
from ekit_core.graph_text import read
from ekit_core.report import count, recorded_graph, table
from ekit_core.rewind import grown
from ekit_core.shapes import Shape
from ekit_runtime.cli import cache as cache_cli
from ekit_runtime.cli import queue as queue_cli
from ekit_runtime.cli import ui as ui_cli
from ekit_runtime.cli.common import (
    EXIT_BROKEN_PIPE,
    EXIT_CLEAN,
    EXIT_FOUND,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    InputError,
    Versions,
    import_graph,
    import_workflow,
    one_line,
    text_of,
)
from ekit_runtime.redaction import Redactor
from ekit_runtime.sources import (
    Recorded,
    RunIdNeeded,
    RunListing,
    SourceError,
    parse_json,
    read_checkpoints,
    read_text,
)
from ekit_runtime.targets import TargetError, write_checkpoint

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_CLEAN",
    "EXIT_FOUND",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "InputError",
    "main",
]

class _Parser(argparse.ArgumentParser):
    # argparse exits by itself on bad usage; raising instead lets ``main``
    # return the exit code, so that it can be called from tests and scripts.
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        raise InputError(f"{self.prog.removeprefix('ekit').strip() or 'usage'}: {message}")


def _stdin_bytes() -> bytes:
    # Read bytes, not text: the inputs are UTF-8 or SQLite whatever the
    # locale says, and a decoding error must be an input error, not a traceback.
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:  # replaced by a text-only stream (a test, an embedding)
        return sys.stdin.read().encode("utf-8", "surrogatepass")
    return bytes(stream.read())


def _read(args: argparse.Namespace, location: str) -> Recorded:
    """The checkpoints at ``location``; a database without ``--run-id`` lists its runs on stdout."""
    try:
        return read_checkpoints(location, run_id=args.run_id, tables=args.tables, stdin=_stdin_bytes)
    except RunIdNeeded as exc:
        _list_runs(exc.runs, getattr(args, "json", False))
        raise InputError(f"{exc} (the runs are listed on standard output)") from None
    except SourceError as exc:
        raise InputError(str(exc)) from None


def _list_runs(runs: Sequence[RunListing], as_json: bool) -> None:
    if as_json:
        _print_json([r.to_dict() for r in runs], sys.stdout)
        return
    if all(r.tables == "store" for r in runs):
        _print_text("\n".join(table(("RUN_ID",), [(r.run_id,) for r in runs])), sys.stdout)
        return
    rows = [(r.run_id, r.tables, r.status or "-", r.workflow or "-") for r in runs]
    _print_text("\n".join(table(("RUN_ID", "TABLES", "STATUS", "WORKFLOW"), rows)), sys.stdout)


def _load_graph(path: str) -> tuple[GraphSpec, Versions]:
    """A graph file and its tags: ``ekit graph``'s JSON, or the graph a checkpoint
    records (a checkpoint file, or its ``graph_steps`` and ``graph_needs`` alone,
    or the step -> dependencies table that older checkpoints hold)."""
    try:
        data = parse_json(read_text(path, _stdin_bytes), path)
    except SourceError as exc:
        raise InputError(str(exc)) from None
    try:
        if isinstance(data, dict) and isinstance(data.get("steps"), list):
            graph = GraphSpec.from_dict(data)
            recorded = data.get("fingerprint")
            if recorded is not None and recorded != graph.fingerprint:
                raise InputError(
                    f"{path}: recorded fingerprint {recorded} does not match its steps "
                    f"({graph.fingerprint})"
                )
            return graph, _file_versions(data.get("versions"), path)
        if isinstance(data, dict) and "graph_steps" in data:
            steps, needs = data["graph_steps"], data.get("graph_needs")
            if not isinstance(steps, str) or not isinstance(needs, str):
                raise InputError(f"{path}: graph_steps and graph_needs must both be strings")
            return GraphSpec.of(read(steps, needs), _file_shapes(data.get("shapes"))), None
        if isinstance(data, dict) and all(isinstance(v, list) for v in data.values()):
            # The ``graph`` table a checkpoint records: step -> dependencies.
            return GraphSpec.of(data), None
    except ValueError as exc:
        raise InputError(f"{path}: {exc}") from None
    raise InputError(
        f"{path}: not a graph (expected the output of 'ekit graph': "
        '{"steps": [{"name": ..., "depends_on": [...]}, ...]})'
    )


def _file_shapes(value: object) -> dict[str, Shape] | None:
    """The ``shapes`` a checkpoint records (step -> shape), as a graph reads them."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("field 'shapes' must be an object of step name -> shape")
    return {name: Shape.from_dict(shape, f"shapes[{name!r}]") for name, shape in value.items()}


def _file_versions(value: object, path: str) -> Versions:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise InputError(f"{path}: field 'versions' must be an object of step name -> version tag")
    return value


def _budget(text: str) -> TokenUsage:
    """``--budget IN/OUT/CALLS``: input tokens, output tokens, LLM calls, as the audit prints usage."""
    parts = [p.replace(",", "") for p in text.split("/")]
    if len(parts) != 3 or not all(p.isascii() and p.isdigit() for p in parts):
        # argparse turns this into "argument --budget: ..." on one line, exit 2.
        raise argparse.ArgumentTypeError(
            f"expected IN/OUT/CALLS, three non-negative integers such as 10,000/2,000/0 "
            f"(0 = no limit), got {text!r}"
        )
    return TokenUsage(*(int(p) for p in parts))


def _graph_option(
    args: argparse.Namespace, recorded: Sequence[WorkflowCheckpoint] = ()
) -> tuple[GraphSpec | None, Versions]:
    if args.workflow is not None:
        return import_graph(args.workflow, recorded)
    if args.graph is not None:
        return _load_graph(args.graph)
    return None, None


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


# -- audit and replay: one path ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Explanation:
    """How ``audit`` and ``replay`` differ; everything else they do is :func:`_cmd_explain`."""

    name: str
    json_key: str
    # The checkpoints explained: audit takes the latest, replay all of them.
    chosen: Callable[[Recorded], tuple[WorkflowCheckpoint, ...]]
    explain: Callable[[GraphSpec | None, Versions, tuple[WorkflowCheckpoint, ...], argparse.Namespace], Any]
    ok: Callable[[Any], bool]


def _heading(how: _Explanation, recorded: Recorded) -> str:
    """``audit of run.jsonl, the latest of its 5 checkpoints (a list of checkpoints)``."""
    what = f"{how.name} of {recorded.label}"
    n = len(recorded.checkpoints)
    if how.name == "audit" and n > 1:
        what += f", the latest of its {count(n)} checkpoints"
    return what if recorded.kind == "json" else f"{what} ({recorded.description})"


def _cmd_explain(args: argparse.Namespace, how: _Explanation) -> int:
    recorded = _read(args, args.source)
    checkpoints = how.chosen(recorded)
    graph, versions = _graph_option(args, tuple(reversed(recorded.checkpoints)))
    subject: Any = graph
    if how is _AUDIT and args.workflow is not None:
        # A workflow that fingerprints its code is audited as itself: the
        # audit then says which steps changed since recorded (docs/cache.md).
        found = import_workflow(args.workflow, tuple(reversed(recorded.checkpoints)))
        if getattr(found, "code_policies", None):
            subject = found
    if graph is None and all(cp.graph is None for cp in checkpoints):
        what = "the checkpoint records no graph" if len(checkpoints) == 1 else "no checkpoint records a graph"
        raise InputError(f"{recorded.label}: {what}; pass --workflow or --graph")
    try:
        report = how.explain(subject, versions, checkpoints, args)
    except ValueError as exc:
        raise InputError(f"{recorded.label}: {exc}") from None
    if args.json:
        data = {how.json_key: recorded.label, "source": recorded.kind, **report.to_dict()}
        _print_json(data, sys.stdout)
    else:
        _print_text(f"{_heading(how, recorded)}\n{report.format()}", sys.stdout)
    return EXIT_CLEAN if how.ok(report) else EXIT_FOUND


_AUDIT = _Explanation(
    "audit", "checkpoint", lambda r: (r.latest,),
    lambda graph, versions, cps, args: audit(graph, cps[0], budget=args.budget, versions=versions),
    lambda report: bool(report.clean),
)
_REPLAY = _Explanation(
    "replay", "checkpoints_file", lambda r: r.checkpoints,
    lambda graph, versions, cps, args: replay(graph, cps),
    lambda report: bool(report.ok),
)


# -- rewind and graph ------------------------------------------------------------------


def _cmd_rewind(args: argparse.Namespace) -> int:
    recorded = _read(args, args.source)
    checkpoint = recorded.latest
    given = None if args.graph_from_checkpoint else _graph_option(args, (checkpoint,))[0]
    # argparse requires one of the three options: no graph given means the recorded one.
    graph = given if given is not None else _recorded_graph_of(checkpoint, recorded.label)
    try:
        trimmed = rewind(graph, checkpoint, args.step)
    except ValueError as exc:
        raise InputError(f"{recorded.label}: {exc}") from None
    # ensure_ascii: the file is readable whatever its reader's encoding, lone surrogates included.
    text = json.dumps(trimmed.to_dict(), indent=2)
    if args.output is None or args.output == "-":
        _print_text(text, sys.stdout)
        return EXIT_CLEAN
    run_id = args.output_run_id if args.output_run_id is not None else args.run_id
    try:
        how = write_checkpoint(args.output, trimmed, run_id=run_id)
    except TargetError as exc:
        raise InputError(f"-o {exc}") from None
    dropped = [n for n in checkpoint.outputs if n not in trimmed.outputs]
    skips = [n for n in checkpoint.skipped if n not in trimmed.skipped]
    undecided = f" and {count(len(skips))} skip(s) ({', '.join(skips)})" if skips else ""
    _print_text(
        f"{args.output}: the checkpoint of {recorded.label} without {count(len(dropped))} "
        f"output(s) ({', '.join(dropped) or 'none'}){undecided}, written {how}; a resume from it "
        "runs them again",
        sys.stdout,
    )
    return EXIT_CLEAN


def _recorded_graph_of(checkpoint: WorkflowCheckpoint, label: str) -> GraphSpec:
    # recorded_graph's own message advises giving the workflow's graph,
    # which is not the point here.
    if checkpoint.graph is None:
        raise InputError(f"{label}: the checkpoint records no graph")
    try:
        return recorded_graph(checkpoint)
    except ValueError as exc:
        raise InputError(f"{label}: recorded graph: {exc}") from None


def _cmd_graph(args: argparse.Namespace) -> int:
    items: dict[str, int] | None = None
    if args.workflow is not None:
        graph, versions = import_graph(args.workflow)
    else:
        checkpoint = _read(args, args.checkpoint).latest
        graph = _recorded_graph_of(checkpoint, args.checkpoint)
        versions = dict(checkpoint.versions)
        if graph.shapes:  # how many items the recorded outputs expand each mapped step into
            items = {m: len(v) for m, v in grown(graph, checkpoint.outputs).members.items()}
    if args.format == "json":
        data = graph.to_dict()
        if versions:
            data["versions"] = dict(versions)
        if items is not None:
            data["items"] = items
        _print_json(data, sys.stdout)
    else:
        _print_text(_GRAPH_FORMATS[args.format](graph, items), sys.stdout)
    return EXIT_CLEAN


def _shape_note(graph: GraphSpec, name: str, items: Mapping[str, int] | None) -> str:
    """What a drawn node says beside its name about its run-time shape (``""`` for none):
    ``(map over split \u00d7N)``, the times sign before the item count N when
    a checkpoint says it, ``(when urgent)``, ``(join any)``. A mapped step is one node."""
    shape = graph.shapes.get(name)
    if shape is None:
        return ""
    notes = []
    if shape.map_over is not None:
        n = None if items is None else items.get(name)
        notes.append(f"map over {shape.map_over}" + ("" if n is None else f" \u00d7{count(n)}"))
    if shape.when is not None:
        notes.append(f"when {shape.when}")
    if shape.join == "any":
        notes.append("join any")
    if shape.repeat is not None:
        notes.append(f"repeat up to {count(shape.repeat)}"
                     + ("" if shape.keep_last is None else f", keep last {count(shape.keep_last)}"))
    if shape.child is not None:
        notes.append(f"child, output {shape.child[len(name) + 1:]}")
    return f" ({', '.join(notes)})" if notes else ""


def _boxed(graph: GraphSpec, node: Callable[[str], str], box: Callable[[int, str], str],
           end: str) -> list[str]:
    """The node lines of ``graph`` with each child workflow's steps inside a box of its own
    (nested as the children are), opened by ``box(i, step)`` and closed by ``end``, after
    the line of the step whose child it is; a graph without children: its node lines."""
    members: dict[str | None, list[str]] = {}
    for n in graph.names:
        members.setdefault(parent_of(n, graph.shapes) if graph.shapes else None, []).append(n)
    lines: list[str] = []
    boxes = iter(range(len(graph.names)))

    def emit(owner: str | None, depth: int) -> None:
        pad = "    " * depth
        for n in members.get(owner, ()):
            lines.append(pad + node(n))
            if n in members:
                lines.append(pad + box(next(boxes), n))
                emit(n, depth + 1)
                lines.append(pad + end)

    emit(None, 1)
    return lines


def _loops(graph: GraphSpec) -> list[tuple[str, str]]:
    """The ``next`` edges of ``graph``'s loops (``repeat=``): a loop's to itself, its
    iterations; a loop whose body is a child, from the body's output to each first step of
    the body (an iteration starts once the one before it ended)."""
    edges: list[tuple[str, str]] = []
    for n, s in graph.shapes.items():
        if s.repeat is None:
            continue
        if s.child is None:
            edges.append((n, n))
            continue
        prefix = f"{n}/"
        edges.extend((s.child, b) for b in graph.names if b.startswith(prefix)
                     and not any(d.startswith(prefix) for d in graph.deps[b]))
    return edges


def _mapped_over(graph: GraphSpec, name: str, dep: str) -> bool:
    shape = graph.shapes.get(name)
    return shape is not None and shape.map_over == dep


def mermaid(graph: GraphSpec, items: Mapping[str, int] | None = None) -> str:
    """The graph as a Mermaid ``flowchart TD``: nodes ``s0, s1, ...`` labelled with the step names.

    A mapped step is a subroutine node (``[[...]]``) reached by a thick
    edge (``==>``) from what it maps over; a loop is a cycle, an edge to
    itself labelled ``next``; a child workflow's steps are in a subgraph
    box named after its step (nested as the children are); shapes are noted in the label
    (see :func:`_shape_note`), ``items`` giving each mapped step's item count.
    """
    lines = ["flowchart TD"]
    ids = {name: f"s{i}" for i, name in enumerate(graph.names)}

    def node(n: str) -> str:
        label = _mermaid_label(n + _shape_note(graph, n, items))
        shape = graph.shapes.get(n)
        mapped = shape is not None and shape.map_over is not None
        return f'{ids[n]}[["{label}"]]' if mapped else f'{ids[n]}["{label}"]'

    lines += _boxed(graph, node, lambda i, n: f'subgraph c{i}["{_mermaid_label(n)}"]', "end")
    lines.extend(f"    {ids[d]} {'==>' if _mapped_over(graph, n, d) else '-->'} {ids[n]}"
                 for n in graph.names for d in graph.deps[n])
    lines.extend(f"    {ids[a]} -->|next| {ids[b]}" for a, b in _loops(graph))
    return "\n".join(lines)


def _mermaid_label(name: str) -> str:
    # Inside a quoted label Mermaid reads "#<decimal>;" as a character: every
    # character that could end the label, start markup or an entity, or that
    # is not printable, is written that way.
    safe = " _-.,:;/()[]{}+*=!?@$%^|~'"
    return "".join(c if (c.isalnum() and c.isprintable()) or c in safe else f"#{ord(c)};" for c in name)


def dot(graph: GraphSpec, items: Mapping[str, int] | None = None) -> str:
    """The graph as a Graphviz ``digraph``: nodes ``n0, n1, ...`` labelled with the step names.

    A mapped step is drawn with a double border (``peripheries=2``) and
    reached by a bold edge from what it maps over, a conditional step
    dashed, a loop with an edge to itself labelled ``next``, a child
    workflow's steps in a cluster named after its step; shapes are noted in
    the label, as in :func:`mermaid`.
    """
    ids = {name: f"n{i}" for i, name in enumerate(graph.names)}
    lines = ["digraph workflow {", "    rankdir=TB;"]

    def node(n: str) -> str:
        shape = graph.shapes.get(n)
        extra = "" if shape is None else (
            ("" if shape.map_over is None else ", peripheries=2")
            + ("" if shape.when is None else ", style=dashed"))
        return f'{ids[n]} [label="{_dot_label(n + _shape_note(graph, n, items))}"{extra}];'

    lines += _boxed(graph, node, lambda i, n: f'subgraph cluster_{i} {{ label="{_dot_label(n)}";',
                    "}")
    lines.extend(f"    {ids[d]} -> {ids[n]}{' [style=bold]' if _mapped_over(graph, n, d) else ''};"
                 for n in graph.names for d in graph.deps[n])
    lines.extend(f'    {ids[a]} -> {ids[b]} [label="next"];' for a, b in _loops(graph))
    lines.append("}")
    return "\n".join(lines)


def _dot_label(name: str) -> str:
    # What UTF-8 cannot hold (a lone surrogate) is shown as its escape, then
    # the label is escaped for DOT: backslashes, quotes and line breaks.
    text = name.encode("utf-8", "backslashreplace").decode("utf-8")
    text = text.replace("\\", "\\\\").replace('"', '\\"')
    return "".join(c if c.isprintable() else f"\\\\x{ord(c):02x}" for c in text)


_GRAPH_FORMATS: dict[str, Callable[[GraphSpec, Mapping[str, int] | None], str]] = {
    "mermaid": mermaid, "dot": dot}


def _cmd_demo(args: argparse.Namespace) -> int:
    try:
        demo = importlib.import_module("ekit_runtime.demo")
    except ModuleNotFoundError as exc:
        if exc.name != "ekit_runtime.demo":
            raise
        raise InputError("demo: this installation has no ekit_runtime.demo module") from None
    code: int = demo.main(list(args.args))
    return code


# -- the parser ----------------------------------------------------------------------


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ekit-workflows")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _source_options(p: argparse.ArgumentParser, metavar: str = "SOURCE", *, positional: bool = True) -> None:
    if positional:
        p.add_argument(
            "source", metavar=metavar,
            help="a checkpoint JSON, JSON lines, a JournalStore journal, a SQLite database (store or "
            "run queue), a postgresql:// URL, or - for standard input; told apart by content",
        )
    p.add_argument("--run-id", metavar="RUN", help="the run to read from a database (omit to list them)")
    p.add_argument("--tables", choices=("store", "queue"),
                   help="read the store's or the queue's tables of a database that holds both")


def _graph_options(p: argparse.ArgumentParser, *, required: bool = False) -> argparse._MutuallyExclusiveGroup:
    group = p.add_mutually_exclusive_group(required=required)
    group.add_argument(
        "--workflow", metavar="MODULE:ATTR",
        help="import the workflow (or GraphSpec) ATTR of MODULE (current dir on sys.path)",
    )
    group.add_argument("--graph", metavar="GRAPH.json", help="a graph written by 'ekit graph'")
    return group


def _add_explain(sub: Any, how: _Explanation, help_text: str, description: str) -> None:
    p = sub.add_parser(how.name, help=help_text, description=description)
    _source_options(p)
    _graph_options(p)
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    if how is _AUDIT:
        p.add_argument(
            "--budget", metavar="IN/OUT/CALLS", type=_budget,
            help="the budget a resume would be given (0 = no limit): report a checkpoint "
            "whose usage already reaches it",
        )
    p.set_defaults(func=lambda args: _cmd_explain(args, how))


def _add_rewind_and_graph(sub: Any) -> None:
    p = sub.add_parser(
        "rewind", help="write a checkpoint that re-runs steps and everything downstream",
        description="Write the latest checkpoint of SOURCE without the outputs of the --step steps "
        "and of every step downstream of them, as JSON: resuming it runs them again.",
    )
    _source_options(p)
    p.add_argument("--step", action="append", required=True, metavar="NAME",
                   help="a step to re-run, or an item of a mapped step (step[key])")
    group = _graph_options(p, required=True)
    group.add_argument("--graph-from-checkpoint", action="store_true",
                       help="use the graph the checkpoint records")
    p.add_argument(
        "-o", "--output", metavar="OUT",
        help="write the checkpoint into this file (default: stdout), through the store that owns it: "
        "a new or checkpoint JSON file, a JournalStore journal, a SqliteStore database; refuses a "
        "run queue, a file another run is writing, and any other kind of file",
    )
    p.add_argument("--output-run-id", metavar="RUN",
                   help="the run to write in a SqliteStore database given to -o (default: --run-id)")
    p.set_defaults(func=_cmd_rewind)

    p = sub.add_parser(
        "graph", help="print a workflow's graph (JSON, Mermaid or Graphviz)",
        description="Print the graph: as JSON (audits can then run without the workflow's code), "
        "as a Mermaid flowchart or as a Graphviz digraph.",
    )
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument(
        "--workflow", metavar="MODULE:ATTR",
        help="the graph of the workflow (or GraphSpec) ATTR of MODULE (current dir on sys.path)",
    )
    group.add_argument("--checkpoint", metavar="SOURCE", help="the graph its latest checkpoint records")
    _source_options(p, positional=False)
    p.add_argument(
        "--format", choices=("json", "mermaid", "dot"), default="json",
        help="json (default; what --graph of audit and replay reads), a mermaid flowchart, or Graphviz dot",
    )
    p.set_defaults(func=_cmd_graph)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ekit",
        description="Inspect and repair recorded ekit runs and drive a run queue: audit what a resume "
        "would skip and run, replay a run's history, rewind steps so that they run again, print a "
        "workflow's graph, run workers. Reads checkpoint JSON, JSON lines, journals, SQLite and "
        "PostgreSQL stores and queues.",
        epilog="Exit codes: 0 clean, 1 anomalies or violations found, "
        "2 bad usage or unreadable input, 3 (worker --until-idle) runs left waiting, "
        "130 interrupted by Ctrl-C.",
    )
    parser.add_argument("--version", action="version", version=f"ekit {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    _add_explain(
        sub, _AUDIT, "what a resume from a checkpoint would skip and run, and why",
        "Explain, step by step, what resuming the latest checkpoint of SOURCE would skip and run. "
        "Without --workflow or --graph, audit against the graph the checkpoint records.",
    )
    _add_explain(
        sub, _REPLAY, "check that recorded checkpoints are a legal execution",
        "Check that the checkpoints of SOURCE, in the order recorded, are a legal execution of the "
        "graph; print the timeline and violations.",
    )
    _add_rewind_and_graph(sub)
    p = sub.add_parser("demo", help="run the demo (arguments go to it)", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_demo)
    queue_cli.add_parsers(sub)
    ui_cli.add_parser(sub)
    cache_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ekit`` command with ``argv`` (default ``sys.argv[1:]``); return the exit code.

    No password of a database URL or key=value DSN among the arguments is
    printed, in any message or log line, whatever a driver says: see
    :mod:`ekit_runtime.redaction`.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    redactor = Redactor.of(argv)
    with redactor.scrubbing_logs():
        return _main(argv, redactor)


def _main(argv: list[str], redactor: Redactor) -> int:
    def error(message: str) -> None:
        _error(redactor.scrub(message))

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
        error(str(exc))
        return EXIT_USAGE
    except SystemExit as exc:
        # ``--help`` and ``--version`` exit through argparse; keep their code.
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except KeyboardInterrupt:
        error("interrupted")
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
        if _is_driver_error(exc):
            # A database the command was given failed (unreachable, not a
            # database, refused us): an input problem, not a bug.
            error(_driver_message(argv, exc, redactor))
            return EXIT_USAGE
        # A bug (ours or an unforeseen input), or a BaseException such as
        # GeneratorExit from code we called: it must not exit 1, which would
        # read as "anomalies found", nor print a traceback.
        error(f"internal error: {one_line(f'{type(exc).__name__}: {text_of(exc)}')}")
        return EXIT_USAGE


def _is_driver_error(exc: BaseException) -> bool:
    """An error of a database driver: sqlite3's, or psycopg's (never imported here for this)."""
    import sqlite3

    if isinstance(exc, sqlite3.Error):
        return True
    return any(c.__module__.split(".")[0] == "psycopg" and c.__name__ == "Error" for c in type(exc).__mro__)


def _driver_message(argv: list[str], exc: BaseException, redactor: Redactor) -> str:
    """``COMMAND: DATABASE: ErrorClass: what the driver said`` (withheld if it may hold a password)."""
    command = next((a for a in argv if not a.startswith("-")), "ekit")
    where = redactor.labels[0] if len(redactor.labels) == 1 else _option(argv, "--queue")
    text = redactor.scrub(one_line(text_of(exc)), withhold=True)
    named = f"{where}: " if where else ""
    return f"{command}: {named}the database failed: {type(exc).__name__}: {text}"


def _option(argv: list[str], name: str) -> str | None:
    """The value of option ``name`` in ``argv`` (``--name VALUE`` or ``--name=VALUE``), if given."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg[len(name) + 1:]
    return None


def _error(message: str) -> None:
    # stderr escapes what its encoding cannot hold ("backslashreplace"), but
    # it may have been replaced (tests, embedding), so escape here as well.
    _print_text(f"ekit: {one_line(message)}", sys.stderr)
