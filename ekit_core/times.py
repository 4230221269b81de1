"""Instants as people read them: ISO 8601 in UTC, from seconds since the epoch.

The core records times as plain numbers (who answered a question, and
when) and may not import ``datetime``; this is the calendar arithmetic
instead (days to a civil date, after Howard Hinnant's ``civil_from_days``),
so that every report prints a time the same way the shell does.
"""

from __future__ import annotations

import math

__all__ = ["iso_utc", "when"]

_DAY = 86_400
# 0001-01-01T00:00:00Z and 10000-01-01T00:00:00Z: the years four digits hold.
_FIRST, _PAST_LAST = -62_135_596_800, 253_402_300_800


def iso_utc(at: float) -> str:
    """``at`` (seconds since 1970-01-01 UTC) as ``2026-12-07T03:04:12Z``, to the whole second.

    An instant outside the years 1 to 9999, or not a number at all, is
    printed as the number it is (:func:`_recorded`): a report shows what was
    recorded. An int is compared as an int: one past any float (``10**400``,
    which an answer's ``at`` and JSON may hold) is no ``OverflowError``.
    """
    if not isinstance(at, int | float) or isinstance(at, bool):
        return _recorded(at)
    if (isinstance(at, float) and not math.isfinite(at)) or not _FIRST <= at < _PAST_LAST:
        return _recorded(at)
    days, seconds = divmod(math.floor(at), _DAY)
    year, month, day = _civil(days)
    hour, rest = divmod(seconds, 3600)
    minute, second = divmod(rest, 60)
    return f"{year:04d}-{month:02d}-{day:02d}T{hour:02d}:{minute:02d}:{second:02d}Z"


def _recorded(at: object) -> str:
    """``repr(at)``; an int too long for Python to write as text (4,300 digits) by its size."""
    try:
        return repr(at)
    except ValueError:
        if not isinstance(at, int):
            raise
        return f"an int of {at.bit_length()} bits"


def _civil(days: int) -> tuple[int, int, int]:
    """The (year, month, day) of the proleptic Gregorian calendar ``days`` after 1970-01-01."""
    # Count from 0000-03-01, so that the leap day ends each 400-year era's year.
    z = days + 719_468
    era = z // 146_097
    doe = z - era * 146_097
    yoe = (doe - doe // 1460 + doe // 36_524 - doe // 146_096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + 3 if mp < 10 else mp - 9
    return yoe + era * 400 + (month <= 2), month, day


def when(at: str | float) -> str:
    """A recorded time as a person reads it: a number of seconds is an instant, in ISO 8601
    UTC (:func:`iso_utc`); text is the recorder's own words for it, kept as they are."""
    return at if isinstance(at, str) else iso_utc(at)
