"""Cache hits resolved as a run starts, as a resume decides what it skips (issue 45).

A hit found by an attempt costs a task, an attempt and a transition of the
core per step: 22.6x a recorded step skipped on resume. Most hits need none
of it: a cached step whose inputs are known when the run starts (its
dependencies recorded, or hits themselves) can be looked up then. So the run
looks them up before it begins, one batch per cache for every such step,
then once more for the steps those hits made ready, and so on; and it starts
from the outputs found as a resume starts from recorded ones: no attempt, no
task, recorded as hits (``cache_hits``, ``StepCacheHit``) with the usage
they saved. A cached step whose inputs come later (after a miss) is looked up
by its attempt, as before.

Only a plain step is looked up here (no condition, map, join, loop or
resource: those are decided by the core as the run goes), and only in a run
without an approval callback (it gates every step's first attempt), answers
or questions, or ``only=``: any of these, and the attempt looks it up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from ekit_core import State, WorkflowCheckpoint, checkpoint_of
from ekit_core.ledger import Ledger
from ekit_core.transitions import context_outputs
from ekit_runtime.cache.base import CachedStep, CacheEntry, CacheHit, _warn, lookup_all
from ekit_runtime.context import StepContext
from ekit_runtime.step import Step

__all__ = ["Found", "hits_at_start", "with_hits"]

Found = dict[str, tuple[Any, CacheEntry]]
"""Step -> (its output, decoded; the entry it came from)."""

_PLAIN = (None, None, None, "all", None, None)  # Step.shaping[:6] of a step with no run-time shape


def hits_at_start(steps: Sequence[Step], state: State, cached: Mapping[str, CachedStep]) -> Found:
    """The hits of the cached ``steps`` whose inputs ``state`` knows, and of those they make known.

    ``state`` is the run's first state; each round looks up, in one batch per
    cache, every cached plain step not recorded whose dependencies are
    recorded or found, with the context it would be started with.
    """
    if state.spec.shaped is not None or state.settled or state.setbacks.asked:
        return {}
    limits = state.spec.limits
    if limits.only is not None or limits.approval:
        return {}
    outputs: dict[str, Any] = dict(state.outputs.items())
    base = context_outputs(state.graph, outputs) if len(outputs) > state.completed else {}
    base.update(state.context)
    waiting = {s.name: s for s in steps if s.name in cached and s.name not in outputs
               and s.shaping is not None and s.shaping[:6] == _PLAIN}
    # Each waiting step's dependencies not known yet, and who waits on each: one pass, so that
    # a chain of n cached steps (n rounds of one step) costs O(n), not O(n^2).
    missing = {n: sum(1 for d in s.depends_on if d not in outputs) for n, s in waiting.items()}
    waits: dict[str, list[str]] = {}
    for name, step in waiting.items():
        for dep in step.depends_on:
            if dep in waiting:
                waits.setdefault(dep, []).append(name)
    ready = [waiting[n] for n, m in missing.items() if not m]
    found: Found = {}
    if not ready:
        return found
    heads = {n: cached[n].head(None) for n in waiting}
    few = _few(cached, heads)
    while ready:
        by_cache: dict[int, list[tuple[CachedStep, str, Mapping[str, Any]]]] = {}
        answered: list[tuple[CachedStep, CacheEntry | None]] = []
        for step in ready:
            one, head = cached[step.name], heads[step.name]
            context = _context(step, base, outputs)
            entries = few.get(head)
            if entries is None:  # (many entries, or a cache that cannot tell: asked below)
                by_cache.setdefault(id(one.cache), []).append((one, head, context))
            else:  # all its entries are read already: matched here, no query
                answered.append((one, _matching(one, entries, context)))
        ready = []
        for wanted in by_cache.values():
            answered += zip((w[0] for w in wanted), lookup_all(wanted[0][0].cache, wanted), strict=True)
        for one, entry in answered:
            if entry is None:
                continue
            try:
                output = one.output_of(entry)
            except Exception:  # (decoded once already: see CachedStep._decodes) the step runs
                continue
            outputs[one.step] = output
            found[one.step] = (output, entry)
            for after in waits.get(one.step, ()):
                missing[after] -= 1
                if not missing[after]:
                    ready.append(waiting[after])
    return found


def _few(cached: Mapping[str, CachedStep], heads: Mapping[str, str]) -> dict[str, list[CacheEntry] | None]:
    """The entries of each head that has few (:meth:`Cache.few`), read at once, one query a cache."""
    caches: dict[int, tuple[Any, list[str]]] = {}
    for name, head in heads.items():
        cache = cached[name].cache
        caches.setdefault(id(cache), (cache, []))[1].append(head)
    few: dict[str, list[CacheEntry] | None] = {}
    for cache, listed in caches.values():
        try:
            few.update(cache.few(listed))
        except Exception as exc:  # a failing cache: each step asks find (which misses), then runs
            _warn(f"could not read the entries of {len(listed)} step(s) in {cache!r}", exc)
    return few


def _matching(one: CachedStep, entries: list[CacheEntry], context: Mapping[str, Any]) -> CacheEntry | None:
    """The newest of ``entries`` (all those under one head) whose every read matches ``context``."""
    hasher = one.hasher(context)
    for entry in entries:
        if all(hasher(k) == h for k, h in entry.reads.items()) and one._decodes(entry):
            return entry
    return None


def _context(step: Step, base: dict[str, Any], outputs: dict[str, Any]) -> Mapping[str, Any]:
    """The context ``step`` would be started with (Runner._context_for), ``outputs`` recorded."""
    if step.context == "all":  # (``outputs`` grows only once this round's lookups are hashed)
        return StepContext(base, outputs)  # type: ignore[arg-type]
    context = base.copy()
    for dep in step.depends_on:
        context[dep] = outputs[dep]
    return context


def with_hits(state: State, found: Found) -> WorkflowCheckpoint:
    """The checkpoint of ``state`` with the outputs ``found``: what the run starts from, as a resume."""
    cp = checkpoint_of(state)
    outputs = Ledger({**cp.outputs, **{name: output for name, (output, _) in found.items()}})
    return WorkflowCheckpoint.of_ledgers(
        outputs, Ledger(cp.step_usage), step_index=cp.step_index + len(found), cost=cp.cost,
        context=cp.context, failures=cp.failures, graph=cp.graph, versions=cp.versions,
        redone=cp.redone, code_fingerprints=cp.code_fingerprints)


def hits_of(found: Found) -> MappingProxyType[str, CacheHit]:
    """The hits ``found``, as checkpoints record them."""
    return MappingProxyType({name: CacheHit(entry.key, entry.usage) for name, (_, entry) in found.items()})
