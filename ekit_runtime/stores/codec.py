"""How a store turns a checkpoint into text and back: the codec, and each output's first encoding.

Encoding happens in one place so that every store fails the same way on an
output it cannot write: a :class:`~ekit_runtime.stores.errors.UnencodableError`
naming the step, raised before a single byte reaches storage.
:class:`OutputEncodings` keeps the mutation rule of docs/stores.md (what is
stored for a step never changes). Every store writes UTF-8: the checks of
what text it cannot hold are here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn, TypeAlias

from ekit_core import WorkflowCheckpoint
from ekit_core.checkpoint import has_durations
from ekit_runtime.stores.errors import UnencodableError

__all__ = [
    "Dumps",
    "Loads",
    "OutputEncodings",
    "check_checkpoint_text",
    "codec",
    "default_dumps",
    "default_loads",
    "encode",
    "encode_text",
    "same_run",
    "utf8_problem",
]

Dumps: TypeAlias = Callable[[Any], str]
"""Turns plain data (dicts, lists, str, numbers, outputs) into text."""

Loads: TypeAlias = Callable[[str], Any]
"""The inverse of a :data:`Dumps`: text back into plain data."""


def codec(dumps: Dumps | None, loads: Loads | None) -> tuple[Dumps, Loads]:
    """A store's ``(dumps, loads)``: the ones given, else the strict JSON pair (no NaN either way).

    Refuses one that is not callable with a ``ValueError`` naming it, when
    the store is made rather than at its first save.
    """
    for name, fn in (("dumps", dumps), ("loads", loads)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} must be a callable or None, got {type(fn).__name__}")
    return (
        dumps if dumps is not None else default_dumps,
        loads if loads is not None else default_loads,
    )


# json.dumps with these options builds an encoder at every call: one, made once, serves every call.
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def default_dumps(data: Any) -> str:
    """Compact, strict JSON on one line: utf-8 text kept as is, NaN and infinities refused."""
    return _ENCODER.encode(data)


class _NonFinite(ValueError):
    pass


def _refuse_constant(name: str) -> NoReturn:
    raise _NonFinite(name)


# json.loads with an option builds a decoder at every call, as json.dumps does: one serves all.
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def default_loads(text: str) -> Any:
    """Strict JSON, the inverse of :func:`default_dumps`: NaN and infinities are refused here too.

    ``json.loads`` reads ``NaN`` and ``Infinity``, which :func:`default_dumps`
    never writes; reading them would make a resume fail later, at a save,
    blaming an old output. The ``ValueError`` says where the value sits.
    """
    try:
        if type(text) is str:
            return _DECODER.decode(text)
        return json.loads(text, parse_constant=_refuse_constant)  # (bytes, as json.loads reads them)
    except _NonFinite as exc:
        where = _nonfinite_at(json.loads(text))
        raise ValueError(
            f"{exc.args[0]} at {where}: JSON has no NaN or infinities, and no store writes them"
        ) from None


def _nonfinite_at(data: Any) -> str:
    """Where the first NaN or infinity in ``data`` is, as subscripts (``['outputs']['a'][0]``)."""
    # A stack, not recursion: stored data may nest deeper than the recursion limit.
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return where or "the top level"
        if isinstance(value, dict):
            stack.extend((v, f"{where}[{k!r}]") for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(value))))
    return "an unknown place"


def _dump(value: Any, dumps: Dumps) -> str:
    text = dumps(value)
    if not isinstance(text, str):
        raise TypeError(f"dumps must return str, got {type(text).__name__}")
    return text


def _to_bytes(value: Any, dumps: Dumps) -> bytes:
    # A lone surrogate passes json.dumps(ensure_ascii=False) and only fails here.
    return _dump(value, dumps).encode("utf-8")


def _to_text(value: Any, dumps: Dumps) -> str:
    text = _dump(value, dumps)
    # Encoded only to fail now on a lone surrogate, before anything is
    # written, rather than inside a SQLite transaction.
    text.encode("utf-8")
    return text


def encode(
    record: Any,
    dumps: Dumps,
    outputs: Iterable[tuple[str, Any]],
    context: Mapping[str, Any] | None = None,
) -> bytes:
    """``dumps(record)`` as utf-8, or :class:`UnencodableError` naming the culprit.

    ``outputs`` and ``context`` are what ``record`` holds; they are only
    walked when encoding fails, to say which step (or context key) is at fault.
    """
    try:
        return _to_bytes(record, dumps)
    except Exception as exc:
        _blame(exc, dumps, outputs, context)


def encode_text(
    record: Any,
    dumps: Dumps,
    outputs: Iterable[tuple[str, Any]],
    context: Mapping[str, Any] | None = None,
) -> str:
    """Like :func:`encode`, for a store that keeps text: ``dumps(record)``, checked to be utf-8-safe."""
    try:
        return _to_text(record, dumps)
    except Exception as exc:
        _blame(exc, dumps, outputs, context)


def _output_error(name: str, exc: Exception, value: Any = None) -> UnencodableError:
    culprit = _culprit(value)
    if culprit is None:
        hint = "pass dumps=/loads= to store rich types"
    else:
        # Named as the workflow's codec would store it (ekit_runtime.typed.type_name).
        spelt, short = f"{culprit.__module__}:{culprit.__qualname__}", culprit.__qualname__
        if dataclasses.is_dataclass(culprit) or callable(getattr(culprit, "model_validate", None)):
            how = f"Workflow(steps, codec=Codec({short}))"
        else:
            how = f"codec.register({short}, encode=..., decode=...) and Workflow(steps, codec=codec)"
        hint = (
            f"it holds a {spelt}: give the workflow a codec that stores it, {how}, "
            "see docs/outputs.md; or pass dumps=/loads= to the store"
        )
    return UnencodableError(
        f"cannot encode the output of step {name!r}: {type(exc).__name__}: {exc}; "
        f"nothing was saved ({hint})",
        step=name,
    )


_PLAIN = (str, int, float, bool, type(None))


def _culprit(value: Any) -> type | None:
    """The type of the first value in ``value`` that is not JSON's (a custom object), if any."""
    stack = [value]  # a stack, not recursion: an output may nest deeper than the limit
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if isinstance(item, _PLAIN):
            continue
        if isinstance(item, dict | list | tuple):
            if id(item) in seen:
                continue
            seen.add(id(item))
            stack.extend(reversed(list(item.values() if isinstance(item, dict) else item)))
            continue
        return type(item)
    return None


