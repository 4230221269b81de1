"""A stable fingerprint of a step's code: what issue 45's resume rule and cache key compare.

:func:`code_fingerprint` hashes (SHA-256) what a function *is*, not where it
sits in a file. It covers, recursively:

- the function's bytecode (``co_code``), its flags and argument counts, the
  names it uses (``co_names``: globals, attributes, imports), its local,
  free and cell variable names, and its constants, nested code objects
  (inner functions, lambdas, comprehensions) included; a docstring is a
  constant, so editing one is a change;
- its defaults (``__defaults__``, ``__kwdefaults__``);
- the values of its closure cells and of the globals it names, when those
  are immutable plain data (``None``, ``bool``, ``int``, ``float``,
  ``complex``, ``str``, ``bytes``, and tuples (NamedTuples too), frozensets
  and frozen dataclasses of them; an enum member by its class, name and
  value): a
  prompt held in a module constant or a variable of the enclosing function
  is part of the step. A list, dict or set is counted by its type only: it
  is state that changes while the program runs (an accumulator, a memo),
  and hashing its contents would make the same code look changed;
- the functions it calls by a global name when they are defined in the same
  module (a helper that builds the prompt), and every function it holds in
  a closure cell (what a decorator wraps, from any module); the code of a
  class of the same module that it names, or of whose object it names or
  is a method: its methods, properties and same-module base classes;
- for a ``functools.partial`` (the step, or one it names), the function and
  its plain-data arguments;
  for a bound method, the function and its object's class; for any other
  callable object, its class (its ``__call__`` only, for another module's)
  and what it wraps (``__wrapped__``: a decorator object, ``lru_cache``).

It does not see, and the docs say so (docs/cache.md): file names and line
numbers (moving a function, reformatting it, editing a comment: no
change), nor the values of a module's own names (``__file__``, ``__name__``:
two checkouts of the same code agree); the value of a global or cell that is not plain data (a client
object, a model settings object), only its name; code in other modules
(a library upgrade); a prompt read from a file, the clock, the network, an
environment variable. A new Python minor version compiles other bytecode,
so every fingerprint changes with it.

Computed once per run per step, by the shell: the core only receives the
fingerprints (:mod:`ekit_core.code`), as it receives ``version`` tags.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import inspect
import types
import weakref
from collections.abc import Callable
from typing import Any

from ekit_runtime.children import unwrapped

__all__ = ["code_fingerprint"]

_PLAIN_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_DEPTH = 40  # how deep a chain of helpers is followed (a guard, not a limit anyone meets)


def code_fingerprint(fn: Callable[..., Any]) -> str:
    """The fingerprint of ``fn``'s code: 32 hex digits (see the module for what it covers)."""
    digest = hashlib.sha256()
    fn = unwrapped(fn)  # a child workflow's step: its own code, as when its child runs alone
    _Hasher(digest, getattr(_unwrapped(fn), "__module__", None)).callable(fn, 0)
    return digest.hexdigest()[:32]


def _unwrapped(fn: Any) -> Any:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__func__", fn)


