"""The cross-run cache: what a key covers, what an entry holds, what a cache object must do.

This module owns the rule of issue 45's cache (the ready-made caches only
store). A cached step's output is looked up under a *head*: the hash of the
step's name, its code fingerprint, its ``version`` tag, the item (for an
item of a mapped step) and the names of the codec's types. Under one head a
cache holds any number of entries, each recording the *reads* of the attempt
that made it: ``{key: hash of the encoded value}`` for every context key the
step read (a dependency's output, a context value), the absent keys it
asked for, and (if it iterated over its context) the set of keys. An entry
is a hit when every read it recorded has the same hash now. So a key the
step never read does not spoil a hit, and one it read cannot be missed: the
step's context is a mapping that records each read (:class:`Reads`).

A value the codec (or JSON) cannot encode cannot be compared: an attempt
that read one is neither looked up nor stored. A wrong hit is then possible
only through what ekit cannot see (docs/cache.md): the clock, files, the
network, settings held outside the step; declare those in the context.

Entries are written once under their key (the head and the reads): the
first writer wins and every later ``put`` of that key gets the stored
entry back, so two processes filling one key both go on with one value.
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ekit_core import TokenUsage
from ekit_core.code import CacheHit
from ekit_core.usage import NO_USAGE
from ekit_runtime import human
from ekit_runtime.context import DictLike
from ekit_runtime.stores.codec import default_dumps, default_loads

__all__ = ["Cache", "CacheEntry", "CacheHit", "CachedStep", "Reads", "entry_key", "head_of"]

_NOTHING: Any = object()
Hasher = Callable[[str], "str | None"]
"""The hash of the value a key holds in a step's context now (``None``: it cannot be encoded)."""
_ABSENT = "-"  # the hash recorded for a key the step asked for and the context did not hold
KEYS = "\x00keys"
"""The read recorded for a step that iterated over its context: the hash of its sorted key set."""
ANSWERS = "\x00answers"
"""The read recorded for a step that had answers to its questions (:mod:`ekit_runtime.human`)."""


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def head_of(step: str, fingerprint: str, version: str | None, item: str | None,
            types: Sequence[str]) -> str:
    """The head a step's entries are kept under (see the module)."""
    return _hash(default_dumps(["ekit-cache-1", step, fingerprint, version, item, sorted(types)]))


# The JSON text of a string, as default_dumps writes it (ensure_ascii off): the C encoder's.
_quoted: Callable[[str], str] = json.encoder.encode_basestring


_TYPES: dict[tuple[str, ...], str] = {}  # a codec's type names -> their text in a head (memo)


def _head_text(step: str, fingerprint: str, version: str | None, item: str | None,
               types: tuple[str, ...]) -> str | None:
    """The text :func:`head_of` hashes, written directly: the same characters as ``default_dumps``
    of its list (about a third of its cost). ``None`` for a value that is not a plain ``str``."""
    text = _TYPES.get(types)
    if text is None:
        if not all(type(t) is str for t in types):
            return None
        text = _TYPES[types] = f",[{','.join(map(_quoted, sorted(types)))}]]"
    if type(step) is not str or type(fingerprint) is not str or (
            version is not None and type(version) is not str) or (item is not None and type(item) is not str):
        return None
    return (f'["ekit-cache-1",{_quoted(step)},{_quoted(fingerprint)},'
            f'{"null" if version is None else _quoted(version)},'
            f'{"null" if item is None else _quoted(item)}{text}')


class _Constant(Exception):
    """``NaN`` or an infinity in a stored text: :func:`loads` lets ``default_loads`` refuse it."""


def _refuse(name: str) -> Any:
    raise _Constant(name)


_SCAN: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder(parse_constant=_refuse).scan_once  # type: ignore[attr-defined]


def loads(text: str) -> Any:
    """:func:`~ekit_runtime.stores.codec.default_loads` of a text a cache stored, by the C
    scanner alone: a hit reads one or two small texts, and the decoder's Python around the
    scan cost more than the parse. A text it does not read whole (whitespace around it, a
    NaN, bad JSON) goes to ``default_loads``, which reads or refuses it as ever."""
    if type(text) is str:
        try:
            value, end = _SCAN(text, 0)
        except Exception:  # (StopIteration: no value at all)
            return default_loads(text)
        if end == len(text):
            return value
    return default_loads(text)


def entry_key(head: str, reads: Mapping[str, str]) -> str:
    """An entry's key: its head and its reads, hashed (what a cache stores it under, once)."""
    text = _key_text(head, reads)
    return _hash(default_dumps([head, sorted(reads.items())]) if text is None else text)


