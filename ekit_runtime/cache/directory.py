"""``DirectoryCache``: the cross-run cache as files in a directory (one file per entry).

An entry is ``<root>/<head>/<key>.json``: a line holding the SHA-256 of the
rest, then the entry's JSON. It is written to a temporary file, flushed to
disk, then hard-linked into place: ``link`` is atomic and fails if the name
exists, so the first writer of a key wins and a later one reads the entry
stored. A file whose checksum does not match (a disk fault, a hand edit) is
never served; a temporary file left by a killed writer is never read, and
``prune`` removes it.

Each head's folder also keeps, in ``.keys/``, one file per set of keys its
entries read (usually one): written the same way, before the entry, so that
an entry is never stored unindexed. A lookup reads those few files, hashes
the step's values of each set's keys, and opens the one entry file that key
names: it reads no entry made from other inputs, however many the head holds.
A directory written before the index existed is indexed when first opened
(``.ekit-indexed`` says it was).
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ekit_runtime.cache.base import Cache, CacheEntry, Hasher, _warn, find_by_key_sets, key_set, loads
from ekit_runtime.cache.sqlite import check_bounds

__all__ = ["DirectoryCache"]

_TMP = ".tmp-"
_KEYS = ".keys"  # in a head's folder: one file per set of keys its entries read
_INDEXED = ".ekit-indexed"  # in the root: every entry written before the index is indexed
_NAME = re.compile(r"[A-Za-z0-9_-]+")


class DirectoryCache(Cache):
    """The cache in the directory ``root`` (created if missing); bounds as :class:`SqliteCache`'s."""

    def __init__(self, root: str | os.PathLike[str], *, max_entries: int | None = None,
                 max_age: float | None = None, max_bytes: int | None = None) -> None:
        check_bounds(max_entries, max_age, max_bytes)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_entries, self.max_age, self.max_bytes = max_entries, max_age, max_bytes
        if not (self.root / _INDEXED).exists():
            try:
                self._index_all()
            except OSError as exc:  # a directory this process may only read: those entries miss
                _warn(f"could not index the entries of {self!r}; they are not looked up", exc)

    def _index_all(self) -> None:
        """Index the entries of a directory written before the index existed, then say so."""
        for path in _entry_files(self.root):
            entry = _read(path)
            if entry is not None:
                self._index(path.parent, entry.reads)
        self._write_once(self.root / _INDEXED, b"", _whole)

    local = True  # local files: its calls are made on the loop (a thread hop costs more)

    def __repr__(self) -> str:
        return f"DirectoryCache({str(self.root)!r})"

    def candidates(self, head: str) -> list[CacheEntry]:
        """The entries under ``head`` younger than ``max_age``, newest first."""
        folder = self.root / _checked(head)
        if not folder.is_dir():
            return []
        # (an entry copied under another head's folder claims another step: never served there)
        found = [e for e in map(_read, sorted(folder.glob("*.json"))) if e is not None and e.head == head]
        if self.max_age is not None:
            fresh = time.time() - self.max_age
            found = [e for e in found if e.created >= fresh]
        return sorted(found, key=lambda e: e.created, reverse=True)

    def find(self, wanted: Sequence[tuple[str, Hasher]]) -> list[CacheEntry | None]:
        """See :meth:`Cache.find`: the key sets of each head (``.keys/``), then the one entry
        file each set's key names, whichever the number of entries under a head."""
        key_sets = {head: self._key_sets(head) for head in dict.fromkeys(head for head, _ in wanted)}
        return find_by_key_sets(wanted, key_sets, self._by_keys)

    def _key_sets(self, head: str) -> list[list[str]]:
        """The sets of keys the entries under ``head`` read (a damaged file's: left out)."""
        try:
            names = os.listdir(self.root / _checked(head) / _KEYS)
        except (FileNotFoundError, NotADirectoryError):
            return []
        found = []
        for name in sorted(names):
            if name.endswith(".json"):
                keys = _read_keys(self.root / head / _KEYS / name)
                if keys is not None:
                    found.append(keys)
        return found

    def _by_keys(self, pairs: list[tuple[str, str]]) -> list[CacheEntry]:
        """The whole, fresh entries stored under ``pairs`` (``(head, key)``)."""
        fresh = time.time() - self.max_age if self.max_age is not None else float("-inf")
        found = []
        for head, key in pairs:
            entry = _read(self.root / _checked(head) / f"{key}.json")
            if entry is not None and entry.head == head and entry.created >= fresh:
                found.append(entry)
        return found

    def put(self, entry: CacheEntry) -> CacheEntry:
        """Store ``entry`` unless its key is taken (then the stored one wins); the stored entry."""
        folder = self.root / _checked(entry.head)
        folder.mkdir(exist_ok=True)
        self._index(folder, entry.reads)  # first: an entry is never stored unindexed
        final = folder / f"{entry.key}.json"
        if not self._write_once(final, entry.to_json().encode("utf-8"), _read):
            stored = _read(final)
            if stored is not None:  # (else pruned meanwhile by another process: this one stands)
                return stored
        if any(b is not None for b in (self.max_entries, self.max_age, self.max_bytes)):
            self.prune()
        return entry

    def _index(self, folder: Path, reads: object) -> None:
        """Record in ``folder/.keys/`` the set of keys ``reads`` read, unless it is there whole."""
        keys = key_set(reads)  # type: ignore[arg-type]
        where = folder / _KEYS / f"{hashlib.sha256(keys.encode('utf-8', 'surrogatepass')).hexdigest()}.json"
        if _read_keys(where) is not None:
            return
        where.parent.mkdir(exist_ok=True)
        self._write_once(where, keys.encode("utf-8", "surrogatepass"), _read_keys)

    def _write_once(self, final: Path, body: bytes, stands: Callable[[Path], object]) -> bool:
        """Write ``body`` under its checksum line at ``final`` unless a file ``stands`` there
        (true: it is whole and reads): to a temporary file, flushed to disk, then hard-linked
        into place (atomic; fails if the name exists), so the first writer wins. Whether it wrote."""
        tmp = self.root / f"{_TMP}{os.getpid()}-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(hashlib.sha256(body).hexdigest().encode("ascii") + b"\n" + body)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, final)
        except FileExistsError:
            if stands(final):
                return False
            os.replace(tmp, final)  # a damaged file under the name: this one replaces it
        finally:
            tmp.unlink(missing_ok=True)
        return True

    def entries(self) -> Iterator[CacheEntry]:
        """Every whole entry, newest first."""
        found = [e for e in map(_read, _entry_files(self.root)) if e is not None]
        return iter(sorted(found, key=lambda e: e.created, reverse=True))

    def prune(self, *, max_entries: int | None = None, max_age: float | None = None,
              max_bytes: int | None = None) -> int:
        """Drop the oldest entries past the bounds given (the cache's own where not given),
        damaged files, and temporary files older than a minute (a killed writer's)."""
        check_bounds(max_entries, max_age, max_bytes)
        max_entries = max_entries if max_entries is not None else self.max_entries
        max_age = max_age if max_age is not None else self.max_age
        max_bytes = max_bytes if max_bytes is not None else self.max_bytes
        dropped = 0
        now = time.time()
        for tmp in self.root.glob(f"{_TMP}*"):
            try:
                if tmp.stat().st_mtime < now - 60:
                    tmp.unlink()
            except FileNotFoundError:
                pass
        files: list[tuple[float, int, Path]] = []
        for path in _entry_files(self.root):
            entry = _read(path)
            try:  # another process's prune may remove any entry at any moment: then it is gone
                size = path.stat().st_size
                if entry is None:
                    path.unlink()
                    dropped += 1
                    continue
            except FileNotFoundError:
                continue
            files.append((entry.created, size, path))
        files.sort(reverse=True)
        total = 0
        for i, (created, size, path) in enumerate(files):
            total += size
            if ((max_age is not None and created < now - max_age)
                    or (max_entries is not None and i >= max_entries)
                    or (max_bytes is not None and total > max_bytes)):
                path.unlink(missing_ok=True)
                dropped += 1
        return dropped


