"""The outside world of the differential test: the script both the runtime's steps and the
reference model follow, and the runtime workflow built from a planned one.

``World`` is the deterministic script (``tests.semantics.model.Script``): what the
k-th attempt of a unit at a given piece of work does (fail while ``fails`` is not
used up, ask a person, succeed with a value made from its inputs) and what a
condition says. Of a mapped step's items, about half fail and ask as planned and
the others do not, so that a mapped step is often left part done.
It counts calls, so the model is handed a copy of the world as it
stands before a run and must make the same calls the runtime makes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

from ekit_core import RetryPolicy, TokenUsage, WorkflowCheckpoint
from ekit_runtime import (
    Child,
    Codec,
    Done,
    Iteration,
    PatternResult,
    Repeat,
    Step,
    Workflow,
    ask,
    attempt_key,
)
from ekit_runtime.cache.base import Cache, CacheEntry
from tests.semantics.model import (
    NO_ANSWER,
    AskFirst,
    Fail,
    Interrupt,
    ModelStep,
    Outcome,
    Record,
    Succeed,
    cache_key,
    seen,
)
from tests.semantics.strategies import CodedWorkflow, ParentStep, flat_steps, steps_at
from tests.support.strategies import PlannedStep, PlannedWorkflow


@dataclasses.dataclass(frozen=True)
class Note:
    """A typed output, stored through the codec."""

    step: str
    text: str


class Transient(ConnectionError):
    """An injected failure that a retry (or a later run) gets past."""


class Crash(BaseException):
    """The process dies: at a step call, or at a save."""


def _plain(value: object) -> object:
    if isinstance(value, Note):
        return {"Note": [value.step, value.text]}
    raise TypeError(type(value).__name__)


def digest(value: object) -> str:
    """A short stable digest of plain data (and Notes)."""
    text = json.dumps(value, sort_keys=True, default=_plain)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def model_steps(plan: PlannedWorkflow, phase: int) -> list[ModelStep]:
    """The planned workflow's code in ``phase``, as the model reads it."""
    steps = _model_steps(steps_at(plan, phase), phase)
    if isinstance(plan, CodedWorkflow):
        codes = dict(plan.codes)
        steps = [dataclasses.replace(s, code=codes[s.name][phase], cache=s.name in plan.cached)
                 for s in steps]
    return steps


def _model_steps(steps: tuple[PlannedStep, ...], phase: int) -> list[ModelStep]:
    return [ModelStep(s.name, s.deps, s.map_over, s.item_key, s.when is not None, s.join_any,
                      s.attempts, None if isinstance(s, ParentStep) else s.versions[phase],
                      s.repeat, s.keep_last,
                      tuple(_model_steps(s.child, phase)) if isinstance(s, ParentStep) else (),
                      s.output if isinstance(s, ParentStep) else None)
            for s in steps]


