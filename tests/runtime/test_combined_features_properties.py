"""Every feature at once, through the real runtime: a resume ends as one uninterrupted run
of the final code, and recorded work that is still valid is never paid for again.

Random workflows (``tests.support.strategies.combined_workflows``) mix mapped steps
over lists, mappings and keyed records (zero items included), item-wise
chains, conditions, joins over alternatives, steps and items that ask a
person, typed outputs through a ``Codec``, and transient failures with
retries. Hypothesis drives a sequence of runs of them, with or without a
concurrency limit: crashes at random saves (the store keeps what was saved
before) or interruptions at random step calls, version bumps between runs,
rewinds of steps and items, answers to the questions asked; every
checkpoint goes through its JSON form and through a store (JSON file,
journal, SQLite, or a list), wrapped or handed to the run as its own
``checkpoint_fn``.

The oracle:

1. the final outputs equal those of one uninterrupted run of the final code
   (answering every question as it is asked, with no fault injected);
2. no step or item is paid (called, successfully) twice for the same work
   (its name, code version and inputs) while its output is recorded and
   still valid: within a run, or across a resume from a checkpoint that
   records it (a rewind or a version bump invalidates what is downstream of
   it, except the items an early cutoff may keep: those stay valid).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ekit_core import RetryPolicy, WorkflowCheckpoint, questions, rewind
from ekit_runtime import (
    Codec,
    JournalStore,
    JsonFileStore,
    RunWaiting,
    SqliteStore,
    Step,
    Workflow,
    ask,
    attempt_key,
)
from tests.support.strategies import Features, PlannedStep, PlannedWorkflow, combined_workflows

# Modest, so that the file takes seconds on a loaded machine; raise it to hunt for bugs.
EXAMPLES = int(os.environ.get("EKIT_COMBINED_EXAMPLES", "50"))


@dataclasses.dataclass(frozen=True)
class Note:
    """A typed output: what a step of kind ``"typed"`` returns, stored through the codec."""

    step: str
    text: str


class Transient(ConnectionError):
    """An injected failure that a retry (or a later run) gets past."""


class Crash(BaseException):
    """The process dies at a save: the store keeps only what was saved before."""


def _plain(value: object) -> object:
    if isinstance(value, Note):
        return {"Note": [value.step, value.text]}
    raise TypeError(type(value).__name__)


def _digest(value: object) -> str:
    text = json.dumps(value, sort_keys=True, default=_plain)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


class World:
    """The outside world the steps pay: what each (step, work) cost, and the faults it injects.

    ``work`` is a digest of the step (or item) name, its code version and its inputs.
    """

    def __init__(self, faults: bool, check_keys: bool = False) -> None:
        self.faults = faults
        self.check_keys = check_keys
        self.keys: dict[str, str] = {}  # attempt key -> the work it was first used for
        self.attempts: Counter[tuple[str, str]] = Counter()
        self.conditions: Counter[tuple[str, str]] = Counter()
        self.paid: list[tuple[str, str]] = []  # the successful calls of the current run
        self.problems: list[str] = []
        self.protected: dict[str, str] = {}  # name -> work still valid in the resumed checkpoint
        self.calls = 0  # the step calls of the current run
        self.interrupt_at: int | None = None  # the call of this run that raises Crash

    def attempted(self, key: str, work: str) -> None:
        """An attempt key names one piece of work (``docs/concepts.md``): a deduplicating API
        would hand back the other work's result."""
        if self.check_keys and self.keys.setdefault(key, work) != work:
            self.problems.append(f"attempt key {key} sent again for other work")

    def paid_for(self, name: str, work: str) -> None:
        if self.protected.get(name) == work:
            self.problems.append(f"{name} paid again for work its resumed checkpoint records")
        if (name, work) in self.paid:
            self.problems.append(f"{name} paid twice in one run for the same work")
        self.paid.append((name, work))


