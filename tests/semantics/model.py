"""A reference model of what a run must do: slow on purpose, plain loops over dicts.

Written from the user docs (docs/concepts.md, docs/failures.md, docs/outputs.md,
docs/checkpoint-format.md), not from ``ekit_core``'s rules: it imports no rule
of the library. The differential test (``test_runtime_agrees_with_the_model``)
runs random workflows through the real runtime and compares it with this file.

What it says, for one run of a workflow, given a checkpoint to resume from (or
none) and a deterministic *script* of what each attempt and each condition does:
the checkpoint after every save, the events, the outcome, and which attempts of
which step and item were called and paid. The model runs one attempt at a time
(the runtime's ``max_concurrency=1``), so the whole event order is determined;
for a concurrent run the test compares only what concurrency leaves determined.

Covered, each as the docs state it:

- steps with dependencies, started in declaration order once their dependencies
  are recorded; items after the declared steps, in the order they were grown;
- ``map_over`` a list (``m[0]``...), a mapping (``m[key]``) or keyed records
  (``item_key``), zero items too (collected at once as ``[]`` or ``{}``);
  item-wise chains (``m2[k]`` needs ``m1[k]``); a mapped step's output is its
  items' outputs in order, skipped ones left out, once every item is settled
  and its own dependencies are recorded;
- conditions (per item for a mapped step), asked before each attempt until they
  answer: one that raises is a failed attempt, a false one skips the step and
  what needs it; ``join="any"`` runs once its inputs are settled if any ran;
- the run's approval callback, after the condition, before each attempt until it
  answers; a denial halts the run ``"denied"`` and the step is not done;
- questions (``ask``): the step waits, the run ends ``"waiting"`` once nothing
  else can run; an answer given with the resume is handed to the step;
- retry policies (``max_attempts``, no delay), timeouts (an attempt the script
  says hangs fails as ``StepTimeoutError``), failure records counting failed
  attempts over all runs; a final failure halts the run or, with
  ``isolate_failures``, only what needs the step;
- an interruption (a ``BaseException``) from a step: nothing new starts, and the
  step is not recorded as failed;
- budgets (``llm_calls``) and ``only=`` (the selection's closure);
- resumes: recorded outputs and skips are kept; a step whose ``version`` (or,
  with ``allow_graph_change``, whose shape) changed runs again with everything
  downstream of it (its questions are dropped, its failure record stays: a
  diagnosis), unless it was skipped: a bumped step stays skipped, a reshaped
  one is decided again; every step and item whose work changed counts one more
  in ``redone``; attempt numbers count past recorded failures and ``redone``;
- loops (``repeat``, concepts.md "Loops"): iteration ``k`` is a unit of its own,
  ``loop#k``, needing the loop's dependencies and ``loop#(k-1)``, seeing its number
  and the previous output; it ends the loop by ``Done`` (or ``until``), whose output
  is then the loop's; an iteration at ``max_iterations`` that does not fails the loop
  (``LoopError``, its iterations kept); ``keep_last`` lets go of older iterations'
  outputs, usage, failure records and questions, counted in ``compacted``; a resume
  reads a loop from its recorded outputs alone; a loop that runs again (a bump
  upstream or of itself) starts from its first iteration, and the iteration it was
  at, and its compacted ones, count in ``redone`` (new attempt numbers), a compacted one
  also the most failed attempts of its loop's compacted iterations, which
  ``compacted_retries`` keeps when their failure records go (docs/checkpoint-format.md);
- the early cutoff: a rerun of what a mapped step maps over sets its items aside,
  and an item whose input comes back unchanged keeps its output (and so does the
  chain below it), unless the mapped step's own code or other inputs changed;
- child workflows (concepts.md, "Loops and child workflows"): step ``s`` of the child
  of ``P`` is the step ``P/s`` of the run, in ``P``'s place, needing ``P``'s inputs and
  its child dependencies, seeing them by their own names; ``P`` needs the child's output
  step and hands its output on (an attempt of its own, asked the approval, no call, no
  usage); a child's child nests (``P/c/s``); maps, loops, conditions inside a child;
- a child per item (``child=`` with ``map_over=``): each child step ``P/s`` grows once
  per item as ``P/s[key]``, needing the same item's steps, seeing the item under what
  ``P`` maps over and ``P``'s other inputs whole; each collects as a mapped step does
  (not told as expanded), and ``P`` is collected from the output step's collection;
- a loop whose body is a workflow (concepts.md, "A loop whose body is a workflow"):
  iteration ``k`` runs every body step ``s`` as ``L/s#k``, needing its body dependencies
  of the same iteration and, with none, ``L/o#(k-1)``; a body map grows ``L/m#k[key]``
  once ``L/u#k`` is recorded, collected as ``L/m#k``; the output step's iteration decides
  (``Done``/``until``, the cap), and at the end each body step records its last
  iteration's output, then the loop; ``keep_last`` lets go of whole iterations, items
  counted under ``compacted["L/m[]"]``; a changed body runs the loop again whole; a
  skipped loop skips its body's first iteration, each step's ``L/s#1``;
- code fingerprints (docs/cache.md): a recorded step whose code changed meets the
  workflow's ``on_code_change`` (``again``: as a version bump; ``keep``: kept, the old
  code recorded; ``refuse``: nothing runs, the steps named); a step not recorded whose
  code changed is other work all the same (new attempt numbers);
- the cache (docs/cache.md): a cached step's attempt hands back, at no cost and with no
  call, the output stored for the same step, code, ``version``, item and inputs read,
  recorded in ``cache_hits`` with the usage it saved; what a paid attempt made is stored
  (the first writer wins); in a workflow with no run-time shape, no recorded question,
  approval, answers or ``only=``, hits are found before the run starts (saved at once).

Not modelled: ``approve()`` questions, retry delays, ``Retry-After`` and jitter,
partial outputs, durations, codecs
beyond their round trip, stores refusing an output, queues and resource limits;
``only=`` naming a step of a loop's body (refused by name before anything runs: the
driver checks the refusal and goes on without the selection); a per-step
``on_code_change``, and a cached step that asks a person (its answers are inputs read)
or that is inside a child; the
early cutoff of a child per item (the runtime runs its items again, the docs do not
say: the model follows it); which of ``StepStarted`` and ``StepCacheHit`` comes first
(the docs say "before its StepFinished"; the test compares the hits on their own).
Rewinds are not a function here: the test rewinds with ``ekit_core.rewind`` and
the model resumes the rewound checkpoint (so it checks what a rewind leaves, not
how a rewind is computed). Where the docs leave an order or a form open (the
order of the skips one transition makes, whether the items of a skipped mapped
step are recorded skipped), the test compares both sides without it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

# -- what the caller describes --------------------------------------------------------------


@dataclass(frozen=True)
class ModelStep:
    """One declared step, as plain data (``when``: it has a condition, decided by the script)."""

    name: str
    deps: tuple[str, ...] = ()
    map_over: str | None = None
    item_key: str | None = None
    when: bool = False
    join_any: bool = False
    max_attempts: int = 1
    version: str | None = None
    repeat: int | None = None  # a loop: at most this many iterations
    keep_last: int | None = None
    child: tuple[ModelStep, ...] = ()  # a child workflow's steps, by their own names
    output: str | None = None  # the child's output step
    relay: bool = False  # (flattened) a parent: it hands its child's output step's on
    item_of: str | None = None  # (flattened) a step of a child run per item of its parent
    code: str = ""  # its code, as its fingerprint tells it apart (docs/cache.md)
    body_of: str | None = None  # (flattened) a step of the body of this loop
    cache: bool = False  # ``cache=True``: a hit hands back an output made before


    def shape(self) -> tuple[Any, ...]:
        """What the checkpoint records of its run-time shape (``()``: none)."""
        shaped = (self.map_over, self.item_key, self.when, self.join_any, self.repeat,
                  self.keep_last, self.relay)
        if self.item_of is not None:  # (a child per item's steps take no shape of their own)
            return ()
        return () if shaped == (None, None, False, False, None, None, False) else shaped[:6]


@dataclass(frozen=True)
class Succeed:
    """The attempt returns ``value`` having spent ``usage`` (input, output tokens, calls);
    ``done``: an iteration that ends its loop (``Done(value)``, or its ``until`` holds)."""

    value: Any
    usage: tuple[int, int, int] = (0, 0, 0)
    done: bool = False


@dataclass(frozen=True)
class Fail:
    """The attempt (or a condition) raises an ``Exception`` of type ``error_type``."""

    error_type: str
    message: str


@dataclass(frozen=True)
class AskFirst:
    """The attempt asks a person; ``then`` is what it does with the answer."""

    prompt: str
    then: Callable[[Any], Succeed | Fail]


@dataclass(frozen=True)
class Interrupt:
    """The attempt raises a ``BaseException`` that is no ``Exception``: the run ends."""


Outcome = Succeed | Fail | AskFirst | Interrupt


class Script(Protocol):
    """What each attempt and each condition does (it may count calls: the model calls it
    in the order a run with ``max_concurrency=1`` does)."""

    def attempt(self, unit: str, step: ModelStep, inputs: dict[str, Any]) -> Outcome: ...

    def condition(self, unit: str, step: ModelStep, inputs: dict[str, Any]) -> bool | Fail: ...

    def approve(self, unit: str) -> bool | Fail: ...

    def cache_get(self, key: tuple[Any, ...]) -> Succeed | None: ...

    def cache_put(self, key: tuple[Any, ...], made: Succeed) -> None: ...


def cache_key(unit: str, step: ModelStep, inputs: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a cache entry is found by (docs/cache.md): the step, its code and ``version``, the
    item, and the value of everything the step read (here: every input it was handed)."""
    return (step.name, unit, step.code, step.version,
            tuple(sorted((k, repr(v)) for k, v in inputs.items())))


