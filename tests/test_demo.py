"""The demo: interrupted midway, resumed from its file, nothing paid twice."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ekit_core import WorkflowCheckpoint
from ekit_runtime import demo

ROOT = Path(__file__).resolve().parent.parent


def _field(text: str, label: str) -> str:
    match = re.search(rf"^{re.escape(label)}: (.*)$", text, re.M)
    assert match, f"no {label!r} line in:\n{text}"
    return match.group(1)


def _count_and_names(text: str, label: str) -> tuple[int, list[str]]:
    match = re.fullmatch(r"(\d+) \((.*)\)", _field(text, label))
    assert match
    names = [] if match.group(2) == "-" else match.group(2).split(", ")
    assert int(match.group(1)) == len(names)
    return len(names), names


def _check(text: str) -> None:
    total = len(demo.build_workflow().steps)
    _, recorded = _count_and_names(text, "recorded before the interruption")
    _, skipped = _count_and_names(text, "skipped on resume")
    _, ran = _count_and_names(text, "ran on resume")
    _, cut = _count_and_names(text, "cancelled in flight (not recorded, will run again)")
    assert recorded and sorted(skipped) == sorted(recorded)
    assert set(cut) <= set(ran)
    assert sorted(skipped + ran) == sorted(s.name for s in demo.build_workflow().steps)
    assert int(_field(text, "tokens saved by resuming")) > 0
    assert _field(text, "tokens saved by resuming") == _field(
        text, "tokens spent before the interruption"
    )
    assert _field(text, "outputs") == f"{total}/{total} steps"


@pytest.mark.parametrize("seed", [1, 7, 42])
def test_demo_skips_exactly_what_was_recorded(
    seed: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert demo.main(["--fast", "--seed", str(seed), "--dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    _check(captured.out)
    _, recorded = _count_and_names(captured.out, "recorded before the interruption")
    assert len(recorded) >= 6  # the interruption comes after 6 completions
    # Progress goes to stderr, as plain lines since it is not a terminal here.
    assert "run cancelled: " in captured.err
    assert "run finished: 12/12 steps" in captured.err
    # The file left behind is the final checkpoint of the resumed run.
    checkpoint = WorkflowCheckpoint.from_dict(
        json.loads((tmp_path / demo.CHECKPOINT_FILE).read_text(encoding="utf-8"))
    )
    assert checkpoint.step_index == 12
    assert checkpoint.context == {"question": "why do resumable workflows matter?"}


def test_stop_after_moves_the_interruption(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--fast", "--stop-after", "2", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    _check(out)
    assert _count_and_names(out, "recorded before the interruption")[0] < 6


def test_default_dir_is_temporary_and_removed(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--fast"]) == 0
    out = capsys.readouterr().out
    path = Path(_field(out, "checkpoint file"))
    assert not path.parent.exists()


def test_the_same_seed_gives_the_same_answer_and_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    demo.main(["--fast", "--seed", "3", "--dir", str(tmp_path / "one")])
    first = capsys.readouterr().out
    demo.main(["--fast", "--seed", "3", "--dir", str(tmp_path / "two")])
    second = capsys.readouterr().out
    spent = "tokens spent by the resume"
    before = "tokens spent before the interruption"
    assert int(_field(first, spent)) + int(_field(first, before)) == int(
        _field(second, spent)
    ) + int(_field(second, before))
    assert _field(first, "final answer") == _field(second, "final answer")


def test_bad_stop_after_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(["--stop-after", "0"])
    assert exc.value.code == 2
    assert "--stop-after" in capsys.readouterr().err


@pytest.mark.skipif(
    not (ROOT / "ekit_runtime" / "__main__.py").exists(), reason="the CLI is not there yet"
)
def test_python_dash_m_ekit_runtime_demo(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "error::RuntimeWarning"}
    done = subprocess.run(
        [sys.executable, "-m", "ekit_runtime", "demo", "--fast", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    _check(done.stdout)
