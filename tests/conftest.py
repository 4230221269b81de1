"""What the whole suite needs to pass on a loaded machine as on a quiet one.

The suite runs on two cores that are often shared (load 4 to 8: another suite,
a build, a browser). Nothing here may turn slowness into a failure:

- A per-test timeout detects a deadlock; it is never a speed check. A test
  that takes 3 s on a quiet machine can take 30 s at load 8, so no test gets
  less than ``TIMEOUT_FLOOR`` seconds, whatever its mark says. A real hang
  still fails, later.
- Hypothesis's per-example ``deadline`` and its "too slow" health check are
  speed checks too: both are off for every property test (an explicit
  ``@settings`` still sets what it names, such as ``max_examples``).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

TIMEOUT_FLOOR = 180.0

settings.register_profile(
    "loaded-machine", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("loaded-machine")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Raise every marked timeout below the floor to the floor (see the module docstring)."""
    for item in items:
        marker = item.get_closest_marker("timeout")
        if marker is not None and marker.args and float(marker.args[0]) < TIMEOUT_FLOOR:
            item.add_marker(pytest.mark.timeout(TIMEOUT_FLOOR), append=False)