class CodeChanged(Exception):
    """A resume refused: steps whose policy is ``"refuse"`` changed since recorded."""

    def __init__(self, steps: tuple[str, ...]) -> None:
        super().__init__(steps)
        self.steps = steps


@dataclass
class Record:
    """What a checkpoint records, as the model reads and writes it (plain dicts).

    ``asked``: unit -> list of [prompt, answer] with ``NO_ANSWER`` until answered;
    ``failures``: unit -> (error type, message, failed attempts over all runs).
    """

    outputs: dict[str, Any] = field(default_factory=dict)
    usage: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    cost: tuple[int, int, int] = (0, 0, 0)
    skipped: dict[str, str] = field(default_factory=dict)
    failures: dict[str, tuple[str, str, int]] = field(default_factory=dict)
    asked: dict[str, list[list[Any]]] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    redone: dict[str, int] = field(default_factory=dict)
    superseded: dict[str, Any] = field(default_factory=dict)
    shapes: dict[str, tuple[Any, ...]] = field(default_factory=dict)  # step -> shape()
    compacted: dict[str, int] = field(default_factory=dict)  # loop -> iterations let go of
    # loop -> the most failed attempts of its compacted iterations (their records are gone)
    compacted_retries: dict[str, int] = field(default_factory=dict)
    codes: dict[str, str] = field(default_factory=dict)  # step -> the code behind its outputs
    hits: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # unit -> usage saved


class _NoAnswer:
    """The answer of a question not answered yet (one object, whatever copies it)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _NoAnswer:
        return self

    def __repr__(self) -> str:
        return "NO_ANSWER"


NO_ANSWER = _NoAnswer()


@dataclass(frozen=True)
class Options:
    """The run's arguments the model knows: ``answers`` are given with the resume."""

    only: tuple[str, ...] | None = None
    isolate_failures: bool = False
    budget_calls: int | None = None
    answers: Mapping[str, Any] = field(default_factory=dict)
    approval: bool = False  # the run asks an approval callback (the script's ``approve``)
    on_code_change: str | None = None  # the workflow's policy: "again", "keep" or "refuse"
    cache: bool = False  # the run is given a cache (the script's ``cache_get``/``cache_put``)


@dataclass
class Prediction:
    """What one run does: a checkpoint per save, events as tuples, the outcome, the calls
    (unit, attempt number) of attempts that began their work and those that were paid."""

    saves: list[Record] = field(default_factory=list)
    events: list[tuple[Any, ...]] = field(default_factory=list)
    outcome: str = "finished"
    begun: list[tuple[str, int]] = field(default_factory=list)
    paid: list[tuple[str, int]] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    let_go: list[str] = field(default_factory=list)  # outputs the resume dropped as outdated
    refused: tuple[str, ...] = ()  # ``CodeChangedError``: the steps whose code changed
    hits: list[str] = field(default_factory=list)  # units the cache handed an output
    kept: list[str] = field(default_factory=list)  # items an early cutoff kept

    @property
    def final(self) -> Record | None:
        """The last checkpoint saved (what the run leaves behind), if it saved any."""
        return self.saves[-1] if self.saves else None


# -- child workflows (concepts.md, "Loops and child workflows") ---------------------------------


def flatten(steps: list[ModelStep]) -> list[ModelStep]:
    """A child's steps are steps of the run: step ``s`` of the child of ``P`` is ``P/s``, in
    ``P``'s place, needing ``P``'s dependencies and its child dependencies (``P/d``); ``P``
    then needs the child's output step alone and hands its output on (a child's child
    nests: ``P/c/s``)."""
    flat: list[ModelStep] = []
    for s in steps:
        if not s.child:
            flat.append(s)
            continue
        p = f"{s.name}/"
        if s.repeat is not None:  # a loop's body: its steps grow once per iteration
            for c in _after_their_dependencies(s.child):
                flat.append(dataclasses.replace(
                    c, name=p + c.name, deps=(*s.deps, *(p + d for d in c.deps)),
                    map_over=None if c.map_over is None else p + c.map_over, body_of=s.name))
            flat.append(dataclasses.replace(s, child=(), output=p + (s.output or "")))
            continue
        if s.map_over is not None:  # a child per item: its steps grow once per item
            for c in _after_their_dependencies(s.child):
                flat.append(dataclasses.replace(
                    c, name=p + c.name, deps=(*s.deps, *(p + d for d in c.deps)),
                    map_over=s.map_over, item_key=s.item_key, item_of=s.name))
            flat.append(dataclasses.replace(s, child=(), deps=(p + (s.output or ""), *s.deps),
                                            relay=True))
            continue
        for c in flatten(list(s.child)):
            own = tuple(p + d for d in c.deps)  # (a parent's first is its output step)
            flat.append(dataclasses.replace(
                c, name=p + c.name, deps=(*own, *s.deps) if c.relay else (*s.deps, *own),
                map_over=None if c.map_over is None else p + c.map_over))
        flat.append(ModelStep(s.name, (p + (s.output or ""),), relay=True))
    return flat


