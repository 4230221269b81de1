"""The construction trick (a twin class, then ``__class__`` assigned) is played only where ``_frozen`` says.

That ground-floor module says what the trick is and why, offers ``twin``
alone, and lists every value built that way with its constructor, which
lives beside the value's class. No other core function assigns
``__class__``, no core module makes a class any other way, and the
runtime reaches the fast constructors only through public names. The
values built that way equal, and are as immutable as, the ordinary ones.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

import ekit_core
from ekit_core import (
    Batch,
    GraphSpec,
    Start,
    TokenUsage,
    WorkflowCheckpoint,
    _frozen,
    checkpoint_of,
    initial_state,
    results,
)
from ekit_core.checkpoint import FailureRecord
from ekit_core.ledger import Ledger

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "ekit_core"
THE_MODULE = CORE / "_frozen.py"
BUILT_FAST = {"State", "WorkflowCheckpoint", "Succeeded", "Start", "Batch", "CheckpointDelta", "ItemRef",
              "RunSpec", "Expansion", "GraphSpec"}


def trick_sites(source: str) -> list[str]:
    """Where ``source`` plays the trick: assigns ``__class__``, or makes or names a twin class."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in ast.walk(target)]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        if any(isinstance(t, ast.Attribute) and t.attr == "__class__" for t in targets):
            found.append(f"{line}: assigns __class__")
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("setattr", "__setattr__") and any(
                isinstance(a, ast.Constant) and a.value == "__class__" for a in node.args
            ):
                found.append(f"{line}: sets __class__ through {name}")
            if name == "type" and len(node.args) == 3:
                found.append(f"{line}: makes a class with type(name, bases, namespace)")
        named = getattr(node, "name", None) or getattr(node, "id", None)
        if isinstance(named, str) and any(word in named.lower() for word in ("twin", "draft")):
            found.append(f"{line}: names a twin ({named})")
    return sorted(set(found))


def _listed() -> dict[str, tuple[str, str]]:
    """Each value ``_frozen``'s docstring lists: class -> (module, constructor)."""
    doc = ast.get_docstring(ast.parse(THE_MODULE.read_text(encoding="utf-8"))) or ""
    pairs = re.findall(r":class:`~ekit_core\.(?:\w+\.)?(\w+)`,\s+by\s+:func:`ekit_core\.(\w+)\.(\w+)`", doc)
    return {cls: (module, function) for cls, module, function in pairs}


def _twinned(tree: ast.Module) -> set[str]:
    """The classes a module makes twins of, through ``twin(Class)``."""
    return {
        node.args[0].id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "twin"
        and node.args and isinstance(node.args[0], ast.Name)
    }


def _builders(tree: ast.Module) -> dict[str, set[str]]:
    """The module-level functions that assign ``__class__``, and the names they assign."""
    found: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Assign) and any(
                    isinstance(t, ast.Attribute) and t.attr == "__class__" for t in inner.targets
                ):
                    value = inner.value
                    found.setdefault(node.name, set()).add(
                        value.id if isinstance(value, ast.Name) else ast.unparse(value))
    return found


