"""Typed outputs: the :class:`Codec` a workflow is given, to store its steps' own types.

A step may return a pydantic model, a dataclass or any value of a type the
caller registered. The codec turns such an output into plain data (a tagged
object, see docs/outputs.md) in every checkpoint the run hands out, so that
every store and the run queue can hold it, and turns it back into the same
type when a run resumes. Decoding looks a tag's type name up in the codec's
registry only: nothing named in a checkpoint is ever imported or evaluated.

The workflow's runs use it through :func:`run_options` (the checkpoint
function wrapped, ``resume_from`` decoded) and :func:`final_checkpoint`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import sys
import types
import typing
import weakref
from collections import abc
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

from ekit_core import TokenUsage, WorkflowCheckpoint
from ekit_core.checkpoint import CheckpointError, given_began, given_held
from ekit_core.ledger import Ledger
from ekit_runtime.children import unwrapped
from ekit_runtime.step import PatternResult, Step
from ekit_runtime.stores.errors import UnencodableError

if typing.TYPE_CHECKING:
    from ekit_runtime.runner import Runner

__all__ = ["TAG", "Codec", "final_checkpoint", "run_options", "type_name"]

TAG = "$ekit"
"""The key that marks a tagged object in stored outputs (docs/outputs.md)."""

T = TypeVar("T")

_JSON_TYPES = (str, int, float, bool, type(None), list, dict, tuple)


def type_name(cls: type) -> str:
    """The name a type is stored under unless registered with another: ``module:qualname``."""
    return f"{cls.__module__}:{cls.__qualname__}"


@dataclasses.dataclass(frozen=True, slots=True)
class _Entry:
    cls: type
    name: str
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]


class _Unregistered(Exception):
    """A dataclass or pydantic model met while encoding whose type the codec does not know."""

    def __init__(self, cls: type) -> None:
        super().__init__(cls)
        self.cls = cls


def _pydantic_base() -> type | None:
    """pydantic's ``BaseModel``, if pydantic is imported already (never imported here)."""
    module = sys.modules.get("pydantic")
    base = getattr(module, "BaseModel", None) if module is not None else None
    return base if isinstance(base, type) else None


def _is_model(cls: object) -> bool:
    base = _pydantic_base()
    return base is not None and isinstance(cls, type) and issubclass(cls, base)


def _is_enum(cls: object) -> bool:
    return isinstance(cls, type) and issubclass(cls, enum.Enum)


def _known_kind(cls: object) -> bool:
    """Whether ``cls`` is one a codec stores with nothing written: a model, a dataclass, an enum."""
    return _is_dataclass(cls) or _is_model(cls) or _is_enum(cls)


def _enum_encoder(value: Any) -> Any:
    return value.value


def _is_dataclass(cls: object) -> bool:
    return isinstance(cls, type) and dataclasses.is_dataclass(cls)


class _Tuple(tuple[Any, ...]):
    """A tuple held by a dataclass field whose annotation admits another array: stored tagged,
    ``{"$ekit": "tuple", "value": [...]}``, since a list would come back as a list."""

    __slots__ = ()


def _dataclass_encoder(value: Any) -> dict[str, Any]:
    listed = _tuple_fields(type(value))
    fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    for name, item in fields.items():
        marked = _marked(item)
        if name in listed and type(marked) is _Tuple:
            marked = tuple(marked)  # stored as a list: its annotation says it is a tuple
        if marked is not item:
            fields[name] = marked
    return fields


def _marked(value: Any) -> Any:
    """``value`` with every tuple in it (itself included) marked to be stored tagged: the same
    object when it holds none. Only lists, dicts and tuples are walked: other values are the
    codec's (a dataclass marks its own fields)."""
    kind = type(value)
    if kind is tuple:
        return _Tuple(_marked(item) for item in value)
    if kind is list:
        items = [_marked(item) for item in value]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else items
    if kind is dict:
        out = {key: _marked(item) for key, item in value.items()}
        return value if all(out[k] is v for k, v in value.items()) else out
    return value