def _output(step: PlannedStep, name: str, inputs: dict[str, Any], work: str, answer: Any) -> Any:
    """What ``step`` (or its item ``name``) returns: made from its inputs, so that a lost or
    stale input shows in the final outputs. Outputs others map over leave the version out,
    so that a bumped upstream may give the same items (the early cutoff's case)."""
    seed = _digest([name, inputs, answer])
    count = int(seed[:2], 16) % 4  # zero items too
    if step.kind == "list":
        return [f"{name}.{seed[j]}" for j in range(count)]
    if step.kind == "dict":
        keys = dict.fromkeys(f"k{seed[j]}" for j in range(count))  # not in sorted order
        return {k: f"{name}.{k}" for k in keys}
    if step.kind == "keyed":
        ids = dict.fromkeys(f"i{seed[j]}" for j in range(count))
        return [{"id": i, "v": f"{name}.{i}"} for i in ids]
    text = f"{name}:{work}:{answer}"
    return Note(name, text) if step.kind == "typed" else text


def _body(step: PlannedStep, version: str, world: World) -> Callable[[Any], Any]:
    declared = set(step.deps)

    async def run(ctx: Any) -> Any:
        key = attempt_key()
        name = key.step
        inputs = {k: v for k, v in ctx.items() if k in declared}
        work = _digest([name, version, inputs])
        world.attempted(str(key), work)
        world.attempts[(name, work)] += 1
        world.calls += 1
        if world.calls == world.interrupt_at:
            raise Crash  # an interruption: the run saves what finished, then ends
        if world.faults and world.attempts[(name, work)] <= step.fails:
            raise Transient(f"{name} is overloaded")
        answer = ask(f"{name}?") if step.asks else None
        await asyncio.sleep(0)
        world.paid_for(name, work)
        return _output(step, name, inputs, work, answer)

    return run


def _condition(step: PlannedStep, world: World) -> Callable[[Any], bool]:
    declared = set(step.deps)

    def holds(ctx: Any) -> bool:
        inputs = {k: v for k, v in ctx.items() if k in declared}
        seed = _digest([step.name, inputs])
        world.conditions[(step.name, seed)] += 1
        if step.when == "raises" and world.faults and world.conditions[(step.name, seed)] == 1:
            raise Transient(f"the condition of {step.name} could not decide")
        return int(seed, 16) % 3 != 0

    holds.__qualname__ = f"cond_{step.name}"  # the fingerprint names a condition so
    return holds


def build(plan: PlannedWorkflow, phase: int, world: World) -> Workflow:
    """The workflow's code in ``phase`` (its version tags), paying ``world``."""
    steps = []
    for s in plan.steps:
        steps.append(Step(
            s.name, _body(s, s.versions[phase], world), s.deps, context="dependencies",
            version=s.versions[phase], map_over=s.map_over, item_key=s.item_key,
            when=None if s.when is None else _condition(s, world),
            join="any" if s.join_any else "all",
            retry=RetryPolicy(max_attempts=s.attempts, backoff_base=0) if s.attempts > 1 else None,
        ))
    return Workflow(steps, codec=Codec(Note) if plan.typed else None)


def _answers(workflow: Workflow, cp: WorkflowCheckpoint | None) -> dict[str, Any]:
    """A person answers every pending question, the same way every time: those the resume
    still asks (a step whose work changed since it asked asks its own, and an answer to the
    old question is refused: ``docs/concepts.md``)."""
    if cp is None or not questions(cp):
        return {}
    kept = workflow.start_state(resume_from=cp, record_events=False).setbacks.asked
    return {name: f"ans({name})" for name in questions(cp) if name in kept}


def _run(workflow: Workflow, cp: WorkflowCheckpoint | None, save: Callable[[Any], None],
         concurrency: int | None = None) -> Mapping[str, Any] | None:
    """One run: its outputs if it finished, ``None`` if it stopped short (any way it may)."""
    try:
        result = workflow.run_sync(resume_from=cp, answers=_answers(workflow, cp) or None,
                                   checkpoint_fn=save, run_id="r", max_concurrency=concurrency)
    except (RunWaiting, Transient, Crash) as exc:
        event(f"a run stopped short: {type(exc).__name__}")  # (--hypothesis-show-statistics)
        return None
    except ExceptionGroup as group:  # several steps failed at once
        _, rest = group.split(Transient)
        if rest is not None:
            raise
        return None
    return dict(result.outputs)


