"""Cache hits resolved as a run starts, as a resume decides what it skips (issue 45).

A hit found by an attempt costs a task, an attempt and a transition of the
core per step: 22.6x a recorded step skipped on resume. Most hits need none
of it: a cached step whose inputs are known when the run starts (its
dependencies recorded, or hits themselves) can be looked up then. So the run
looks them up before it begins, one batch per cache for every such step,
then once more for the steps those hits made ready, and so on; and it starts
from the outputs found as a resume starts from recorded ones: no attempt, no
task, recorded as hits (``cache_hits``, ``StepCacheHit``) with the usage
they saved. A fresh run (nothing recorded) looks them up before its first
state is built (:func:`hits_when_fresh`), which is then built once, from
them (:func:`fresh_with_hits`). A cached step whose inputs come later (after
a miss) is looked up by its attempt, as before.

Only a plain step is looked up here (no condition, map, join, loop or
resource: those are decided by the core as the run goes), and only in a run
without an approval callback (it gates every step's first attempt), answers
or questions, or ``only=``: any of these, and the attempt looks it up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from ekit_core import GraphSpec, State, WorkflowCheckpoint, checkpoint_of
from ekit_core.checkpoint import RecordedGraph
from ekit_core.transitions import context_outputs
from ekit_runtime.cache.base import (
    ANSWERS,
    KEYS,
    CachedStep,
    CacheEntry,
    CacheHit,
    Hasher,
    _Unencodable,
    _warn,
    hit_of,
    loads,
    value_hash,
)
from ekit_runtime.context import StepContext
from ekit_runtime.step import _CACHED, Step

__all__ = ["Found", "fresh_with_hits", "hits_at_start", "hits_of", "hits_when_fresh", "with_hits"]

Found = dict[str, tuple[Any, CacheEntry]]
"""Step -> (its output, decoded; the entry it came from)."""

_PLAIN = (None, None, None, "all", None, None)  # Step.shaping[:6] of a step with no run-time shape
_ABSENT = "-"  # (base.value_hash's mark of a key the context does not hold)


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
    outputs: dict[str, Any] = state.outputs.as_dict()

    def context() -> dict[str, Any]:
        base = context_outputs(state.graph, outputs) if len(outputs) > state.completed else {}
        base.update(state.context)
        return base
    return _hits(steps, cached, outputs, context)


def hits_when_fresh(steps: Sequence[Step], context: Mapping[str, Any] | None,
                    cached: Mapping[str, CachedStep]) -> Found:
    """:func:`hits_at_start` of a fresh run (nothing recorded) of a static graph, with no ``only=``
    and no approval callback, before its first state is built (see :func:`fresh_with_hits`)."""
    return _hits(steps, cached, {}, lambda: dict(context or {}))


def _hits(steps: Sequence[Step], cached: Mapping[str, CachedStep], outputs: dict[str, Any],
          context: Callable[[], dict[str, Any]]) -> Found:
    """The rounds of :func:`hits_at_start` from the ``outputs`` recorded and the run's
    ``context`` (with the outputs a context of all of them shows: made only if a step is ready)."""
    found: Found = {}
    waiting, missing, waits = _waiting(steps, cached, outputs)
    ready = [waiting[n] for n, m in missing.items() if not m]
    if not ready:
        return found
    base = context()
    heads = {n: cached[n].head(None) for n in waiting}
    few = _few(cached, heads)
    # Key -> (its value, the encoder, the hash): every step that reads a value hashes it once
    # (a fan-out of cached steps over one output). By the value's identity: nothing runs
    # between the lookups here, and a value that is not the one hashed is hashed again.
    hashed: dict[str, tuple[Any, Any, str | None]] = {}
    while ready:
        asked: dict[int, list[tuple[CachedStep, str, Hasher]]] = {}
        answered: list[tuple[str, CacheEntry, Any]] = []
        for step in ready:
            name = step.name
            one, head = cached[name], heads[name]
            entries = few.get(head)
            if entries is None:  # (many entries, or a cache that cannot tell: asked below)
                asked.setdefault(id(one.cache), []).append(
                    (one, head, _hasher(one, _context(step, base, outputs), hashed)))
                continue
            # All its entries are read already: matched here, no query; the newest whose every
            # read matches the context (built only if an entry read anything) and which decodes.
            hasher: Hasher | None = None
            for entry in entries:
                if entry.reads:
                    if hasher is None:
                        hasher = _hasher(one, _context(step, base, outputs), hashed)
                    if not all(hasher(k) == h for k, h in entry.reads.items()):
                        continue
                try:
                    output = one.decode(loads(entry.output))
                except Exception as exc:
                    _undecodable(one, entry, exc)
                    continue
                answered.append((name, entry, output))
                break
        for wanted in asked.values():
            answered += _find(wanted)
        ready = _known(answered, outputs, found, waits, missing, waiting)
    return found


def _known(answered: list[tuple[str, CacheEntry, Any]], outputs: dict[str, Any], found: Found,
           waits: Mapping[str, list[str]], missing: dict[str, int], waiting: Mapping[str, Step]
           ) -> list[Step]:
    """Record the hits ``answered`` as known; the steps that makes ready (every dependency known)."""
    ready = []
    for name, entry, output in answered:
        outputs[name] = output
        found[name] = (output, entry)
        after = waits.get(name)
        if after is not None:
            for later in after:
                left = missing[later] = missing[later] - 1
                if not left:
                    ready.append(waiting[later])
    return ready


def _waiting(steps: Sequence[Step], cached: Mapping[str, CachedStep], outputs: Mapping[str, Any]
             ) -> tuple[dict[str, Step], dict[str, int], dict[str, list[str]]]:
    """The cached plain steps not recorded, how many of each one's dependencies are not known
    yet, and who waits on each: one pass, so that a chain of n cached steps (n rounds of one
    step) costs O(n), not O(n^2)."""
    waiting: dict[str, Step] = {}
    missing: dict[str, int] = {}
    for step in steps:  # (one loop of plain tests: comprehensions and a sum cost 9k a step)
        name, shaping = step.name, step.shaping
        if name in cached and name not in outputs and shaping is not None and (
                shaping is _CACHED or shaping[:6] == _PLAIN):
            waiting[name] = step
            unknown = 0
            for dep in step.depends_on:
                if dep not in outputs:
                    unknown += 1
            missing[name] = unknown
    waits: dict[str, list[str]] = {}
    for name, step in waiting.items():
        for dep in step.depends_on:
            if dep in waiting:
                if dep in waits:
                    waits[dep].append(name)
                else:
                    waits[dep] = [name]
    return waiting, missing, waits


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


def _find(wanted: list[tuple[CachedStep, str, Hasher]]) -> list[tuple[str, CacheEntry, Any]]:
    """The hits of ``wanted`` (one cache), in one :meth:`Cache.find`, with their outputs: as
    :func:`~ekit_runtime.cache.base.lookup_all` (a failing cache or entry is a miss)."""
    cache = wanted[0][0].cache
    try:
        entries = cache.find([(head, hasher) for _, head, hasher in wanted])
    except Exception as exc:  # a damaged or unreachable cache: the steps run, as on a miss
        names = ", ".join(repr(one.step) for one, _, _ in wanted)
        _warn(f"could not look up {names} in {cache!r}; running them", exc)
        return []
    hits = []
    for (one, _, _), entry in zip(wanted, entries, strict=True):
        if entry is not None:
            try:
                hits.append((one.step, entry, one.decode(loads(entry.output))))
            except Exception as exc:
                _undecodable(one, entry, exc)
    return hits


def _undecodable(one: CachedStep, entry: CacheEntry, exc: Exception) -> None:
    """Warn that ``entry`` no longer decodes (damaged, or an output type changed since): a miss."""
    _warn(f"the entry {entry.key} of {one.step!r} in {one.cache!r} cannot be decoded; "
          "passing over it", exc)


def _hasher(one: CachedStep, context: Mapping[str, Any], hashed: dict[str, tuple[Any, Any, str | None]]
            ) -> Hasher:
    """:meth:`CachedStep.hasher` of ``context``, sharing ``hashed`` with the other steps' hashers."""
    encode = one.encode

    def hasher(key: str) -> str | None:
        if key in (KEYS, ANSWERS):  # (the key set is each context's own)
            try:
                return value_hash(context, key, encode)
            except _Unencodable:
                return None
        try:
            value = context[key]
        except KeyError:
            return _ABSENT
        seen = hashed.get(key)
        if seen is not None and seen[0] is value and seen[1] is encode:
            return seen[2]
        try:
            digest: str | None = value_hash(context, key, encode)
        except _Unencodable:
            digest = None
        hashed[key] = (value, encode, digest)
        return digest
    return hasher


