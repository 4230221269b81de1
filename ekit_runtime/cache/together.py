"""Cached attempts that start together are looked up together (issue 45).

A cached step whose inputs come only during the run (after a miss, or after
a step that is not cached) is looked up by its attempt, just before its
work. When several such attempts start in one turn (a fan-out of cached
steps over one output, the items of a cached map), each would ask its cache
alone: two queries an attempt in a SQL cache. The runner collects them as it
starts them (:class:`Together`) and asks each cache once for all of them, in
one :meth:`~ekit_runtime.cache.Cache.find`, before any of them runs; each
attempt then takes its own answer (:class:`Ahead`) where it would have
looked up. What is found is what each attempt would have found alone: the
same key, the same entries, the same rule (``lookup_all``); only the number
of queries changes. A cache over the network is asked in one worker thread,
which every attempt of the batch awaits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from ekit_runtime.cache.base import CachedStep, CacheEntry, lookup_all

__all__ = ["Ahead", "Together"]

_PENDING: Any = object()


class Ahead:
    """One attempt's lookup, made with its batch: its head, and the entry found (or ``None``)."""

    __slots__ = ("cached", "context", "found", "head", "index", "pending")

    def __init__(self, cached: CachedStep, head: str, context: Mapping[str, Any]) -> None:
        self.cached, self.head, self.context = cached, head, context
        self.found: CacheEntry | None = _PENDING
        self.pending: asyncio.Future[list[CacheEntry | None]] | None = None
        self.index = 0

    async def entry(self) -> CacheEntry | None:
        """The entry the batch found for this attempt (``None``: a miss)."""
        if self.found is _PENDING:
            if self.pending is None:  # (never asked: alone in its cache, it asks now)
                return await _alone(self.cached, self.head, self.context)
            # Shielded: one attempt cancelled must not cancel its batch's query for the others.
            self.found = (await asyncio.shield(self.pending))[self.index]
        return self.found


async def _alone(cached: CachedStep, head: str, context: Mapping[str, Any]) -> CacheEntry | None:
    if cached.cache.local:
        return cached.lookup(head, context)
    return await asyncio.to_thread(cached.lookup, head, context)


class Together:
    """The cached attempts of one turn's starts, looked up in one query per cache (see the module)."""

    __slots__ = ("_asked",)

    def __init__(self) -> None:
        self._asked: dict[int, list[Ahead]] = {}  # id(cache) -> its attempts, in start order

    def add(self, cached_steps: Mapping[str, CachedStep], step: str, item: str | None,
            context: Mapping[str, Any]) -> Ahead | None:
        """An attempt of ``step`` (its ``item``, or ``None``) starting with ``context``: its
        lookup, if the step is one of the run's ``cached_steps`` (``None``: it is not)."""
        cached = cached_steps.get(step)
        if cached is None:
            return None
        try:
            head = cached.head(item)
        except Exception:  # (its attempt makes it again, and fails as it would have alone)
            return None
        ahead = Ahead(cached, head, context)
        self._asked.setdefault(id(cached.cache), []).append(ahead)
        return ahead

    def look_up(self) -> None:
        """Ask each cache for all its attempts at once: a local one now, one over the network
        in a worker thread that the attempts await. An attempt alone in its cache asks itself."""
        for asked in self._asked.values():
            if len(asked) < 2:
                continue
            cache = asked[0].cached.cache
            wanted = [(a.cached, a.head, a.context) for a in asked]
            if cache.local:
                for ahead, found in zip(asked, lookup_all(cache, wanted), strict=True):
                    ahead.found = found
                continue
            pending = asyncio.ensure_future(asyncio.to_thread(lookup_all, cache, wanted))
            for n, ahead in enumerate(asked):
                ahead.pending, ahead.index = pending, n
