"""What a checkpoint claims about skips, collections and questions, checked against the graph it resumes.

A checkpoint is untrusted input (see :mod:`ekit_core.checkpoint`): its
``skipped`` and its mapped steps' outputs are claims that a resume acts on,
so each is checked against what the declared graph and the recorded outputs
allow, and a claim no run of the graph could make is a
:class:`~ekit_core.CheckpointError` naming the field and the step, raised
before any step runs. The rules, for every graph (with run-time shapes or
without):

- a skip names a declared step, or an item that the recorded outputs make;
- a skipped step (or item) has no recorded output, and no recorded step or
  item needs it (a ``join="any"`` step needs one of its dependencies only);
- a skip has a cause: the step's condition, a skipped dependency, or (a
  ``join="any"`` step) every dependency skipped; so a graph with no
  conditions records no skips at all;
- a mapped step's recorded output stands on its items: the output it maps
  over is recorded and can be mapped over, and each item is recorded or
  skipped (a resume would otherwise run the items again after the steps
  that need the collected output, and never collect them);
- a step's questions come in an order a run records: only the last may be
  unanswered, and none but the last denied.

A checkpoint recorded from another graph (a resume with
``allow_graph_change``) is held, of the rules on skips, to "no output"
only: its skips were decided by the other graph's shapes. Pure: no I/O, deterministic.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ekit_core.checkpoint import CheckpointError, WorkflowCheckpoint
from ekit_core.compat import recorded_from
from ekit_core.exchanges import Exchange
from ekit_core.expansion import Expanded, bodies_of
from ekit_core.graph import GraphSpec
from ekit_core.rewind import grown

__all__ = ["check_claims", "check_collections", "check_questions", "check_skips"]


def check_claims(graph: GraphSpec, checkpoint: WorkflowCheckpoint) -> None:
    """What a resume checks of ``checkpoint`` before anything expands: its skips
    (:func:`check_skips`) and the order of its questions (:func:`check_questions`)."""
    check_skips(graph, checkpoint)
    if checkpoint.asked:
        check_questions(checkpoint.asked)


def check_questions(asked: Mapping[str, tuple[Exchange, ...]]) -> None:
    """Refuse a step's questions in an order no run records: only the last may be
    unanswered, and none but the last denied (a denial ends the step's asking).

    ``from_dict`` holds a checkpoint it reads to this rule; a checkpoint built
    as a value (``dataclasses.replace``, say) meets it here, on resume.
    """
    for name, exchanges in asked.items():
        for i, exchange in enumerate(exchanges[:-1]):
            answer = exchange.answer
            if answer is None or answer.approved is False:
                problem = "unanswered" if answer is None else "a denial"
                raise CheckpointError(f"asked.{name}[{i}]", f"is {problem}, yet a later question follows")


def check_skips(graph: GraphSpec, checkpoint: WorkflowCheckpoint) -> None:
    """Refuse the skips of ``checkpoint`` that no run of ``graph`` records (see the module)."""
    skipped, outputs = checkpoint.skipped, checkpoint.outputs
    if not skipped:
        return
    both = next((n for n in skipped if n in outputs), None)
    if both is not None:
        raise CheckpointError("skipped", f"records {both!r} as skipped and its output too")
    if checkpoint.fingerprint is not None and not recorded_from(graph, checkpoint):
        return  # another graph's skips: see the module
    # The items only when an item is skipped: a recorded item that needs a
    # skipped step is refused by the resume's expansion anyway.
    items = grown(graph, outputs) if any(n not in graph.index for n in skipped) else Expanded()
    item_children: dict[str, list[str]] = {}
    for item, deps in items.steps.items():
        for dep in deps:
            item_children.setdefault(dep, []).append(item)
    for name in skipped:
        if name in graph.index:
            deps, owner, children = graph.deps[name], name, (*graph.dependents[name],)
        elif name in items.items:
            deps, owner, children = items.steps[name], items.items[name].step, ()
        elif (loop := _first_iteration_of(graph, name)) is not None:
            if loop not in skipped:
                raise CheckpointError("skipped", f"records {name!r} as skipped, yet not its loop "
                                                 f"{loop!r}, which is skipped with it")
            deps, owner, children = graph.deps[loop], loop, ()
        else:
            raise CheckpointError("skipped", f"names {name!r}, which is no step or item of this run")
        _check_needed(graph, name, (*children, *item_children.get(name, ())), outputs)
        _check_cause(graph, name, owner, deps, skipped, outputs)


def _first_iteration_of(graph: GraphSpec, name: str) -> str | None:
    """The loop ``name`` is the first iteration of (``L#1``), which waits for the loop's
    dependencies and is skipped with it, or the body step (``L/s#1``, skipped with its
    loop); ``None`` for any other name."""
    loop = name[:-2] if name.endswith("#1") else None
    shape = graph.shapes.get(loop) if loop else None
    if shape is not None and shape.repeat is not None:
        return loop
    if loop and loop in graph.index and any(
            s.repeat is not None and s.child is not None and loop.startswith(f"{n}/")
            for n, s in graph.shapes.items()):
        return loop
    return None


def _check_needed(graph: GraphSpec, name: str, children: tuple[str, ...],
                  outputs: Mapping[str, Any]) -> None:
    """No recorded step or item needs the skipped ``name`` (a join over alternatives
    needs one of its dependencies only)."""
    for child in children:
        if child in outputs and not (_joins_any(graph, child) and _some_recorded(
                graph.deps[child], outputs)):
            raise CheckpointError("skipped", f"records {name!r} as skipped, yet the output of "
                                             f"{child!r}, which needs it")


def _check_cause(graph: GraphSpec, name: str, owner: str, deps: tuple[str, ...],
                 skipped: Mapping[str, str], outputs: Mapping[str, Any]) -> None:
    """The skip of ``name`` (a step, or an item of ``owner``) has a cause a run records:
    a skipped dependency, or its condition, decided once its dependencies were settled."""
    gone = [d for d in deps if d in skipped]
    if gone and (not _joins_any(graph, owner) or len(gone) == len(deps)):
        return
    shape = graph.shapes.get(owner)
    if shape is None or shape.when is None:
        raise CheckpointError("skipped", f"records {name!r} as skipped, yet it has no condition "
                                         "and no skipped step it needs")
    unsettled = next((d for d in deps if d not in outputs and d not in skipped), None)
    if unsettled is not None:
        raise CheckpointError("skipped", f"records {name!r} as skipped by its condition, yet not "
                                         f"the output of {unsettled!r}, which it is decided on")


def _joins_any(graph: GraphSpec, name: str) -> bool:
    shape = graph.shapes.get(name)
    return shape is not None and shape.join == "any"


def _some_recorded(deps: tuple[str, ...], outputs: Mapping[str, Any]) -> bool:
    return any(d in outputs for d in deps)


def check_collections(graph: GraphSpec, outputs: Mapping[str, Any], skipped: Mapping[str, str],
                      members: Mapping[str, tuple[str, ...]]) -> None:
    """Refuse a recorded mapped step whose items are not all recorded or skipped.

    ``members`` holds the items a resume expanded each mapped step into (the
    recorded outputs are expanded again for one it lacks: a resume's
    selection may hold no items of a step); a recorded mapped step with none
    was never expanded (what it maps over is not recorded, or is no list or
    mapping).
    """
    recorded = [n for n, s in graph.shapes.items()  # (a child per item: its steps collect)
                if s.map_over is not None and s.child is None and n in outputs]
    if recorded and any(s.child is not None and s.repeat is not None for s in graph.shapes.values()):
        inside = {n for body in bodies_of(graph).values() for n in body}  # (they map per iteration)
        recorded = [n for n in recorded if n not in inside]
    if any(n not in members for n in recorded):
        members = grown(graph, outputs).members
    for name in recorded:
        items = members.get(name)
        if items is None:
            raise CheckpointError("outputs", f"records the output of mapped step {name!r}, yet no "
                                             f"items of {graph.shapes[name].map_over!r}, which it "
                                             "maps over")
        missing = next((m for m in items if m not in outputs and m not in skipped), None)
        if missing is not None:
            raise CheckpointError("outputs", f"records the output of mapped step {name!r}, yet "
                                             f"not that of its item {missing!r}")
