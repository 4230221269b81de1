"""``ekit cache list|show|prune``: inspect and bound a cross-run cache (docs/cache.md).

``CACHE`` is a SQLite cache file, a cache directory, or a ``postgresql://``
URL. A cache that does not exist is an input error (exit 2): nothing is
created by looking. Exit codes are the other subcommands' (:mod:`ekit_runtime.cli.common`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ekit_core.report import usage_text
from ekit_core.times import when
from ekit_runtime.cache.base import Cache, CacheEntry
from ekit_runtime.cli.common import EXIT_CLEAN, InputError

__all__ = ["add_parser", "open_existing"]


def add_parser(sub: Any) -> None:
    """Add ``cache`` (with ``list``, ``show`` and ``prune``) to the ``ekit`` command's subparsers."""
    p = sub.add_parser("cache", help="list, show and prune the entries of a cross-run cache",
                       description="Inspect or bound a cross-run cache: a SQLite cache file, a cache "
                       "directory, or a postgresql:// URL (see docs/cache.md).")
    verbs = p.add_subparsers(dest="verb", metavar="VERB")
    verbs.required = True
    listing = verbs.add_parser("list", help="one line per entry, newest first")
    listing.add_argument("cache", metavar="CACHE")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(func=_cmd_list)
    show = verbs.add_parser("show", help="one entry: what it read, what it holds, what it saved")
    show.add_argument("cache", metavar="CACHE")
    show.add_argument("key", metavar="KEY", help="the entry's key, or a prefix of it naming one entry")
    show.set_defaults(func=_cmd_show)
    prune = verbs.add_parser("prune", help="drop the oldest entries past the bounds given")
    prune.add_argument("cache", metavar="CACHE")
    prune.add_argument("--max-entries", type=int, metavar="N", help="keep at most N entries")
    prune.add_argument("--max-age", type=float, metavar="SECONDS", help="drop entries older than this")
    prune.add_argument("--max-bytes", type=int, metavar="N", help="keep at most N bytes of entries")
    prune.set_defaults(func=_cmd_prune)


def open_existing(spec: str) -> Cache:
    """The cache ``spec`` names, which must exist (``InputError`` otherwise)."""
    if spec.startswith(("postgresql://", "postgres://")):
        from ekit_runtime.cache.postgres import PostgresCache

        return PostgresCache(spec)
    path = Path(spec)
    if path.is_dir():
        from ekit_runtime.cache.directory import DirectoryCache

        return DirectoryCache(path)
    if not path.is_file():
        raise InputError(f"cache {spec}: no such cache file or directory")
    from ekit_runtime.cache.sqlite import SqliteCache

    return SqliteCache(path)


def _row(entry: CacheEntry) -> dict[str, Any]:
    return {"key": entry.key, "step": entry.step, "created": when(entry.created),
            "saved": entry.usage.to_dict(), "reads": sorted(entry.reads), "bytes": len(entry.output)}


def _cmd_list(args: argparse.Namespace) -> int:
    cache = open_existing(args.cache)
    try:
        entries = list(cache.entries())
    finally:
        cache.close()
    if args.json:
        json.dump({"cache": args.cache, "entries": [_row(e) for e in entries]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return EXIT_CLEAN
    print(f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'} in {args.cache}")
    for e in entries:
        reads = ", ".join(sorted(k for k in e.reads if not k.startswith("\x00"))) or "-"
        print(f"  {e.key[:16]}  {e.step}  {when(e.created)}  saved {usage_text(e.usage)}  "
              f"{len(e.output)} bytes  read: {reads}".encode(errors="backslashreplace").decode())
    return EXIT_CLEAN


def _cmd_show(args: argparse.Namespace) -> int:
    cache = open_existing(args.cache)
    try:
        found = [e for e in cache.entries() if e.key.startswith(args.key)] if args.key else []
    finally:
        cache.close()
    if len(found) != 1:
        what = "no entry" if not found else f"{len(found)} entries"
        raise InputError(f"cache show: {what} of {args.cache} with a key beginning {args.key!r}")
    entry = found[0]
    json.dump({**_row(entry), "head": entry.head, "reads": dict(entry.reads),
               "output": json.loads(entry.output)}, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return EXIT_CLEAN


def _cmd_prune(args: argparse.Namespace) -> int:
    if args.max_entries is None and args.max_age is None and args.max_bytes is None:
        raise InputError("cache prune: give --max-entries, --max-age or --max-bytes")
    cache = open_existing(args.cache)
    try:
        dropped = cache.prune(max_entries=args.max_entries, max_age=args.max_age, max_bytes=args.max_bytes)
    except ValueError as exc:
        raise InputError(f"cache prune: {exc}") from None
    finally:
        cache.close()
    print(f"pruned {dropped} entr{'y' if dropped == 1 else 'ies'} from {args.cache}")
    return EXIT_CLEAN
