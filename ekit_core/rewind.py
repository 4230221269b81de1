"""Re-running work deliberately: which recorded outputs a change invalidates.

This module owns one rule: **a step that runs again makes everything
downstream of it run again** (its dependents consumed the old output).
:func:`rewind` applies it to steps the user names; :func:`outdated_steps`
finds the steps a resume must re-run because they changed since they were
recorded (a bumped ``version`` tag, or dependencies that differ from the
recorded graph). Both are pure.

In a graph with run-time shapes (:mod:`ekit_core.shapes`) the rule reads
the graph as the run grew it: the items the recorded outputs expand into
(:func:`grown`). An item's dependents are the items chained to it and its
mapped step's collected output; a step's are its declared dependents and
the items of the steps mapped over it. So rewinding one item ``M[k]`` drops
it, ``M``'s collected output, the items chained to it (``N[k]``, with
``N``'s collection) and what needs those; rewinding ``M`` drops every item
of ``M`` too; rewinding what ``M`` maps over drops all of that. Rewinding a
step that runs a child workflow (``P``) drops every step of its child
(``P/...``) too: the step's work is its child's. The steps
and items skipped downstream are dropped with them: their conditions are
decided again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import replace
from types import MappingProxyType
from typing import Any, cast

from ekit_core.checkpoint import WorkflowCheckpoint
from ekit_core.code import code_changed
from ekit_core.compat import reshaped_steps
from ekit_core.expansion import (
    Expanded,
    ItemRef,
    bodies_of,
    body_maps,
    body_step_iteration,
    child_items,
    children_per_item,
    expand,
    expanders,
    items_compacted,
    iteration_of,
    loops_of,
)
from ekit_core.graph import GraphSpec
from ekit_core.shapes import Shape, item_name, items_of, iteration_name

__all__ = [
    "changed_steps", "downstream", "grown", "kept_unrecorded", "outdated_steps", "reached",
    "redone_after", "rewind", "without_questions",
]


def grown(graph: GraphSpec, outputs: Mapping[str, Any]) -> Expanded:
    """The items that ``outputs`` expand ``graph``'s mapped steps into, as a resume expands them.

    Empty for a graph without mapped steps, or before anything they map
    over is recorded. Expansions that a recorded output refuses (not a list
    or mapping) add nothing, as in a run.
    """
    found = Expanded()
    for over in expanders(graph):
        if over in outputs:
            more, _refused = expand(graph, over, outputs[over])
            found.steps.update(more.steps)
            found.items.update(more.items)
            found.members.update(more.members)
            found.kinds.update(more.kinds)
    for parent, child_steps in children_per_item(graph).items() if graph.shapes else ():
        over = cast(str, graph.shapes[parent].map_over)
        if over in outputs:  # (a child per item: its steps once per item, as a run grows them)
            child_items(graph, parent, child_steps, outputs[over], found)
    loops = dict.fromkeys(loops_of(graph)) if graph.shapes else {}
    if loops:  # and the recorded iterations of its loops, each after the one before it
        bodies = bodies_of(graph)
        inside = {step: (loop, frozenset(body)) for loop, body in bodies.items() for step in body}
        table = {**loops, **inside}
        for name in outputs:
            at = iteration_of(name, table)
            if at is None:
                continue
            loop, k = at
            if loop in inside:  # a step of a loop's body: iteration k of its loop's
                owner, steps = inside[loop]
                body_step_iteration(graph, owner, steps, loop, k, found)
            elif loop not in bodies:
                before = iteration_name(loop, k - 1) if k > 1 else ""
                found.steps[name] = (*graph.deps[loop], before) if before else graph.deps[loop]
                found.items[name] = ItemRef(loop, str(k), before, None, k)
        if bodies:
            _body_items(graph, outputs, inside, found)
    return found


def _body_items(graph: GraphSpec, outputs: Mapping[str, Any],
                inside: Mapping[str, tuple[str, frozenset[str]]], found: Expanded) -> None:
    """The items of a loop body's maps that the recorded iterations they map over make
    (``M#k[key]``, collected as ``M#k``), as a run expands them."""
    maps = body_maps(graph)
    for over in [n for n, ref in found.items.items() if ref.step in maps and n in outputs]:
        k = found.items[over].iteration
        items_out = outputs[over]
        for step in maps[found.items[over].step]:
            mapped = iteration_name(step, k)
            if mapped not in found.steps:
                owner, steps = inside[step]
                body_step_iteration(graph, owner, steps, step, k, found)
            items = items_of(items_out, graph.shapes[step].item_key)
            if isinstance(items, str):
                continue
            names = []
            for key, _value, pick in items:
                item = item_name(mapped, key)
                names.append(item)
                found.steps[item] = found.steps[mapped]
                found.items[item] = ItemRef(mapped, key, over, pick)
            found.members[mapped] = tuple(names)
            found.kinds[mapped] = "dict" if isinstance(items_out, Mapping) else "list"


def iterations_of(loops: Iterable[str], names: Iterable[str]) -> set[str]:
    """The names among ``names`` spelt as iterations of one of ``loops`` (``L#k``), or as
    items of one (``M#k[key]``, of a body's map: they go with their iteration)."""
    table = dict.fromkeys(loops)
    return {n for n in names if table and iteration_of(n.partition("[")[0], table) is not None}


def _consumers(graph: GraphSpec, items: Expanded) -> dict[str, list[str]]:
    """Who consumes each step's or item's output in the grown graph (see the module)."""
    consumers = {n: list(graph.dependents[n]) for n in graph.names}
    for name, deps in items.steps.items():
        consumers.setdefault(name, [])
        for d in deps:
            consumers.setdefault(d, []).append(name)  # (a compacted iteration too)
    for name, ref in items.items.items():
        consumers[name].append(ref.step)
    # A loop's body steps record their last iteration's outputs as the loop ends: they go
    # with the loop's own output, whichever iteration is rewound.
    for loop, body in bodies_of(graph).items():
        consumers[loop] = [*consumers[loop], *body]
    return consumers


def downstream(graph: GraphSpec, names: Iterable[str]) -> list[str]:
    """``names`` and every step that depends on one of them, in declaration order."""
    seen = set(names)
    frontier = list(seen)
    while frontier:
        for child in graph.dependents[frontier.pop()]:
            if child not in seen:
                seen.add(child)
                frontier.append(child)
    return [n for n in graph.names if n in seen]


def outdated_steps(
    graph: GraphSpec, checkpoint: WorkflowCheckpoint, versions: Mapping[str, str] | None = None,
    code: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Recorded steps a resume must run again, each with the reason, downstream ones included.

    A recorded step is outdated when its ``version`` tag differs from the
    recorded one (no tag on either side counts as equal), or when the
    checkpoint records its dependencies and they differ from the graph's, or
    its run-time shape and it differs (a plain step now mapped, or the
    reverse, keyed, conditioned or joined otherwise: what it recorded is not
    what it makes now), or its code's fingerprint (``code``, step -> fingerprint:
    see :mod:`ekit_core.code`) differs from the recorded one.
    """
    versions, code = versions or {}, code or {}
    recorded_graph: Mapping[str, tuple[str, ...]] = checkpoint.graph or {}
    reshaped = set(reshaped_steps(graph, checkpoint))
    changed: dict[str, str] = {}
    for name in graph.names:
        if name not in checkpoint.outputs:
            continue
        why = _other_work(checkpoint, versions, code, name)
        if why is not None:
            changed[name] = why
        elif name in recorded_graph and set(recorded_graph[name]) != set(graph.deps[name]):
            changed[name] = (
                f"its dependencies changed from {sorted(recorded_graph[name])} "
                f"to {sorted(graph.deps[name])}"
            )
        elif name in reshaped:
            changed[name] = (f"its shape changed from {_shape_text(checkpoint.shapes.get(name))} "
                             f"to {_shape_text(graph.shapes.get(name))}")
    # Walk downstream once (O(steps + edges)), naming for each step the
    # dependency through which the change reached it. A reshaped step that was
    # skipped is decided again: what joined its absence runs again too.
    reasons = dict(changed)
    reached = {*changed, *(n for n in reshaped if n in checkpoint.skipped)}
    frontier = list(reached)
    while frontier:
        parent = frontier.pop()
        for child in graph.dependents[parent]:
            if child in reached:
                continue
            reached.add(child)
            frontier.append(child)
            if child in checkpoint.outputs:
                reasons[child] = f"it depends on {parent!r}, which runs again"
    return {n: reasons[n] for n in graph.names if n in reasons}


def _other_work(checkpoint: WorkflowCheckpoint, versions: Mapping[str, str], code: Mapping[str, str],
                name: str) -> str | None:
    """Why the recorded output of ``name`` is other work by its tag or its code (``None``: not)."""
    old, new = checkpoint.versions.get(name), versions.get(name)
    if old != new:
        return f"its version changed from {old!r} to {new!r}"
    recorded = checkpoint.code_fingerprints
    if recorded and code_changed(recorded, code, name):
        return (f"its code changed since recorded (fingerprint {recorded[name][:12]} "
                f"is now {code[name][:12]})")
    return None


def _shape_text(shape: Shape | None) -> str:
    """A shape as the reason names it: its set fields, or ``plain``."""
    fields = shape.to_dict() if shape is not None else {}
    return ", ".join(f"{k}={v!r}" for k, v in fields.items()) if fields else "plain"


def rewind(
    graph: GraphSpec | Any, checkpoint: WorkflowCheckpoint, steps: str | Iterable[str]
) -> WorkflowCheckpoint:
    """``checkpoint`` without the outputs of ``steps`` and of everything downstream of them.

    Resuming the result runs those steps again and skips the rest, as
    LangGraph users do with a fork of a thread's state. ``graph`` is a
    :class:`GraphSpec` or anything with one as ``.graph`` (a ``Workflow``).
    Failures, cost, context and the graph record are kept: they are history.
    The questions those steps asked, with their answers, are dropped: a
    rewound step asks again (a denied approval is undone so).
    ``steps`` is an iterable of step names, or one name as a plain string
    (``"ab"`` is the step ``ab``, not ``a`` and ``b``). Raises ``ValueError``
    naming steps the graph does not have, or for ``steps`` that is neither.

    In a graph with run-time shapes ``steps`` may also name items
    (``"summarize[2]"``, as the checkpoint records them): see the module for
    what rewinding an item, a mapped step, or what it maps over drops.
    Skips recorded downstream are dropped too.
    """
    spec = graph if isinstance(graph, GraphSpec) else getattr(graph, "graph", None)
    if not isinstance(spec, GraphSpec):
        raise ValueError(f"graph must be a GraphSpec or a Workflow, got {type(graph).__name__}")
    if not isinstance(checkpoint, WorkflowCheckpoint):
        raise ValueError(f"checkpoint must be a WorkflowCheckpoint, got {type(checkpoint).__name__}")
    wanted = list(dict.fromkeys(_step_names(steps)))
    if spec.shapes:
        wanted = _with_children(spec, wanted)
        rewound, touched = _rewind_shaped(spec, checkpoint, wanted)
    else:
        unknown = [n for n in wanted if n not in spec.index]
        if unknown:
            raise ValueError(f"cannot rewind unknown step(s): {', '.join(map(repr, unknown))}")
        touched = set(downstream(spec, wanted))
        rewound = without(checkpoint, spec, touched)
    if rewound is checkpoint:  # nothing recorded to let go of: the same work runs
        return checkpoint
    # What runs again, recorded or not (an attempt interrupted on the old input), is other work.
    return replace(rewound, redone=redone_after(checkpoint, rewound, touched))


def _with_children(graph: GraphSpec, wanted: list[str]) -> list[str]:
    """``wanted`` and, for each step in it that runs a child workflow, every step of its
    child (``P/...``): the step's work is its child's, so rewinding it runs its child
    again, as rewinding a mapped step runs its items again."""
    prefixes = tuple(f"{n}/" for n in wanted if n in graph.shapes and graph.shapes[n].child)
    if not prefixes:
        return wanted
    return [*wanted, *(n for n in graph.names if n.startswith(prefixes) and n not in wanted)]


def redone_after(before: WorkflowCheckpoint, after: WorkflowCheckpoint,
                 touched: Iterable[str] = ()) -> MappingProxyType[str, int]:
    """``before.redone`` counting once more each output ``before`` records and ``after``
    lets go of (``after`` holds a subset of them), and each step or item in ``touched``
    (whose work changed, recorded or not): the attempts that made those outputs are
    spent, and one that asked, failed or was interrupted (which no checkpoint records)
    did other work, so the next attempt of each has a number, and a key, of its own."""
    counted = set(touched)
    if not (after.outputs is before.outputs or len(after.outputs) == len(before.outputs)):
        counted.update(n for n in before.outputs if n not in after.outputs)
    # A compacted iteration's failed attempts went with its failure record, the most of
    # any of its loop's with compacted_retries: a run of it again numbers past them too.
    retried: dict[str, int] = {}
    if before.compacted and after.compacted != before.compacted:
        # (a loop that starts again from its first iteration runs its compacted ones again:
        # their attempts were spent, as a recorded output's were)
        for loop, upto in before.compacted.items():
            if loop.endswith("[]"):  # (a body map's items, counted: their names are gone)
                continue
            shape = before.shapes.get(loop)
            steps = [loop] if shape is None or shape.child is None else \
                [n for n in (before.graph or {}) if n.startswith(f"{loop}/")]
            again = [iteration_name(step, k) for step in steps
                     for k in range(after.compacted.get(loop, 0) + 1, upto + 1)]
            # (and the items of their maps, by the only name left: one per iteration, which
            # attempt_number adds to each item's count)
            again += [items_compacted(iteration_name(step, k)) for step in steps
                      if items_compacted(step) in before.compacted
                      for k in range(after.compacted.get(loop, 0) + 1, upto + 1)]
            counted.update(again)
            spent = before.compacted_retries.get(loop, 0)
            if spent:
                retried.update(dict.fromkeys(again, spent))
    if not counted:
        return before.redone
    redone = dict(before.redone)
    for name in counted:
        redone[name] = redone.get(name, 0) + 1 + retried.get(name, 0)
    return MappingProxyType(redone)


def changed_steps(graph: GraphSpec, checkpoint: WorkflowCheckpoint,
                  versions: Mapping[str, str] | None = None,
                  code: Mapping[str, str] | None = None) -> list[str]:
    """The steps whose work changed since ``checkpoint``, recorded or not: their ``version``
    tag differs from the recorded one, or the dependencies or shape the checkpoint
    records for them differ from ``graph``'s (see :func:`outdated_steps`, which keeps
    the recorded ones and adds what is downstream)."""
    versions = versions or {}
    code, recorded_code = code or {}, checkpoint.code_fingerprints
    recorded_graph: Mapping[str, tuple[str, ...]] = checkpoint.graph or {}
    reshaped = set(reshaped_steps(graph, checkpoint))
    return [n for n in graph.names
            if checkpoint.versions.get(n) != versions.get(n) or n in reshaped
            or (recorded_code and code_changed(recorded_code, code, n))
            or (n in recorded_graph and set(recorded_graph[n]) != set(graph.deps[n]))]


def reached(graph: GraphSpec, checkpoint: WorkflowCheckpoint, roots: Iterable[str]) -> set[str]:
    """``roots``, every step downstream of them and the items of those that are mapped (now or
    when recorded) that ``checkpoint`` names or its outputs grow into: what may have run,
    or been interrupted, on work that changes, whatever the checkpoint records of it."""
    steps = downstream(graph, [n for n in roots if n in graph.index])
    found = {*roots, *steps}
    mapped = tuple(f"{n}[" for n in steps if (n in graph.shapes and graph.shapes[n].map_over)
                   or (n in checkpoint.shapes and checkpoint.shapes[n].map_over))
    mapped += tuple(f"{n}#" for n in steps if (n in graph.shapes and graph.shapes[n].repeat)
                    or (n in checkpoint.shapes and checkpoint.shapes[n].repeat))
    # (a loop whose body is a workflow runs again whole: its body steps' iterations L/s#k,
    # and its maps' items L/m#k[key], are reached with it, grown or only failed or asked)
    if any(graph.shapes[n].child is not None for n in steps
           if n in graph.shapes and graph.shapes[n].repeat):
        mapped += tuple(f"{s}#" for loop, body in bodies_of(graph).items() if loop in steps
                        for s in body)
    # (a child per item's steps take no shape of their own: their items are P/s[key] all
    # the same, which the parent's shape says)
    mapped += tuple(f"{n}[" for n in steps if "/" in n and _per_item(graph, checkpoint, n))
    if not mapped:
        return found
    names = (*grown(graph, checkpoint.outputs).items, *checkpoint.outputs, *checkpoint.failures,
             *checkpoint.asked, *checkpoint.superseded, *checkpoint.skipped)
    found.update(n for n in names if n.startswith(mapped) and n not in graph.index)
    found.update(_next_iterations(graph, checkpoint, steps))
    return found


def kept_unrecorded(graph: GraphSpec, checkpoint: WorkflowCheckpoint, kept: Iterable[str]
                    ) -> set[str]:
    """The items of ``kept`` (mapped steps whose code changed since an item of theirs was
    recorded, and whose ``on_code_change`` keeps them: :mod:`ekit_core.code`) that
    ``checkpoint`` does not record: they run the new code, which is other work than an
    attempt of the old code may have begun on them, so they get new attempt numbers as
    changed work does (issue 45). ``keep`` keeps recorded outputs only; nothing downstream
    changes: what reads a kept step reads its recorded items, or new ones it never saw.
    (A step is kept only with something recorded: an unmapped one is whole.)"""
    kept = [k for k in kept if k in graph.index]
    if not kept:
        return set()
    owned = tuple(f"{k}[" for k in kept)
    settled = (checkpoint.outputs, checkpoint.skipped, checkpoint.superseded)
    return {n for n in reached(graph, checkpoint, kept)
            if n.startswith(owned) and not any(n in table for table in settled)}


def _per_item(graph: GraphSpec, checkpoint: WorkflowCheckpoint, name: str) -> bool:
    """Whether ``name`` is a step of a child run per item (now or when recorded)."""
    parent = name[:name.rindex("/")]
    return any(shape is not None and shape.child is not None and shape.map_over is not None
               for shape in (graph.shapes.get(parent), checkpoint.shapes.get(parent)))


def _next_iterations(graph: GraphSpec, checkpoint: WorkflowCheckpoint, steps: Iterable[str]
                     ) -> list[str]:
    """The iteration each unfinished loop among ``steps`` runs next (the one after the last
    recorded, or compacted): it may have run, or been interrupted, with nothing saved,
    so new work there needs a new number too. None before the loop's dependencies are
    recorded (it cannot have started), nor past its cap as recorded."""
    found: list[str] = []
    outputs = checkpoint.outputs
    bodies: dict[str, tuple[str, ...]] | None = None
    for loop in steps:
        shape = checkpoint.shapes.get(loop) or graph.shapes.get(loop)
        if shape is None or shape.repeat is None or loop in outputs or loop in checkpoint.skipped:
            continue
        # (a loop whose body is a workflow: its iterations are its output step's, the next
        # one is every body step's, and its inputs are its body steps' from outside it)
        if shape.child is not None and bodies is None:
            bodies = bodies_of(graph)
        body = bodies.get(loop, ()) if shape.child is not None and bodies else ()
        inputs = [d for s in body for d in graph.deps[s] if not d.startswith(f"{loop}/")] \
            if body else graph.deps[loop]
        if not all(d in outputs for d in inputs):
            continue
        counted = shape.child if body and shape.child else loop
        last = checkpoint.compacted.get(loop, 0)
        while iteration_name(counted, last + 1) in outputs:
            last += 1
        if last < shape.repeat:
            found.extend(iteration_name(s, last + 1) for s in body or (loop,))
    return found


def without_questions(checkpoint: WorkflowCheckpoint, names: AbstractSet[str]) -> WorkflowCheckpoint:
    """``checkpoint`` without the questions ``names`` asked, answered or not: code whose work
    changed asks its own (as an uninterrupted run of it would), never hearing the old answer."""
    if not checkpoint.asked or not names & checkpoint.asked.keys():
        return checkpoint
    return replace(checkpoint, asked=MappingProxyType(
        {k: v for k, v in checkpoint.asked.items() if k not in names}))


def _rewind_shaped(graph: GraphSpec, checkpoint: WorkflowCheckpoint, wanted: list[str]
                   ) -> tuple[WorkflowCheckpoint, set[str]]:
    """:func:`rewind` in a graph with run-time shapes: items, collections and skips too
    (and the steps and items that run again)."""
    items = grown(graph, checkpoint.outputs)
    if checkpoint.compacted:
        _refuse_compacted(checkpoint.compacted, wanted)
    # (an item set aside for an early cutoff is known too: rewinding it lets go of it)
    unknown = [n for n in wanted
               if n not in graph.index and n not in items.items and n not in checkpoint.superseded
               and n not in checkpoint.skipped]  # (a loop's first iteration, skipped with it)
    if unknown:
        raise ValueError(f"cannot rewind unknown step(s) or item(s): {', '.join(map(repr, unknown))}")
    consumers = _consumers(graph, items)
    # Rewinding a mapped step rewinds every one of its items; a loop, every iteration.
    seen = {*wanted, *(m for n in wanted for m in items.members.get(n, ())),
            *(m for m, ref in items.items.items() if ref.iteration and ref.step in wanted)}
    seen |= {m for n in list(seen) for m in items.members.get(n, ())}  # (L/m#k's items)
    frontier = list(seen)
    while frontier:
        for child in consumers.get(frontier.pop(), ()):
            if child not in seen:
                seen.add(child)
                frontier.append(child)
    keep_forced_skips(graph, items, checkpoint.skipped, seen)
    _reach_loops(graph, checkpoint, wanted, seen)
    outputs = {k: v for k, v in checkpoint.outputs.items() if k not in seen}
    if checkpoint.compacted:  # (a loop that lets go of its count runs again whole)
        again = _restarted(graph, checkpoint, outputs) - seen
        if again:
            seen |= again
            outputs = {k: v for k, v in outputs.items() if k not in again}
    aside = _set_aside(graph, checkpoint, items, wanted, seen)
    untouched = aside.keys() == checkpoint.superseded.keys() and len(outputs) == len(checkpoint.outputs)
    if untouched and not seen & checkpoint.skipped.keys() and not (
            checkpoint.asked and seen & checkpoint.asked.keys()):
        return checkpoint, seen
    # (a compacted iteration is done, counted in step_index as a recorded one is, while its
    # loop keeps its count: while the iteration after the last compacted one stays)
    compacted = compacted_done(checkpoint, _counts_kept(checkpoint, outputs)) \
        if checkpoint.compacted else 0
    return _dropping(
        checkpoint, seen, outputs,
        sum(1 for n in outputs if n in graph.index or n in items.items) + compacted,
        skipped=MappingProxyType({k: v for k, v in checkpoint.skipped.items() if k not in seen}),
        superseded=MappingProxyType(aside),
    ), seen


def _reach_loops(graph: GraphSpec, checkpoint: WorkflowCheckpoint, wanted: list[str],
                 seen: set[str]) -> None:
    """Add to ``seen`` what a rewind reaches of the loops it reaches: a loop's first
    iteration, skipped with it, is decided again with it (as is each body step's, L/s#1);
    the question of the iteration it was at, not recorded, is asked again; and what the
    rewind reaches of that iteration (:func:`_reach_next`)."""
    looped = [n for n in seen if n in graph.shapes and graph.shapes[n].repeat]
    if not looped:
        return
    bodies = bodies_of(graph)
    seen |= {first for n in looped for s in bodies.get(n, (n,))
             if (first := iteration_name(s, 1)) in checkpoint.skipped}
    seen |= {n for n in iterations_of(looped, checkpoint.asked) if n not in checkpoint.outputs}
    _reach_next(graph, _next_iterations(graph, checkpoint, looped), wanted, seen)


def _restarted(graph: GraphSpec, checkpoint: WorkflowCheckpoint, outputs: Mapping[str, Any]
               ) -> set[str]:
    """The recorded iterations of each loop whose ``compacted`` count ``outputs`` lets go of
    (a body's steps' iterations and its maps' items too): the loop runs again from its
    first iteration, and they ran on what it carried, so they run again (a body step
    before its output step in the first kept iteration, which edges do not reach)."""
    kept = _counts_kept(checkpoint, outputs)
    loops = [n for n in checkpoint.compacted if not n.endswith("[]") and n not in kept]
    if not loops:
        return set()
    bodies = bodies_of(graph)
    return iterations_of([*loops, *(s for n in loops for s in bodies.get(n, ()))],
                         checkpoint.outputs)


def _reach_next(graph: GraphSpec, nexts: list[str], wanted: list[str], seen: set[str]) -> None:
    """Add to ``seen`` what a rewind reaches of the iteration each unfinished loop was at
    (``nexts``: it may have run, or been interrupted, with nothing saved): a one-step
    loop's iteration; of a body's, each step rewound or needing what runs again (an input
    of the loop, a step of the same iteration, the previous iteration's output). The
    steps of that iteration before the rewound one stay: "that step ... and everything
    after it" (docs/concepts.md)."""
    inside: dict[str, tuple[str, frozenset[str]]] = {}
    for name in nexts:
        step, k = name[:name.rindex("#")], int(name[name.rindex("#") + 1:])
        shape = graph.shapes.get(step)
        if shape is not None and shape.repeat and shape.child is None:
            seen.add(name)  # (a one-step loop's: it is the loop)
            continue
        if not inside:
            inside = {s: (loop, frozenset(body)) for loop, body in bodies_of(graph).items()
                      for s in body}
        loop, body = inside[step]
        grown_k = Expanded()
        body_step_iteration(graph, loop, body, step, k, grown_k)
        if step in wanted or any(d in seen for d in grown_k.steps[name]):
            seen.add(name)


def _counts_kept(checkpoint: WorkflowCheckpoint, outputs: Mapping[str, Any]
                 ) -> MappingProxyType[str, int]:
    """The ``compacted`` counts of the loops whose first kept iteration ``outputs`` still
    holds (a body's: its output step's); the others start again from their first."""
    shapes = checkpoint.shapes
    kept = {}
    for loop, n in checkpoint.compacted.items():
        shape = shapes.get(loop)
        exit_step = shape.child if shape is not None and shape.child is not None else loop
        if not loop.endswith("[]") and iteration_name(exit_step, n + 1) in outputs:
            kept[loop] = n
    for key, n in checkpoint.compacted.items():  # (a body map's items: with their loop's count)
        if key.endswith("[]") and any(key.startswith(f"{loop}/") for loop in kept):
            kept[key] = n
    return MappingProxyType(kept)


def compacted_done(checkpoint: WorkflowCheckpoint, counts: Mapping[str, int]) -> int:
    """How many done steps and items the ``compacted`` ``counts`` stand for: a compacted
    iteration of a one-step loop is one, of a body one per body step, and a body map's
    count (``step[]``) is its items'."""
    done = 0
    for loop, n in counts.items():
        shape = checkpoint.shapes.get(loop)
        if loop.endswith("[]") or shape is None or shape.child is None:
            done += n
        else:
            done += n * sum(1 for step in (checkpoint.graph or {}) if step.startswith(f"{loop}/"))
    return done


def _refuse_compacted(compacted: Mapping[str, int], wanted: list[str]) -> None:
    """Refuse by name to rewind an iteration ``keep_last`` compacted: it has no output to let
    go of, and what it ran on is gone (rewinding the first one kept, whose input was
    compacted, lets go of the loop's count: the loop runs again from its first iteration)."""
    for name in wanted:
        at = iteration_of(name, compacted)
        if at is not None and at[1] <= compacted[at[0]]:
            raise ValueError(f"cannot rewind {name!r}: its output was compacted (keep_last); "
                             f"rewind the loop {at[0]!r} to run every iteration again")


def _set_aside(graph: GraphSpec, checkpoint: WorkflowCheckpoint, items: Expanded,
               wanted: list[str], seen: set[str]) -> dict[str, Any]:
    """What an early cutoff may keep after this rewind: a rewound output that steps map
    over, and the items dropped only because of it (their mapped step not rewound
    itself, nothing else they need dropped), so that a resume runs only the items
    whose input changes."""
    aside = _still_aside(graph, checkpoint.superseded, wanted, seen)
    sources = [u for u in wanted if u in checkpoint.outputs and u in expanders(graph)]
    if not sources:
        return aside
    for u in sources:
        aside[u] = checkpoint.outputs[u]
    for name, ref in items.items.items():
        if name not in checkpoint.outputs or name not in seen:
            continue
        step, clean = ref.step, True
        if step not in graph.shapes:  # (a child per item's step: no early cutoff, as on a bump)
            continue
        while clean:
            shape = graph.shapes[step]
            over = cast(str, shape.map_over)
            clean = step not in wanted and not any(
                d in seen for d in graph.deps[step] if d != over)
            upstream = graph.shapes.get(over)
            if over in sources or upstream is None or upstream.map_over is None:
                break
            step = over
        if clean and over in sources:
            aside[name] = checkpoint.outputs[name]
    return aside


def _still_aside(graph: GraphSpec, superseded: Mapping[str, Any], wanted: list[str],
                 seen: set[str]) -> dict[str, Any]:
    """What was set aside before that an early cutoff may still keep after this rewind: not
    an item rewound by name, nor one whose mapped step (or one it is chained to) is
    rewound or has another input that runs again (the current code, or new inputs,
    would not make that output), nor an item of a step no longer mapped."""
    prefixes = {f"{n}[": n for n, s in graph.shapes.items() if s.map_over is not None}
    aside = {}
    for name, value in superseded.items():
        if name not in graph.index:  # an item (else the output of what steps map over)
            owner = next((m for p, m in prefixes.items() if name.startswith(p)), None)
            if owner is None or name in wanted or not _untouched(graph, owner, wanted, seen):
                continue
        aside[name] = value
    return aside


def _untouched(graph: GraphSpec, step: str, wanted: list[str], seen: set[str]) -> bool:
    """Whether neither mapped step ``step`` nor a mapped step it is chained to is rewound,
    and no input of theirs but the one they map over runs again."""
    while True:
        over = cast(str, graph.shapes[step].map_over)
        if step in wanted or any(d in seen for d in graph.deps[step] if d != over):
            return False
        upstream = graph.shapes.get(over)
        if upstream is None or upstream.map_over is None:
            return True
        step = over


def keep_forced_skips(graph: GraphSpec, items: Expanded, skipped: Mapping[str, str],
                      seen: set[str]) -> None:
    """Take out of ``seen`` the skips that the skips kept force: what needs a step that
    stays skipped is skipped again, so its skip stays (a resume refuses it otherwise).

    Shared by a rewind and by a resume after a version bump: both drop the
    skips below what runs again, and neither may drop one that a skip they
    keep still forces (``items``: what the recorded outputs grow into)."""
    def deps_of(name: str) -> tuple[str, ...]:
        return items.steps[name] if name in items.steps else graph.deps[name]

    kept = [n for n in skipped if n not in seen]
    frontier = list(kept)
    consumers = _consumers(graph, items) if frontier and seen & skipped.keys() else {}
    while frontier:
        name = frontier.pop()
        for child in consumers.get(name, ()):
            if child not in seen or child not in skipped or name not in deps_of(child):
                continue
            ref = items.items.get(child)
            if ref is not None and ref.source in seen:
                continue  # an item of an output that goes with the rest: it is no more
            shape = graph.shapes.get(child)
            deps = deps_of(child)
            if shape is not None and shape.join == "any" and not all(
                    d in skipped and d not in seen for d in deps):
                continue
            seen.discard(child)
            frontier.append(child)


def _step_names(steps: object) -> list[str]:
    """``steps`` as a list of names: one string is one name, never its characters."""
    if isinstance(steps, str):
        return [steps]
    # bytes iterate as ints: never a list of names someone meant.
    if isinstance(steps, bytes | bytearray) or not isinstance(steps, Iterable):
        raise ValueError(
            f"steps must be a step name or an iterable of step names, got {type(steps).__name__}"
        )
    names = list(steps)
    wrong = [n for n in names if not isinstance(n, str)]
    if wrong:
        raise ValueError(f"steps must hold step names (strings), got {wrong[0]!r}")
    return names


def without(checkpoint: WorkflowCheckpoint, graph: GraphSpec, names: Iterable[str]) -> WorkflowCheckpoint:
    """``checkpoint`` with the outputs and usage of ``names`` removed, and the questions
    they and what depends on them asked, with their answers (nothing else changes).

    A question below a step that runs again goes too: the input it was
    asked about changes, so it is asked again. So do the recorded items of a
    step in ``names`` that was mapped when recorded and is not now: nothing
    would make or collect them again.
    """
    gone = set(names)
    if gone and checkpoint.shapes:
        gone |= _unmapped_items(checkpoint, graph, gone)
        # (a loop that runs again runs every iteration again, of its body's steps too)
        looped = [n for n in gone if n in checkpoint.shapes and checkpoint.shapes[n].repeat is not None]
        bodies = bodies_of(graph) if looped else {}
        body = [t for n in looped for t in bodies.get(n, ())]
        gone |= iterations_of([*looped, *body], checkpoint.outputs)
        gone.update(body)  # (they recorded its last iteration's outputs as it ended)
    if gone and checkpoint.asked:
        return _without_asking(checkpoint, graph, gone)
    if not gone & checkpoint.outputs.keys():
        return checkpoint
    outputs = {k: v for k, v in checkpoint.outputs.items() if k not in gone}
    return _dropping(checkpoint, gone, outputs, sum(1 for n in graph.names if n in outputs),
                     skipped=checkpoint.skipped, superseded=checkpoint.superseded)


def _unmapped_items(checkpoint: WorkflowCheckpoint, graph: GraphSpec, gone: set[str]) -> set[str]:
    """The recorded items of the steps in ``gone`` mapped then (by the checkpoint's shapes)
    but not now (by ``graph``'s)."""
    now = graph.shapes
    was = [n for n, shape in checkpoint.shapes.items() if shape.map_over is not None and n in gone
           and (n not in now or now[n].map_over is None)]
    if not was:
        return set()
    prefixes = tuple(f"{n}[" for n in was)
    return {k for k in checkpoint.outputs if k.startswith(prefixes) and k not in graph.index}


def _without_asking(checkpoint: WorkflowCheckpoint, graph: GraphSpec, gone: set[str]
                    ) -> WorkflowCheckpoint:
    """:func:`without` of a checkpoint that records questions: those of ``gone``, of the
    steps below it and of their items go with the outputs."""
    below = set(downstream(graph, [n for n in gone if n in graph.index]))
    # Only a mapped step has items: a step merely named ``a[x]`` is not one of ``a``'s.
    items = tuple(f"{n}[" for n in below if n in graph.shapes and graph.shapes[n].map_over is not None)
    items += tuple(f"{n}#" for n in below if n in graph.shapes and graph.shapes[n].repeat is not None)
    asking = {k for k in checkpoint.asked if k in gone or k in below or k.startswith(items)}
    if not asking and not gone & checkpoint.outputs.keys():
        return checkpoint
    outputs = {k: v for k, v in checkpoint.outputs.items() if k not in gone}
    dropped = _dropping(checkpoint, gone, outputs, sum(1 for n in graph.names if n in outputs),
                        skipped=checkpoint.skipped, superseded=checkpoint.superseded)
    return replace(dropped, asked=MappingProxyType(
        {k: v for k, v in checkpoint.asked.items() if k not in asking}))


def _dropping(
    checkpoint: WorkflowCheckpoint, gone: set[str], outputs: dict[str, Any], step_index: int, *,
    skipped: MappingProxyType[str, str], superseded: MappingProxyType[str, Any],
) -> WorkflowCheckpoint:
    """``checkpoint`` with ``outputs`` (the usage, durations and questions of ``gone`` dropped too):
    every other field kept.

    Built field by field rather than by ``dataclasses.replace``, which would
    carry over the ledgers a core-made checkpoint shares with its run, and
    with them a delta the new outputs do not extend.
    """
    # (a loop none of whose kept iterations is left starts again from its first)
    compacted = _counts_kept(checkpoint, outputs) if checkpoint.compacted else checkpoint.compacted
    return WorkflowCheckpoint(
        step_index=step_index,
        outputs=MappingProxyType(outputs),
        cost=checkpoint.cost,
        context=checkpoint.context,
        step_usage=MappingProxyType({k: u for k, u in checkpoint.step_usage.items() if k not in gone}),
        durations=MappingProxyType({k: d for k, d in checkpoint.durations.items() if k not in gone}),
        began=MappingProxyType({k: b for k, b in checkpoint.began.items() if k not in gone}),
        held=MappingProxyType({k: h for k, h in checkpoint.held.items() if k not in gone}),
        failures=checkpoint.failures,
        fingerprint=checkpoint.fingerprint,
        graph=checkpoint.graph,
        format_version=checkpoint.format_version,
        versions=checkpoint.versions,
        skipped=skipped,
        shapes=checkpoint.shapes,
        superseded=superseded,
        asked=MappingProxyType({k: v for k, v in checkpoint.asked.items() if k not in gone})
        if checkpoint.asked else checkpoint.asked,
        redone=checkpoint.redone,
        compacted=compacted,
        compacted_retries=MappingProxyType({loop: n for loop, n in checkpoint.compacted_retries.items()
                                            if loop in compacted})
        if checkpoint.compacted_retries else checkpoint.compacted_retries,
        code_fingerprints=checkpoint.code_fingerprints,
        cache_hits=MappingProxyType({k: h for k, h in checkpoint.cache_hits.items() if k not in gone})
        if checkpoint.cache_hits else checkpoint.cache_hits,
        drives=checkpoint.drives,
    )