def test_the_frozen_module_is_ground_floor_and_says_why() -> None:
    tree = ast.parse(THE_MODULE.read_text(encoding="utf-8"))
    imported = [
        node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    ] + [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert not [name for name in imported if name.startswith("ekit_core")]
    doc = ast.get_docstring(tree) or ""
    for reason in ("__class__", "instructions", "exec"):
        assert reason in doc


def test_the_trick_is_played_only_by_the_listed_constructors_on_their_own_twins() -> None:
    listed = _listed()
    assert set(listed) == BUILT_FAST
    seen_twins: set[str] = set()
    seen_builders: set[tuple[str, str]] = set()
    offenders: dict[str, list[str]] = {}
    for path in sorted(CORE.rglob("*.py")):
        if path == THE_MODULE:
            continue
        module = path.stem
        tree = ast.parse(path.read_text(encoding="utf-8"))
        twinned = _twinned(tree)
        seen_twins |= twinned
        allowed = {function for _, (mod, function) in listed.items() if mod == module}
        builders = _builders(tree)
        for function, classes in builders.items():
            seen_builders.add((module, function))
            if function not in allowed or not classes <= twinned | {"kind"}:
                offenders.setdefault(module, []).append(f"{function} assigns {sorted(classes)}")
        for site in trick_sites(path.read_text(encoding="utf-8")):
            if "makes a class" in site or "through" in site:
                offenders.setdefault(module, []).append(site)
        for cls in twinned:
            if listed.get(cls, ("",))[0] != module:
                offenders.setdefault(module, []).append(f"twins {cls}, not listed for this module")
    assert offenders == {}
    assert seen_twins == BUILT_FAST
    assert seen_builders == set(listed.values())


def test_the_frozen_module_makes_the_twins() -> None:
    assert trick_sites(THE_MODULE.read_text(encoding="utf-8")), "the scan no longer sees the trick"
    assert _frozen.__all__ == ["twin"]


@pytest.mark.parametrize("planted", [
    "value.__class__ = State\n",
    "a, b.__class__ = 1, State\n",
    "object.__setattr__(value, '__class__', State)\n",
    "setattr(value, '__class__', State)\n",
    "_StateTwin = type('_StateTwin', (), {'__slots__': ('spec',)})\n",
    "class _StateDraft:\n    __slots__ = ('spec',)\n",
    "def twin(frozen): ...\n",
])
def test_the_scan_finds_a_planted_trick(planted: str) -> None:
    assert trick_sites("from ekit_core.state import State\n" + planted)


def test_the_scan_leaves_ordinary_code_alone() -> None:
    assert trick_sites("x = type(value)\nname = value.__class__.__name__\nw = object.__new__(Run)\n") == []


def test_a_constructor_the_list_leaves_out_is_found() -> None:
    source = "def sneaky():\n    value = _StartTwin()\n    value.__class__ = Start\n"
    assert _builders(ast.parse(source)) == {"sneaky": {"Start"}}
    assert "sneaky" not in {function for _, function in _listed().values()}


def test_the_runtime_imports_no_private_core_module() -> None:
    offenders = []
    for path in sorted((ROOT / "ekit_runtime").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "ekit_core" and any(p.startswith("_") for p in parts[1:2]):
                    offenders.append(f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)} {name}")
    assert offenders == []


# -- the values built fast are the ordinary values -------------------------------------------------


def _same_value(fast: object, ordinary: object) -> None:
    assert type(fast) is type(ordinary)
    assert fast == ordinary and hash(fast) == hash(ordinary)
    fields = dataclasses.fields(ordinary)  # type: ignore[arg-type]
    for f in fields:
        assert getattr(fast, f.name) == getattr(ordinary, f.name), f.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(fast, fields[0].name, None)


def test_a_fast_batch_and_start_are_the_ordinary_values() -> None:
    start = results.first_start("s")
    _same_value(start, Start("s", 1, 0.0, False))
    _same_value(results.batch((start,)), Batch((Start("s"),), ()))


def test_a_fast_state_is_the_ordinary_state() -> None:
    state = initial_state(GraphSpec.of({"a": [], "b": ["a"]}))
    started = ekit_core.apply(state, [Start("a")])  # frozen through state_of_run
    ordinary = dataclasses.replace(started)  # through State.__init__
    assert type(started) is type(ordinary) and started == ordinary
    for f in dataclasses.fields(ordinary):
        assert getattr(started, f.name) == getattr(ordinary, f.name), f.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        started.completed = 3  # type: ignore[misc]


def test_a_fast_checkpoint_is_the_ordinary_checkpoint_and_hashes_its_graph_when_read() -> None:
    usage = TokenUsage(1, 2, 1)
    outputs, step_usage = Ledger([("a", 1)]), Ledger([("a", usage)])
    context: MappingProxyType[str, Any] = MappingProxyType({"k": 0})
    failures: MappingProxyType[str, FailureRecord] = MappingProxyType({})
    versions: MappingProxyType[str, str] = MappingProxyType({})
    fast = WorkflowCheckpoint.of_ledgers(
        outputs, step_usage, step_index=1, cost=usage, context=context, failures=failures,
        graph=None, versions=versions, fingerprint="f",
    )
    ordinary = WorkflowCheckpoint(1, MappingProxyType({"a": 1}), usage, context,
                                  MappingProxyType({"a": usage}), failures, "f", None, 1, versions)
    assert type(fast) is WorkflowCheckpoint and fast == ordinary and fast.to_dict() == ordinary.to_dict()
    graph = GraphSpec.of({"a": [], "b": ["a"]})
    made = checkpoint_of(initial_state(graph))
    assert made.fingerprint == graph.fingerprint and made.graph == graph.deps
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.step_index = 3  # type: ignore[misc]


def test_a_fast_item_ref_is_the_ordinary_item_ref() -> None:
    from ekit_core.expansion import ItemRef, item_ref

    _same_value(item_ref("m", "0", "root", 0), ItemRef("m", "0", "root", 0))
    _same_value(item_ref("n", "k", "m[k]"), ItemRef("n", "k", "m[k]"))