def _blame(
    cause: Exception,
    dumps: Dumps,
    outputs: Iterable[tuple[str, Any]],
    context: Mapping[str, Any] | None,
) -> NoReturn:
    """Raise the :class:`UnencodableError` naming the first output or context key at fault."""
    for name, value in outputs:
        try:
            _to_bytes(value, dumps)
        except Exception as exc:
            raise _output_error(name, exc, value) from exc
    for key, value in (context or {}).items():
        try:
            _to_bytes(value, dumps)
        except Exception as exc:
            raise UnencodableError(
                f"cannot encode context key {key!r}: {type(exc).__name__}: {exc}; "
                "nothing was saved"
            ) from exc
    raise UnencodableError(
        f"cannot encode the checkpoint: {type(cause).__name__}: {cause}; nothing was saved"
    ) from cause


# (the output object, b'"<step>":' + its encoding, where the encoding starts)
_Entry: TypeAlias = tuple[Any, bytes, int]
_Chosen: TypeAlias = list[tuple[str, _Entry]]


class OutputEncodings:
    """The first encoding of each step's output, reused for as long as saves hand the same object.

    The library never copies outputs, so a step may mutate an earlier
    step's output after it was saved. The rule (docs/stores.md): a store
    encodes each output once, the first time it saves or loads it, and
    every later write of that step, a full rewrite included, uses that
    encoding, so what is stored for a step never changes. An output is
    "the same" while it is the same object (or, within one run, the same
    by :meth:`WorkflowCheckpoint.delta_since`); another object under that
    name (another run, a hand-made checkpoint) is encoded afresh.

    With the default codec a document is spliced from the cached
    fragments, so re-saving old outputs costs a copy, not an encoding.
    Another codec's text cannot be spliced: old outputs are then decoded
    from their first encoding and encoded again with the document.
    """

    __slots__ = ("_began", "_chosen", "_dumps", "_durations", "_entries", "_fresh", "_json", "_loads",
                 "_prev", "_usage")

    def __init__(self, dumps: Dumps, loads: Loads) -> None:
        self._dumps = dumps
        self._loads = loads
        self._json = dumps is default_dumps
        self._entries: dict[str, _Entry] = {}
        # Names encoded by the last members() call: their objects are the
        # ones just encoded, so the slow path need not decode them back.
        self._fresh: set[str] = set()
        # The last checkpoint document_of() wrote, with its outputs' entries
        # and usage members in order: the next one of the run adds a delta.
        self._prev: WorkflowCheckpoint | None = None
        self._chosen: _Chosen = []
        self._usage: list[bytes] = []
        self._durations: list[bytes] = []
        self._began: list[bytes] = []

    def members(self, outputs: Iterable[tuple[str, Any]], *, every: bool = False) -> _Chosen:
        """``(step, entry)`` for each ``(step, output)``: the cached entry, or a new encoding.

        Raises :class:`UnencodableError` naming the step for an output that
        cannot be encoded. ``every=True`` says that ``outputs`` are all of a
        checkpoint's: entries of other steps are forgotten.
        """
        old = self._entries
        entries = {} if every else old
        chosen: _Chosen = []
        fresh: set[str] = set()
        for name, value in outputs:
            entry = old.get(name)
            if entry is None or entry[0] is not value:
                entry = self._encode(name, value)
                fresh.add(name)
            entries[name] = entry
            chosen.append((name, entry))
        self._entries = entries
        self._fresh = fresh
        return chosen

    def seed(self, outputs: Mapping[str, Any]) -> None:
        """Remember ``outputs`` (just loaded) as stored: their encoding is what later writes use."""
        entries: dict[str, _Entry] = {}
        for name, value in outputs.items():
            with contextlib.suppress(UnencodableError):
                # A loads may build what its dumps cannot write; saving it will say so.
                entries[name] = self._encode(name, value)
        self._entries = entries
        self._prev = None

    def check(self, checkpoint: WorkflowCheckpoint) -> None:
        """Raise the :class:`UnencodableError` a save of ``checkpoint`` would, writing nothing.

        Encodes every field but the per-step ones, and each output not
        encoded yet (those loaded are), which the next save then reuses:
        what a run starts from is checked before its first step.
        """
        check_checkpoint_text(checkpoint)
        encode(checkpoint.to_dict(per_step=False), self._dumps, (), checkpoint.context)
        self.members(checkpoint.outputs.items())

    def document_of(self, checkpoint: WorkflowCheckpoint, head: Mapping[str, Any]) -> bytes:
        """``{**head, **checkpoint.to_dict()}`` encoded, each output from its first encoding.

        Within one run only the outputs, usage and durations new since the
        last call are looked up (``delta_since``); the rest is spliced from
        that call's.
        """
        prev = self._prev
        delta = checkpoint.delta_since(prev) if prev is not None and same_run(checkpoint, prev) else None
        if delta is not None and delta.extends:
            chosen = self._chosen + self.members(delta.outputs)
            new_usage, new_durations, new_began = delta.step_usage, delta.durations, delta.began
            usage, durations, began = self._usage, self._durations, self._began
        else:
            chosen = self.members(checkpoint.outputs.items(), every=True)
            new_usage = tuple(checkpoint.step_usage.items())
            new_durations = tuple(checkpoint.durations.items())
            new_began = tuple(checkpoint.began.items()) if new_durations else ()
            usage, durations, began = [], [], []
        if self._json:
            usage = usage + [
                _to_bytes(name, default_dumps) + b":" + _to_bytes(u.to_dict(), default_dumps)
                for name, u in new_usage
            ]
            durations = durations + [
                _to_bytes(name, default_dumps) + b":" + _to_bytes(seconds, default_dumps)
                for name, seconds in new_durations
            ]
            if new_began:
                began = began + [
                    _to_bytes(name, default_dumps) + b":" + _to_bytes(moment, default_dumps)
                    for name, moment in new_began
                ]
        self._prev, self._chosen, self._usage, self._durations = checkpoint, chosen, usage, durations
        self._began = began
        # to_dict of the checkpoint without its per-step parts: every other
        # field, in order, as the core defines them (cheap, whatever the
        # run's length: the graph's two strings are spelt once per graph).
        record = {**head, **checkpoint.to_dict(per_step=False)}
        if not self._json:
            record["step_usage"] = {k: u.to_dict() for k, u in checkpoint.step_usage.items()}
        if has_durations(checkpoint):  # (written only when there are some, as to_dict does)
            record["durations"] = None if self._json else dict(checkpoint.durations)
            if began:
                record["began"] = None
            elif not self._json and checkpoint.began:
                record["began"] = dict(checkpoint.began)
            if checkpoint.held:  # (sparse: the attempts a limit held; written whole, as it is small)
                record["held"] = {k: dict(h) for k, h in checkpoint.held.items()}
        return self.document(record, chosen, checkpoint.context, usage, durations, began)

    def document(
        self,
        record: Mapping[str, Any],
        chosen: _Chosen,
        context: Mapping[str, Any] | None,
        usage: list[bytes] | None = None,
        durations: list[bytes] | None = None,
        began: list[bytes] | None = None,
    ) -> bytes:
        """``dumps(record)`` as utf-8, ``record["outputs"]`` replaced by the ``chosen`` encodings.

        ``usage``, when given, replaces ``record["step_usage"]`` the same way
        (members ``"<step>":{...}``, default codec only), ``durations``
        ``record["durations"]`` (members ``"<step>":<seconds>``) and ``began``
        ``record["began"]`` (members ``"<step>":<epoch seconds>``).
        """
        if not self._json:
            data = dict(record)
            data["outputs"] = {
                name: entry[0] if name in self._fresh else self._decoded(name, entry)
                for name, entry in chosen
            }
            return encode(data, self._dumps, (), context)
        # default_dumps has no spaces, so this is byte for byte default_dumps(record).
        parts = []
        for key, value in record.items():
            head = _to_bytes(key, default_dumps) + b":"
            if key == "outputs":
                parts.append(head + b"{" + b",".join(entry[1] for _, entry in chosen) + b"}")
            elif key == "step_usage" and usage is not None:
                parts.append(head + b"{" + b",".join(usage) + b"}")
            elif key == "durations" and durations is not None:
                parts.append(head + b"{" + b",".join(durations) + b"}")
            elif key == "began" and began is not None:
                parts.append(head + b"{" + b",".join(began) + b"}")
            else:
                parts.append(head + encode(value, self._dumps, (), context))
        return b"{" + b",".join(parts) + b"}"

    def _encode(self, name: str, value: Any) -> _Entry:
        try:
            head = _to_bytes(name, default_dumps) + b":"
            body = _to_bytes(value, self._dumps)
        except Exception as exc:
            raise _output_error(name, exc, value) from exc
        return (value, head + body, len(head))

    def _decoded(self, name: str, entry: _Entry) -> Any:
        try:
            return self._loads(entry[1][entry[2] :].decode("utf-8"))
        except Exception as exc:
            raise UnencodableError(
                f"cannot write the output of step {name!r} again: loads cannot read what dumps "
                f"made of it ({type(exc).__name__}: {exc}); nothing was saved",
                step=name,
            ) from exc