def _key_text(head: str, reads: Mapping[str, str]) -> str | None:
    """The text :func:`entry_key` hashes, written directly: the same characters as
    ``default_dumps`` of its list, whose encoder's Python (set up at each call) cost a
    lookup more than the hash. ``None`` for a value that is not a plain ``str``."""
    if type(head) is not str:
        return None
    pairs = sorted(reads.items())
    for key, hashed in pairs:
        if type(key) is not str or type(hashed) is not str:
            return None
    return f"[{_quoted(head)},[{','.join([f'[{_quoted(k)},{_quoted(h)}]' for k, h in pairs])}]]"


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """One recorded output: under ``head``, for the ``reads`` it was made from.

    ``output`` is its encoded form (JSON text of the codec's plain data),
    ``usage`` what making it cost (what a hit saves), ``created`` when it
    was stored (UTC epoch seconds), ``step`` the name of the step or item
    that made it (for listing), ``key`` its :func:`entry_key`.
    """

    head: str
    reads: Mapping[str, str]
    output: str
    usage: TokenUsage = NO_USAGE
    created: float = field(default_factory=time.time)
    step: str = ""
    # The key a cache stored it under, as read back with it (``""``: computed when asked):
    # a hit's key is recorded, and hashing it again costs a hit as much as its lookup.
    stored_key: str = field(default="", repr=False, compare=False)

    @classmethod
    def _read_back(cls, head: str, reads: Mapping[str, str], output: str, usage: TokenUsage,
                   created: float, step: str, key: str) -> CacheEntry:
        """The entry a cache read back, every field given: filled as an :class:`_EntryTwin` (plain
        slot stores), then made a ``CacheEntry`` by ``__class__`` assignment (the two share one
        slot layout). The frozen ``__init__`` sets each field with ``object.__setattr__``, and
        the slots' own setters are called through argument tuples: 4k more an entry read."""
        entry = _EntryTwin()
        entry.head, entry.reads, entry.output, entry.usage = head, reads, output, usage
        entry.created, entry.step, entry.stored_key = created, step, key
        entry.__class__ = cls  # type: ignore[assignment]
        return entry  # type: ignore[return-value]

    @property
    def key(self) -> str:
        """The entry's key: :func:`entry_key` of its head and reads."""
        return self.stored_key or entry_key(self.head, self.reads)

    def to_json(self) -> str:
        """The entry as one JSON text (what the directory cache writes; the others store columns)."""
        return default_dumps({
            "head": self.head, "reads": dict(self.reads), "output": self.output,
            "usage": self.usage.to_dict(), "created": self.created, "step": self.step,
        })

    @classmethod
    def from_json(cls, text: str) -> CacheEntry:
        """The inverse of :meth:`to_json` (``ValueError`` for anything else)."""
        data = default_loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("reads"), dict):
            raise ValueError("not a cache entry")
        usage = data["usage"]
        return cls(str(data["head"]), dict(data["reads"]), str(data["output"]),
                   TokenUsage(usage["input_tokens"], usage["output_tokens"], usage["llm_calls"]),
                   float(data["created"]), str(data.get("step", "")))