class World:
    """What each attempt and condition does, counting every call (``Script``)."""

    def __init__(self, plan: PlannedWorkflow, salt: int = 0) -> None:
        self.planned = flat_steps(plan.steps)  # (children's steps by their names in the run)
        # the output steps of loops' bodies: what they return may end their loop
        self.body_outputs = {f"{n}/{s.output}" for n, s in self.planned.items()
                             if isinstance(s, ParentStep) and s.repeat is not None}
        self.salt = salt  # varies the outputs, decisions and faults of one plan
        self.attempts: Counter[tuple[str, str]] = Counter()
        self.conditions: Counter[tuple[str, str]] = Counter()
        self.approvals: Counter[str] = Counter()
        self.calls = 0  # step calls of the current run
        self.begun: list[tuple[str, int]] = []  # (unit, attempt key's number), as called
        self.paid: list[tuple[str, int]] = []  # the attempts that succeeded, so were paid
        self.keys: dict[str, str] = {}  # attempt key -> the work it was first sent for
        self.problems: list[str] = []
        self.interrupt_at: int | None = None  # the call of this run that raises Crash
        self.stored: dict[tuple[Any, ...], Succeed] = {}  # what the runs' cache holds
        self.current: dict[str, ModelStep] = {}  # step -> as the code now declares it
        self.runs = 0  # fresh runs so far: a step not cached answers otherwise in each

    def cache_get(self, key: tuple[Any, ...]) -> Succeed | None:
        """What a cache hit hands back for ``key`` (``model.cache_key``), if any."""
        return self.stored.get(key)

    def cache_put(self, key: tuple[Any, ...], made: Succeed) -> None:
        """An output paid for is stored: the first writer of a key wins."""
        self.stored.setdefault(key, made)

    def state(self) -> tuple[Any, ...]:
        """What the world remembers (to compare the model's copy with the runtime's)."""
        return (dict(self.attempts), dict(self.conditions), dict(self.approvals), self.calls,
                sorted(map(repr, self.stored)))

    def attempt(self, unit: str, step: ModelStep, inputs: dict[str, Any]) -> Outcome:
        planned = self.planned[step.name]
        work = digest([unit, step.version, inputs, *([step.code] if step.code else [])])
        self.attempts[(unit, work)] += 1
        self.calls += 1
        if self.calls == self.interrupt_at:
            return Interrupt()
        troubled = unit == step.name or int(digest([self.salt, work]), 16) % 2 == 0
        if troubled and self.attempts[(unit, work)] <= planned.fails:
            if hangs(unit, self.attempts[(unit, work)], self.salt):  # the step's timeout fails it
                return Fail("StepTimeoutError", f"step {unit!r} timed out after {TIMEOUT:g}s")
            return Fail("Transient", f"{unit} is overloaded")
        usage = (len(unit), 1, 1)
        loop = planned.repeat is not None or step.name in self.body_outputs

        def made(answer: Any) -> Succeed:
            # (a step not cached answers otherwise in a fresh run, as a model may: what reads
            # it then reads another value, and a cache must miss)
            salt = self.salt if step.cache or not self.runs else [self.salt, self.runs]
            value = _output(planned, unit, inputs, work, answer, salt)
            return Succeed(value, usage, loop and ends(value, self.salt))

        if planned.asks and troubled:
            return AskFirst(f"{unit}?", made)
        return made(None)

    def approve(self, unit: str) -> bool | Fail:
        """The run's approval callback: some units are refused, or it raises, the first time."""
        self.approvals[unit] += 1
        kind = int(digest(["approve", unit, self.salt]), 16) % 6
        if self.approvals[unit] == 1 and kind == 0:
            return False
        if self.approvals[unit] == 1 and kind == 1:
            return Fail("Transient", f"the approval of {unit} could not decide")
        return True

    def condition(self, unit: str, step: ModelStep, inputs: dict[str, Any]) -> bool | Fail:
        planned = self.planned[step.name]
        seed = digest([step.name, inputs, self.salt])
        self.conditions[(step.name, seed)] += 1
        if planned.when == "raises" and self.conditions[(step.name, seed)] == 1:
            return Fail("Transient", f"the condition of {step.name} could not decide")
        return int(seed, 16) % 3 != 0


TIMEOUT = 0.1
"""Seconds a step that may fail is given: an attempt that hangs fails by it (an attempt
that does not hang never yields, so it cannot time out however loaded the machine)."""


def ends(output: Any, salt: int) -> bool:
    """Whether an iteration whose output is ``output`` ends its loop (about one in three):
    a function of the output alone, so that a loop's ``until`` can say it too."""
    return int(digest(["ends", output, salt]), 16) % 3 == 0


def hangs(unit: str, attempt: int, salt: int) -> bool:
    """Whether a failing attempt hangs (and times out) rather than raising."""
    return int(digest(["hang", unit, attempt, salt]), 16) % 3 == 0


def _output(step: PlannedStep, name: str, inputs: dict[str, Any], work: str, answer: Any,
            salt: Any) -> Any:
    """Made from the inputs, so that a lost or stale input shows; outputs others map over
    leave the version out, so that a bumped upstream may give the same items (cutoff)."""
    seed = digest([name, inputs, answer, salt])
    count = int(seed[:2], 16) % 4  # zero items too
    if step.kind == "list":
        return [f"{name}.{seed[j]}" for j in range(count)]
    if step.kind == "dict":
        keys = dict.fromkeys(f"k{seed[j]}" for j in range(count))  # not in sorted order
        return {k: f"{name}.{k}" for k in keys}
    if step.kind == "keyed":
        ids = dict.fromkeys(f"i{seed[j]}" for j in range(count))
        return [{"id": i, "v": f"{name}.{i}"} for i in ids]
    text = f"{name}:{work}:{answer}" + (f":run{salt[1]}" if isinstance(salt, list) else "")
    return Note(name, text) if step.kind == "typed" else text


