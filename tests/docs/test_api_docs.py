"""Every public name is documented: in docs/api.md, and by a docstring.

A public name is one listed in ``ekit_core.__all__`` or ``ekit_runtime.__all__``.
docs/api.md documents it with an entry in that package's section: a heading
starting with the name in backquotes followed by prose, or a list item
starting with it followed by a description. A name ekit_runtime re-exports
from ekit_core may be documented in either section.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from types import ModuleType

import pytest

import ekit_core
import ekit_runtime

API = Path(__file__).resolve().parents[2] / "docs" / "api.md"
PACKAGES = (ekit_core, ekit_runtime)


def _sections() -> dict[str, str]:
    text = API.read_text(encoding="utf-8")
    parts = re.split(r"^## `?(ekit_\w+)`?\s*$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _entries(section: str) -> set[str]:
    names = set()
    for match in re.finditer(r"^#{3,4} `(\w+)[^`]*`.*\n+([^#\n].*)", section, re.M):
        if match.group(2).strip():
            names.add(match.group(1))
    for match in re.finditer(r"^- `(\w+)[^`]*`(.*)$", section, re.M):
        if len(match.group(2).strip(" :-")) > 3:
            names.add(match.group(1))
    return names


def _public() -> list[tuple[str, str]]:
    return [(p.__name__, name) for p in PACKAGES for name in p.__all__]


def test_api_md_has_a_section_per_package() -> None:
    assert set(_sections()) >= {"ekit_core", "ekit_runtime"}


@pytest.mark.parametrize(("package", "name"), _public())
def test_public_name_is_in_api_md(package: str, name: str) -> None:
    sections = _sections()
    documented = _entries(sections[package])
    obj = getattr(ekit_runtime if package == "ekit_runtime" else ekit_core, name)
    if package == "ekit_runtime" and getattr(ekit_core, name, None) is obj:
        documented |= _entries(sections["ekit_core"])
    assert name in documented, f"{package}.{name} has no entry in docs/api.md"


def _own_doc(obj: object, name: str) -> str:
    doc = inspect.getdoc(obj) or ""
    # A dataclass without a docstring gets one made of its signature.
    if inspect.isclass(obj) and doc.startswith(f"{name}("):
        return ""
    return doc.strip()


@pytest.mark.parametrize(("package", "name"), _public())
def test_public_name_has_a_docstring(package: str, name: str) -> None:
    module: ModuleType = ekit_runtime if package == "ekit_runtime" else ekit_core
    obj = getattr(module, name)
    if not (inspect.isclass(obj) or inspect.isroutine(obj)):
        # Constants and type aliases cannot carry a __doc__ of their own; their
        # api.md entry (checked above) is their documentation.
        return
    assert _own_doc(obj, name), f"{package}.{name} has no docstring"
    if inspect.isclass(obj):
        for attr, value in vars(obj).items():
            if attr.startswith("_"):
                continue
            target = value.fget if isinstance(value, property) else value
            if isinstance(target, classmethod | staticmethod):
                target = target.__func__
            if inspect.isfunction(target):
                assert (target.__doc__ or "").strip(), f"{package}.{name}.{attr} has no docstring"


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.__name__)
def test_every_module_says_what_it_owns(package: ModuleType) -> None:
    root = Path(package.__file__ or "").parent
    for path in sorted(root.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        assert re.match(r'\s*(#[^\n]*\n\s*)*[rRbBuU]?"""', source), f"{path.name} has no docstring"