# Abstract types whose values may be lists as well as tuples (typing's aliases resolve to these).
_SEQUENCES = (abc.Sequence, abc.MutableSequence, abc.Collection, abc.Iterable, abc.Reversible, abc.Container)


def _holds_array(hint: Any) -> bool | None:
    """Whether a value ``hint`` admits may be stored as a JSON array: ``True`` a tuple only,
    ``False`` something else too (a list, a sequence, anything), ``None`` never."""
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        return _holds_array(typing.get_args(hint)[0])
    if origin in (typing.Union, types.UnionType):
        kinds = {_holds_array(option) for option in typing.get_args(hint)} - {None}
        return None if not kinds else kinds == {True}
    if origin is typing.Literal:
        return None
    cls = origin if origin is not None else hint
    if cls is tuple:
        return True
    if not isinstance(cls, type) or cls is object:
        return False  # Any, a TypeVar, what did not resolve: anything
    if issubclass(cls, str | bytes | bytearray | dict) or cls in (int, float, bool, type(None)):
        return None
    return False if issubclass(cls, list) or cls in _SEQUENCES else None


_TUPLE_FIELDS: weakref.WeakKeyDictionary[type, frozenset[str]] = weakref.WeakKeyDictionary()


def _tuple_fields(cls: type) -> frozenset[str]:
    """The fields of dataclass ``cls`` annotated so that only a tuple is stored as a list.

    Those are stored as lists and come back as tuples; a tuple in any other
    field (``tuple[int, ...] | list[int]``, ``Any``) is stored tagged, so
    that it comes back a tuple, and a list there stays a list. Read from the
    annotations at first use (they may name types defined later).
    """
    names = _TUPLE_FIELDS.get(cls)
    if names is None:
        names = frozenset(name for name, hint in _hints(cls).items() if _holds_array(hint) is True)
        _TUPLE_FIELDS[cls] = names
    return names