def reference(plan: PlannedWorkflow) -> Mapping[str, Any]:
    """The outputs of one uninterrupted run of the final code (answers given as asked)."""
    world = World(faults=False)
    workflow = build(plan, plan.phases - 1, world)
    saved: list[WorkflowCheckpoint] = []
    for _ in range(4 * len(plan.steps) + 4):
        outputs = _run(workflow, saved[-1] if saved else None, saved.append)
        if outputs is not None:
            assert world.problems == []
            return outputs
    raise AssertionError("the uninterrupted run never finished")


class Saver:
    """A run's ``checkpoint_fn``: the checkpoint through JSON, then into the store; dead
    (saving nothing) after the crash it may be set to raise at its ``crash_at``-th save."""

    def __init__(self, store: Any, world: World, recorded: dict[str, str],
                 crash_at: int | None) -> None:
        self.store, self.world, self.recorded, self.crash_at = store, world, recorded, crash_at
        self.saves = 0
        self.dead = False
        self.last: WorkflowCheckpoint | None = None

    def __call__(self, cp: WorkflowCheckpoint) -> None:
        if self.dead:
            return
        self.saves += 1
        if self.saves == self.crash_at:
            self.dead = True
            raise Crash
        data = json.loads(json.dumps(cp.to_dict()))
        again = WorkflowCheckpoint.from_dict(data)
        assert again == cp, "a checkpoint changed through its JSON form"
        if self.last is not None:  # the checkpoints of one run only grow
            lost = [n for n, v in self.last.outputs.items() if cp.outputs.get(n, Crash) != v]
            assert lost == [], f"a later checkpoint of the run lost or changed {lost}"
        self.last = cp
        self.store.save(again)
        _note_recorded(cp, self.world, self.recorded)


def _note_recorded(cp: WorkflowCheckpoint | None, world: World, recorded: dict[str, str]) -> None:
    """Note the work behind each output of ``cp`` that the run just paid for."""
    last = {name: work for name, work in world.paid}
    for name in () if cp is None else cp.outputs:
        if name in last:
            recorded[name] = last[name]


class ListStore:
    """A store that keeps the dict form of its last checkpoint, as a user's own might."""

    def __init__(self) -> None:
        self.data: dict[str, Any] | None = None

    def save(self, cp: WorkflowCheckpoint) -> None:
        self.data = json.loads(json.dumps(cp.to_dict()))

    def load(self) -> WorkflowCheckpoint | None:
        return None if self.data is None else WorkflowCheckpoint.from_dict(self.data)

    __call__ = save


@contextmanager
def a_store(kind: str) -> Iterator[Any]:
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
        else:
            yield ListStore()


def still_valid(plan: PlannedWorkflow, phase: int, cp: WorkflowCheckpoint, rewound: set[str],
                recorded: Mapping[str, str]) -> dict[str, str]:
    """The work ``cp`` records that a resume in ``phase`` may not pay for again.

    A rewound step, or one whose version differs from the one recorded, runs
    again with everything downstream of it (``docs/concepts.md``); of those,
    an item keeps its output when only the step its mapped step maps over ran
    again, on purpose, and gave it the same input (the early cutoff).
    """
    by_name = {s.name: s for s in plan.steps}
    roots = set(rewound) | {
        s.name for s in plan.steps if s.name in cp.outputs and cp.versions.get(s.name) != s.versions[phase]}
    gone = set(roots)
    changed = True  # (declaration order is not topological: grow to a fixed point)
    while changed:
        changed = False
        for s in plan.steps:
            if s.name not in gone and any(d in gone for d in s.deps):
                gone.add(s.name)
                changed = True
    valid = {}
    for name in cp.outputs:
        owner = name.split("[", 1)[0]
        if name not in recorded or owner not in by_name:
            continue
        step = by_name[owner]
        cutoff = (name != owner and step.map_over in roots and owner not in roots
                  and not _is_item_chain(by_name, step)
                  and not any(d in gone for d in step.deps if d != step.map_over))
        if owner not in gone or cutoff:
            valid[name] = recorded[name]
    return valid


def _is_item_chain(by_name: Mapping[str, PlannedStep], step: PlannedStep) -> bool:
    return step.map_over is not None and by_name[step.map_over].map_over is not None


@dataclasses.dataclass(frozen=True)
class Turn:
    """What happens before and during one disturbed run: the code moves on a phase (a
    version bump), a step is rewound (or, with ``item``, the item of it at that position
    among those recorded), the process dies at a save (its number)."""

    bump: bool = False
    rewind: str | None = None
    crash_at: int | None = None
    item: int | None = None


