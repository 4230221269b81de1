"""Building frozen values fast: a mutable twin with the same slots.

A frozen dataclass's ``__init__`` sets every field through
``object.__setattr__``, which costs about a thousand machine instructions a
field; the shell builds a state, a checkpoint and a result for every step,
which made that the largest cost of a long run. A twin class with the very
same ``__slots__`` takes plain (specialised, cheap) attribute stores, and
assigning ``__class__`` then turns the instance into the frozen class: same
layout, same value, immutable from then on. Used only by the constructors
that run once per step; everything else builds values the ordinary way.
"""

from __future__ import annotations

from typing import Any

__all__ = ["twin"]


def twin(frozen: type) -> type[Any]:
    """A plain class with ``frozen``'s slots, whose instances may become ``frozen`` ones."""
    return type(f"_{frozen.__name__}Draft", (), {"__slots__": vars(frozen)["__slots__"]})
