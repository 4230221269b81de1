"""What a step receives: ``StepContext``, a copy-on-write view of the run so far.

A step with ``context="all"`` (ExecutionKit's default) sees the initial
context plus every output recorded before it started. Copying all of that
into a fresh ``dict`` for every step made a run quadratic; a
``StepContext`` is built in O(1) instead, over the run's persistent output
ledger (a snapshot: outputs recorded later do not appear) and the initial
context.

Writes stay the step's own: setting or deleting a key changes this step's
view only, never another step's, the run's or a checkpoint's. Values are
not copied, though: mutating a nested object (``context["doc"].append``)
mutates that output itself, which is the caller's object (see
``docs/failures.md``, "Outputs are your objects").

It is a ``MutableMapping``, not a ``dict``: ``context[key]``, ``get``,
``in``, iteration, ``**context``, ``dict(context)`` and ``context | other``
all work; code that insists on a real ``dict`` (``json.dumps(context)``)
takes ``context.copy()``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

from ekit_core.ledger import Ledger

__all__ = ["DictLike", "StepContext"]

_MISSING: Any = object()


class DictLike(MutableMapping[str, Any]):
    """What a step's code calls on its ``ctx`` as on a ``dict`` beyond the mapping protocol:
    ``copy()`` and ``|`` give plain dicts, built from ``items()`` (so a wrapper that records
    what is read sees all of it read)."""

    __slots__ = ()

    def copy(self) -> dict[str, Any]:
        """A plain ``dict`` of everything the context holds (O(size))."""
        return dict(self.items())

    def __or__(self, other: Mapping[str, Any]) -> dict[str, Any]:
        merged = self.copy()
        merged.update(other)
        return merged

    def __ror__(self, other: Mapping[str, Any]) -> dict[str, Any]:
        merged = dict(other)
        merged.update(self.items())
        return merged


class StepContext(DictLike):
    """The context of one step attempt: own writes over a snapshot of outputs and context."""

    __slots__ = ("_base", "_gone", "_outputs", "_own")

    def __init__(self, base: Mapping[str, Any], outputs: Ledger[str, Any]) -> None:
        self._base = base
        self._outputs = outputs
        self._own: dict[str, Any] | None = None
        self._gone: set[str] | None = None

    def __getitem__(self, key: str) -> Any:
        own = self._own
        if own is not None and key in own:
            return own[key]
        if self._gone is not None and key in self._gone:
            raise KeyError(key)
        value = self._outputs.get(key, _MISSING)
        if value is _MISSING:
            return self._base[key]
        return value

    def get(self, key: str, default: Any = None) -> Any:
        """``context[key]``, or ``default`` when the key is absent."""
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        if self._own is not None and key in self._own:
            return True
        if self._gone is not None and key in self._gone:
            return False
        return key in self._outputs or key in self._base

    def __iter__(self) -> Iterator[str]:
        own, gone = self._own or {}, self._gone or set()
        yield from own
        seen = own.keys() | gone
        outputs = self._outputs
        for key in outputs:
            if key not in seen:
                yield key
        for key in self._base:
            if key not in seen and key not in outputs:
                yield key

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __setitem__(self, key: str, value: Any) -> None:
        if self._own is None:
            self._own = {}
        self._own[key] = value
        if self._gone is not None:
            self._gone.discard(key)

    def __delitem__(self, key: str) -> None:
        if key not in self:
            raise KeyError(key)
        if self._own is not None:
            self._own.pop(key, None)
        if self._gone is None:
            self._gone = set()
        self._gone.add(key)

    def __repr__(self) -> str:
        # Bounded: a long run's context holds thousands of outputs.
        shown = []
        for i, key in enumerate(self):
            if i == 8:
                shown.append("...")
                break
            shown.append(f"{key!r}: {self[key]!r}")
        return f"StepContext({{{', '.join(shown)}}})"
