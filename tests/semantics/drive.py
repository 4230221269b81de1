"""Drive a planned workflow through the real runtime, turn after turn, and compare every turn
with the reference model: the differential test's engine (the test file holds the strategies).

A *turn* is one run: before it the code may move on a phase (a version bump) and a
step, an item or an upstream may be rewound; during it the process may die at the
k-th save (``checkpoint_fn`` raises a ``BaseException``; the store keeps what was
saved before) or at the c-th step call (the step raises one; the run saves what
finished). Every checkpoint goes through its JSON form and into a store, and the
next turn resumes what the store loads. After the scripted turns, calm turns run
the final code to its end.

What is compared, each turn (``Mismatch`` says which):

- ``saves``: with ``max_concurrency=1``, the checkpoints saved, in order (a crash at
  a save: those before it), each as the model reads it (outputs, usage, cost,
  skips, failures, questions, versions, redone, superseded);
- ``events``: with ``max_concurrency=1``, the whole event sequence; otherwise each
  unit's own sequence, when the run's end does not depend on the order;
- ``paid``: which attempts (unit, attempt number) began and which were paid;
- ``final``: the last checkpoint, and the outcome, when the order cannot change them;
- ``audit``: what ``ekit_core.audit`` says a resume of the loaded checkpoint skips;
- ``replay``: ``ekit_core.replay`` accepts every checkpoint sequence the runs saved.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import os
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ekit_core import (
    LoopError,
    RunSettled,
    StepCacheHit,
    StepDenied,
    StepExpanded,
    StepFailed,
    StepFinished,
    StepInterrupted,
    StepOutdated,
    StepRetried,
    StepSkipped,
    StepStarted,
    StepWaiting,
    TokenUsage,
    WorkflowCheckpoint,
    audit,
    questions,
    replay,
    rewind,
)
from ekit_core.events import RunStarted
from ekit_runtime import (
    CodeChangedError,
    JournalStore,
    JsonFileStore,
    RunHalted,
    SqliteCache,
    SqliteStore,
    Workflow,
)
from ekit_runtime.cache.base import Cache
from tests.semantics import model
from tests.semantics.strategies import CodedWorkflow, ParentStep, ReshapedWorkflow
from tests.semantics.world import (
    Crash,
    MemoryCache,
    Transient,
    World,
    approval,
    build,
    model_steps,
    record_of,
)
from tests.support.strategies import PlannedWorkflow

DSN = os.environ.get("EKIT_TEST_POSTGRES_DSN")


@dataclass(frozen=True)
class Turn:
    """One disturbed run: a bump before it, a rewind (``rewind_item``: the item of that step
    at that position among those recorded), a crash at a save or at a step call."""

    bump: bool = False
    rewind: str | None = None
    rewind_item: int | None = None
    crash_at_save: int | None = None
    crash_at_call: int | None = None
    fresh: bool = False  # a new run (its own run_id and store), sharing the cache


@dataclass(frozen=True)
class RunArgs:
    """The arguments every run of an example is given."""

    concurrency: int | None = 1
    isolate_failures: bool = False
    budget_calls: int | None = None
    only: tuple[str, ...] | None = None
    approval: bool = False


# The disagreements found and not fixed yet (test_found_by_the_model.py, xfail), each stepped
# around where the driver meets it by raising KnownBug with a KNOWN_... name here: none now.


class KnownBug(Exception):
    """The runtime met a disagreement already written down in test_found_by_the_model.py."""


class Mismatch(AssertionError):
    """The runtime and the model disagree."""


def _event(e: Any) -> tuple[Any, ...] | None:
    if isinstance(e, RunStarted):
        return ("RunStarted",)
    if isinstance(e, (StepStarted, StepFinished, StepRetried, StepFailed)):
        return (type(e).__name__, e.name, e.attempt)
    if isinstance(e, (StepSkipped, StepExpanded, StepOutdated, StepWaiting, StepInterrupted,
                      StepDenied, StepCacheHit)):
        return (type(e).__name__, e.name)
    if isinstance(e, RunSettled):
        return ("RunSettled", e.outcome)
    return None  # CheckpointSaved and the rest: the shell's own


def _settled(events: list[tuple[Any, ...]], mapped: set[str]) -> list[tuple[Any, ...]]:
    """``events`` with each run of what settling tells (skips, expansions, collections of
    mapped steps) in one order: the docs say what one transition settles, not in which
    order it tells it."""
    def settling(e: tuple[Any, ...]) -> bool:
        # (a loop's own StepFailed is its LoopError, told where a resume reads the loop)
        return e[0] in ("StepSkipped", "StepExpanded") or (
            e[0] in ("StepFinished", "StepFailed") and e[1] in mapped)

    def told(block: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        # (an item of a mapped step skipped in the same breath: told or not, see _dedupe)
        gone = {e[1] for e in block if e[0] == "StepSkipped"}
        return sorted(e for e in block if not (
            e[0] == "StepSkipped" and "[" in e[1] and e[1].split("[", 1)[0] in gone))

    out: list[tuple[Any, ...]] = []
    block: list[tuple[Any, ...]] = []
    for e in events:
        if settling(e):
            block.append(e)
            continue
        out.extend(told(block))
        block = []
        out.append(e)
    return out + told(block)


def _why(reason: str) -> str:
    """A skip's cause: its condition, or a skipped step it needs (which one, when it needs
    several, the docs do not say)."""
    return "condition" if reason.startswith("condition") else "needs"


def _dedupe(saves: list[model.Record], body: frozenset[str] = frozenset(),
            body_maps: frozenset[str] = frozenset()) -> list[model.Record]:
    kept: list[model.Record] = []
    for r in saves:
        # (the steps of a loop's body, and their maps of an iteration, never start: their
        # iterations and items do; how a resume counts them in ``redone`` shows in no key,
        # and the docs do not say)
        redone = {u: n for u, n in r.redone.items()
                  if u not in body and ("[" in u or u.rsplit("#", 1)[0] not in body_maps)}
        r = dataclasses.replace(r, redone=redone)
        # (what is set aside for an early cutoff is compared through the items it keeps)
        # (the items of a skipped mapped step: recorded skipped or not at all, the docs do
        # not say; a resume lets go of them either way)
        skipped = {u: _why(w) for u, w in r.skipped.items()
                   if u.split("[", 1)[0] == u or u.split("[", 1)[0] not in r.skipped}
        # (a LoopError's message names the loop, concepts.md; its words are the runtime's)
        failures = {u: (t, f"names {u!r}" if t == "LoopError" and repr(u) in m else m, n)
                    for u, (t, m, n) in r.failures.items()}
        r = dataclasses.replace(r, skipped=skipped, superseded={}, failures=failures)
        if not kept or kept[-1] != r:
            kept.append(r)
    return kept


def _outdated_in_order(events: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """``events`` with each run of ``StepOutdated`` sorted: the docs say a resume tells one
    per step that runs again (api.md, ``initial_state``), not in which order (a child per
    item's steps: declared, or as they grow)."""
    out: list[tuple[Any, ...]] = []
    for e in events:
        if e[0] == "StepOutdated" and out and out[-1][0] == "StepOutdated":
            start = len(out)
            while start and out[start - 1][0] == "StepOutdated":
                start -= 1
            out[start:] = sorted([*out[start:], e])
        else:
            out.append(e)
    return out


def _per_unit(events: list[tuple[Any, ...]]) -> dict[str, list[tuple[Any, ...]]]:
    units: dict[str, list[tuple[Any, ...]]] = {}
    for e in events:
        if len(e) > 1 and e[0] != "RunSettled":
            units.setdefault(e[1], []).append(e)
    return units


@contextmanager
def a_store(kind: str) -> Iterator[Any]:
    """A store of ``kind`` for one example, removed afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        if kind == "json":
            yield JsonFileStore(Path(tmp) / "cp.json")
        elif kind == "journal":
            yield JournalStore(Path(tmp) / "cp.jsonl")
        elif kind == "sqlite":
            store = SqliteStore(Path(tmp) / "cp.db", run_id="r")
            try:
                yield store
            finally:
                store.close()
        elif kind == "postgres":
            from ekit_runtime.stores.postgres import PostgresStore

            assert DSN is not None
            run_id = f"model-{uuid.uuid4().hex}"
            pg = PostgresStore(DSN, run_id=run_id)
            try:
                yield pg
            finally:
                pg.delete(run_id)
                pg.close()
        else:
            raise ValueError(kind)


class Saver:
    """A run's ``checkpoint_fn``: each checkpoint through JSON into the store; it raises
    ``Crash`` at its ``crash_at``-th save and saves nothing afterwards."""

    def __init__(self, store: Any, crash_at: int | None) -> None:
        self.store, self.crash_at = store, crash_at
        self.saved: list[WorkflowCheckpoint] = []
        self.calls = 0
        self.dead = False

    def __call__(self, cp: WorkflowCheckpoint) -> None:
        if self.dead:
            return
        self.calls += 1
        if self.calls == self.crash_at:
            self.dead = True
            raise Crash
        again = WorkflowCheckpoint.from_dict(json.loads(json.dumps(cp.to_dict())))
        if again != cp:
            raise Mismatch("a checkpoint changed through its JSON form")
        self.store.save(again)
        self.saved.append(again)


def _answers(steps: list[model.ModelStep], record: model.Record | None,
             policy: str | None) -> dict[str, Any]:
    """A person answers every question the model says a resume still asks."""
    if record is None:
        return {}
    probe = model.Run(steps, record, World.__new__(World), model.Options(on_code_change=policy))
    try:
        probe.resume()
    except model.CodeChanged:
        return {}
    return {u: f"ans({u})" for u, asked in probe.rec.asked.items() if asked[-1][1] is model.NO_ANSWER}


def _run(plan: PlannedWorkflow, workflow: Workflow, cp: WorkflowCheckpoint | None,
         saver: Saver, args: RunArgs, answers: dict[str, Any], events: list[Any],
         world: World, cache: Cache | None, run_id: str) -> str:
    """One runtime run; how it ended."""
    budget = None if args.budget_calls is None else TokenUsage(llm_calls=args.budget_calls)
    try:
        workflow.run_sync(resume_from=cp, answers=answers or None, checkpoint_fn=saver,
                          run_id=run_id, max_concurrency=args.concurrency, budget=budget,
                          cache=cache,
                          isolate_failures=args.isolate_failures,
                          only=list(args.only) if args.only else None, trace=events.append,
                          approval=approval(world) if args.approval else None,
                          allow_graph_change=isinstance(plan, ReshapedWorkflow))
    except CodeChangedError as refused:
        return f"refused {list(refused.steps)}"
    except (Crash, Transient, TimeoutError, RunHalted, asyncio.CancelledError, LoopError) as exc:
        return type(exc).__name__
    except ExceptionGroup as group:
        _, rest = group.split((Transient, TimeoutError, LoopError))
        if rest is not None:
            raise
        return "Transient"
    return "finished"


def drive(plan: PlannedWorkflow, store_kind: str, turns: list[Turn], args: RunArgs,
          salt: int = 0) -> int:
    """Run ``plan`` through ``turns`` and then calmly to its end, comparing each turn with
    the model; raises ``Mismatch`` at the first disagreement. Returns the turns run."""
    world = World(plan, salt)
    if args.only and any(world.planned[n].repeat is not None for o in args.only
                         for n in [o.rsplit("/", 1)[0]] if "/" in o):
        args = _refused_only(plan, world, args)
    phase, runs = 0, 0
    history: list[WorkflowCheckpoint] = []
    codes: dict[tuple[str, str], str] = {}  # (step, fingerprint) -> its code, as the model names it
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(a_store(store_kind))
        cache = _a_cache(plan, stack)
        limit = len(turns) + 4 * _units(plan) + 8
        for number in range(limit):
            calm = number >= len(turns)
            turn = Turn() if calm else turns[number]
            if calm:  # the calm turns lift the budget and the selection: the run can end
                args = RunArgs(args.concurrency, args.isolate_failures, approval=args.approval)
            phase = plan.phases - 1 if calm else min(phase + turn.bump, plan.phases - 1)
            workflow = build(plan, phase, world)
            steps = model_steps(plan, phase)
            _learn(codes, workflow, steps)
            if turn.fresh and cache is not None:  # a new run: what the cache holds is its gain
                store, runs, history = stack.enter_context(a_store(store_kind)), runs + 1, []
                world.runs = runs
            cp = store.load()
            if cp is not None and turn.rewind is not None:
                cp = rewind(workflow, cp, _target(workflow, cp, turn))
                history.append(cp)
            record = None if cp is None else record_of(cp, workflow, codes)
            answers = _answers(steps, record, _policy(plan))
            world.calls = 0
            world.interrupt_at = turn.crash_at_call
            mine = copy.deepcopy(world)
            options = model.Options(args.only, args.isolate_failures, args.budget_calls, answers,
                                    args.approval, _policy(plan), cache is not None)
            predicted = model.run(steps, record, mine, options)
            if cp is not None and not os.environ.get("EKIT_MODEL_NOAUDIT") and not predicted.refused:
                _check_audit(workflow, cp, steps, record, number, options)
            before = copy.deepcopy(world)
            keys_before = dict(world.keys)
            saver, events = Saver(store, turn.crash_at_save), list[Any]()
            ended = _run(plan, workflow, cp, saver, args, answers, events, world, cache,
                         f"r{runs}" if runs else "r")
            if ended.startswith("refused") or predicted.refused:
                if ended != f"refused {list(predicted.refused)}":
                    raise Mismatch(f"turn {number}: the resume was {ended}, the model says "
                                   f"refused {list(predicted.refused)}")
                return number + 1  # (refused while the code stays changed: nothing more runs)
            history.extend(saver.saved)
            if world.problems:
                raise Mismatch(f"turn {number}: {world.problems}")
            if not saver.saved:  # a resume numbers attempts from what was saved: the keys of
                world.keys = keys_before  # a run that saved nothing may come again (concepts.md)
            _compare(number, predicted, saver, events, workflow, args, world, mine, before, steps,
                     codes)
            report = _replay(plan, workflow, history)
            if report.violations:
                raise Mismatch(f"turn {number}: replay refused the runs' checkpoints: "
                               f"{[v.to_dict() for v in report.violations]}")
            if calm and ended == "finished" and predicted.outcome == "finished":
                return number + 1
            if calm and predicted.failed and all(
                    (record_of(c, workflow).failures.get(u, ("",))[0] == "LoopError")
                    for u in predicted.failed for c in saver.saved[-1:]):
                return number + 1  # a loop at its cap fails again on every resume (concepts.md)
            if calm and predicted.outcome in ("failed",) and not args.isolate_failures:
                continue
    raise Mismatch("the run never finished")


def _refused_only(plan: PlannedWorkflow, world: World, args: RunArgs) -> RunArgs:
    """``only`` naming a step of a loop's body is refused by name before anything runs
    (docs/concepts.md, "Running some of the steps"): checked, then the example goes on
    without the selection. (The model leaves this out: nothing runs to compare.)"""
    assert args.only is not None
    saved: list[WorkflowCheckpoint] = []
    before, keys = world.state(), dict(world.keys)
    try:
        build(plan, 0, world).run_sync(only=list(args.only), checkpoint_fn=saved.append,
                                       run_id="r", max_concurrency=args.concurrency)
    except ValueError as refused:
        if not any(f"only names {o!r}, a step of the body of the loop" in str(refused)
                   for o in args.only):
            raise Mismatch(f"only={list(args.only)} refused, but not by the body step's name: "
                           f"{refused}") from refused
    else:
        raise Mismatch(f"only={list(args.only)} names a step of a loop's body: not refused")
    if saved or world.state() != before or world.keys != keys:
        raise Mismatch(f"only={list(args.only)} was refused after something ran or was saved")
    return dataclasses.replace(args, only=None)


def _target(workflow: Workflow, cp: WorkflowCheckpoint, turn: Turn) -> str:
    """What ``turn`` rewinds: its step, or an item or iteration of it among those recorded."""
    assert turn.rewind is not None
    items = sorted(n for n in cp.outputs if n.startswith(f"{turn.rewind}["))
    # (a reshaped step may record items its current code no longer maps:
    # rewind knows only the current graph's names, and refuses the rest)
    mapped = any(s.name == turn.rewind and s.map_over for s in workflow.steps)
    if any(s.name == turn.rewind and s.repeat for s in workflow.steps):
        # an iteration of a loop, among those recorded (concepts.md, Loops)
        items = [n for n in cp.outputs if n.startswith(f"{turn.rewind}#")]
        mapped = True
    if items and turn.rewind_item is not None and mapped:
        return items[turn.rewind_item % len(items)]
    return turn.rewind


def _policy(plan: PlannedWorkflow) -> str | None:
    return plan.policy if isinstance(plan, CodedWorkflow) else None


def _a_cache(plan: PlannedWorkflow, stack: contextlib.ExitStack) -> Cache | None:
    """The cache every run of a coded example is given (``None``: no step is cached)."""
    if not isinstance(plan, CodedWorkflow) or not plan.cached:
        return None
    if plan.cache == "memory":
        return MemoryCache()
    folder = stack.enter_context(tempfile.TemporaryDirectory())
    sqlite = SqliteCache(Path(folder) / "cache.db")
    stack.callback(sqlite.close)
    return sqlite


def _learn(codes: dict[tuple[str, str], str], workflow: Workflow,
           steps: list[model.ModelStep]) -> None:
    """Which code each fingerprint of ``workflow`` is, as the model names it."""
    if any(s.code or s.cache for s in steps) or workflow.code_policies:
        mine = {s.name: s.code for s in model.flatten(steps)}
        for name, printed in workflow.code_fingerprints().items():
            codes[(name, printed)] = mine.get(name, "?")


def _compare(number: int, predicted: model.Prediction, saver: Saver, events: list[Any],
             workflow: Workflow, args: RunArgs, world: World, mine: World, before: World,
             steps: list[model.ModelStep], codes: dict[tuple[str, str], str]) -> None:
    body = frozenset(s.name for s in model.flatten(steps) if s.body_of is not None)
    mapped_body = frozenset(s.name for s in model.flatten(steps) if s.body_of and s.map_over)
    got = _dedupe([record_of(cp, workflow, codes) for cp in saver.saved], body, mapped_body)
    want = _dedupe(predicted.saves, body, mapped_body)
    crashed = saver.crash_at is not None and saver.dead
    got_events = [t for t in map(_event, events) if t is not None]
    where = f"turn {number}"
    # (when a hit is told beside its StepStarted, the docs leave open: "before its
    # StepFinished"; which units hit, in which order, is compared on its own)
    hits = [e[1] for e in got_events if e[0] == "StepCacheHit"]
    got_events = [e for e in got_events if e[0] != "StepCacheHit"]
    if not crashed and (hits if args.concurrency == 1 else sorted(hits)) != (
            predicted.hits if args.concurrency == 1 else sorted(predicted.hits)):
        raise Mismatch(f"{where}: cache hits differ\n runtime {hits}\n model   {predicted.hits}")
    if os.environ.get("EKIT_MODEL_DEBUG"):
        print(where, "runtime", got_events, "\n model  ", predicted.events)
        print(" saves", got, "\n model", want)
    # (which steps of a body a resume tells outdated when the loop runs again, beyond those
    # whose work changed, the docs do not say: the outputs it lets go of are compared)
    def told(e: tuple[Any, ...]) -> bool:
        return not (e[0] == "StepOutdated" and e[1] in body)

    got_events = _outdated_in_order(list(filter(told, got_events)))
    predicted = dataclasses.replace(
        predicted, events=_outdated_in_order(list(filter(told, predicted.events))))
    if args.concurrency == 1:
        if crashed:
            want = want[: len(got)]
        if got != want:
            raise Mismatch(_diff_saves(where, got, want))
        if not crashed:
            mapped = {m.name for m in model.flatten(steps) if m.map_over or m.repeat}
            if _settled(got_events, mapped) != _settled(predicted.events, mapped):
                raise Mismatch(f"{where}: events differ\n runtime {got_events}\n model   {predicted.events}")
            begun, paid = world.begun[len(before.begun):], world.paid[len(before.paid):]
            if (begun, paid) != (predicted.begun, predicted.paid):
                raise Mismatch(f"{where}: attempts begun, paid\n runtime {begun} {paid}\n"
                               f" model   {predicted.begun} {predicted.paid}")
            theirs, ours = world.state(), mine.state()
            if theirs != ours:
                raise Mismatch(f"{where}: the calls differ\n runtime {world.state()}\n"
                               f" model   {mine.state()}")
        return
    order_free = (not crashed and world.interrupt_at is None and args.budget_calls is None
                  and (args.isolate_failures or not predicted.failed)
                  and not any(e[0] == "StepDenied" for e in predicted.events))
    if order_free:
        if got[-1:] != want[-1:]:
            raise Mismatch(_diff_saves(where, got[-1:], want[-1:]))
        begun, paid = world.begun[len(before.begun):], world.paid[len(before.paid):]
        if (sorted(begun), sorted(paid)) != (sorted(predicted.begun), sorted(predicted.paid)):
            raise Mismatch(f"{where}: attempts begun, paid\n runtime {sorted(begun)} {sorted(paid)}"
                           f"\n model   {sorted(predicted.begun)} {sorted(predicted.paid)}")
        if _per_unit(got_events) != _per_unit(predicted.events):
            raise Mismatch(f"{where}: per-unit events differ\n runtime {_per_unit(got_events)}\n"
                           f" model   {_per_unit(predicted.events)}")


def _replay(plan: PlannedWorkflow, workflow: Workflow, history: list[WorkflowCheckpoint]) -> Any:
    """``replay`` of what the runs recorded. A reshaped workflow's checkpoints are of several
    graphs, and a sequence is legal for one graph: those since its last change of shape."""
    if not isinstance(plan, ReshapedWorkflow) or not history:
        return replay(workflow, history)
    start = len(history)
    while start and history[start - 1].fingerprint == history[-1].fingerprint:
        start -= 1
    return replay(None, history[start:])  # (the graph those checkpoints record)


def _units(plan: PlannedWorkflow) -> int:
    """How many steps ``plan`` runs, a loop's body once per iteration: each may need a turn
    or two of its own to fail, ask and finish (a body failing in every iteration needs many
    calm turns)."""
    return sum(1 + (s.repeat or 1) * len(s.child) if isinstance(s, ParentStep) else 1
               for s in plan.steps)


def _diff_saves(where: str, got: list[model.Record], want: list[model.Record]) -> str:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            fields = [f for f in vars(a) if getattr(a, f) != getattr(b, f)]
            return (f"{where}: save {i} differs in {fields}\n"
                    + "\n".join(f" {f}: runtime {getattr(a, f)!r}\n {' ' * len(f)}  model   {getattr(b, f)!r}"
                                for f in fields))
    return f"{where}: {len(got)} saves by the runtime, {len(want)} by the model"


def _check_audit(workflow: Workflow, cp: WorkflowCheckpoint, steps: list[model.ModelStep],
                 record: model.Record | None, number: int, options: model.Options) -> None:
    """What audit says a resume skips is what the model's resume keeps."""
    probe = model.Run(steps, record, World.__new__(World),  # (audit: no only=, no cache)
                      model.Options(on_code_change=options.on_code_change))
    probe.resume()
    # (as a run starts: loops grown too, so that a body's map over no items, collected
    # as the resume starts, is kept as audit says)
    probe._skip_needing_skipped()
    probe.grow(start=True)
    probe.settle()
    kept = set(probe.rec.outputs) | set(probe.rec.skipped)
    report = audit(workflow, cp)
    listed = {row.name for row in report.steps}
    skips = {row.name for row in report.steps if row.action == "skip"}
    # (audit lists no rows for the items of a skipped mapped step, nor for the first
    # iteration of a skipped loop: the step's row says it)
    kept = {u for u in kept if u in listed or probe._owner(u) not in skips}
    if skips != kept:
        raise Mismatch(f"turn {number}: audit skips {sorted(skips - kept)} the model runs, "
                       f"runs {sorted(kept - skips)} the model keeps")


__all__ = ["DSN", "KnownBug", "Mismatch", "RunArgs", "Turn", "drive", "questions"]