class _Hasher:
    """Feeds what a callable is into one digest, each function once (cycles: by name)."""

    def __init__(self, digest: Any, module: str | None) -> None:
        self.digest, self.module = digest, module
        self.seen: set[int] = set()

    def put(self, *parts: object) -> None:
        for part in parts:
            data = part if isinstance(part, bytes) else str(part).encode("utf-8", "surrogatepass")
            self.digest.update(len(data).to_bytes(8, "little"))
            self.digest.update(data)

    def callable(self, fn: Any, depth: int) -> None:
        if isinstance(fn, functools.partial):
            self.put("partial")
            self.callable(fn.func, depth)
            self.value(fn.args, depth)
            self.value(fn.keywords, depth)
        elif isinstance(fn, types.MethodType):
            owner = fn.__self__ if isinstance(fn.__self__, type) else type(fn.__self__)
            self.put("method", owner.__qualname__)
            self.callable(fn.__func__, depth)
            if owner.__module__ == self.module:  # the other methods it calls through self
                self.klass(owner, depth + 1)
        elif isinstance(fn, types.FunctionType):
            self.function(fn, depth)
        elif isinstance(fn, type):
            self.klass(fn, depth)
        elif isinstance(fn, types.BuiltinFunctionType | types.BuiltinMethodType):
            self.put("builtin", getattr(fn, "__module__", None), fn.__qualname__)
        else:
            call = inspect.getattr_static(type(fn), "__call__", None)
            self.put("object", type(fn).__module__, type(fn).__qualname__)
            if type(fn).__module__ == self.module:  # its class's code: __call__ and what it calls
                self.klass(type(fn), depth + 1)
            elif isinstance(call, types.FunctionType):
                self.function(call, depth)
            wrapped = getattr(fn, "__wrapped__", None)  # a decorator object (update_wrapper, lru_cache)
            if wrapped is not None and wrapped is not fn and depth <= _DEPTH:
                self.put("wrapped")
                self.callable(wrapped, depth + 1)

    def function(self, fn: types.FunctionType, depth: int) -> None:
        if id(fn) in self.seen or depth > _DEPTH:
            self.put("seen", fn.__qualname__)
            return
        self.seen.add(id(fn))
        self.put("function", fn.__qualname__)
        self.code(fn.__code__)
        self.value(fn.__defaults__, depth)
        self.value(fn.__kwdefaults__, depth)
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
            self.put("cell", name)
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell: the enclosing function has not bound it yet
                self.put("empty")
                continue
            if isinstance(contents, types.FunctionType):  # a decorator's wrapped function, any module
                self.callable(contents, depth + 1)
            else:
                self.reference(contents, depth)
        globals_ = fn.__globals__
        for name in _names(fn.__code__):
            if name in globals_:
                self.put("global", name)
                if not (name.startswith("__") and name.endswith("__")):  # __file__: where, not what
                    self.reference(globals_[name], depth)

    def reference(self, value: object, depth: int) -> None:
        """A value the code refers to by name: plain data by value, same-module code by its code."""
        if _plain(value, 0) or isinstance(value, enum.Enum):
            self.value(value, depth)
        elif ((isinstance(value, types.FunctionType | type) and value.__module__ == self.module)
              or isinstance(value, functools.partial | types.MethodType)):  # (with what they hold)
            self.callable(value, depth + 1)
        elif type(value).__module__ == self.module:  # an object of a class of the module: its code
            self.put("object", type(value).__qualname__)
            self.klass(type(value), depth + 1)
        else:
            self.put("opaque", type(value).__module__, type(value).__qualname__)

    def klass(self, cls: type, depth: int) -> None:
        if id(cls) in self.seen or depth > _DEPTH:
            self.put("seen", cls.__qualname__)
            return
        self.seen.add(id(cls))
        self.put("class", cls.__qualname__)
        for base in cls.__bases__:
            if base.__module__ == self.module:  # inherited methods of the module are its code too
                self.put("base")
                self.klass(base, depth + 1)
        for name, member in sorted(vars(cls).items()):
            if isinstance(member, staticmethod | classmethod):
                member = member.__func__
            if isinstance(member, property):
                self.put("property", name)
                for accessor in (member.fget, member.fset, member.fdel):
                    if isinstance(accessor, types.FunctionType):
                        self.function(accessor, depth + 1)
            elif isinstance(member, types.FunctionType):
                self.put("member", name)
                self.function(member, depth + 1)
            elif _plain(member, 0) and not name.startswith("__"):
                self.put("member", name)
                self.value(member, depth)

    def code(self, code: types.CodeType) -> None:
        # What a code object feeds the digest depends on it alone (code objects are immutable;
        # their constants are literals): fed once per process, then replayed as the same bytes
        # (a worker fingerprints the same steps at every run it drives).
        known = _CODE_BYTES.get(id(code))
        if known is not None and known[0]() is code:
            self.digest.update(known[1])
            return
        digest, self.digest = self.digest, _Bytes()
        try:
            self._code(code)
            fed = b"".join(self.digest.parts)
        finally:
            self.digest = digest
        key = id(code)
        _CODE_BYTES[key] = (weakref.ref(code, lambda _: _CODE_BYTES.pop(key, None)), fed)
        digest.update(fed)

    def _code(self, code: types.CodeType) -> None:
        self.put("code", code.co_code, code.co_flags, code.co_argcount, code.co_posonlyargcount,
                 code.co_kwonlyargcount, code.co_names, code.co_varnames, code.co_freevars,
                 code.co_cellvars)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                self.code(const)
            else:
                self.value(const, 0)

    def value(self, value: object, depth: int) -> None:
        """Plain data by type and value, order-free for sets; anything else by its type."""
        if isinstance(value, _PLAIN_SCALARS):
            self.put(type(value).__name__, repr(value))
        elif isinstance(value, tuple | list):
            self.put(type(value).__name__, len(value))
            for item in value:
                self.value(item, depth)
        elif isinstance(value, frozenset | set):
            self.put(type(value).__name__, len(value))
            for text in sorted(_sub_hash(v) for v in value):
                self.put(text)
        elif isinstance(value, dict):
            self.put("dict", len(value))
            for key, item in sorted(((_sub_hash(k), v) for k, v in value.items()),
                                    key=lambda pair: pair[0]):
                self.put(key)
                self.value(item, depth)
        elif _frozen_dataclass(value):  # settings: the model, the temperature, by value
            self.put("dataclass", type(value).__qualname__)
            for f in dataclasses.fields(value):  # type: ignore[arg-type]  # (mypy: an object)
                self.put(f.name)
                self.value(getattr(value, f.name), depth)
        elif isinstance(value, enum.Enum):  # a mode, a model name: which member, and its value
            self.put("enum", type(value).__qualname__, value.name)
            self.value(value.value, depth)
        elif isinstance(value, types.CodeType):
            self.code(value)
        elif callable(value) and depth <= _DEPTH:
            self.callable(value, depth + 1)
        else:
            self.put("opaque", type(value).__module__, type(value).__qualname__)