def _dataclass_decoder(cls: type) -> Callable[[Any], Any]:
    fields = dataclasses.fields(cls)
    init = {f.name for f in fields if f.init}

    def decode(data: Any) -> Any:
        if not isinstance(data, dict):
            raise TypeError(f"stored data must be an object of fields, got {type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in fields})
        if unknown:
            raise TypeError(f"{cls.__qualname__} has no field {unknown[0]!r}")
        tuples = _tuple_fields(cls)  # (a tuple in another field was stored tagged)
        if tuples:
            data = {k: tuple(v) if k in tuples and type(v) is list else v for k, v in data.items()}
        obj = cls(**{k: v for k, v in data.items() if k in init})
        for key, value in data.items():
            if key not in init:  # set after __init__, as the instance had it
                object.__setattr__(obj, key, value)
        return obj

    return decode


def _model_encoder(value: Any) -> Any:
    return value.model_dump(mode="json", round_trip=True)


def _hints(obj: Any) -> dict[str, Any]:
    """``typing.get_type_hints(obj)``, or ``{}`` when an annotation cannot be resolved."""
    try:
        return typing.get_type_hints(obj)
    except Exception:
        return {}


def _return_hint(run: Any) -> Any:
    """The return annotation of a step's ``run``, resolved, or ``None`` (none, or unresolvable)."""
    fn = unwrapped(run)  # (a child's step: its own function, not the wrapper that nests it)
    while isinstance(fn, functools.partial):
        fn = fn.func
    if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
        call = inspect.getattr_static(type(fn), "__call__", None)  # a callable object's method
        fn = call if inspect.isfunction(call) else None
    annotations = getattr(fn, "__annotations__", None)
    if not annotations or "return" not in annotations:
        return None
    return _hints(fn).get("return")


class Codec:
    """How a workflow stores outputs of its steps' own types, and restores them as those types.

    ``Codec(*types)`` registers each type; :meth:`register` adds more.
    Pydantic models (``model_dump(mode="json")`` / ``model_validate``),
    dataclasses (their fields, each stored in turn / the constructor) and
    enums (their value / the enum called with it) need nothing but
    registering; any other type is registered with its own
    ``encode`` (to plain data) and ``decode`` (back). A workflow given a codec,
    ``Workflow(steps, codec=codec)``, also registers the dataclasses and
    pydantic models its steps' return annotations name (``-> Summary``,
    ``-> list[Summary]``), and those of a registered dataclass's fields
    (enums too).

    Every checkpoint the run hands out holds such an output as a tagged
    object, ``{"$ekit": "type", "type": NAME, "value": DATA}``, which every
    store and the run queue can hold; a resume turns it back into the type
    registered under ``NAME``, and nothing else: a name the codec does not
    know is a :class:`~ekit_core.CheckpointError` naming the step, raised
    before any step runs. Nothing a checkpoint names is imported or
    evaluated. A stored dict of the caller's that holds the key ``"$ekit"``
    is escaped as ``{"$ekit": "dict", "value": {...}}``, and a tuple within a
    dataclass's field is stored as ``{"$ekit": "tuple", "value": [...]}``
    (unless it is the value of a field annotated as a tuple only: a list),
    so that each comes back as it was.
    """

    __slots__ = ("_by_name", "_by_type")

    def __init__(self, *types: type) -> None:
        self._by_type: dict[type, _Entry] = {}
        self._by_name: dict[str, _Entry] = {}
        for cls in types:
            self.register(cls)

    def __repr__(self) -> str:
        return f"Codec({', '.join(sorted(self._by_name))})"

    def __contains__(self, cls: object) -> bool:
        return cls in self._by_type

    @property
    def names(self) -> tuple[str, ...]:
        """The names registered types are stored under, in the order registered."""
        return tuple(self._by_name)

    def register(
        self,
        cls: type[T],
        *,
        encode: Callable[[T], Any] | None = None,
        decode: Callable[[Any], T] | None = None,
        name: str | None = None,
    ) -> type[T]:
        """Store ``cls`` under ``name`` (default ``module:qualname``); returns ``cls`` (a decorator).

        A pydantic model, a dataclass or an enum needs neither ``encode`` nor
        ``decode``; any other type needs both: ``encode(value)`` returns
        plain data (it may hold registered values, stored in turn) and
        ``decode(data)`` the value again. Registering a type again replaces
        its entry; a name taken by another type is a ``ValueError``.
        """
        if not isinstance(cls, type):
            raise ValueError(f"register takes a type, got {type(cls).__name__}")
        if name is None:
            name = type_name(cls)
        elif not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        if (encode is None) != (decode is None):
            raise ValueError(f"register {cls.__qualname__} with both encode= and decode=, or neither")
        for what, fn in (("encode", encode), ("decode", decode)):
            if fn is not None and not callable(fn):
                raise ValueError(f"{what} must be callable, got {type(fn).__name__}")
        if encode is None or decode is None:
            if cls in _JSON_TYPES:
                raise ValueError(f"{cls.__qualname__} is stored as it is: there is nothing to register")
            if _is_model(cls):
                encode, decode = _model_encoder, typing.cast(Any, cls).model_validate
            elif _is_enum(cls):
                encode, decode = _enum_encoder, cls
            elif _is_dataclass(cls):
                encode, decode = _dataclass_encoder, _dataclass_decoder(cls)
            else:
                raise ValueError(
                    f"{type_name(cls)} is no pydantic model, dataclass or enum: "
                    "register it with encode= (to plain data) and decode= (back)"
                )
        held = self._by_name.get(name)
        if held is not None and held.cls is not cls and type_name(held.cls) != type_name(cls):
            raise ValueError(f"name {name!r} is taken by {type_name(held.cls)}")
        old = self._by_type.pop(cls, None)
        if old is not None:
            del self._by_name[old.name]
        if held is not None:  # the same type, defined again (a reloaded module)
            self._by_type.pop(held.cls, None)
        entry = _Entry(cls, name, encode, decode)
        self._by_type[cls] = entry
        self._by_name[name] = entry
        return cls

    def _adopt(self, other: Codec) -> None:
        """Register every type ``other`` knows that this codec does not, under its name
        there (a child workflow's codec, adopted by its parent's); a name taken by
        another type is a ``ValueError``, as in :meth:`register`."""
        for entry in list(other._by_type.values()):
            if entry.cls not in self._by_type:
                self.register(entry.cls, encode=entry.encode, decode=entry.decode, name=entry.name)

    # -- values ---------------------------------------------------------------

    def encode(self, value: Any) -> Any:
        """``value`` as plain data: registered values tagged, dicts holding ``"$ekit"`` escaped.

        Plain data comes back as the very object given. A dataclass or
        pydantic model of a type not registered is an
        :class:`~ekit_runtime.stores.UnencodableError`; other values are left
        for the store's ``dumps`` to encode.
        """
        try:
            return self._encode(value)
        except _Unregistered as exc:
            raise UnencodableError(f"{_unregistered(exc.cls)}; nothing was encoded") from None

    def decode(self, data: Any) -> Any:
        """The inverse of :meth:`encode`: tagged objects back into their registered types.

        A type name the codec does not know, a malformed tag, or a
        ``decode`` that fails is a :class:`~ekit_core.CheckpointError`.
        """
        return self._decoded_at(data, "<value>")

    def _decoded_at(self, data: Any, where: str) -> Any:
        try:
            return self._decode(data, where)
        except RecursionError:
            raise CheckpointError(where, "nests too deeply to decode") from None

    def encode_checkpoint(self, checkpoint: WorkflowCheckpoint) -> WorkflowCheckpoint:
        """``checkpoint`` with its outputs and context encoded (:meth:`encode`), as a run hands it out."""
        return _Forms(self).stored(checkpoint)

    def decode_checkpoint(self, checkpoint: WorkflowCheckpoint | Mapping[str, Any]) -> WorkflowCheckpoint:
        """``checkpoint`` (or its dict) with its outputs and context decoded, as a resume reads it."""
        restored = _Forms(self).restore(checkpoint)
        assert restored is not None
        return restored

    def _encode(self, value: Any) -> Any:
        kind = type(value)
        if kind is str or kind is int or kind is float or kind is bool or value is None:
            return value
        if kind is dict or (isinstance(value, dict) and kind not in self._by_type):
            out = {}
            changed = kind is not dict
            for key, item in value.items():
                encoded = self._encode(item)
                changed = changed or encoded is not item
                out[key] = encoded
            if TAG in value:
                return {TAG: "dict", "value": out}
            return out if changed else value
        if kind is list or kind is tuple or (
                isinstance(value, list | tuple) and kind not in self._by_type):
            items = [self._encode(item) for item in value]
            if kind is _Tuple:
                return {TAG: "tuple", "value": items}
            if kind is list and all(a is b for a, b in zip(items, value, strict=True)):
                return value
            return items  # a tuple as JSON stores it, so that what is stored equals what loads
        entry = self._by_type.get(kind)
        if entry is not None:
            return {TAG: "type", "type": entry.name, "value": self._encode(entry.encode(value))}
        if _known_kind(kind):
            raise _Unregistered(kind)
        return value  # for the store's dumps to encode, or refuse

    def _decode(self, value: Any, where: str) -> Any:
        kind = type(value)
        if kind is dict:
            if TAG in value:
                return self._untag(value, where)
            out = {}
            changed = False
            for key, item in value.items():
                decoded = self._decode(item, where)
                changed = changed or decoded is not item
                out[key] = decoded
            return out if changed else value
        if kind is list:
            items = [self._decode(item, where) for item in value]
            return value if all(a is b for a, b in zip(items, value, strict=True)) else items
        if kind is tuple:
            return tuple(self._decode(item, where) for item in value)
        return value

    def _untag(self, value: dict[str, Any], where: str) -> Any:
        mark = value[TAG]
        if mark == "dict" and set(value) == {TAG, "value"} and type(value["value"]) is dict:
            return {k: self._decode(v, where) for k, v in value["value"].items()}
        if mark == "tuple" and set(value) == {TAG, "value"} and type(value["value"]) is list:
            return tuple(self._decode(v, where) for v in value["value"])
        if mark != "type" or set(value) != {TAG, "type", "value"} or type(value["type"]) is not str:
            raise CheckpointError(
                where,
                f"holds a malformed {TAG!r} object (keys {sorted(map(str, value))}): a tagged "
                f'object is {{"{TAG}": "type", "type": NAME, "value": DATA}}, '
                f'{{"{TAG}": "dict", "value": {{...}}}} or {{"{TAG}": "tuple", "value": [...]}}',
            )
        name = value["type"]
        entry = self._by_name.get(name)
        if entry is None:
            known = ", ".join(sorted(self._by_name)) or "none"
            raise CheckpointError(
                where,
                f"holds a value of type {name!r}, which the workflow's codec has not registered "
                f"(registered: {known}); register that type with the codec to read it "
                "(nothing a checkpoint names is ever imported)",
            )
        data = self._decode(value["value"], where)
        try:
            return entry.decode(data)
        except Exception as exc:
            raise CheckpointError(
                where, f"cannot rebuild the stored {name}: {type(exc).__name__}: {exc}"
            ) from exc

    # -- a workflow's types -------------------------------------------------------

    def _bind(self, steps: Iterable[Step]) -> None:
        """Register the types the steps' return annotations name; refuse one no store could hold.

        Then the same for the fields of every dataclass registered. Raises
        :class:`~ekit_runtime.stores.UnencodableError` naming the step (or
        the dataclass and its field) and the type.
        """
        for step in steps:
            hint = _return_hint(step.run)
            if hint is None:
                continue
            bad = self._claim(hint, set())
            if bad is not None:
                raise UnencodableError(
                    f"step {step.name!r} is annotated to return {_spelt(bad)}, which the "
                    f"workflow's codec cannot store: register it with "
                    f"codec.register({getattr(bad, '__qualname__', bad)}, encode=..., decode=...) "
                    "(docs/outputs.md)",
                    step=step.name,
                )
        # The fields of each dataclass registered (by hand or from an annotation), until no new one.
        done: set[type] = set()
        while todo := [e.cls for e in self._by_type.values()
                       if e.encode is _dataclass_encoder and e.cls not in done]:
            for cls in todo:
                done.add(cls)
                names = {f.name for f in dataclasses.fields(cls)}
                for field, hint in _hints(cls).items():
                    bad = self._claim(hint, set()) if field in names else None
                    if bad is not None:
                        raise UnencodableError(
                            f"field {field!r} of dataclass {type_name(cls)} is annotated as "
                            f"{_spelt(bad)}, which the workflow's codec cannot store: register it "
                            f"with codec.register({getattr(bad, '__qualname__', bad)}, encode=..., "
                            "decode=...) (docs/outputs.md)"
                        )

    def _claim(self, hint: Any, seen: set[int]) -> Any:
        """Register the dataclasses and models ``hint`` names; the first other type no store holds."""
        if hint is None or hint is Any or hint is object:
            return None
        if isinstance(hint, str | TypeVar | typing.ForwardRef):
            return None  # not resolved: no claim
        if id(hint) in seen:
            return None
        seen.add(id(hint))
        origin = typing.get_origin(hint)
        args = typing.get_args(hint)
        if origin is typing.Annotated:
            return self._claim(args[0], seen)
        if origin is typing.Literal:
            return None
        if origin is not None:
            if origin is PatternResult:
                return self._claim(args[0], seen) if args else None
            if origin is not typing.Union and origin is not types.UnionType and isinstance(
                    origin, type) and self._unstorable(origin):
                return origin
            for arg in args:
                bad = self._claim(arg, seen) if arg is not Ellipsis else None
                if bad is not None:
                    return bad
            return None
        supertype = getattr(hint, "__supertype__", None)  # a NewType
        if supertype is not None:
            return self._claim(supertype, seen)
        if not isinstance(hint, type):
            return None
        if hint in self._by_type:
            return None
        if _known_kind(hint):
            self.register(hint)  # (a dataclass's fields are claimed by _bind)
            return None
        return hint if self._unstorable(hint) else None

    def _unstorable(self, cls: type) -> bool:
        """Whether a value of ``cls`` is one no default store could hold and the codec does not know."""
        if cls in self._by_type or cls is PatternResult:
            return False
        if issubclass(cls, (str, int, float, dict, list, tuple)):
            return False
        if cls.__module__ in ("collections.abc", "typing") or cls is types.NoneType:
            return False  # an abstract type (Mapping, Sequence): no claim about the value
        return not _known_kind(cls)


def _spelt(hint: Any) -> str:
    if isinstance(hint, type):
        return hint.__qualname__ if hint.__module__ == "builtins" else type_name(hint)
    return repr(hint)


def _unregistered(cls: type) -> str:
    kind = "a pydantic model" if _is_model(cls) else "an enum" if _is_enum(cls) else "a dataclass"
    return (
        f"{kind} {type_name(cls)}, which the workflow's codec has not registered: "
        f"register it (Codec({cls.__qualname__}) or codec.register({cls.__qualname__})), or "
        f"annotate the step to return it (-> {cls.__qualname__}) so that it can be read back "
        "on a resume"
    )


class _Forms:
    """One run's checkpoints as handed out: outputs encoded once each, in O(new outputs) a save.

    Keeps an encoded ledger beside the core's while any output differs
    from its stored form, and hands out the core's own checkpoint while
    none does. An output read from ``resume_from`` is stored as it was read.
    """

    __slots__ = ("_codec", "_context", "_last", "_ledger", "_raw", "_restored", "_superseded")

    def __init__(self, codec: Codec) -> None:
        self._codec = codec
        self._raw: Ledger[str, Any] | None = None  # the core's ledger last encoded
        self._ledger: Ledger[str, Any] | None = None  # its encoded twin, None when the same
        self._last: tuple[WorkflowCheckpoint, WorkflowCheckpoint] | None = None
        self._restored: dict[str, tuple[Any, Any]] = {}  # step -> (decoded output, as stored)
        self._context: tuple[Any, Any] | None = None
        self._superseded: tuple[Any, Any] | None = None

    # -- resume ---------------------------------------------------------------

    def restore(
        self, checkpoint: WorkflowCheckpoint | Mapping[str, Any] | None
    ) -> WorkflowCheckpoint | None:
        """``checkpoint`` with its stored outputs decoded (the same object when none is tagged)."""
        if checkpoint is None:
            return None
        cp = checkpoint if isinstance(checkpoint, WorkflowCheckpoint) else WorkflowCheckpoint.from_dict(
            checkpoint)
        decode = self._codec._decoded_at
        outputs = None
        for name, value in cp.outputs.items():
            typed = decode(value, f"outputs.{name}")
            if typed is not value:
                if outputs is None:
                    outputs = dict(cp.outputs)
                outputs[name] = typed
                self._restored[name] = (typed, value)
        context = self._decoded(cp.context, "context")
        superseded = self._decoded(cp.superseded, "superseded")
        if outputs is None and context is cp.context and superseded is cp.superseded:
            return cp
        return dataclasses.replace(
            cp, outputs=cp.outputs if outputs is None else MappingProxyType(outputs),
            context=context, superseded=superseded, _outputs_ledger=None, _usage_ledger=None,
        )

    def _decoded(self, table: MappingProxyType[str, Any], field: str) -> MappingProxyType[str, Any]:
        decoded = {k: self._codec._decoded_at(v, f"{field}.{k}") for k, v in table.items()}
        if all(decoded[k] is v for k, v in table.items()):
            return table
        return MappingProxyType(decoded)

    # -- saves ----------------------------------------------------------------

    def stored(self, cp: WorkflowCheckpoint) -> WorkflowCheckpoint:
        """``cp`` as the run hands it out: every output in its stored form.

        Raises :class:`UnencodableError` naming the step whose output the codec cannot encode.
        """
        last = self._last
        if last is not None and last[0] is cp:
            return last[1]
        raw, usage = cp._outputs_ledger, cp._usage_ledger
        context = self._encoded_table(cp.context, "context")
        superseded = self._encoded_table(cp.superseded, "superseded")
        if raw is None or usage is None:  # a checkpoint not made by the core
            pairs = [(name, self._output(name, value)) for name, value in cp.outputs.items()]
            if all(e is v for (_, e), v in zip(pairs, cp.outputs.values(), strict=True)) and (
                    context is cp.context and superseded is cp.superseded):
                out = cp
            else:
                out = dataclasses.replace(
                    cp, outputs=MappingProxyType(dict(pairs)), context=context,
                    superseded=superseded, _outputs_ledger=None, _usage_ledger=None)
        else:
            ledger = self._ledger_of(raw)
            if ledger is None and context is cp.context and superseded is cp.superseded:
                out = cp
            else:
                out = _with_stored(cp, raw if ledger is None else ledger, usage, context, superseded)
        self._last = (cp, out)
        return out

    def _ledger_of(self, raw: Ledger[str, Any]) -> Ledger[str, Any] | None:
        """The encoded twin of ``raw`` (``None``: every output is stored as it is)."""
        prev = self._raw
        if prev is not None and raw.extends(prev):
            new = raw.items_from(len(prev))
            base, ledger = prev, self._ledger
        else:
            new = raw.items_from(0)
            base, ledger = None, None
        pairs = [(name, self._output(name, value)) for name, value in new]
        if ledger is None:
            if all(e is v for (_, e), (_, v) in zip(pairs, new, strict=True)):
                self._raw = raw
                self._ledger = None
                return None
            ledger = Ledger([*(base.items_from(0) if base is not None else ()), *pairs])
        else:
            for name, encoded in pairs:
                ledger = ledger.with_item(name, encoded)
        self._raw, self._ledger = raw, ledger
        return ledger

    def _output(self, name: str, value: Any) -> Any:
        restored = self._restored.get(name)
        if restored is not None and restored[0] is value:
            return restored[1]
        return self._encoded(value, f"step {name!r} returned", f"the output of step {name!r}", name)

    def _encoded(self, value: Any, holder: str, what: str, step: str | None) -> Any:
        """``value`` encoded by the codec, or an :class:`UnencodableError` naming ``what`` holds it
        (``holder``: the same, as the subject of "returned"/"holds"), whatever encoding raised."""
        try:
            return self._codec._encode(value)
        except _Unregistered as exc:
            raise UnencodableError(
                f"{holder} {_unregistered(exc.cls)}; nothing was saved", step=step
            ) from None
        except RecursionError:
            raise UnencodableError(
                f"cannot encode {what}: it nests too deeply (or holds itself); nothing was saved",
                step=step,
            ) from None
        except Exception as exc:
            raise UnencodableError(
                f"cannot encode {what}: the codec's encoder raised {type(exc).__name__}: {exc}; "
                "nothing was saved", step=step,
            ) from exc

    def _encoded_table(self, table: MappingProxyType[str, Any], field: str) -> MappingProxyType[str, Any]:
        cached = self._context if field == "context" else self._superseded
        if cached is not None and cached[0] is table:
            return typing.cast(MappingProxyType[str, Any], cached[1])
        encoded: MappingProxyType[str, Any] = table
        if table:
            values = {}
            for key, value in table.items():
                values[key] = self._encoded(
                    value, f"{field} key {key!r} holds", f"{field} key {key!r}",
                    key if field == "superseded" else None,
                )
            if not all(values[k] is v for k, v in table.items()):
                encoded = MappingProxyType(values)
        if field == "context":
            self._context = (table, encoded)
        else:
            self._superseded = (table, encoded)
        return encoded


def _with_stored(
    cp: WorkflowCheckpoint, outputs: Ledger[str, Any], usage: Ledger[str, TokenUsage],
    context: MappingProxyType[str, Any], superseded: MappingProxyType[str, Any],
) -> WorkflowCheckpoint:
    """``cp`` with its outputs, context and set-aside outputs in their stored forms, every other
    field carried over as it is.

    Built by ``of_ledgers`` (O(1), the ledgers shared) rather than
    ``dataclasses.replace``, which would build the durations table at every
    save; so each field is named here, and a field left out is lost from
    every save of a run with a codec (tests/stores/test_every_checkpoint_field_survives.py).
    """
    return WorkflowCheckpoint.of_ledgers(
        outputs, usage, step_index=cp.step_index, cost=cp.cost, context=context,
        failures=cp.failures, graph=cp.graph, versions=cp.versions, fingerprint=cp.fingerprint,
        format_version=cp.format_version, skipped=cp.skipped, shapes=cp.shapes,
        superseded=superseded, asked=cp.asked, durations=cp._times, redone=cp.redone, compacted=cp.compacted,
        began=given_began(cp), code_fingerprints=cp.code_fingerprints, cache_hits=cp.cache_hits,
        compacted_retries=cp.compacted_retries,
        drives=cp.drives, held=given_held(cp),
    )


class _StoredSave:
    """A run's ``checkpoint_fn``, handed each checkpoint in its stored form.

    Its ``prepare_run`` encodes the checkpoint the run starts from (what no
    save could write is refused before any step runs) and hands it to the
    wrapped function's ``prepare_run``, if it has one.
    """

    __slots__ = ("fn", "forms")

    def __init__(self, fn: Callable[[WorkflowCheckpoint], Any], forms: _Forms) -> None:
        self.fn, self.forms = fn, forms

    def __call__(self, checkpoint: WorkflowCheckpoint) -> Any:
        return self.fn(self.forms.stored(checkpoint))

    def prepare_run(self, checkpoint: WorkflowCheckpoint) -> Any:
        """Encode the checkpoint the run starts from; hand it to the wrapped ``prepare_run``."""
        from ekit_runtime.runner import prepare_run_of

        stored = self.forms.stored(checkpoint)
        prepare = prepare_run_of(self.fn)
        return None if prepare is None else prepare(stored)


def run_options(codec: Codec, options: Mapping[str, Any]) -> dict[str, Any]:
    """A run's options with ``resume_from`` decoded and ``checkpoint_fn`` handed stored forms.

    Raises :class:`~ekit_core.CheckpointError` naming the step whose stored
    output the codec cannot read, before anything runs.
    """
    forms = _Forms(codec)
    changed = dict(options)
    changed["resume_from"] = forms.restore(options.get("resume_from"))
    fn = options.get("checkpoint_fn")
    if fn is not None:
        changed["checkpoint_fn"] = _StoredSave(fn, forms)
    return changed


def final_checkpoint(codec: Codec, runner: Runner) -> WorkflowCheckpoint:
    """The run's last checkpoint in its stored form (as is, when that cannot be encoded)."""
    fn = runner.checkpoint_fn
    forms = fn.forms if isinstance(fn, _StoredSave) else _Forms(codec)
    last = runner.last_checkpoint
    cp = last if last is not None else runner.checkpoint_now()
    try:
        return forms.stored(cp)
    except UnencodableError:
        return cp
