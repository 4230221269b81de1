"""Moved to :mod:`ekit_runtime.cli.watch`: this name is that module (kept so that old imports work)."""

import sys

from ekit_runtime.cli import watch as _moved

sys.modules[__name__] = _moved