def _body(declared_step: ModelStep, world: World, until: bool, prefix: str) -> Any:
    """The step's function: ``declared_step`` as its child declares it, under ``prefix`` in
    the run. Its fingerprint sees its ``code`` (a constant it holds), not its version, which
    it reads from ``world`` (state, which a fingerprint does not hash) as it runs."""
    name = prefix + declared_step.name
    declared = ({seen(name, prefix + d) for d in declared_step.deps}
                | set(_parent_inputs(prefix, world))
                | ({declared_step.name} if declared_step.repeat is not None else set()))
    code = declared_step.code  # (held for the fingerprint: the step's code)

    async def run(ctx: Any) -> Any:
        assert code is not None
        mstep = world.current[name]
        key = attempt_key()
        unit = key.step
        world.begun.append((unit, key.attempt))
        inputs = {k: [v.number, v.previous] if isinstance(v, Iteration) else v
                  for k in declared if k in ctx for v in [ctx[k]]}
        work = digest([unit, mstep.version, inputs, *([mstep.code] if mstep.code else [])])
        if world.keys.setdefault(str(key), work) != work:  # (docs/concepts.md: keys name work)
            world.problems.append(f"attempt key {key} sent again for other work")
        outcome = world.attempt(unit, dataclasses.replace(mstep, name=name), inputs)
        if isinstance(outcome, AskFirst):
            outcome = outcome.then(ask(outcome.prompt))
        if isinstance(outcome, Interrupt):
            raise Crash
        if isinstance(outcome, Fail) and outcome.error_type == "StepTimeoutError":
            await asyncio.Event().wait()  # hangs until the step's timeout cancels it
        if isinstance(outcome, Fail):
            raise Transient(outcome.message)
        assert isinstance(outcome, Succeed)
        world.paid.append((unit, key.attempt))
        if mstep.cache:  # (the runtime stores what it paid for in the run's cache)
            world.cache_put(cache_key(unit, dataclasses.replace(mstep, name=name), inputs), outcome)
        result = PatternResult(outcome.value, cost=TokenUsage(*outcome.usage))
        return Done(result) if outcome.done and not until else result

    return run


def _condition(mstep: ModelStep, world: World, prefix: str) -> Any:
    name = prefix + mstep.name
    declared = {seen(name, prefix + d) for d in mstep.deps} | set(_parent_inputs(prefix, world))

    def holds(ctx: Any) -> bool:
        flat = dataclasses.replace(world.current[name], name=name)
        said = world.condition("", flat, {k: ctx[k] for k in declared if k in ctx})
        if isinstance(said, Fail):
            raise Transient(said.message)
        return said

    holds.__qualname__ = "cond"  # the fingerprint and the skip reasons name a condition so
    return holds


def approval(world: World) -> Any:
    """The run's approval callback, following ``world``."""
    def approve(name: str, metadata: Any) -> bool:
        said = world.approve(name)
        if isinstance(said, Fail):
            raise Transient(said.message)
        return said

    return approve


def _parent_inputs(prefix: str, world: World) -> list[str]:
    """What a step of the child under ``prefix`` sees of its parents' inputs, by name."""
    names: list[str] = []
    while prefix:
        parent = prefix[:-1]
        outer = parent.rsplit("/", 1)[0] + "/" if "/" in parent else ""
        names.extend(seen(prefix + "x", outer + d) for d in world.planned[parent].deps)
        if world.planned[parent].repeat is not None:  # a body sees its loop's Iteration
            names.append(seen(prefix + "x", parent))
        prefix = outer
    return names


def build(plan: PlannedWorkflow, phase: int, world: World) -> Workflow:
    """The runtime workflow of ``plan``'s code in ``phase``, following ``world``."""
    steps = _steps(steps_at(plan, phase), phase, world, "", model_steps(plan, phase))
    typed = any(s.kind == "typed" for s in world.planned.values())
    policy = plan.policy if isinstance(plan, CodedWorkflow) else None
    return Workflow(steps, codec=Codec(Note) if typed else None,
                    on_code_change=policy)  # type: ignore[arg-type]