class Cache:
    """What a cache object does; subclass it (see :class:`SqliteCache`, :class:`DirectoryCache`).

    ``candidates(head)`` returns the entries stored under ``head`` that are
    not past the cache's age bound; ``put(entry)`` stores ``entry`` unless
    an entry with its key is stored already, and returns the stored one.
    Both may be called from any thread. ``entries()`` lists every entry and
    ``prune()`` applies the bounds (or those given), returning how many went.
    A cache must never hand back an entry that was not written whole.
    ``local`` says its calls are quick local I/O (a file), made on the event
    loop's thread; a cache over the network (PostgreSQL) leaves it false,
    and its calls are made in a worker thread.
    """

    local = False

    def candidates(self, head: str) -> list[CacheEntry]:
        """The entries stored under ``head``, newest first."""
        raise NotImplementedError

    def put(self, entry: CacheEntry) -> CacheEntry:
        """Store ``entry`` unless its key is taken; the entry stored under its key."""
        raise NotImplementedError

    def few(self, heads: Sequence[str]) -> dict[str, list[CacheEntry] | None]:
        """For each of ``heads``: every entry under it, newest first, when it has only a few
        (``None``: more, or the cache cannot tell; ask :meth:`find`). A run's start reads them
        all at once, then matches them as its steps' inputs become known, with no query more."""
        return dict.fromkeys(heads)

    def find(self, wanted: Sequence[tuple[str, Hasher]]) -> list[CacheEntry | None]:
        """For each ``(head, hasher)``: the newest entry under ``head`` whose every read
        ``hasher(key)`` gives the same hash for now (``None``: none does).

        ``hasher`` hashes the value a key holds in the asking step's context (``None``:
        it cannot be encoded). This default reads every entry under each head
        (:meth:`candidates`); :class:`SqliteCache` keeps the sets of keys its entries
        read by head, so that it fetches only the entries that can match, by key.
        """
        found: list[CacheEntry | None] = []
        for head, hasher in wanted:
            found.append(next((e for e in self.candidates(head)
                               if all(hasher(k) == h for k, h in e.reads.items())), None))
        return found

    def entries(self) -> Iterator[CacheEntry]:
        """Every entry held, in no particular order."""
        raise NotImplementedError

    def prune(self, *, max_entries: int | None = None, max_age: float | None = None,
              max_bytes: int | None = None) -> int:
        """Drop entries past the bounds (the cache's own where not given); how many were dropped."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the cache holds open (a connection)."""


class _EntryTwin:
    """A ``CacheEntry`` being read back: its slots, in its order, and no frozen ``__setattr__``
    (the core's construction trick, ``ekit_core._frozen`` says why; ``__class__`` assignment
    needs the same layout, which :func:`_same_layout` checks at import)."""

    __slots__ = CacheEntry.__slots__
    head: str
    reads: Mapping[str, str]
    output: str
    usage: TokenUsage
    created: float
    step: str
    stored_key: str


def _same_layout(filling: type, frozen: type) -> None:
    """Refuse at import a twin whose slots drifted from its frozen class's (a field added to one)."""
    if filling.__slots__ != frozen.__slots__ or frozen.__bases__ != (object,):  # type: ignore[attr-defined]
        raise TypeError(f"{filling.__name__} must have the slots of {frozen.__name__}")


_same_layout(_EntryTwin, CacheEntry)


_new = object.__new__
_SET_HIT_KEY, _SET_HIT_SAVED = (vars(CacheHit)[name].__set__ for name in ("key", "saved"))


def hit_of(entry: CacheEntry) -> CacheHit:
    """The hit ``entry`` makes, as checkpoints record it: ``CacheHit(entry.key, entry.usage)``,
    made through its slots (its frozen ``__init__`` sets each field with ``object.__setattr__``:
    1.2k a hit), the two values being those of an entry already made. (Not through a twin, as a
    read-back entry is: ``CacheHit`` is the core's, and the core lists the values it builds so.)"""
    hit: CacheHit = _new(CacheHit)
    _SET_HIT_KEY(hit, entry.key)
    _SET_HIT_SAVED(hit, entry.usage)
    return hit


def find_by_key_sets(wanted: Sequence[tuple[str, Hasher]], key_sets: Mapping[str, Sequence[Sequence[str]]],
                     fetch: Callable[[list[tuple[str, str]]], Iterable[CacheEntry]]
                     ) -> list[CacheEntry | None]:
    """:meth:`Cache.find` of a cache that keeps, for each head, the sets of keys its entries
    read (``key_sets``): each set's keys hashed as the asking step's context holds them now
    make the key of the one entry that can match, and ``fetch(pairs)`` reads those entries
    (the fresh ones of them) by ``(head, key)``. So a lookup reads no entry made from other inputs,
    however many the cache holds. Each entry found is checked read by read all the same."""
    asked: dict[tuple[str, str], list[int]] = {}  # (head, entry key) -> which of wanted would take it
    for n, (head, hasher) in enumerate(wanted):
        for keys in key_sets.get(head, ()):
            reads = {}
            for key in keys:
                hashed = hasher(key)
                if hashed is None:
                    break
                reads[key] = hashed
            else:
                asked.setdefault((head, entry_key(head, reads)), []).append(n)
    found: list[CacheEntry | None] = [None] * len(wanted)
    if not asked:
        return found
    for entry in fetch(list(asked)):
        for n in asked.get((entry.head, entry.key), ()):
            head, hasher = wanted[n]
            best = found[n]
            if entry.head == head and (not entry.reads or all(
                    hasher(k) == h for k, h in entry.reads.items())) and (
                    best is None or entry.created > best.created):
                found[n] = entry
    return found


