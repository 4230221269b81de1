"""Frozen values built fast: the mechanism, and why the core uses it.

The trick. A frozen dataclass's generated ``__init__`` sets each field
through ``object.__setattr__`` (a lookup and a C call, about a thousand
machine instructions a field). A *twin* is a plain class with the very same
slots: it takes plain attribute stores, which the interpreter specialises to
a few instructions each. Assigning ``__class__`` then turns the twin
instance into an instance of the frozen class (same layout, so CPython
allows it): the same value, immutable from then on.

Why it is worth it. The core builds a state, a checkpoint, a start and a
batch, and the runtime a success, for every step of a run. Counted with
callgrind (CPython 3.11), those five cost about 59k instructions through
their ``__init__`` and about 19k through twins (a state alone 19k against
4k), where a whole chain step costs about 153k
(``python -m benchmarks.instructions``; docs/performance.md). Code
generation would fold these constructors into one, but the core's purity
rule forbids ``exec``.

Each constructor hands its value back as the frozen type through an
annotated local (``made: State = value``), not ``typing.cast``: a cast is a
Python call, and five of them (one per value) cost a chain step about 1.7k
instructions (measured, issue 45).

This module is on the ground floor and imports nothing of the core: it
offers :func:`twin` alone. Each module that defines a value built this way
makes that value's twin with it and writes the value's fast constructor
beside the class (a constructor has to name every field, so it belongs
where the fields are declared), and nowhere else:

- :class:`~ekit_core.State`, by :func:`ekit_core.transitions.state_of_run`:
  the state a transition's working copy freezes into, once per transition
  (it reads the working copy, which only the transitions know);
- :class:`~ekit_core.WorkflowCheckpoint`, by
  :func:`ekit_core.checkpoint.fast_checkpoint`: what
  :meth:`WorkflowCheckpoint.of_ledgers <ekit_core.WorkflowCheckpoint.of_ledgers>`
  and :func:`~ekit_core.checkpoint_of` return, once per checkpoint;
- :class:`~ekit_core.CheckpointDelta`, by :func:`ekit_core.checkpoint.fast_delta`:
  what a checkpoint of the core adds to the one before it, once per save of
  every store (measured: 0.23 us through the twin, 0.99 us through ``__init__``);
- :class:`~ekit_core.Succeeded`, by :func:`ekit_core.results.succeeded`: a
  step's success as the shell reports it;
- :class:`~ekit_core.Start`, by :func:`ekit_core.results.first_start`: a
  plain first attempt;
- :class:`~ekit_core.Batch`, by :func:`ekit_core.results.batch`: a batch of
  starts and nothing to withdraw;
- :class:`~ekit_core.GraphSpec`, by :func:`ekit_core.graph.grown_graph`: a loop's
  running graph, grown by its next iteration;
- :class:`~ekit_core.RunSpec`, by :func:`ekit_core.state.grown_spec`: a shaped run's
  spec, once its graph grows (each iteration of a loop: ``dataclasses.replace`` cost
  about 12k instructions an iteration, two a growth, through ``__init__`` and
  ``__post_init__``);
- :class:`~ekit_core.expansion.Expansion`, by :func:`ekit_core.expansion.grown_expansion`:
  what a shaped run's maps and loops have grown, once per growth;
- :class:`~ekit_core.expansion.ItemRef`, by :func:`ekit_core.expansion.item_ref`:
  what each item of a mapped step is, once per item (measured: the map's
  item about 5k instructions cheaper than through ``__init__`` with its
  five fields, of which loops added the fifth).

Everything else, these values included when built anywhere else, is built
the ordinary way (``tests/test_construction_trick.py`` checks that only the
constructors listed here assign ``__class__``, each to a class twinned here).
"""

from __future__ import annotations

from typing import Any

__all__ = ["twin"]


def twin(frozen: type) -> type[Any]:
    """A plain class with the slots of ``frozen`` and its bases: its instances may become ``frozen`` ones.

    Fill every field of an instance with plain attribute stores, then assign
    ``frozen`` to its ``__class__``: the result equals ``frozen(...)`` of
    those fields and is as immutable.
    """
    slots = tuple(name for cls in reversed(frozen.__mro__) for name in vars(cls).get("__slots__", ()))
    return type(f"_{frozen.__name__}Twin", (), {"__slots__": slots})
