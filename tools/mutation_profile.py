"""A pytest plugin for mutation runs only (``python -m tools.mutation``, docs/testing.md).

Loaded by ``[tool.mutmut] pytest_add_cli_args``; never by the ordinary suite.

- Hypothesis draws the same examples on every run (``derandomize``) and keeps no
  database, so a mutant is killed or survives the same way each time and two
  scores can be compared; it does not shrink a failing example (a mutant only
  needs to fail, and shrinking a large workflow takes longer than mutmut's
  timeout). Tests keep their own ``max_examples``.
- mutmut 3.8's call-stack bookkeeping (used only to record which function called
  which, for its cache) can fail to reset its context variable while it collects
  coverage on the store tests (``LookupError`` from ``ContextVar.reset``), which
  aborts the run before any mutant is tried. A failed reset is replaced here by
  restoring the value the token recorded; which tests cover which function is
  recorded either way.
- mutmut runs each mutant's tests by node id, but some ids are not stable
  across processes: ``ids=repr`` of an object prints its address
  (``[json-<tests.stores.test_stores.Opaque object at 0x7f...>]``), and pytest then
  refuses the whole run ("not found"), which mutmut counts as a timeout, i.e.
  killed. Parametrized ids are passed here as their test function, and the
  parameters that were not asked for (addresses ignored) are deselected.
"""

from __future__ import annotations

import re
from contextvars import Token
from typing import Any

import pytest
from hypothesis import Phase, settings

settings.register_profile(
    "ekit-mutation",
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    report_multiple_bugs=False,
)
settings.load_profile("ekit-mutation")


def _tolerate_mutmut_context_resets() -> None:
    try:
        from mutmut.core import MutmutCallStack
    except ImportError:  # an ordinary pytest run, or a mutmut without it
        return
    context_var = MutmutCallStack._ctx

    def reset(cls: Any, token: Token[Any]) -> None:
        try:
            context_var.reset(token)
        except (LookupError, ValueError, RuntimeError):
            old = token.old_value
            context_var.set((None, 0) if old is Token.MISSING else old)

    MutmutCallStack.reset = classmethod(reset)  # type: ignore[method-assign,assignment]


_tolerate_mutmut_context_resets()

_WANTED = pytest.StashKey[dict[str, set[str]]]()
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _normal(nodeid: str) -> str:
    return _ADDRESS.sub(" at 0x", nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(
    early_config: pytest.Config, parser: pytest.Parser, args: list[str]
) -> None:
    wanted: dict[str, set[str]] = {}
    rewritten: list[str] = []
    for arg in args:
        if "::" in arg and "[" in arg:
            function = arg.split("[", 1)[0]
            wanted.setdefault(function, set()).add(_normal(arg))
            if function in rewritten:
                continue
            arg = function
        rewritten.append(arg)
    args[:] = rewritten
    early_config.stash[_WANTED] = wanted


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = config.stash.get(_WANTED, {})

    def unwanted(item: pytest.Item) -> bool:
        function = item.nodeid.split("[", 1)[0]
        return function in wanted and _normal(item.nodeid) not in wanted[function]

    dropped = [item for item in items if unwanted(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not unwanted(item)]
