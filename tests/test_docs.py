"""Every ```python block in README.md and docs/*.md runs, so examples cannot rot.

The blocks of one file run in order in one namespace, in a fresh temporary
working directory, so later blocks may use names earlier ones defined. Write
a block that must not run as ```text (or any other language).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    "path", [p for p in FILES if _blocks(p)], ids=lambda p: str(p.relative_to(ROOT))
)
def test_examples_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": f"docs_{path.stem}"}
    for number, source in enumerate(_blocks(path), 1):
        code = compile(source, f"{path.name}[block {number}]", "exec")
        exec(code, namespace)


def test_docs_have_examples() -> None:
    assert any(_blocks(p) for p in FILES), "no runnable example found in README or docs"