def turns(plan: PlannedWorkflow) -> st.SearchStrategy[list[Turn]]:
    names = [s.name for s in plan.steps]
    rewinds = st.none() | st.sampled_from(names) if plan.features.rewinds else st.none()
    bumps = st.booleans() if plan.phases > 1 else st.just(False)
    crashes, items = st.none() | st.integers(1, 8), st.none() | st.integers(0, 3)
    return st.lists(st.builds(Turn, bumps, rewinds, crashes, items), min_size=1, max_size=6)


def drive(plan: PlannedWorkflow, store_kind: str, script: list[Turn], direct: bool = False,
          concurrency: int | None = None) -> Mapping[str, Any]:
    """Run ``plan`` through the disturbed runs of ``script``, then calmly (the final code,
    nothing disturbed) to its end, checking the second promise on the way; its outputs.

    ``direct``: the store itself is the runs' ``checkpoint_fn`` (its own fast paths, deltas
    and checks), and a turn's ``crash_at`` interrupts the run at that step call instead
    (the run saves what finished, as it must whatever a step raises)."""
    world = World(faults=True, check_keys=plan.features.attempt_keys_name_work)
    recorded: dict[str, str] = {}
    phase = 0
    with a_store(store_kind) as store:
        for turn in range(len(script) + 4 * len(plan.steps) + 8):
            calm = turn >= len(script)
            step = Turn() if calm else script[turn]
            phase = plan.phases - 1 if calm else min(phase + step.bump, plan.phases - 1)
            workflow = build(plan, phase, world)
            cp = loaded = store.load()
            keys_before = dict(world.keys)
            rewound: set[str] = set()
            if cp is not None and step.rewind is not None:
                items = sorted(n for n in cp.outputs if n.startswith(f"{step.rewind}["))
                target = items[step.item % len(items)] if items and step.item is not None else step.rewind
                cp = rewind(workflow, cp, target)
                rewound.add(step.rewind)  # (an item's whole step: the check stays on the safe side)
            world.paid, world.calls = [], 0
            world.protected = {} if cp is None else still_valid(plan, phase, cp, rewound, recorded)
            if direct:
                world.interrupt_at = step.crash_at
                outputs = _run(workflow, cp, store, concurrency)
                after = store.load()
                _note_recorded(after, world, recorded)
                saved = (None if after is None else after.to_dict()) != (
                    None if loaded is None else loaded.to_dict())
            else:
                saver = Saver(store, world, recorded, step.crash_at)
                outputs = _run(workflow, cp, saver, concurrency)
                saved = saver.saves > saver.dead
            assert world.problems == []
            if not saved:  # attempt numbers count what checkpoints record: a resume of other code
                world.keys = keys_before  # from the same one may reuse these (docs/concepts.md)
            if outputs is not None and calm:
                # The finished run's own checkpoint resumes to the same outputs, paying nothing.
                world.paid = []
                assert _run(workflow, store.load(), lambda cp: None) == outputs
                assert world.paid == []
                return outputs
    raise AssertionError("the run never finished")


@pytest.mark.timeout(300)  # a deadlock detector only: the examples take seconds
@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(plan=combined_workflows(), store_kind=st.sampled_from(["list", "json", "journal", "sqlite"]),
       direct=st.booleans(), concurrency=st.sampled_from([None, 1, 2]), data=st.data())
def test_any_mix_of_features_resumes_to_the_uninterrupted_outputs(
        plan: PlannedWorkflow, store_kind: str, direct: bool, concurrency: int | None,
        data: st.DataObject) -> None:
    script = data.draw(turns(plan), label="script")
    assert drive(plan, store_kind, script, direct, concurrency) == reference(plan)


def test_a_bump_of_the_mapped_over_step_and_of_another_dependency_runs_the_items() -> None:
    plan = PlannedWorkflow((
        PlannedStep("s0", (), "list", versions=("v0", "v1")),
        PlannedStep("s1", (), "text", versions=("v0", "v1")),
        PlannedStep("s2", ("s0", "s1"), map_over="s0", versions=("v0", "v0")),
    ), phases=2, features=Features())
    assert drive(plan, "list", [Turn(), Turn(bump=True)]) == reference(plan)