class _Bytes:
    """Collects what :meth:`_Hasher.code` feeds, as a digest would take it."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def update(self, data: bytes) -> None:
        self.parts.append(data)


# id(code) -> (a weak reference to it, the bytes it feeds): see _Hasher.code. By identity, not
# by equality (two equal code objects may differ in what is hashed of them), and dropped with it.
_CODE_BYTES: dict[int, tuple[weakref.ref[types.CodeType], bytes]] = {}


def _sub_hash(value: object) -> str:
    """The hash of one plain value on its own: what orders a set's members, a dict's keys."""
    digest = hashlib.sha256()
    _Hasher(digest, None).value(value, _DEPTH + 1)
    return digest.hexdigest()


def _plain(value: object, depth: int) -> bool:
    """Whether ``value`` is immutable plain data (what a cell or a global is hashed by value as)."""
    if isinstance(value, _PLAIN_SCALARS):
        return True
    if depth > 8:
        return False
    if isinstance(value, tuple) or type(value) is frozenset:  # a NamedTuple of settings too
        return all(_plain(v, depth + 1) for v in value)
    if _frozen_dataclass(value):
        return all(_plain(getattr(value, f.name), depth + 1)
                   for f in dataclasses.fields(value))  # type: ignore[arg-type]
    return False


def _frozen_dataclass(value: object) -> bool:
    params = getattr(type(value), "__dataclass_params__", None)
    return params is not None and params.frozen and not isinstance(value, type)


def _names(code: types.CodeType) -> list[str]:
    """Every global (and attribute) name the code and its nested code use, each once, in order."""
    names = dict.fromkeys(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(dict.fromkeys(_names(const)))
    return list(names)