def _context(step: Step, base: dict[str, Any], outputs: dict[str, Any]) -> Mapping[str, Any]:
    """The context ``step`` would be started with (Runner._context_for), ``outputs`` recorded."""
    if step.context == "all":  # (``outputs`` grows only once this round's lookups are hashed)
        return StepContext(base, outputs)  # type: ignore[arg-type]
    context = base.copy()
    for dep in step.depends_on:
        context[dep] = outputs[dep]
    return context


def with_hits(state: State, found: Found) -> WorkflowCheckpoint:
    """The checkpoint of ``state`` with the outputs ``found``: what the run starts from, as a resume.

    Its outputs and usage are plain mappings, as a checkpoint read from a store
    holds: the resume that reads them asks each step whether it is recorded.
    """
    cp = checkpoint_of(state)
    outputs = state.outputs.as_dict()
    for name, (output, _) in found.items():
        outputs[name] = output
    return WorkflowCheckpoint(
        cp.step_index + len(found), MappingProxyType(outputs), cost=cp.cost, context=cp.context,
        step_usage=MappingProxyType(state.step_usage.as_dict()), failures=cp.failures,
        graph=cp.graph, format_version=cp.format_version, versions=cp.versions,
        durations=cp.durations, redone=cp.redone, began=cp.began, held=cp.held,
        code_fingerprints=cp.code_fingerprints, compacted=cp.compacted,
        compacted_retries=cp.compacted_retries, drives=cp.drives)


def fresh_with_hits(found: Found, graph: GraphSpec, context: Mapping[str, Any] | None,
                    versions: Mapping[str, str], code: Mapping[str, str]) -> WorkflowCheckpoint:
    """:func:`with_hits` of a fresh run's first state, without the state: the checkpoint of
    nothing recorded (``context``, the graph, the ``versions`` tags and the ``code``
    fingerprints it starts with) and the outputs ``found``. The run's drive is left to the
    state it starts (``Workflow.start_state(drive=...)``), as a resume's own is."""
    return WorkflowCheckpoint(
        len(found), MappingProxyType({name: output for name, (output, _) in found.items()}),
        context=MappingProxyType(dict(context or {})), step_usage=MappingProxyType({}),
        graph=RecordedGraph.of(graph), versions=MappingProxyType(dict(versions)),
        code_fingerprints=MappingProxyType(dict(code)))


def hits_of(found: Found) -> MappingProxyType[str, CacheHit]:
    """The hits ``found``, as checkpoints record them."""
    return MappingProxyType({name: hit_of(entry) for name, (_, entry) in found.items()})

