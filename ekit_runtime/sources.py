"""Reading recorded checkpoints from wherever ekit keeps them, told apart by their content.

This module owns what the ``ekit`` command reads. :func:`read_checkpoints`
takes a file name (``-`` for standard input) or a PostgreSQL DSN (a URL or a
libpq key=value string) and returns
the :class:`Recorded` checkpoints it holds, oldest first:

- a checkpoint JSON (``checkpoint.to_dict()``; a ``JsonFileStore`` file), or
  a JSON array of them;
- JSON lines, one checkpoint per line (what the docs' ``checkpoint_fn``
  appends);
- a ``JournalStore`` journal: its whole history, one checkpoint per line
  (:meth:`~ekit_runtime.stores.JournalStore.history`);
- a SQLite database holding a ``SqliteStore`` or a run queue
  (``SqliteQueue``), and a PostgreSQL database holding a ``PostgresStore``
  or a ``PostgresQueue``: the latest checkpoint of one run (``run_id``;
  these keep no history).

The kind is read from the first bytes, never from the file's name: a SQLite
file starts with ``SQLite format 3\\0``, every journal line with
``{"c":"``, and JSON is told from JSON lines by whether its first line is a
whole JSON object. Nothing read is ever executed, and databases are only
read: SQLite stores through a read-only connection. Every problem is a
:class:`SourceError` (a ``ValueError``) whose message is one line naming the
file (or the redacted URL) and the problem; a database read without a run id
raises :class:`RunIdNeeded`, which lists its runs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote

from ekit_core import WorkflowCheckpoint
from ekit_runtime.redaction import is_keyword_dsn, redacted, scrub

__all__ = [
    "SQLITE_MAGIC",
    "Recorded",
    "RunIdNeeded",
    "RunListing",
    "SourceError",
    "SourceKind",
    "Tables",
    "parse_json",
    "pick_workflow",
    "read_checkpoints",
    "read_text",
    "redacted",
    "workflow_entries",
    "workflow_spec",
]

SQLITE_MAGIC = b"SQLite format 3\x00"
"""The first 16 bytes of every SQLite database file."""
_JOURNAL_START = b'{"c":"'

SourceKind = Literal[
    "json", "jsonl", "journal", "sqlite-store", "sqlite-queue", "postgres-store", "postgres-queue"
]
"""What a source turned out to be."""
Tables = Literal["store", "queue"]
"""Which of ekit's tables to read in a database that holds both a store's and a queue's."""

_KEEPS_LATEST = "which keeps only the latest checkpoint"
_DESCRIBED: dict[str, str] = {
    "json": "a checkpoint JSON",
    "jsonl": "a list of checkpoints",
    "journal": "a JournalStore journal, which keeps the history since its last full record",
    "sqlite-store": f"a SqliteStore database, {_KEEPS_LATEST}",
    "sqlite-queue": f"a SqliteQueue run queue, {_KEEPS_LATEST}",
    "postgres-store": f"a PostgresStore database, {_KEEPS_LATEST}",
    "postgres-queue": f"a PostgresQueue run queue, {_KEEPS_LATEST}",
}


class SourceError(ValueError):
    """A source that cannot be read; the message is one line naming it and the problem."""