def _checked(head: str) -> str:
    """``head``, refused unless it is one plain name (a hash): never a path out of the root."""
    if not isinstance(head, str) or not _NAME.fullmatch(head):
        raise ValueError(f"a cache entry's head must be a hash (letters, digits, - and _), got {head!r:.80}")
    return head


def _entry_files(root: Path) -> Iterator[Path]:
    """The entry files under ``root``: never through a folder that is a link to elsewhere."""
    for folder in root.iterdir():
        if folder.is_dir() and not folder.is_symlink():
            yield from (p for p in folder.glob("*.json") if not p.is_symlink())


def _whole(path: Path) -> bytes | None:
    """The body of the file at ``path`` if it is whole (its checksum matches), else ``None``."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    digest, _, body = data.partition(b"\n")
    if hashlib.sha256(body).hexdigest().encode("ascii") != digest:
        return None
    return body


def _read(path: Path) -> CacheEntry | None:
    """The entry in ``path`` if it is whole (its checksum matches), else ``None``."""
    body = _whole(path)
    if body is None:
        return None
    try:
        return CacheEntry.from_json(body.decode("utf-8"))
    except (ValueError, KeyError, TypeError):
        return None


def _read_keys(path: Path) -> list[str] | None:
    """The set of keys in the index file ``path`` if it is whole, else ``None``."""
    body = _whole(path)
    if body is None:
        return None
    try:
        keys = loads(body.decode("utf-8", "surrogatepass"))
    except ValueError:
        return None
    return keys if isinstance(keys, list) and all(isinstance(k, str) for k in keys) else None
