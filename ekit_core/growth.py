"""Growing a run's graph by name: steps added, with their dependencies, to a running state.

Internal for now (not in ``ekit_core.__all__``): the ground floor that
run-time shapes will build on. The rules of :func:`add_steps`:

- each added step has a new name; each of its dependencies names a step of
  the graph or another added step; the grown graph must stay acyclic (a
  :class:`~ekit_core.GraphError` otherwise, and the state is unchanged);
- added steps take the next declaration indices, in the order given:
  nothing already in the state moves, its bit window included, and
  :func:`~ekit_core.plan` starts them after every older ready step;
- an added step is ready at once when all its dependencies are recorded;
  otherwise it waits exactly as a step of a fresh run does (a countdown of
  its unrecorded dependencies when it has several), so readiness still costs
  O(1) per finished dependency;
- a settled run does not grow (:class:`~ekit_core.TransitionError`): it has
  ended, and its outcome is final;
- a run with ``only`` (:mod:`ekit_core.selection`) fixed its selection when
  it started: the added steps are outside it, never ready, and left for a
  run without ``only`` (the run ends without them).

The fingerprint rule: a state's graph is the grown graph, so its
checkpoints record and fingerprint every step added so far, not the graph
the run began with. A resume passes the grown graph; the graph the run began
with is then "another graph" (``GraphMismatchError``, or
``allow_graph_change=True``).

Adding costs O(steps in the graph) (the graph and the dependents index are
rebuilt), paid once per call, not per step run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from types import MappingProxyType

from ekit_core import window
from ekit_core.errors import TransitionError
from ekit_core.graph import GraphError, GraphSpec
from ekit_core.state import RunSpec, State

__all__ = ["add_steps"]


def add_steps(state: State, steps: Mapping[str, Iterable[str]]) -> State:
    """``state`` with ``steps`` (name -> dependencies) added to its graph (see the module)."""
    if state.settled:
        raise TransitionError(f"cannot add steps to a settled run ({state.outcome})")
    graph = state.spec.graph
    added = {name: tuple(deps) for name, deps in _checked_names(graph, steps)}
    grown = GraphSpec.of([*graph.deps.items(), *added.items()])
    if state.limits.only is not None:  # outside the selection: known, never ready
        spec = RunSpec(grown, state.spec.limits, state.spec.context, state.spec.versions,
                       state.spec.dependents, held=state.spec.held + len(added),
                       code_fingerprints=state.spec.code_fingerprints, drives=state.spec.drives)
        return replace(state, spec=spec, events=())
    outputs = state.outputs
    ready, offset, waiting = state._ready, state._offset, dict(state._waiting)
    if not (ready or state._running):
        offset = grown.index[next(iter(added))] if added else offset
    for name, deps in added.items():
        missing = sum(1 for d in deps if d not in outputs)
        if not missing:
            ready = window.add(ready, window.bit(grown.index[name] - offset))
        elif len(deps) > 1 and missing < len(deps):
            waiting[name] = missing
    offset, ready, running = window.anchor(offset, ready, state._running)
    spec = RunSpec(grown, state.spec.limits, state.spec.context, state.spec.versions,
                   _grown_dependents(state.spec, added),
                   code_fingerprints=state.spec.code_fingerprints, drives=state.spec.drives)
    return replace(state, spec=spec, events=(), _offset=offset, _ready=ready, _running=running,
                   _waiting=MappingProxyType(waiting))


def _checked_names(
    graph: GraphSpec, steps: Mapping[str, Iterable[str]]
) -> list[tuple[str, Iterable[str]]]:
    if not isinstance(steps, Mapping):
        raise GraphError(f"steps to add must be a mapping of name to dependencies, got "
                         f"{type(steps).__name__}")
    known = [name for name in steps if name in graph.index]
    if known:
        raise GraphError(f"cannot add steps already in the graph: {sorted(known)}", known)
    return list(steps.items())


def _grown_dependents(
    spec: RunSpec, added: Mapping[str, tuple[str, ...]]
) -> MappingProxyType[str, tuple[str, ...]]:
    """The run's dependents index with the added steps' edges (in declaration order)."""
    dependents = dict(spec.dependents)
    for name, deps in added.items():
        dependents.setdefault(name, ())
        for d in deps:
            dependents[d] = (*dependents.get(d, ()), name)
    return MappingProxyType(dependents)

