"""Moved to :mod:`ekit_runtime.cli.queue`: this name is that module (kept so that old imports work)."""

import sys

from ekit_runtime.cli import queue as _moved

sys.modules[__name__] = _moved
