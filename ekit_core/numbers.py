"""The one check of the numbers callers pass in: finite, in range, and a float once checked.

Every public numeric argument (a step's ``timeout``, a :class:`RetryPolicy`'s
delays and jitter, a queue worker's lease, heartbeat and poll, a queue's
``Limits.window``, the seconds of a claim or a save, ...) goes through
:func:`check_number`, so that each refuses the same values the same way: a
``ValueError`` naming the argument, raised where the value is given, before
anything is paid for. A value is refused when it is not a number (``True``,
``"1"``), not finite (NaN, which compares false with every bound and so
slips past ``<`` checks, or an infinity), outside its range, or an ``int``
too large for a float (``10**400``, which would otherwise raise
``OverflowError`` wherever it first meets a float, long after it was given).
"""

from __future__ import annotations

import math
import sys
from typing import Final

__all__ = ["MAX_SECONDS", "check_number"]

MAX_SECONDS: Final = 1_000_000_000
"""The longest duration any argument takes, in seconds (about 31.7 years).

Past any wait a run means, and far inside what every clock, timer and
database column holding ``now + seconds`` can take.
"""

_LARGEST: Final = sys.float_info.max


def check_number(
    value: object,
    name: str,
    *,
    low: float = 0.0,
    high: float | None = MAX_SECONDS,
    above_low: bool = False,
    unit: str = " of seconds",
) -> float:
    """``value`` as a float if a finite number from ``low`` to ``high``, else a ValueError naming ``name``.

    ``above_low`` excludes ``low`` itself (``timeout`` must be above 0);
    ``high=None`` takes any finite number. ``bool`` is refused though it is
    an ``int``: ``True`` seconds is a mistake, not a duration. ``unit`` says
    what the number counts, in the message (``" of seconds"``, or ``""``).
    """
    top = _LARGEST if high is None else high
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        # Compared before any conversion: an int past the float range compares
        # exactly with a float, where float(value) would raise OverflowError.
        or not (low < value if above_low else low <= value)
        or not value <= top
        or not math.isfinite(value)
    ):
        raise ValueError(f"{name} must be {_range(low, high, above_low, unit)}, got {_shown(value)}")
    return float(value)


def _range(low: float, high: float | None, above_low: bool, unit: str) -> str:
    what = f"a finite number{unit}"
    if high is None:
        return f"{what} {'>' if above_low else '>='} {_figure(low)}"
    if above_low:
        return f"{what} above {_figure(low)} and at most {_figure(high)}"
    return f"{what} from {_figure(low)} to {_figure(high)}"


def _figure(number: float) -> str:
    return str(int(number)) if number == int(number) else repr(number)


def _shown(value: object) -> str:
    """``value`` for the message, cut short: ``10**400`` has 401 digits."""
    try:
        text = repr(value)
    except ValueError:  # an int past the interpreter's limit on digits turned to text
        return f"an int of {value.bit_length() if isinstance(value, int) else '?'} bits"
    return text if len(text) <= 80 else f"{text[:40]}... ({len(text)} characters)"
