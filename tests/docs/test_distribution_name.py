"""The project installs as ``ekit-workflows``, and everything that tells a user what to install says so.

The name ``ekit`` on the package index belongs to an unrelated project:
``pip install 'ekit[postgres]'`` outside a checkout installs that one. The
import packages (``ekit_core``, ``ekit_runtime``) and the ``ekit`` command
keep their names.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PROJECT = PYPROJECT["project"]
TARGETS = PYPROJECT["tool"]["hatch"]["build"]["targets"]
NAME = "ekit-workflows"

# Where a user reads what to install: the README, the docs, the changelog,
# and every message or docstring of the two packages.
TEXTS = sorted(
    [
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
        *(ROOT / "docs").glob("**/*.md"),
        *(ROOT / "ekit_core").glob("**/*.py"),
        *(ROOT / "ekit_runtime").glob("**/*.py"),
    ]
)
# ``pip install`` then any options, then a requirement: quoted or not, with extras or not.
INSTALL = re.compile(r"""pip install(?:\s+-[-\w]+)*\s+['"]?([A-Za-z][\w.-]*)(?:\[([\w,\s-]+)\])?""")


def _installs() -> list[tuple[str, str, str | None]]:
    found = []
    for path in TEXTS:
        for match in INSTALL.finditer(path.read_text(encoding="utf-8")):
            found.append((str(path.relative_to(ROOT)), match.group(1), match.group(2)))
    return found


def test_the_distribution_is_named_ekit_workflows() -> None:
    assert PROJECT["name"] == NAME
    assert PROJECT["scripts"] == {"ekit": "ekit_runtime.cli:main"}
    assert TARGETS["wheel"]["packages"] == ["ekit_core", "ekit_runtime"]


def test_nothing_tells_a_user_to_install_the_old_name() -> None:
    old = re.compile(r"""pip install(?:\s+-[-\w]+)*\s+['"]?ekit(?![\w-])""")
    offenders = [
        f"{path.relative_to(ROOT)}: {m.group(0)}"
        for path in TEXTS
        for m in old.finditer(path.read_text(encoding="utf-8"))
    ]
    assert offenders == []


def test_every_install_of_the_project_names_it_and_extras_it_has() -> None:
    ours = [(where, extras) for where, name, extras in _installs() if name.startswith("ekit")]
    assert {where for where, _ in ours} >= {
        "README.md", "docs/executors.md", "docs/queue.md", "docs/stores.md", "ekit_runtime/dask.py",
        "ekit_runtime/stores/pg.py",
    }
    names = {name for _, name, _ in _installs() if name.startswith("ekit")}
    assert names == {NAME}
    extras = {e.strip() for _, x in ours if x for e in x.split(",")}
    assert extras >= {"postgres", "dask"}
    assert extras <= set(PROJECT["optional-dependencies"])


@pytest.mark.parametrize(
    "path", [".ci/run", "ekit_runtime/cli/command.py", "tests/runtime/test_cli_commands.py"]
)
def test_metadata_is_read_under_the_distribution_name(path: str) -> None:
    text = (ROOT / path).read_text(encoding="utf-8")
    asked = re.findall(r"""\b(?:version|requires|distribution|metadata)\(\s*['"]([^'"]+)['"]""", text)
    assert asked and set(asked) == {NAME}


def test_the_project_urls_point_somewhere_that_exists() -> None:
    urls = PROJECT["urls"]
    assert set(urls) >= {"Documentation", "Changelog", "Issues"}
    for label, url in urls.items():
        if re.match(r"https?://", url):
            continue
        # No public home yet: a path in the source distribution, and an anchor in it if given.
        path, _, anchor = url.partition("#")
        target = ROOT / path
        assert target.is_file(), (label, url)
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(encoding="utf-8"), re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
            assert anchor in slugs, (label, url, sorted(slugs))
        shipped = TARGETS["sdist"]["include"]
        assert path in shipped or any(path.startswith(f"{d}/") for d in shipped), (label, url)


def test_the_changelog_names_the_current_version_or_an_unreleased_one() -> None:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings, "no release heading"
    assert "Unreleased" in headings[0] or PROJECT["version"] in headings[0]
    assert NAME in text