def same_run(checkpoint: WorkflowCheckpoint, previous: WorkflowCheckpoint) -> bool:
    """Whether ``checkpoint`` may be stored as a delta on ``previous``: same run, same format.

    A different fingerprint, format version or graph means another run (or
    another version of the workflow), which the stores write in full.
    """
    return (
        checkpoint.fingerprint == previous.fingerprint
        and checkpoint.format_version == previous.format_version
        # Checkpoints of one run share the graph object: skip the deep comparison.
        and (checkpoint.graph is previous.graph or checkpoint.graph == previous.graph)
    )


def utf8_problem(text: str) -> str | None:
    """Why UTF-8 (every store's text) cannot hold ``text``, or ``None`` if it can."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"it holds {text[exc.start:exc.end]!r} at {exc.start}, which UTF-8 cannot encode"
    return None


def check_checkpoint_text(
    checkpoint: WorkflowCheckpoint, name_problem: Callable[[str], str | None] = utf8_problem
) -> None:
    """Refuse a step name, version tag or context key of ``checkpoint`` that no save could write.

    Raises :class:`UnencodableError` naming the step (or the context key)
    for text UTF-8 cannot hold, and for a step name that ``name_problem``
    finds fault with (a database may have stricter rules for its keys).
    Stores run it on the checkpoint a run starts from (see ``prepare_run``),
    so that a name they could never write fails before the first step, not
    at its save; it costs O(steps), whatever the outputs.
    """
    graph = checkpoint.graph
    names = graph.keys() if graph is not None else checkpoint.outputs.keys()
    checks: list[tuple[str, Callable[[str], str | None], str, str | None]] = [
        (n, name_problem, f"the name of step {n!r}", n) for n in names
    ]
    checks += [
        (tag, utf8_problem, f"the version tag of step {n!r}", n) for n, tag in checkpoint.versions.items()
    ]
    checks += [(key, utf8_problem, f"context key {key!r}", None) for key in checkpoint.context]
    for text, problem, what, step in checks:
        why = problem(text) if isinstance(text, str) else None
        if why is not None:
            raise UnencodableError(f"cannot store {what}: {why}; nothing was saved", step=step)
