"""What every ``ekit`` subcommand shares: its exit codes, its one input error, importing a workflow.

The ``ekit`` command (:mod:`ekit_runtime.cli`) and the subcommands it adds
from :mod:`ekit_runtime.cli.queue` and :mod:`ekit_runtime.cli.ui` all turn a
bad input into one line on stderr and exit ``2``, exit ``130`` on Ctrl-C, and
import a user's ``--workflow MODULE:ATTR`` the same guarded way. Those
shared pieces live here, below all three, so that none imports another
back; :mod:`ekit_runtime.cli` re-exports the exit codes and
:class:`InputError`, and says what each exit code means to a caller.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ekit_core import GraphSpec, WorkflowCheckpoint
from ekit_core.report import graph_of, versions_of
from ekit_runtime.sources import SourceError, pick_workflow, workflow_entries, workflow_spec

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_CLEAN",
    "EXIT_FOUND",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "InputError",
    "Versions",
    "guarded",
    "import_graph",
    "import_workflow",
    "import_object",
    "one_line",
    "raised",
    "text_of",
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

Versions = Mapping[str, str] | None


class InputError(Exception):
    """An input the command cannot use; its message is the one line printed to stderr."""


def import_object(spec: str, option: str) -> object:
    """The attribute ``ATTR`` (dotted) of module ``MODULE`` that ``spec`` names; failures are InputErrors.

    The current directory is put on ``sys.path`` while the module imports.
    The module is arbitrary code: besides raising, it may call sys.exit()
    while being imported, which would otherwise end the command with that
    code and no output, reading as a clean audit, or raise a BaseException
    of its own (GeneratorExit, a custom subclass), which would otherwise end
    it with a traceback and exit 1, reading as "anomalies found". Each is
    one line and exit 2. Only Ctrl-C is let through, to exit 130 as
    everywhere else. ``option`` names the option in messages.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InputError(f"{option} {spec}: expected MODULE:ATTR, e.g. myflows:workflow")
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise InputError(f"{option} {spec}: no module named {exc.name!r}") from None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        raise InputError(f"{option} {spec}: importing {module_name!r} {raised(exc)}") from None
    finally:
        if added:
            # The module may have edited sys.path itself.
            with contextlib.suppress(ValueError):
                sys.path.remove(cwd)
    # Attribute reads run code too (properties, module __getattr__).
    obj: object = module
    missing = (AttributeError, lambda exc: f"{module_name!r} has no attribute {attr!r}")
    for part in attr.split("."):
        obj = guarded(_getter(obj, part), f"{option} {spec}", f"reading {attr!r}", missing)
    return obj


def _getter(obj: object, name: str) -> Callable[[], object]:
    return lambda: getattr(obj, name)


_Expected = tuple[type[BaseException], Callable[[BaseException], str]]


def guarded(read: Callable[[], Any], where: str, what: str, expected: _Expected | None = None) -> Any:
    """``read()`` (code of the user's module); whatever it raises, Ctrl-C aside, is an InputError.

    The message is ``where: what raised ...``, or for an ``expected``
    exception type, ``where:`` and what its function says.
    """
    try:
        return read()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        if expected is not None and isinstance(exc, expected[0]):
            raise InputError(f"{where}: {expected[1](exc)}") from None
        raise InputError(f"{where}: {what} {raised(exc)}") from None


def import_graph(spec: str, recorded: Sequence[WorkflowCheckpoint] = ()) -> tuple[GraphSpec, Versions]:
    """The graph of ``--workflow spec`` and the version tags its steps declare.

    ``spec`` is any workflow source ``ekit worker`` takes (see
    :func:`~ekit_runtime.sources.workflow_spec`); of a dict of several, the
    entry whose graph a checkpoint of ``recorded`` records.
    """
    where = f"--workflow {spec}"
    obj, attr = _imported_workflow(spec, recorded)
    invalid = (ValueError, lambda exc: f"{attr!r}: {text_of(exc)}")
    graph = guarded(lambda: graph_of(obj), where, f"reading {attr}.graph", invalid)
    versions = guarded(lambda: versions_of(obj), where, f"reading {attr}.steps")
    return graph, versions


def import_workflow(spec: str, recorded: Sequence[WorkflowCheckpoint] = ()) -> object:
    """The workflow object ``--workflow spec`` names (see :func:`import_graph`), as it is."""
    return _imported_workflow(spec, recorded)[0]


def _imported_workflow(spec: str, recorded: Sequence[WorkflowCheckpoint]) -> tuple[object, str]:
    where = f"--workflow {spec}"
    try:
        module, attr, name = workflow_spec(spec)
    except SourceError as exc:
        raise InputError(f"--workflow {exc}") from None
    found = import_object(f"{module}:{attr}", "--workflow")
    entries = guarded(lambda: workflow_entries(found, attr), where, f"reading {attr}")
    try:
        return pick_workflow(entries, name, spec, _records_graph_of(recorded)), attr
    except SourceError as exc:
        raise InputError(f"--workflow {exc}") from None


def _records_graph_of(recorded: Sequence[WorkflowCheckpoint]) -> Callable[[object], bool] | None:
    """Whether a workflow's graph is one ``recorded`` records (by fingerprint); ``None``: none recorded."""
    prints = {cp.fingerprint for cp in recorded} - {None}
    if not prints:
        return None

    def fits(obj: object) -> bool:
        try:
            return graph_of(obj).fingerprint in prints
        except KeyboardInterrupt:
            raise
        except BaseException:  # (the module's code) an entry that is no workflow fits nothing
            return False

    return fits


def raised(exc: BaseException) -> str:
    """What ``exc`` says, as the end of a one-line message: ``raised KeyError: 'x'``."""
    if isinstance(exc, SystemExit):
        return f"called sys.exit({text_of(exc.code, repr)})"
    text = text_of(exc)
    name = type(exc).__name__
    return f"raised {one_line(f'{name}: {text}' if text else name)}"


def text_of(value: object, show: Callable[[object], str] = str) -> str:
    # An exception from arbitrary code may have a __str__ (or an exit code a
    # __repr__) that raises in turn; the one-line message must still come out.
    try:
        return show(value)
    except Exception:
        return f"<{type(value).__name__} whose {show.__name__}() raised>"


def one_line(text: str) -> str:
    # Error messages go to stderr as exactly one line, whatever the exception
    # or file name held.
    return " ".join(text.splitlines())
