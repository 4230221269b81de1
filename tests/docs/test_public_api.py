"""The public surface: sorted ``__all__``, and errors that name the module users import."""

from __future__ import annotations

import importlib

import pytest

import ekit_core
import ekit_runtime
import ekit_runtime.stores


@pytest.mark.parametrize("package", [ekit_core, ekit_runtime, ekit_runtime.stores])
def test_all_is_sorted_and_every_name_resolves(package: object) -> None:
    names = list(package.__all__)  # type: ignore[attr-defined]
    assert names == sorted(names)
    for name in names:
        assert getattr(package, name) is not None


@pytest.mark.parametrize("package", [ekit_core, ekit_runtime, ekit_runtime.stores])
def test_exceptions_show_a_public_module_in_tracebacks(package: object) -> None:
    for name in package.__all__:  # type: ignore[attr-defined]
        if name in ("DaskExecutor", "WorkerLostError", "PostgresStore"):
            continue  # optional extras, loaded on demand
        obj = getattr(package, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            module = importlib.import_module(obj.__module__)
            assert not obj.__module__.split(".")[-1].startswith("_"), (name, obj.__module__)
            assert getattr(module, name) is obj  # importable from where the traceback says