@dataclass(frozen=True, slots=True)
class RunListing:
    """One run a database holds: its id, the tables holding it, and for a queue its status and workflow."""

    run_id: str
    tables: Tables
    status: str | None = None
    workflow: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe data."""
        return {"run_id": self.run_id, "tables": self.tables, "status": self.status,
                "workflow": self.workflow}


class RunIdNeeded(SourceError):
    """A database was read without a run id; ``runs`` lists the runs it holds."""

    def __init__(self, message: str, runs: Sequence[RunListing]) -> None:
        super().__init__(message)
        self.runs = tuple(runs)


@dataclass(frozen=True, slots=True)
class Recorded:
    """The checkpoints read from one source, oldest first (at least one).

    ``label`` names the source in messages (a file name, ``"<file>, run
    '<id>'"``, a URL without its password); ``kind`` says what it turned out
    to be. A database keeps only a run's latest checkpoint, so it gives one.
    """

    label: str
    kind: SourceKind
    checkpoints: tuple[WorkflowCheckpoint, ...]

    @property
    def latest(self) -> WorkflowCheckpoint:
        """The last checkpoint recorded."""
        return self.checkpoints[-1]

    @property
    def description(self) -> str:
        """What the source is, in words: ``"a SqliteStore database, which keeps only the latest ..."``."""
        return _DESCRIBED[self.kind]


def read_checkpoints(
    location: str,
    *,
    run_id: str | None = None,
    tables: Tables | None = None,
    stdin: Callable[[], bytes] | None = None,
) -> Recorded:
    """The checkpoints recorded at ``location``: a file, ``-`` (``stdin()``'s bytes) or a PostgreSQL DSN.

    A PostgreSQL DSN is a ``postgresql://`` (or ``postgres://``) URL or a
    libpq key=value string (``host=db dbname=runs``: one that starts with a
    libpq keyword and ``=``), never a file name.

    ``run_id`` picks the run of a database (:class:`RunIdNeeded` lists them
    when it is missing); ``tables`` picks the store's or the queue's tables
    of a database that holds both. Raises :class:`SourceError` for anything
    that cannot be read.
    """
    if location.startswith(("postgresql://", "postgres://")) or is_keyword_dsn(location):
        return _read_postgres(location, run_id, tables)
    if location == "-":
        if stdin is None:
            raise SourceError("-: no standard input to read")
        raw, where = stdin(), "-"
    else:
        raw, where = _read_file(location), location
    if raw.startswith(SQLITE_MAGIC):
        if location == "-":
            raise SourceError("-: a SQLite database cannot be read from standard input; give its file")
        return _read_sqlite(location, run_id, tables)
    if run_id is not None or tables is not None:
        raise SourceError(f"{where}: --run-id and --tables are for databases; this is not one")
    if raw.lstrip(b" \t\r\n").startswith(_JOURNAL_START):
        if location == "-":
            raise SourceError("-: a JournalStore journal cannot be read from standard input; give its file")
        return _read_journal(location)
    return _read_json(_text(raw, where), where)


def read_text(path: str, stdin: Callable[[], bytes] | None = None) -> str:
    """The UTF-8 text of file ``path`` (``-``: of ``stdin()``); a :class:`SourceError` if unreadable."""
    if path == "-":
        if stdin is None:
            raise SourceError("-: no standard input to read")
        return _text(stdin(), "-")
    return _text(_read_file(path), path)


def _read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise SourceError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise SourceError(f"{path}: is a directory, not a file") from None
    except OSError as exc:
        raise SourceError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _text(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SourceError(f"{where}: not UTF-8 text ({exc.reason})") from None


# -- JSON and JSON lines ------------------------------------------------------------


def parse_json(text: str, where: str) -> Any:
    """``json.loads(text)``, any failure a :class:`SourceError` naming ``where`` and the position."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SourceError(
            f"{where}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise SourceError(f"{where}: invalid JSON: nested too deeply") from None
    except ValueError as exc:
        # Not a syntax error but a value json refuses to build, such as an int
        # longer than sys.get_int_max_str_digits() digits.
        raise SourceError(f"{where}: unreadable JSON: {exc}") from None


def _checkpoint(data: Any, where: str) -> WorkflowCheckpoint:
    try:
        checkpoint = WorkflowCheckpoint.from_dict(data)
        # Decoded now, so that a fault in the recorded graph (a step named
        # twice) is told with the file, as any other malformed field is.
        checkpoint.check_graph()
    except ValueError as exc:
        raise SourceError(f"{where}: {exc}") from None
    return checkpoint


def _lines(text: str) -> Iterator[tuple[int, str]]:
    # Split on "\n" only: str.splitlines() also breaks at U+2028, U+2029 and
    # \x85, which JSON allows raw inside strings (the stores write
    # ensure_ascii=False), and would cut such a checkpoint in two.
    for number, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")
        if line.strip():
            yield number, line


def _is_json_lines(lines: list[tuple[int, str]]) -> bool:
    """JSON lines, rather than one JSON document: more than one line, the first a whole object."""
    if len(lines) < 2:
        return False
    try:
        return isinstance(json.loads(lines[0][1]), dict)
    except (ValueError, RecursionError):
        return False


def _read_json(text: str, where: str) -> Recorded:
    lines = list(_lines(text))
    if not lines:
        raise SourceError(f"{where}: holds no checkpoint (expected a JSON object, or one per line)")
    if _is_json_lines(lines):
        cps = [_checkpoint(parse_json(line, f"{where} line {n}"), f"{where} line {n}") for n, line in lines]
        return Recorded(where, "jsonl", tuple(cps))
    data = parse_json(text, where)
    if isinstance(data, list):
        if not data:
            raise SourceError(f"{where}: holds no checkpoint (an empty JSON array)")
        return Recorded(where, "jsonl", tuple(_checkpoint(d, f"{where} [{i}]") for i, d in enumerate(data)))
    return Recorded(where, "json", (_checkpoint(data, where),))


# -- a journal ------------------------------------------------------------------------


def _read_journal(path: str) -> Recorded:
    from ekit_runtime.stores import JournalStore

    try:
        cps = tuple(JournalStore(path).history())
    except ValueError as exc:  # CorruptStoreError names the file and line
        raise SourceError(_one_line(str(exc))) from None
    except OSError as exc:
        raise SourceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not cps:
        raise SourceError(f"{path}: the journal holds no checkpoint")
    return Recorded(path, "journal", cps)


# -- databases ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Table:
    """One kind of ekit table found in a database: how to list its runs and load one."""

    tables: Tables
    kind: SourceKind
    runs: Callable[[], list[RunListing]]
    load: Callable[[str], WorkflowCheckpoint | None]


def _pick(label: str, found: list[_Table], run_id: str | None, tables: Tables | None) -> Recorded:
    """The latest checkpoint of ``run_id`` in whichever of ``found`` holds it."""
    what = " and ".join(_DESCRIBED[t.kind].split(",")[0] for t in found) or "no ekit table"
    if tables is not None:
        found = [t for t in found if t.tables == tables]
        if not found:
            raise SourceError(f"{label}: holds no {tables} tables (it holds {what})")
    if not found:
        raise SourceError(f"{label}: a database without ekit's tables (no store, no run queue)")
    if run_id is None:
        runs = [r for t in found for r in t.runs()]
        raise RunIdNeeded(
            f"{label}: {what} holding {len(runs):,} run(s); pass --run-id RUN to pick one", runs
        )
    holding = [t for t in found if any(r.run_id == run_id for r in t.runs())]
    if not holding:
        raise SourceError(f"{label}: no run {run_id!r} (run without --run-id to list the runs)")
    if len(holding) > 1:
        raise SourceError(
            f"{label}: run {run_id!r} is in both the store's and the queue's tables; "
            "pass --tables store or --tables queue"
        )
    where = f"{label}, run {run_id!r}"
    try:
        checkpoint = holding[0].load(run_id)
    except ValueError as exc:
        raise SourceError(f"{where}: {_one_line(str(exc))}") from None
    if checkpoint is None:
        raise SourceError(f"{where}: no checkpoint saved yet")
    return Recorded(where, holding[0].kind, (checkpoint,))


def _read_sqlite(path: str, run_id: str | None, tables: Tables | None) -> Recorded:
    import sqlite3

    uri = "file:" + quote(os.path.abspath(path)) + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=30.0)
    except sqlite3.Error as exc:
        raise SourceError(f"{path}: cannot open the database: {exc}") from None
    try:
        with _database_errors(path, sqlite3.Error):
            names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            found = []
            if "ekit_runs" in names:
                found.append(_sqlite_store(conn))
            if "ekit_queue_runs" in names:
                found.append(_sqlite_queue(path))
            return _pick(path, found, run_id, tables)
    finally:
        conn.close()


def _sqlite_store(conn: Any) -> _Table:
    from ekit_runtime.stores import SqliteStore

    # A read-only connection: the store's DDL finds its tables and writes nothing.
    def store(run: str) -> SqliteStore:
        return SqliteStore(conn, run_id=run)

    return _Table(
        "store", "sqlite-store",
        lambda: [RunListing(r, "store") for r in store("-").runs()],
        lambda run: store(run).load(),
    )


def _sqlite_queue(path: str) -> _Table:
    from ekit_runtime.queue import SqliteQueue

    return _queue_table("sqlite-queue", lambda: SqliteQueue(path))


def _queue_table(kind: SourceKind, open_queue: Callable[[], Any]) -> _Table:
    def runs() -> list[RunListing]:
        with open_queue() as q:
            return [RunListing(r.run_id, "queue", r.status, r.workflow) for r in q.runs()]

    def load(run: str) -> WorkflowCheckpoint | None:
        with open_queue() as q:
            checkpoint: WorkflowCheckpoint | None = q.checkpoint(run)
            return checkpoint

    return _Table("queue", kind, runs, load)


def _read_postgres(url: str, run_id: str | None, tables: Tables | None) -> Recorded:
    label = redacted(url)
    try:
        from ekit_runtime.stores.pg import connect, psycopg
    except ModuleNotFoundError as exc:
        raise SourceError(f"{label}: {exc}") from None
    with _database_errors(label, psycopg.Error, dsn=url):
        with connect(url) as conn:
            row = conn.execute(
                "SELECT to_regclass('ekit_runs') IS NOT NULL, to_regclass('ekit_queue_runs') IS NOT NULL"
            ).fetchone()
        has_store, has_queue = row if row is not None else (False, False)
        found = []
        if has_store:
            found.append(_postgres_store(url))
        if has_queue:
            found.append(_postgres_queue(url))
        return _pick(label, found, run_id, tables)


def _postgres_store(url: str) -> _Table:
    from ekit_runtime.stores import PostgresStore

    def runs() -> list[RunListing]:
        with PostgresStore(url, run_id="-") as store:
            return [RunListing(r, "store") for r in store.runs()]

    def load(run: str) -> WorkflowCheckpoint | None:
        with PostgresStore(url, run_id=run) as store:
            return store.load()

    return _Table("store", "postgres-store", runs, load)


def _postgres_queue(url: str) -> _Table:
    from ekit_runtime.queue import PostgresQueue

    return _queue_table("postgres-queue", lambda: PostgresQueue(url))


@contextmanager
def _database_errors(label: str, driver_error: type[Exception], *, dsn: str = "") -> Iterator[None]:
    """Turn what reading a database raises into a one-line :class:`SourceError` naming it.

    ``driver_error`` is the driver's base class (``sqlite3.Error``,
    ``psycopg.Error``); a ``ValueError`` is a store's corrupt data, a
    ``LookupError`` a queue's unknown run. The exception's text is scrubbed
    of ``dsn``'s password (a driver that cannot parse a URL quotes it back).
    """
    try:
        yield
    except SourceError:
        raise
    except (driver_error, ValueError, LookupError, OSError) as exc:
        # A driver's message may hold tabs and line breaks: one line, single spaces.
        text = scrub(" ".join(str(exc).split()), dsn)
        raise SourceError(f"{label}: {type(exc).__name__}: {text}") from None


def _one_line(text: str) -> str:
    return " ".join(text.splitlines())


# -- the workflows a command imports: MODULE:ATTR[:NAME] ---------------------------


def workflow_spec(spec: str) -> tuple[str, str, str | None]:
    """``MODULE:ATTR[:NAME]`` split as every ``ekit`` command reads it: module, attribute, name.

    ATTR names a workflow (or graph) or a dict of them, name -> workflow, as
    ``ekit worker --workflows`` takes; NAME picks one entry of such a dict.
    Raises :class:`SourceError` for a spec without a module or an attribute.
    """
    module, sep, rest = spec.partition(":")
    attr, _, name = rest.partition(":")
    if not sep or not module or not attr or (rest.endswith(":") and not name):
        raise SourceError(f"{spec}: expected MODULE:ATTR (a workflow, or a dict of name -> workflow), "
                          "or MODULE:ATTR:NAME (one entry of that dict)")
    return module, attr, name or None


def workflow_entries(obj: object, attr: str) -> dict[str, object]:
    """What ``MODULE:ATTR`` names, as name -> workflow: a mapping's own entries, or else the
    one object, named after ATTR's last part (as ``ekit worker`` names it). What an entry
    must be (a ``Workflow``, a ``GraphSpec``) is the caller's to check."""
    if isinstance(obj, Mapping):
        return {str(k): v for k, v in obj.items()}
    return {attr.rsplit(".", 1)[-1]: obj}


def pick_workflow(
    entries: Mapping[str, object], name: str | None, spec: str, fits: Callable[[object], bool] | None = None
) -> object:
    """The one entry of ``entries`` (what ``spec`` named) a command works with.

    ``name`` given: that entry. Otherwise the only entry, or else the only
    one for which ``fits`` holds (say, whose graph a checkpoint records).
    Anything else is a :class:`SourceError` naming ``spec`` and the choices.
    """
    names = ", ".join(repr(k) for k in entries)
    if name is not None and name not in entries:
        raise SourceError(f"{spec}: no workflow named {name!r} (it has {names or 'none'})")
    if name is not None:
        return entries[name]
    if not entries:
        raise SourceError(f"{spec}: an empty dict, no workflow in it")
    if len(entries) == 1:
        return next(iter(entries.values()))
    fitting = [w for w in entries.values() if fits is not None and fits(w)]
    if len(fitting) == 1:
        return fitting[0]
    why = "none has the graph the checkpoint records." if fits is not None else "which one is meant?"
    raise SourceError(f"{spec}: a dict of {len(entries)} workflows ({names}), {why} Name one, as {spec}:NAME")
