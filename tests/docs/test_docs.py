"""Every ```python block in README.md and docs/*.md runs, so examples cannot rot.

The blocks of one file run in order in one namespace, in a fresh temporary
working directory, so later blocks may use names earlier ones defined: each
page runs on its own, as a reader following it would. The pages also use
file names no other page uses, so that running them one after another in
one folder (a reader trying several pages) works too. Write a block that
must not run as ```text (or any other language).
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    "path", [p for p in FILES if _blocks(p)], ids=lambda p: str(p.relative_to(ROOT))
)
def test_examples_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace = _page_namespace(path, monkeypatch)
    for number, source in enumerate(_blocks(path), 1):
        code = compile(source, f"{path.name}[block {number}]", "exec")
        exec(code, namespace)


def _page_namespace(path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """The namespace of a page's blocks: a module's, registered as a script's ``__main__`` is
    (dataclasses defined in a block look their module up in ``sys.modules``)."""
    module = types.ModuleType(f"docs_{path.stem}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module.__dict__


FILE_NAME = re.compile(r"""["']([\w.-]+\.(?:json|jsonl|db|sqlite|txt))["']""")


def test_pages_use_file_names_no_other_page_uses() -> None:
    owners: dict[str, set[str]] = {}
    for path in FILES:
        for block in _blocks(path):
            for name in FILE_NAME.findall(block):
                owners.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    shared = {name: sorted(pages) for name, pages in owners.items() if len(pages) > 1}
    assert shared == {}


def test_every_page_runs_after_every_other_in_one_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for path in (p for p in FILES if _blocks(p)):
        namespace = _page_namespace(path, monkeypatch)
        for number, source in enumerate(_blocks(path), 1):
            exec(compile(source, f"{path.name}[block {number}]", "exec"), namespace)


def test_docs_have_examples() -> None:
    assert any(_blocks(p) for p in FILES), "no runnable example found in README or docs"