def _steps(planned_steps: tuple[PlannedStep, ...], phase: int, world: World, prefix: str,
           mine: list[ModelStep] | None = None, until: bool = False) -> list[Step]:
    """``planned_steps`` as runtime steps (``until``: a loop's body, whose loop ends by it)."""
    steps = []
    for m, planned in zip(mine or _model_steps(planned_steps, phase), planned_steps, strict=True):
        repeat = None if m.repeat is None else Repeat(
            m.repeat, (lambda out: ends(out, world.salt)) if planned.until else None, m.keep_last)
        if isinstance(planned, ParentStep):
            inner = _steps(planned.child, phase, world, f"{prefix}{m.name}/",
                           until=planned.until and planned.repeat is not None)
            typed = any(s.kind == "typed" for s in planned.child)
            child = Child(Workflow(inner, codec=Codec(Note) if typed else None), planned.output)
            steps.append(Step(m.name, depends_on=m.deps, child=child, repeat=repeat,
                              map_over=m.map_over, item_key=m.item_key))
            continue
        world.current[prefix + m.name] = m
        steps.append(Step(
            m.name, _body(m, world, planned.until or until, prefix), m.deps, repeat=repeat,
            context="dependencies", version=m.version,
            map_over=m.map_over, item_key=m.item_key,
            when=_condition(m, world, prefix) if m.when else None, join="any" if m.join_any else "all",
            retry=RetryPolicy(max_attempts=m.max_attempts, backoff_base=0) if m.max_attempts > 1 else None,
            timeout=TIMEOUT if planned.fails else None, cache=m.cache,
        ))
    return steps


def record_of(cp: WorkflowCheckpoint, workflow: Workflow,
              codes: dict[tuple[str, str], str] | None = None) -> Record:
    """What a runtime checkpoint records, as the model reads it (typed outputs decoded;
    ``codes``: (step, fingerprint) -> the code it fingerprints, as the model names it)."""
    codes = codes or {}
    codec = workflow.codec
    if codec is not None:
        cp = codec.decode_checkpoint(cp)
    return Record(
        outputs=dict(cp.outputs),
        usage={n: (u.input_tokens, u.output_tokens, u.llm_calls) for n, u in cp.step_usage.items()},
        cost=(cp.cost.input_tokens, cp.cost.output_tokens, cp.cost.llm_calls),
        skipped=dict(cp.skipped),
        failures={n: (f.error_type, f.message, f.attempts) for n, f in cp.failures.items()},
        asked={n: [[e.question.prompt, NO_ANSWER if e.answer is None else e.answer.value]
                   for e in ex] for n, ex in cp.asked.items()},
        versions=dict(cp.versions),
        shapes={n: (s.map_over, s.item_key, s.when is not None, s.join == "any", s.repeat,
                    s.keep_last) for n, s in cp.shapes.items()},
        compacted=dict(cp.compacted),
        compacted_retries=dict(cp.compacted_retries),
        redone=dict(cp.redone),
        superseded=dict(cp.superseded),
        codes={n: codes.get((n, f), "?") for n, f in cp.code_fingerprints.items()},
        hits={n: (h.saved.input_tokens, h.saved.output_tokens, h.saved.llm_calls)
              for n, h in cp.cache_hits.items()},
    )


class MemoryCache(Cache):
    """A cache held in memory (``ekit_runtime.cache.Cache``'s contract, in a dict): the
    runs of one example share it, as runs share a ``SqliteCache`` file."""

    local = True

    def __init__(self) -> None:
        self._by_key: dict[str, CacheEntry] = {}

    def candidates(self, head: str) -> list[CacheEntry]:
        """The entries under ``head``, newest first."""
        return [e for e in reversed(self._by_key.values()) if e.head == head]

    def put(self, entry: CacheEntry) -> CacheEntry:
        """Store ``entry`` unless its key is taken; the entry stored under its key."""
        return self._by_key.setdefault(entry.key, entry)

    def entries(self) -> Iterator[CacheEntry]:
        """Every entry held."""
        return iter(list(self._by_key.values()))

    def prune(self, *, max_entries: int | None = None, max_age: float | None = None,
              max_bytes: int | None = None) -> int:
        """Nothing to bound: an example holds a few entries."""
        return 0
