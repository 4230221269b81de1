"""Building frozen values fast: the one trick, and why the core plays it.

A frozen dataclass's ``__init__`` sets every field through
``object.__setattr__``, which costs about a thousand machine instructions a
field; the core builds a state, a checkpoint, a batch and a start for every
step of a run, which made that the largest cost of a long run. A *twin*, a
plain class with the very same ``__slots__``, takes plain (specialised,
cheap) attribute stores, and assigning ``__class__`` then turns the instance
into the frozen class: same layout, same value, immutable from then on.

Each value module builds its own per-step value through its twin in exactly
one constructor function, named as such: ``make_state``
(:mod:`ekit_core.state`), ``WorkflowCheckpoint.of_ledgers``
(:mod:`ekit_core.checkpoint`), ``succeeded`` and ``first_start``
(:mod:`ekit_core.results`), ``_batch`` (:mod:`ekit_core.transitions`).
Everything else builds values the ordinary way, and nothing outside
``ekit_core`` makes a twin (code generation, which would fold those five into
one, is what the purity rule forbids: no ``exec`` in the core).
"""

from __future__ import annotations

from typing import Any

__all__ = ["twin"]


def twin(frozen: type) -> type[Any]:
    """A plain class with ``frozen``'s slots, whose instances may become ``frozen`` ones."""
    return type(f"_{frozen.__name__}Draft", (), {"__slots__": vars(frozen)["__slots__"]})
