"""Moved to :mod:`ekit_runtime.cli.cache`: this name is that module (kept so that old imports work)."""

import sys

from ekit_runtime.cli import cache as _moved

sys.modules[__name__] = _moved
