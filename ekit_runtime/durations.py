"""Durations as people write them on a command line: ``90``, ``90s``, ``15m``, ``2h``, ``1d``, ``1h30m``.

:func:`parse_duration` is the one reader, used by ``ekit queue prune
--older-than``. A bare number is seconds (as the option always took), a
fraction included (``0.5``); otherwise the text is one or more
``<number><unit>`` parts, largest unit first and each unit at most once,
with the units in :data:`UNITS`. Anything else (a negative or infinite
number, an unknown unit such as ``y`` or ``mo``, ``h`` before a number,
units out of order) is a ``ValueError`` that shows what is accepted, so a
typo never prunes more than was meant.
"""

from __future__ import annotations

import math
import re

__all__ = ["UNITS", "parse_duration"]

UNITS: dict[str, int] = {"w": 604_800, "d": 86_400, "h": 3_600, "m": 60, "s": 1}
"""Seconds per unit, largest first: weeks, days, hours, minutes, seconds."""

_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
# ASCII only: \d would also take other scripts' digits, which no one types for this.
_BARE = re.compile(_NUMBER, re.ASCII)
_PART = re.compile(rf"({_NUMBER})([a-z]+)", re.ASCII)
_EXAMPLES = "seconds (90, 0.5) or a number and a unit, largest first: 90s, 15m, 2h, 1d, 1w, 1h30m"


def parse_duration(text: str) -> float:
    """The seconds that ``text`` stands for; ``ValueError`` naming the accepted forms if none.

    Letters may be upper or lower case and the whole may be surrounded by
    spaces; there are none inside it (``1h 30m`` is refused, ``1h30m`` is not).
    """
    given = text.strip().lower()
    if _BARE.fullmatch(given):
        return _finite(float(given), text)
    seconds = 0.0
    end = 0
    last = math.inf
    for part in _PART.finditer(given):
        unit = part.group(2)
        if part.start() != end or unit not in UNITS or UNITS[unit] >= last:
            raise _refused(text)
        seconds += float(part.group(1)) * UNITS[unit]
        end, last = part.end(), UNITS[unit]
    if end == 0 or end != len(given):
        raise _refused(text)
    return _finite(seconds, text)


def _finite(seconds: float, text: str) -> float:
    # A huge number of digits reads as inf: refuse it rather than prune nothing forever.
    if not math.isfinite(seconds):
        raise _refused(text)
    return seconds


def _refused(text: str) -> ValueError:
    shown = text if len(text) <= 40 else text[:40] + "..."
    return ValueError(f"{shown!r} is not a duration: expected {_EXAMPLES}")