def _after_their_dependencies(steps: tuple[ModelStep, ...]) -> list[ModelStep]:
    """A child per item's (or a loop body's) steps in the order they grow: each after the
    steps it needs, otherwise as declared (the docs leave the order open;
    ``ekit_core.expansion`` says so)."""
    placed: dict[str, ModelStep] = {}
    while len(placed) < len(steps):  # (pass after pass over the declared order)
        for c in steps:
            if c.name not in placed and all(d in placed for d in c.deps):
                placed[c.name] = c
    return list(placed.values())


def seen(unit: str, dep: str) -> str:
    """The name under which a step of a child sees ``dep``: its child's steps by their own
    names (``P/c/k``, then ``P/k``, then ``k``: the innermost child first), the parent's
    inputs by theirs."""
    cut = [i + 1 for i, ch in enumerate(unit) if ch == "/"]
    for i in reversed(cut):
        if dep.startswith(unit[:i]):
            return dep[i:]
    return dep


# -- the run ----------------------------------------------------------------------------------


def _add(a: tuple[int, int, int], b: tuple[int, int, int]) -> tuple[int, int, int]:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2])


class Run:
    """One run, one attempt at a time. Units are declared steps and items, by name."""

    def __init__(self, steps: list[ModelStep], record: Record | None, script: Script,
                 options: Options) -> None:
        steps = flatten(steps)
        self.steps = {s.name: s for s in steps}
        self.bodies: dict[str, list[ModelStep]] = {}  # loop -> its body's steps
        for s in steps:
            if s.body_of is not None:
                self.bodies.setdefault(s.body_of, []).append(s)
        self.body_maps: dict[str, str] = {}  # M#k (a body's map in iteration k) -> U#k
        self.script = script
        self.options = options
        self.rec = copy.deepcopy(record) if record is not None else Record()
        self.resumed = record is not None
        self.order: list[str] = [s.name for s in steps]  # units, in start order
        self.unit_step: dict[str, ModelStep] = {s.name: s for s in steps}
        self.unit_deps: dict[str, list[str]] = {s.name: list(s.deps) for s in steps}
        self.piece: dict[str, Any] = {}  # item -> its piece of what its step maps over
        self.upstream: dict[str, str] = {}  # item of a chain -> the item it chains to
        self.items: dict[str, list[tuple[Any, str]]] = {}  # mapped step -> [(key, item)]
        self.mapping: dict[str, bool] = {}  # mapped step -> its input was a mapping
        self.failed_now: dict[str, int] = {}  # unit -> attempts failed in this run
        self.final_failed: set[str] = set()
        self.answered_condition: set[str] = set()
        self.approved: set[str] = set()
        self.halted = ""
        self.out = Prediction()
        self.selected = self._closure(options.only) if options.only else None
        self.ran_now: set[str] = set()  # units that succeeded in this run
        self.outdated: list[str] = []
        self.told_at_start: list[tuple[Any, ...]] = []
        self.code_moved: set[str] = set()  # steps not recorded whose code changed
        self.code_kept: set[str] = set()  # recorded steps whose changed code ``keep`` kept

    # -- what the docs call "need" --------------------------------------------------------

    def _closure(self, only: tuple[str, ...]) -> set[str]:
        chosen: set[str] = set()
        todo = list(only)
        while todo:
            name = todo.pop()
            if name not in chosen:
                chosen.add(name)
                todo.extend(self.steps[name].deps)
                todo.extend(t.name for t in self.bodies.get(name, ()))  # (a loop: its body)
        return chosen

    def _downstream(self, roots: set[str]) -> set[str]:
        """Declared steps that need any of ``roots``, transitively, with the roots."""
        gone = set(roots)
        grew = True
        while grew:
            grew = False
            for s in self.steps.values():
                if s.name not in gone and any(d in gone for d in s.deps):
                    gone.add(s.name)
                    grew = True
            for loop, body in self.bodies.items():  # a changed body runs its loop again whole
                if loop not in gone and any(t.name in gone for t in body):
                    gone.update([loop, *(t.name for t in body)])
                    grew = True
        return gone

    def _owner(self, unit: str) -> str:
        if unit in self.steps:
            return unit
        base = unit.split("[", 1)[0]
        if base in self.steps:
            return base
        return base.rsplit("#", 1)[0] if "#" in base else base

    def _iteration(self, unit: str) -> tuple[str, int] | None:
        """``(loop, k)`` when ``unit`` is iteration ``k`` of a loop (``loop#k``, or ``L/s#k``
        of a step of its body), else ``None``."""
        if unit in self.steps or "[" in unit or "#" not in unit:
            return None
        loop, k = unit.rsplit("#", 1)
        step = self.steps.get(loop)
        if step is not None and step.body_of is not None:
            return (step.body_of, int(k))
        return (loop, int(k)) if step is not None and step.repeat is not None else None

    # -- resume --------------------------------------------------------------------------

    def resume(self) -> None:
        rec = self.rec
        shapes = {n: s.shape() for n, s in self.steps.items() if s.shape()}
        if not self.resumed:
            rec.versions = {n: s.version for n, s in self.steps.items() if s.version is not None}
            rec.shapes = shapes
            rec.codes = self._codes()
            return
        # A changed shape (allow_graph_change) is changed work, as a changed version is.
        reshaped = {n for n, s in self.steps.items() if rec.shapes.get(n, ()) != s.shape()}
        roots = reshaped | {n for n, s in self.steps.items() if rec.versions.get(n) != s.version}
        roots |= self._code_changed()
        rec.versions = {n: s.version for n, s in self.steps.items() if s.version is not None}
        rec.shapes = shapes
        changed = self._downstream(roots | self.code_moved)  # work that changed: new numbers
        # A skipped step does not run again for its bump: its skip stands, and so does what
        # it forces; a reshaped one is decided again. What runs again is downstream of those.
        rerun = self._downstream({r for r in roots if r not in rec.skipped or r in reshaped})
        self.outdated = [n for n in self.order if n in rerun and n in rec.outputs]
        touched = [n for n in self.steps if n in changed]
        known = Run(list(self.steps.values()), Record(outputs=rec.outputs), self.script, Options())
        known.grow(start=True)  # (loops too: a body's maps grow L/m#k[key] in its iterations)
        while known.grow():  # the items the recorded outputs make
            pass
        for m, pairs in known.items.items():
            touched.extend(u for _, u in pairs if self._owner(m) in changed)
        # (an item known only by its ``redone`` count is not counted again: its last
        # number is unused, so new; the docs ask no more)
        touched.extend(self._next_iterations(changed))
        # A kept step's items not recorded run the new code: other work, new numbers (issue
        # 45: a changed fingerprint "never re-sends the attempt key of different work";
        # ``keep`` keeps recorded outputs only). Nothing downstream of it changes.
        settled = {*rec.outputs, *rec.skipped, *rec.superseded}
        anew = [u for m, pairs in known.items.items() if m in self.code_kept for _, u in pairs]
        anew += [u for u in (*rec.failures, *rec.asked) if self._owner(u) in self.code_kept]
        anew = [u for u in dict.fromkeys(anew) if u not in settled and u not in touched
                and u.startswith(f"{self._owner(u)}[")]
        touched.extend(anew)
        spent: dict[str, int] = {}
        for loop, upto in rec.compacted.items():  # run again from the first: spent numbers
            if loop in rerun:
                # (a body's: each step's iterations, and its maps' items by the only name
                # left, M#k[], which each item M#k[key] counts too: docs/checkpoint-format.md)
                names = [f"{t.name}#{k}" for t in self.bodies.get(loop, ())
                         for k in range(1, upto + 1)] or [f"{loop}#{k}" for k in range(1, upto + 1)]
                names += [f"{t.name}#{k}[]" for t in self.bodies.get(loop, ())
                          if f"{t.name}[]" in rec.compacted for k in range(1, upto + 1)]
                touched.extend(names)
                spent.update(dict.fromkeys(names, rec.compacted_retries.get(loop, 0)))
        for unit in [*rec.outputs, *rec.skipped, *rec.failures, *rec.asked, *rec.superseded]:
            if self._owner(unit) in changed and unit not in touched:
                touched.append(unit)
        self._let_go(roots, changed)
        self._set_aside(roots - (set(rec.skipped) - reshaped), rerun)
        for unit in touched:
            rec.redone[unit] = rec.redone.get(unit, 0) + 1 + spent.get(unit, 0)
            if self._owner(unit) in changed or unit in anew:
                rec.asked.pop(unit, None)  # the old code's question is not the new one's
            if self._owner(unit) in rerun:
                if unit in rec.outputs:
                    self.out.let_go.append(unit)
                for table in (rec.outputs, rec.usage, rec.skipped, rec.hits):  # (failures stay)
                    table.pop(unit, None)
        for loop in list(rec.compacted):  # a loop that runs again starts from its first iteration
            if loop in rerun or (loop.endswith("[]") and loop[:-2] in rerun):
                del rec.compacted[loop]
                rec.compacted_retries.pop(loop, None)
        for unit in list(rec.skipped):  # a skipped mapped step's items are not grown again
            if "[" in unit and unit not in self.steps and self._owner(unit) in rec.skipped:
                del rec.skipped[unit]
        for unit, answer in self.options.answers.items():
            rec.asked[unit][-1][1] = answer

    def _codes(self) -> dict[str, str]:
        """What the checkpoint records of each step's code: every step's, with a policy or a
        cache (a parent hands its child's output on: no code of its own)."""
        if self.options.on_code_change is None and not any(s.cache for s in self.steps.values()):
            return {}
        return {n: s.code for n, s in self.steps.items()
                if not s.relay and (self.options.on_code_change is not None or s.cache)}

    def _code_changed(self) -> set[str]:
        """docs/cache.md: "On resume, a recorded step whose fingerprint changed meets its
        policy": ``again`` runs it again as a version bump does, ``keep`` keeps it (and the
        code its outputs were made by), ``refuse`` refuses the resume before anything runs."""
        rec, policy = self.rec, self.options.on_code_change
        now = self._codes()
        moved = [n for n in self.steps if n in rec.codes and n in now and rec.codes[n] != now[n]]
        changed = [n for n in moved
                   if n in rec.outputs or any(u.startswith(f"{n}[") for u in rec.outputs)]
        # A step not recorded whose code changed is other work all the same: new attempt
        # numbers (issue 45: "a changed version or fingerprint ... never re-sends the attempt
        # key of different work"), whatever the policy, which is for recorded steps.
        self.code_moved = {n for n in moved if n not in changed}
        if changed and policy == "refuse":
            raise CodeChanged(tuple(changed))
        if policy == "keep":
            now.update({n: rec.codes[n] for n in changed})
            self.code_kept = set(changed)
        rec.codes = now
        return set(changed) if policy in ("again", None) else set()

    def _next_iterations(self, changed: set[str]) -> list[str]:
        """The iteration each unfinished loop whose work changed runs next: once its
        dependencies are recorded it may have run with nothing saved (concepts.md: new
        numbers "whether the checkpoint records ... or nothing at all")."""
        rec, found = self.rec, []
        for s in self.steps.values():
            if (s.repeat is None or s.name not in changed or s.name in rec.outputs
                    or s.name in rec.skipped or not all(d in rec.outputs for d in s.deps)):
                continue
            # (a body's iterations are its output step's: concepts.md, "How it ends")
            counted = s.output if s.name in self.bodies and s.output else s.name
            last = rec.compacted.get(s.name, 0)
            while f"{counted}#{last + 1}" in rec.outputs:
                last += 1
            shape = rec.shapes.get(s.name) or s.shape()
            if last < shape[4] and s.name not in self.bodies:
                found.append(f"{s.name}#{last + 1}")
            elif last < shape[4]:  # every step of the body's next iteration
                found.extend(f"{t.name}#{last + 1}" for t in self.bodies[s.name])
        return found

    def _set_aside(self, roots: set[str], gone: set[str]) -> None:
        """The early cutoff: a mapped step whose mapped-over step runs again (and nothing
        else of its own) sets its items aside, with the old input, to keep unchanged ones.
        (concepts.md says "runs again on purpose": the runtime also keeps the items when
        what they map over runs again because a step above it changed; so does the model.)"""
        rec = self.rec
        for m in self.steps.values():
            over = m.map_over
            if (over is None or over not in gone or m.name in roots or self.steps[over].map_over
                    or m.item_of is not None):  # (a child per item: see the docstring)
                continue
            if any(d in gone for d in m.deps if d != over) or over not in rec.outputs:
                continue
            rec.superseded[over] = rec.outputs[over]
            for unit in list(rec.outputs):
                owner = self._owner(unit)
                if unit != owner and (owner == m.name or self._chained_to(unit, m.name)) and (
                        self._unchanged_chain(owner, m.name, roots, gone)):
                    rec.superseded[unit] = rec.outputs[unit]

    def _unchanged_chain(self, step: str, mapped: str, roots: set[str], gone: set[str]) -> bool:
        """Whether no step from ``mapped`` down the chain to ``step`` changed its own code or
        has another input that runs again: only then is an item of ``step`` still its work."""
        while True:
            s = self.steps[step]
            if s.name in roots or any(d in gone for d in s.deps if d != s.map_over):
                return False
            if step == mapped:
                return True
            step = s.map_over or ""

    def _let_go(self, roots: set[str], changed: set[str]) -> None:
        """What was set aside can no longer be kept once the mapped step's own code, or
        another of its inputs, changed: its items run again (concepts.md, early cutoff)."""
        for m in self.steps.values():
            if m.map_over is None:
                continue
            if m.name in roots or any(d in changed for d in m.deps if d != m.map_over):
                for unit in list(self.rec.superseded):
                    if unit.startswith(m.name + "[") or self._chained_to(unit, m.name):
                        del self.rec.superseded[unit]

    def _chained_to(self, unit: str, mapped: str) -> bool:
        owner = self._owner(unit)
        while owner in self.steps and self.steps[owner].map_over is not None:
            if self.steps[owner].map_over == mapped:
                return unit != owner
            owner = self.steps[owner].map_over or ""
        return False

    # -- growth -----------------------------------------------------------------------------

    def grow(self, start: bool = False) -> bool:
        """Expand every mapped step whose input is recorded, and right after it the steps
        chained to it, item-wise (depth first, each level in declaration order); at the
        ``start`` of a run, each loop's iterations too, in the same pass."""
        changed = self._grow_body_maps()
        for over in self.steps.values():  # (by what they map over: a resume grows so)
            if start and over.repeat is not None:
                self._start_loop(over)
            if over.map_over is not None or over.name not in self.rec.outputs:
                continue
            # (a child per item grows after the maps over the same step: the docs leave the
            # order open, and the model follows the runtime)
            for m in sorted(self.steps.values(), key=lambda m: m.item_of is not None):
                if (m.map_over != over.name or m.name in self.items or m.relay
                        or m.body_of is not None or self._forced_skip(m)):
                    continue
                self._expand(m, self._pieces(m, self.rec.outputs[over.name]))
                self._grow_chains(m.name)
                changed = True
        return changed

    def _forced_skip(self, m: ModelStep) -> bool:
        """Whether mapped step ``m`` is skipped, or one of its dependencies is: it is then
        skipped, not grown ("one of them skipped skips it", concepts.md, Shapes decided at
        run time; and on a resume "a step that needs both the bumped step and a step skipped
        elsewhere stays skipped", concepts.md), so no expansion of it is told."""
        gone = [d in self.rec.skipped for d in m.deps]
        return m.name in self.rec.skipped or (all(gone) if m.join_any else any(gone))

    def _grow_chains(self, mapped: str) -> None:
        for m in self.steps.values():
            if (m.map_over == mapped and m.name not in self.items and not m.relay
                    and m.body_of is None and not self._forced_skip(m)):
                self.mapping[m.name] = self.mapping[mapped]
                self._expand(m, [(k, None) for k, _ in self.items[mapped]], chained=True)
                self._grow_chains(m.name)

    def _pieces(self, m: ModelStep, value: Any) -> list[tuple[Any, Any]]:
        if isinstance(value, Mapping):
            self.mapping[m.name] = True
            return list(value.items())
        self.mapping[m.name] = False
        if m.item_key is not None:
            return [(piece[m.item_key], piece) for piece in value]
        return list(enumerate(value))

    def _expand(self, m: ModelStep, pieces: list[tuple[Any, Any]], chained: bool = False) -> None:
        self.items[m.name] = []
        if (self.selected is None or m.name in self.selected) and m.item_of is None:
            self.out.events.append(("StepExpanded", m.name))  # (outside ``only``: silently)
        for key, piece in pieces:
            unit = f"{m.name}[{key}]"
            self.items[m.name].append((key, unit))
            self.order.append(unit)
            self.unit_step[unit] = m
            over = m.map_over or ""
            if chained:  # m2[k] needs m1[k], and sees its output
                self.upstream[unit] = f"{over}[{key}]"
            else:
                self.piece[unit] = piece
            first = self.upstream.get(unit, over)
            self.unit_deps[unit] = [first, *(d for d in m.deps if d != over)]
            if m.item_of is not None:  # it waits for the same item's steps it needs
                self.unit_deps[unit] = [over, *(f"{d}[{key}]" if d.startswith(f"{m.item_of}/")
                                                else d for d in m.deps if d != over)]
            self._keep_cut_off(m, key, unit, piece)
        if not pieces and m.name not in self.rec.outputs and self._collectable(m.name):
            self._collect(m.name)  # no items: collected as soon as it is expanded

    def _keep_cut_off(self, m: ModelStep, key: Any, unit: str, piece: Any) -> None:
        """An item whose input is as it was keeps its set-aside output, and so does the
        chain below it, item by item."""
        sup = self.rec.superseded
        if unit not in sup:
            return
        over = m.map_over or ""
        if unit in self.upstream:  # kept when the item it chains to was
            same = self.upstream[unit] in self.rec.outputs and self.upstream[unit] not in self.ran_now
        else:
            old = sup.get(over)
            old_pieces = dict(self._pieces(m, old)) if old is not None else {}
            same = key in old_pieces and old_pieces[key] == piece
        if same and unit not in self.rec.outputs:
            self.rec.outputs[unit] = sup[unit]
            self.out.kept.append(unit)
            self.out.events.append(("StepSkipped", unit))
        if same or unit not in self.rec.outputs:
            del sup[unit]

    # -- settling: skips and collections ----------------------------------------------------

    def settle(self) -> None:
        """Skip what needs a skipped unit, collect what is complete, grow: to a fixed point."""
        changed = True
        while changed:
            changed = self.grow()
            for unit in list(self.order):
                if self._done(unit) or (unit in self.failed_now and unit in self.final_failed):
                    continue
                step = self.unit_step[unit]
                deps = self.unit_deps[unit]
                skipped = [d for d in deps if d in self.rec.skipped]
                if step.join_any and unit == step.name:
                    if all(d in self.rec.skipped for d in deps):
                        self._skip(unit, f"it needs {deps[0]!r}, which was skipped")
                        changed = True
                elif skipped:
                    self._skip(unit, f"it needs {skipped[0]!r}, which was skipped")
                    changed = True
                elif unit in self.items and unit not in self.rec.outputs and self._collectable(unit):
                    self._collect(unit)
                    changed = True
                elif step.relay and step.map_over is not None and self._collectable_parent(unit):
                    # a child per item's parent is collected from its output step, no attempt
                    self.rec.outputs[unit] = self.rec.outputs[deps[0]]
                    self.out.events.append(("StepFinished", unit, 1))
                    changed = True
                elif step.map_over is not None and unit == step.name and step.map_over in self.rec.skipped:
                    self._skip(unit, f"it needs {step.map_over!r}, which was skipped")
                    changed = True

    def _collectable_parent(self, unit: str) -> bool:
        if self.selected is not None and unit not in self.selected:
            return False
        return all(d in self.rec.outputs for d in self.unit_deps[unit])

    def _skip_needing_skipped(self) -> None:
        """A resume skips the declared steps that need a skipped one before it grows anything:
        a mapped step so skipped is not expanded, and no expansion of it is told
        (concepts.md: "a step that needs both the bumped step and a step skipped elsewhere
        stays skipped"; what a skip forces is settled as the run starts)."""
        grew = True
        while grew:
            grew = False
            for s in self.steps.values():
                if s.name in self.rec.skipped or s.name in self.rec.outputs:
                    continue
                gone = [d for d in s.deps if d in self.rec.skipped]
                if gone and (len(gone) == len(s.deps) if s.join_any else True):
                    self._skip(s.name, f"it needs {gone[0]!r}, which was skipped")
                    grew = True

    def _done(self, unit: str) -> bool:
        if unit in self.rec.outputs or unit in self.rec.skipped:
            return True
        it = self._iteration(unit.split("[", 1)[0])  # a compacted iteration is done, its
        # output let go of (and its maps' items)
        return it is not None and it[1] <= self.rec.compacted.get(it[0], 0)

    def _collectable(self, m: str) -> bool:
        if self.selected is not None and self._owner(m) not in self.selected:
            return False  # outside ``only`` nothing of it runs, not even its collection
        deps = self.steps[m].deps if m in self.steps else self.unit_deps[m]
        return (all(self._done(u) for _, u in self.items[m])
                and all(d in self.rec.outputs for d in deps))

    def _collect(self, m: str) -> None:
        pairs = [(k, self.rec.outputs[u]) for k, u in self.items[m] if u in self.rec.outputs]
        self.rec.outputs[m] = dict(pairs) if self.mapping[m] else [v for _, v in pairs]
        self.out.events.append(("StepFinished", m, 1))

    def _skip(self, unit: str, reason: str) -> None:
        self.rec.skipped[unit] = reason
        self.out.events.append(("StepSkipped", unit))

    # -- choosing and running ---------------------------------------------------------------

    def ready(self) -> list[str]:
        """Units that may start now, in start order."""
        if self.halted:
            return []
        found = []
        for unit in self.order:
            step = self.unit_step[unit]
            if self._done(unit) or unit in self.final_failed or unit in self.items:
                continue
            if step.map_over is not None and unit == step.name:
                continue  # a mapped step never starts: it is collected
            if step.repeat is not None and unit == step.name:
                continue  # nor does a loop: its iterations do
            if (step.body_of is not None and unit == step.name) or unit in self.body_maps:
                continue  # nor a step of a body (its iterations do), nor a map in it
            if self.selected is not None and step.name not in self.selected:
                continue
            if self._waiting(unit):
                continue
            deps = self.unit_deps[unit]
            if any(self._blocked(d) for d in deps):
                continue
            if step.join_any and unit == step.name:
                if all(self._done(d) for d in deps) and any(d in self.rec.outputs for d in deps):
                    found.append(unit)
            elif all(d in self.rec.outputs for d in deps):
                found.append(unit)
        return found

    def _blocked(self, dep: str) -> bool:
        return dep in self.final_failed

    def _waiting(self, unit: str) -> bool:
        asked = self.rec.asked.get(unit, [])
        return bool(asked) and asked[-1][1] is NO_ANSWER

    def inputs(self, unit: str) -> dict[str, Any]:
        step = self.unit_step[unit]
        if step.body_of is not None:
            return self._body_inputs(unit, step)
        found = {d: self.rec.outputs[d] for d in step.deps if d in self.rec.outputs}
        if step.item_of is not None and unit != step.name:  # the same item's outputs
            found = {d.split("[", 1)[0]: self.rec.outputs[d] for d in self.unit_deps[unit]}
        if unit in self.upstream:
            found[step.map_over or ""] = self.rec.outputs[self.upstream[unit]]
        elif unit in self.piece:
            found[step.map_over or ""] = self.piece[unit]
        it = self._iteration(unit)
        if it is not None:  # its number and the previous iteration's output (None: the first)
            loop, k = it
            found[loop] = [k, self.rec.outputs[f"{loop}#{k - 1}"] if k > 1 else None]
        return {seen(step.name, d): v for d, v in found.items()}

    def number(self, unit: str) -> int:
        """The attempt's number: past the recorded failures and the outputs let go of."""
        recorded = self.rec.failures.get(unit, ("", "", 0))[2] - self.failed_now.get(unit, 0)
        spent = self.rec.redone.get(f"{unit[:unit.rfind('[')]}[]", 0) if unit.endswith("]") else 0
        return self.rec.redone.get(unit, 0) + spent + recorded + self.failed_now.get(unit, 0) + 1

    def attempt(self, unit: str) -> None:
        step = self.unit_step[unit]
        number = self.number(unit)
        inputs = self.inputs(unit)
        if step.when and unit not in self.answered_condition:
            said = self.script.condition(unit, step, inputs)
            if isinstance(said, Fail):
                self._failed(unit, self.failed_now.get(unit, 0) + 1, said)
                return
            if not said:
                self._skip(unit, "condition cond was false")
                self.settle()
                self.save()
                return
            self.answered_condition.add(unit)
        if self.options.approval and unit not in self.approved:
            said = self.script.approve(unit)
            if isinstance(said, Fail):  # it did not answer: the retry asks again
                self._failed(unit, self.failed_now.get(unit, 0) + 1, said)
                return
            if not said:
                self.out.events.append(("StepDenied", unit))
                self.halted = "denied"
                self.save()
                return
            self.approved.add(unit)
        tried = self.failed_now.get(unit, 0) + 1  # events count the attempts of this run
        self.out.events.append(("StepStarted", unit, tried))
        if step.cache and self.options.cache and self._hit(unit, step, inputs):
            self.out.events.append(("StepFinished", unit, tried))
            self.settle()
            self.save()
            return
        outcome: Outcome
        if step.relay:  # a parent hands its child's output on: no call, nothing paid
            outcome = Succeed(self.rec.outputs[self.unit_deps[unit][0]])
        else:
            self.out.begun.append((unit, number))
            outcome = self.script.attempt(unit, step, inputs)
        if isinstance(outcome, AskFirst):
            answers = [a for _, a in self.rec.asked.get(unit, []) if a is not NO_ANSWER]
            if not answers:
                self.rec.asked[unit] = [[outcome.prompt, NO_ANSWER]]
                self.out.events.append(("StepWaiting", unit))
                self.settle()
                self.save()
                return
            outcome = outcome.then(answers[0])
        if isinstance(outcome, Interrupt):
            self.out.events.append(("StepInterrupted", unit))
            self.halted = "cancelled"
            self.save()
            return
        if isinstance(outcome, Fail):
            self._failed(unit, tried, outcome)
            return
        assert isinstance(outcome, Succeed)
        if not step.relay:
            self.out.paid.append((unit, number))
        if step.cache and self.options.cache:  # stored for later runs (the first writer wins)
            self.script.cache_put(cache_key(unit, step, inputs), outcome)
        number = tried
        self.ran_now.add(unit)
        self.rec.outputs[unit] = outcome.value
        if outcome.usage != (0, 0, 0):
            self.rec.usage[unit] = outcome.usage
        self.rec.cost = _add(self.rec.cost, outcome.usage)
        self.out.events.append(("StepFinished", unit, number))
        it = self._iteration(unit)
        if it is not None and step.body_of is None:
            self._iterated(*it, outcome.done)
        elif it is not None and step.name == self.steps[it[0]].output:  # the body's output
            self._body_iterated(*it, outcome.done)
        budget = self.options.budget_calls
        if budget is not None and self.rec.cost[2] >= budget:
            self.halted = "budget_exceeded"
        self.settle()
        self.save()

    def _hit(self, unit: str, step: ModelStep, inputs: dict[str, Any]) -> bool:
        """docs/cache.md: a hit hands back the output recorded for the same step, code and
        ``version``, item and values read; it costs nothing and is recorded in ``cache_hits``
        with the usage it saved."""
        found = self.script.cache_get(cache_key(unit, step, inputs))
        if found is None:
            return False
        self.rec.outputs[unit] = found.value
        self.rec.hits[unit] = found.usage
        self.out.hits.append(unit)
        self.ran_now.add(unit)
        return True

    def _hits_at_start(self) -> bool:
        """docs/cache.md, "When hits are found": cached plain steps whose inputs are known as
        the run starts are looked up before it begins, and those their hits make known; not
        in a run with an approval callback, answers or ``only=``. (The runtime also looks up
        none in a workflow with run-time shapes or a recorded question, which the docs do not
        say: the model follows it.)"""
        o, rec = self.options, self.rec
        if (not o.cache or o.approval or o.answers or o.only or rec.asked
                or any(s.shape() for s in self.steps.values())
                or all(n in rec.outputs for n in self.steps)):
            return False
        found, grew = False, True
        while grew:
            grew = False
            for n, s in self.steps.items():
                if (s.cache and n not in rec.outputs and n not in rec.skipped
                        and all(d in rec.outputs for d in s.deps)
                        and self._hit(n, s, self.inputs(n))):
                    found = grew = True
        return found

    def _failed(self, unit: str, number: int, error: Fail) -> None:
        self.failed_now[unit] = self.failed_now.get(unit, 0) + 1
        before = self.rec.failures.get(unit, ("", "", 0))[2]
        self.rec.failures[unit] = (error.error_type, error.message, before + 1)
        if self.failed_now[unit] < self.unit_step[unit].max_attempts:
            self.out.events.append(("StepRetried", unit, number))
            self.save()
            return
        self.out.events.append(("StepFailed", unit, number))
        self.final_failed.add(unit)
        self.out.failed.append(unit)
        if not self.options.isolate_failures:
            self.halted = "failed"
        self.save()

    def save(self) -> None:
        self.out.saves.append(copy.deepcopy(self.rec))

    # -- loops: one iteration at a time (concepts.md, Loops) -----------------------------------

    def _grow_iterations(self, loop: str, first: int, last: int) -> None:
        """Iteration ``k`` is a unit of its own, ``loop#k``: it needs the loop's dependencies
        and iteration ``k-1``."""
        step = self.steps[loop]
        for k in range(first, last + 1):
            unit = f"{loop}#{k}"
            self.order.append(unit)
            self.unit_step[unit] = step
            self.unit_deps[unit] = [*step.deps, *([f"{loop}#{k - 1}"] if k > 1 else [])]

    def _start_loop(self, step: ModelStep) -> None:
        if step.name in self.bodies:
            self._start_body(step)
            return
        self._start_one_step_loop(step)

    def _start_one_step_loop(self, step: ModelStep) -> None:
        """A run knows a loop's iterations from the recorded outputs alone: recorded (or
        compacted) ones are done; the next one runs, unless the loop is recorded, or its
        recorded iterations reach its cap (it fails again, at once)."""
        rec = self.rec
        loop, cap = step.name, step.repeat or 0
        if loop in rec.skipped:  # its first iteration is skipped with it, selected or not
            first = f"{loop}#1"
            if first not in rec.skipped:  # (told, where a map's items are not: the docs
                # leave open what a resume tells of the skips it finds; this is the runtime's)
                rec.skipped[first] = rec.skipped[loop]
                self.told_at_start.append(("StepSkipped", first))
            self._grow_iterations(loop, 1, 1)
            return
        if self.selected is not None and loop not in self.selected:
            return
        last = rec.compacted.get(loop, 0)
        while f"{loop}#{last + 1}" in rec.outputs:
            last += 1
        if loop in rec.outputs or last >= cap:
            self._grow_iterations(loop, 1, last)
            if loop not in rec.outputs:
                self._loop_failed(loop, last)
        else:
            self._grow_iterations(loop, 1, last + 1)

    def _iterated(self, loop: str, k: int, done: bool) -> None:
        """Iteration ``k`` is recorded: with ``keep_last`` the older ones are let go of; if it
        said it is done, its output is the loop's; at the cap the loop fails; else the next
        iteration is grown (and told, as a growth of one)."""
        step = self.steps[loop]
        if step.keep_last is not None and k > step.keep_last:
            self._compact(loop, k - step.keep_last)
        if done:
            self.rec.outputs[loop] = self.rec.outputs[f"{loop}#{k}"]
            self.ran_now.add(loop)
            self.out.events.append(("StepFinished", loop, 1))
        elif k >= (step.repeat or 0):
            self._loop_failed(loop, k)
        else:
            self._grow_iterations(loop, k + 1, k + 1)
            self.out.events.append(("StepExpanded", loop))

    def _compact(self, loop: str, upto: int) -> None:
        """``keep_last``: the outputs of iterations up to ``upto`` are let go of and counted in
        ``compacted`` (their usage, failure records and questions go with them)."""
        rec = self.rec
        for j in range(rec.compacted.get(loop, 0) + 1, upto + 1):
            failed = rec.failures.get(f"{loop}#{j}", ("", "", 0))[2]
            if failed > rec.compacted_retries.get(loop, 0):
                rec.compacted_retries[loop] = failed
            for table in (rec.outputs, rec.usage, rec.failures, rec.asked):
                table.pop(f"{loop}#{j}", None)
        rec.compacted[loop] = max(upto, rec.compacted.get(loop, 0))

    # -- a loop whose body is a workflow (concepts.md, "A loop whose body is a workflow") ------

    def _start_body(self, step: ModelStep) -> None:
        """As a one-step loop, read from the body's output step's recorded iterations; every
        iteration grown whole."""
        rec, loop, out = self.rec, step.name, step.output or ""
        if loop in rec.skipped:  # its first iteration is skipped with it, each body step's
            for t in self.bodies[loop]:
                first = f"{t.name}#1"
                if first not in rec.skipped:  # (told, as a one-step loop's is: the runtime's)
                    rec.skipped[first] = rec.skipped[loop]
                    self.told_at_start.append(("StepSkipped", first))
            self._grow_body(loop, 1, 1)
            return
        if self.selected is not None and loop not in self.selected:
            return
        last = rec.compacted.get(loop, 0)
        while f"{out}#{last + 1}" in rec.outputs:
            last += 1
        if loop in rec.outputs or last >= (step.repeat or 0):
            self._grow_body(loop, 1, last)
            if loop not in rec.outputs:
                self._loop_failed(loop, last)
        else:
            self._grow_body(loop, 1, last + 1)
        # (the maps of its recorded iterations grow with them, before the loops declared
        # after it start: the docs leave the order open, and the model follows the runtime)
        self._grow_body_maps()

    def _grow_body(self, loop: str, first: int, last: int) -> None:
        """Iteration ``k`` runs every body step ``s`` as ``L/s#k``: it needs the loop's inputs,
        its body dependencies of the same iteration, and (with none) ``L/o#(k-1)``."""
        out = self.steps[loop].output or ""
        for k in range(first, last + 1):
            for t in self.bodies[loop]:
                unit = f"{t.name}#{k}"
                inside = [d for d in t.deps if d.startswith(f"{loop}/")]
                self.order.append(unit)
                self.unit_step[unit] = t
                self.unit_deps[unit] = [*(d for d in t.deps if d not in inside),
                                        *(f"{d}#{k}" for d in inside),
                                        *([f"{out}#{k - 1}"] if not inside and k > 1 else [])]
                if t.map_over is not None:
                    self.body_maps[unit] = f"{t.map_over}#{k}"

    def _grow_body_maps(self) -> bool:
        """A body's map ``M`` over ``U`` grows, once ``U#k`` is recorded, the items ``M#k[key]``
        (told as ``M#k`` expanded), collected as ``M#k``."""
        grew = False
        for unit, over in self.body_maps.items():
            if unit in self.items or over not in self.rec.outputs:  # (told when collected too)
                continue
            t, value = self.unit_step[unit], self.rec.outputs[over]
            pairs = list(value.items()) if isinstance(value, Mapping) else (
                [(p[t.item_key], p) for p in value] if t.item_key else list(enumerate(value)))
            self.mapping[unit] = isinstance(value, Mapping)
            self.items[unit] = []
            self.out.events.append(("StepExpanded", unit))
            for key, piece in pairs:
                item = f"{unit}[{key}]"
                self.items[unit].append((key, item))
                self.order.append(item)
                self.unit_step[item] = t
                self.piece[item] = piece
                self.unit_deps[item] = list(self.unit_deps[unit])
            grew = True
        return grew

    def _body_inputs(self, unit: str, step: ModelStep) -> dict[str, Any]:
        """What a body step's iteration (or an item of it) sees: the loop's inputs, its body
        dependencies of the same iteration by their names, and the loop's ``Iteration``."""
        loop = step.body_of or ""
        base = unit.split("[", 1)[0]
        k = int(base.rsplit("#", 1)[1])
        out = self.steps[loop].output or ""
        found = {}
        for d in self.unit_deps[base]:
            if d != f"{out}#{k - 1}":
                found[d.rsplit("#", 1)[0] if d.startswith(f"{loop}/") else d] = self.rec.outputs[d]
        if unit in self.piece:
            found[step.map_over or ""] = self.piece[unit]
        found[loop] = [k, self.rec.outputs[f"{out}#{k - 1}"] if k > 1 else None]
        return {seen(step.name, d): v for d, v in found.items()}

    def _body_iterated(self, loop: str, k: int, done: bool) -> None:
        """The body's output step recorded iteration ``k``: the loop decides, as a one-step
        loop does; ending, each body step records its last iteration's output, then the loop."""
        step = self.steps[loop]
        if step.keep_last is not None and k > step.keep_last:
            self._compact_body(loop, k - step.keep_last)
        if done:
            for t in self.bodies[loop]:
                self.rec.outputs[t.name] = self.rec.outputs[f"{t.name}#{k}"]
                self.ran_now.add(t.name)
                self.out.events.append(("StepFinished", t.name, 1))
            self.rec.outputs[loop] = self.rec.outputs[f"{step.output}#{k}"]
            self.ran_now.add(loop)
            self.out.events.append(("StepFinished", loop, 1))
        elif k >= (step.repeat or 0):
            self._loop_failed(loop, k)
        else:
            self._grow_body(loop, k + 1, k + 1)
            self.out.events.append(("StepExpanded", loop))

    def _compact_body(self, loop: str, upto: int) -> None:
        """``keep_last`` lets go of whole iterations, items included: the iterations counted
        under ``compacted[L]``, the items of a map ``M`` under ``compacted["M[]"]``."""
        rec = self.rec
        for j in range(rec.compacted.get(loop, 0) + 1, upto + 1):
            for t in self.bodies[loop]:
                unit = f"{t.name}#{j}"
                items = [u for u in {*rec.outputs, *rec.failures, *rec.asked, *rec.usage}
                         if u.startswith(f"{unit}[")]
                mine = len(self.items.get(unit, [])) or sum(1 for u in items if u in rec.outputs)
                if t.map_over is not None and mine:
                    rec.compacted[f"{t.name}[]"] = rec.compacted.get(f"{t.name}[]", 0) + mine
                for u in [unit, *items]:
                    failed = rec.failures.get(u, ("", "", 0))[2]
                    if failed > rec.compacted_retries.get(loop, 0):
                        rec.compacted_retries[loop] = failed
                    for table in (rec.outputs, rec.usage, rec.failures, rec.asked):
                        table.pop(u, None)
        rec.compacted[loop] = max(upto, rec.compacted.get(loop, 0))

    def _loop_failed(self, loop: str, k: int) -> None:
        """A loop whose iteration at its cap did not end it fails with ``LoopError`` naming it;
        its iterations stay recorded."""
        self.rec.failures[loop] = ("LoopError", f"step {loop!r} did not end within "
                                   f"repeat={self.steps[loop].repeat}: iteration {k}", 1)
        self.out.events.append(("StepFailed", loop, 1))
        self.final_failed.add(loop)
        self.out.failed.append(loop)
        if not self.options.isolate_failures:
            self.halted = "failed"

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> Prediction:
        try:
            self.resume()
        except CodeChanged as refused:
            self.out.refused, self.out.outcome = refused.steps, "refused"
            return self.out
        self.out.events.append(("RunStarted",))
        budget = self.options.budget_calls
        hits = (budget is None or self.rec.cost[2] < budget) and self._hits_at_start()
        self.out.events.extend(("StepOutdated", n) for n in self.outdated)
        for unit in self.order:  # (a step a condition skipped is told by RunStarted alone)
            if unit in self.rec.outputs:
                self.out.events.append(("StepSkipped", unit))
        if budget is not None and self.rec.cost[2] >= budget:
            self.halted = "budget_exceeded"
        told = len(self.out.events)
        self._skip_needing_skipped()
        self.grow(start=True)  # (a loop's iterations are not told, as a map's items are not)
        self.settle()
        self.out.events[told:] = [e for e in self.out.events[told:] if e[0] != "StepSkipped"]
        self.out.events.extend(self.told_at_start)
        if self.options.answers or hits:
            self.save()  # the answers, or the hits, are recorded before anything runs
        while True:
            ready = self.ready()
            if not ready:
                break
            self.attempt(ready[0])
        self.out.outcome = self._outcome()
        self.out.waiting = [u for u in self.order if self._waiting(u)]
        self.out.events.append(("RunSettled", self.out.outcome))
        return self.out

    def _outcome(self) -> str:
        wanted = [n for n in self.steps if self.selected is None or n in self.selected]
        if self.halted == "budget_exceeded" and all(self._done(n) for n in wanted):
            return "finished"  # a budget the last step reaches leaves nothing undone
        if self.final_failed:  # (a failure kept in its branch still says how the run ended)
            return "failed"
        if self.halted:
            return self.halted
        if any(self._waiting(u) for u in self.order):
            return "waiting"
        return "finished"


def run(steps: list[ModelStep], record: Record | None, script: Script,
        options: Options = Options()) -> Prediction:
    """What one run of ``steps`` does, resumed from ``record`` (``None``: a fresh run)."""
    return Run(steps, record, script, options).run()