def key_set(reads: Iterable[str]) -> str:
    """The set of keys an entry read, as the caches' indexes hold it (JSON of the sorted keys)."""
    return default_dumps(sorted(reads))


class _Unencodable(Exception):
    """A value read that cannot be encoded: the attempt is neither looked up nor stored."""


class Reads(DictLike):
    """A step's context that records what the step reads (see the module).

    Each key read is recorded once, with the hash of its value's encoding at
    the moment it is first read (a value the step changes in place later does
    not change the record); a key the step wrote before reading it is its
    own, not an input. Iterating, ``len``, ``keys()`` record the key set;
    what shows or copies all of it (``repr``, ``copy()``, ``|``, a deep copy,
    a pickle) records every key and value.
    """

    __slots__ = ("_context", "_encode", "_written", "failed", "reads")

    def __init__(self, context: MutableMapping[str, Any], encode: Any) -> None:
        self._context, self._encode = context, encode
        self.reads: dict[str, str] = {}
        self._written: set[str] = set()
        self.failed: str | None = None  # the key whose value could not be encoded

    def _read(self, key: str) -> None:
        if key in self.reads or key in self._written:
            return
        try:
            self.reads[key] = value_hash(self._context, key, self._encode)
        except _Unencodable:
            self.failed = self.failed or str(key)
            self.reads[key] = "?"

    def __getitem__(self, key: str) -> Any:
        self._read(key)
        return self._context[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._written.add(key)
        self._context[key] = value

    def __delitem__(self, key: str) -> None:
        self._read(key)  # whether it was there (a KeyError or not) is an input
        self._written.add(key)
        del self._context[key]

    def __iter__(self) -> Iterator[str]:
        self._keys()
        return iter(self._context)

    def __len__(self) -> int:
        self._keys()
        return len(self._context)

    def _keys(self) -> None:
        if KEYS not in self.reads:
            self.reads[KEYS] = keys_hash(self._context)

    def _all(self) -> None:
        self._keys()
        for key in list(self._context):
            self._read(key)

    def __repr__(self) -> str:
        self._all()  # a prompt may hold the context's repr: all of it is an input then
        return f"Reads({self._context!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # copy.copy, copy.deepcopy and pickle go through here: they get a dict of
        # everything, read (a copy of this object would record its reads elsewhere).
        return (dict, (self.copy(),))


def keys_hash(context: Mapping[str, Any]) -> str:
    """The hash of a context's key set (the read of a step that iterated over it)."""
    return _hash(default_dumps(sorted(map(str, context))))


def value_hash(context: Mapping[str, Any], key: str, encode: Any) -> str:
    """The hash of ``context[key]``'s encoding, or the mark of an absent key."""
    if key == KEYS:
        return keys_hash(context)
    if key == ANSWERS:
        return answers_hash()
    try:
        value = context[key]
    except KeyError:
        return _ABSENT
    try:
        text = default_dumps(_typed(encode(value)))
    except Exception as exc:  # (TypeError, ValueError, UnencodableError: all mean "cannot compare")
        raise _Unencodable(key) from exc
    return _hash(text)


def answers_hash() -> str:
    """The hash of the answers the attempt running in this context has (the mark of none)."""
    asking = human.ANSWERS.get(None)
    if asking is None or not asking.answers:
        return _ABSENT
    try:
        return _hash(default_dumps([[a.value, a.approved] for a in asking.answers]))
    except Exception as exc:
        raise _Unencodable(ANSWERS) from exc


_EXACT = frozenset({str, int, float, bool, type(None)})
_KEY_TYPES = (str, int, float, bool, type(None))


def _typed(data: Any) -> Any:
    """``data`` (an encoding's plain data) with what JSON would blur made plain: a tuple is not a
    list, an ``int`` key not a ``str`` key, a ``str`` or ``int`` subclass (an enum) not its base.

    Every container becomes a one-key dict (a scalar never is one), so no two differ only in tags.
    """
    kind = type(data)
    if kind in _EXACT:
        return data
    if kind is list or kind is tuple:
        return {"l" if kind is list else "t": [_typed(v) for v in data]}
    if kind is dict:
        pairs = []
        for k, v in data.items():
            if not isinstance(k, _KEY_TYPES):
                raise TypeError(f"a key of type {type(k).__name__} is no JSON key")
            pairs.append([_typed(k), _typed(v)])
        return {"d": pairs}
    if isinstance(data, _KEY_TYPES):  # a subclass: an IntEnum, a str subclass
        base = next(b for b in kind.__mro__ if b in _EXACT)
        return {"s": [f"{kind.__module__}.{kind.__qualname__}", base(data)]}
    raise TypeError(f"{kind.__name__} is not plain data")


@dataclass(slots=True)
class CachedStep:
    """One cached step of one run: its head prefix, the cache, the codec's encode and decode."""

    cache: Cache
    step: str
    fingerprint: str
    version: str | None
    types: tuple[str, ...]
    encode: Any
    decode: Any
    # id(entry) -> its output, decoded by lookup or store, handed on by output_of (a hit decodes
    # once; by id, not key: a key is a hash to compute, and the caller holds the entry meanwhile)
    _decoded: dict[int, Any] = field(default_factory=dict)
    def head(self, item: str | None) -> str:
        """The head of the step, or of one of its items: :func:`head_of` of them."""
        text = _head_text(self.step, self.fingerprint, self.version, item, self.types)
        if text is None:
            return head_of(self.step, self.fingerprint, self.version, item, self.types)
        return _hash(text)

    def lookup(self, head: str, context: Mapping[str, Any]) -> CacheEntry | None:
        """The newest entry under ``head`` whose every read matches ``context`` now, or ``None``."""
        return lookup_all(self.cache, [(self, head, context)])[0]

    def hasher(self, context: Mapping[str, Any]) -> Hasher:
        """What hashes each key's value in ``context`` (once a key), for :meth:`Cache.find`."""
        memo: dict[str, str | None] = {}
        encode = self.encode

        def hashed(key: str) -> str | None:
            if key not in memo:
                try:
                    memo[key] = value_hash(context, key, encode)
                except _Unencodable:
                    memo[key] = None
            return memo[key]
        return hashed

    def output_of(self, entry: CacheEntry) -> Any:
        """The output an entry holds, decoded."""
        decoded = self._decoded.pop(id(entry), _NOTHING)
        return self.decode(loads(entry.output)) if decoded is _NOTHING else decoded

    def _decodes(self, entry: CacheEntry) -> bool:
        """Whether ``entry``'s output decodes (kept for :meth:`output_of`): one that no longer
        does (damaged, or made with an output type that changed since) is a miss, with a warning."""
        try:
            self._decoded[id(entry)] = self.decode(loads(entry.output))
        except Exception as exc:
            _warn(f"the entry {entry.key} of {self.step!r} in {self.cache!r} cannot be decoded; "
                  "passing over it", exc)
            return False
        return True

    def store(self, head: str, reads: Reads, name: str, output: Any, usage: TokenUsage
              ) -> CacheEntry | None:
        """Store ``output`` under ``head`` for the reads recorded. ``None`` when it is stored (or
        cannot be: an input or the output cannot be encoded); the entry another process stored
        under that key first, with another output, which the run then goes on with."""
        if reads.failed is not None:
            return None
        recorded = dict(reads.reads)
        try:
            text = default_dumps(self.encode(output))
            given = answers_hash()  # a step that asked: its answers are an input
        except Exception:
            return None
        if given != _ABSENT:
            recorded[ANSWERS] = given
        try:
            stored = self.cache.put(CacheEntry(head, recorded, text, usage, time.time(), name))
        except Exception as exc:  # the call is paid and its output is the run's: keep it
            _warn(f"could not store the output of {name!r} in {self.cache!r}", exc)
            return None
        if stored.output == text:
            return None
        # another process stored this key first: all go on with its output, if it decodes
        return stored if self._decodes(stored) else None


def _warn(what: str, exc: Exception) -> None:
    warnings.warn(f"ekit: {what}: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=3)


def lookup_all(cache: Cache, wanted: Sequence[tuple[CachedStep, str, Mapping[str, Any]]]
               ) -> list[CacheEntry | None]:
    """For each ``(cached step, head, context)`` of one cache: its hit, or ``None``; in one
    :meth:`Cache.find`. An entry that no longer decodes is a miss; a cache that fails is a
    miss for all (with a warning), never an error: the steps run."""
    try:
        found = cache.find([(head, step.hasher(context)) for step, head, context in wanted])
    except Exception as exc:  # a damaged or unreachable cache: the steps run, as on a miss
        names = ", ".join(repr(step.step) for step, _, _ in wanted)
        _warn(f"could not look up {names} in {cache!r}; running them", exc)
        return [None] * len(wanted)
    return [entry if entry is not None and step._decodes(entry) else None
            for (step, _, _), entry in zip(wanted, found, strict=True)]
