"""The cross-run cache (issue 45): a step with ``cache=True`` run with ``run(cache=...)`` gets
back an output recorded for the same code and the same inputs, at no cost. See docs/cache.md."""

from ekit_runtime.cache.base import Cache, CachedStep, CacheEntry, CacheHit, Reads, entry_key, head_of
from ekit_runtime.cache.directory import DirectoryCache
from ekit_runtime.cache.sqlite import SqliteCache

__all__ = [
    "Cache",
    "PostgresCache",
    "CacheEntry",
    "CacheHit",
    "CachedStep",
    "DirectoryCache",
    "Reads",
    "SqliteCache",
    "entry_key",
    "head_of",
]


def __getattr__(name: str) -> object:
    # PostgresCache imports psycopg (the "postgres" extra): only when asked for.
    if name == "PostgresCache":
        from ekit_runtime.cache.postgres import PostgresCache

        return PostgresCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
