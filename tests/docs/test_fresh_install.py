"""A wheel built from this checkout, installed by name into a fresh venv, runs the demo.

What a user gets from ``pip install ekit-workflows``: the wheel is built
from the checkout as a release would build it, installed with
``--no-index --no-deps`` (the core depends on nothing, so nothing else may
be needed) into a new virtual environment in a temporary folder, and
``ekit demo`` runs there with an environment of its own: no ``PYTHONPATH``,
a working directory outside the checkout, so that only the installed copy
can be imported. No package index is asked for anything when the build
backend is installed (the ``test`` extra brings hatchling); without it, pip
fetches the backend from wherever it is configured to, as any build would.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ekit_runtime import demo

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]

# Building the wheel, creating the venv (ensurepip included) and two demo runs
# take about 15 s alone on the 2-core machine, longer with the suite around.
pytestmark = pytest.mark.timeout(120)


def _run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=100, check=False, **kwargs)  # type: ignore[call-overload]
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    isolation = [] if importlib.util.find_spec("hatchling") is None else ["--no-build-isolation"]
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", *isolation]
    _run([*pip, "-w", str(out), str(ROOT)])
    (built,) = out.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("fresh")
    _run([sys.executable, "-m", "venv", str(home / "venv")], env=_clean_env(home), cwd=home)
    bin_dir = home / "venv" / "bin"
    _run(
        [str(bin_dir / "python"), "-m", "pip", "install", "--no-index", "--no-deps", "--quiet", str(wheel)],
        env=_clean_env(home),
        cwd=home,
    )
    yield bin_dir


def _clean_env(home: Path) -> dict[str, str]:
    # Nothing of the suite's environment: no PYTHONPATH pointing at the checkout.
    return {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}


def test_the_wheel_holds_the_two_packages_under_the_distribution_name(wheel: Path) -> None:
    name = PROJECT["name"].replace("-", "_")
    assert wheel.name.startswith(f"{name}-{PROJECT['version']}-")
    with zipfile.ZipFile(wheel) as archive:
        tops = {entry.split("/")[0] for entry in archive.namelist()}
        metadata = archive.read(f"{name}-{PROJECT['version']}.dist-info/METADATA").decode()
        entry_points = archive.read(f"{name}-{PROJECT['version']}.dist-info/entry_points.txt").decode()
    assert tops == {"ekit_core", "ekit_runtime", f"{name}-{PROJECT['version']}.dist-info"}
    assert re.search(rf"^Name: {re.escape(PROJECT['name'])}$", metadata, re.M)
    assert not re.search(r"^Requires-Dist: (?!.*extra ==)", metadata, re.M)  # no runtime dependency
    assert "ekit = ekit_runtime.cli:main" in entry_points


def test_the_installed_copy_is_the_one_imported(venv: Path) -> None:
    where = _run(
        [str(venv / "python"), "-c", "import ekit_core, ekit_runtime; print(ekit_core.__file__); "
         "print(ekit_runtime.__file__)"],
        env=_clean_env(venv.parent.parent),
        cwd=venv.parent.parent,
    ).stdout.split()
    assert len(where) == 2 and all(Path(p).is_relative_to(venv.parent) for p in where), where
    version = _run([str(venv / "ekit"), "--version"], env=_clean_env(venv.parent.parent)).stdout
    assert version == f"ekit {PROJECT['version']}\n"


@pytest.mark.parametrize("command", [["ekit", "demo"], ["python", "-m", "ekit_runtime.demo"]])
def test_the_demo_runs_from_the_fresh_install(
    venv: Path, command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = venv.parent.parent
    done = _run(
        [str(venv / command[0]), *command[1:], "--fast", "--seed", "7"], env=_clean_env(home), cwd=home
    )
    # The checkout's demo, run here, gives the answer the installed one must give.
    assert demo.main(["--fast", "--seed", "7", "--dir", str(tmp_path)]) == 0
    expected = re.search(r"^final answer: .*$", capsys.readouterr().out, re.M)
    assert expected and expected.group(0).startswith("final answer: Report: why do resumable")
    assert expected.group(0) in done.stdout.splitlines(), done.stdout
    assert "outputs: 12/12 steps" in done.stdout
