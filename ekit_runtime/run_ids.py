"""What a run id is, for every store and queue: one rule, one place.

A run id is non-empty text that UTF-8 can hold: SQL text (SQLite,
PostgreSQL) is UTF-8, so a run id with a lone surrogate could be neither
saved nor found. A backend with stricter keys adds its own limits on top
of this rule (the run queue: at most 200 characters and no NUL; the
PostgreSQL store: what a PostgreSQL key can hold), never instead of it.
"""

from __future__ import annotations

__all__ = ["check_run_id"]


def check_run_id(run_id: object, name: str = "run_id") -> str:
    """``run_id`` if it is non-empty text UTF-8 can hold, else a ``ValueError`` naming ``name``.

    Checked when a store or queue is handed the id, so that one it could
    never write fails then, not at its first save. The message shows at most
    300 characters of what was given: a hostile id may be megabytes long.
    """
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"{name} must be a non-empty string, got {run_id!r:.300}")
    try:
        run_id.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"{name} must be encodable as UTF-8 (it holds a lone surrogate), got {run_id!r:.300}"
        ) from None
    return run_id
