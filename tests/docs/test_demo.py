"""The demo: interrupted midway, resumed from its file, nothing paid twice."""

from __future__ import annotations

import errno
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ekit_core import WorkflowCheckpoint
from ekit_runtime import demo
from ekit_runtime.cli import main as cli_main
from ekit_runtime.stores import JsonFileStore

ROOT = Path(__file__).resolve().parents[2]


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


# A folder the demo cannot write in is one line naming it, exit 2, never an
# "internal error".


def _one_demo_error(err: str, *fragments: str) -> None:
    assert "Traceback" not in err and "internal error" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("ekit:")]
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def _demo_in_a_child(argv: list[str]) -> tuple[int, str]:
    """Run ``ekit demo ARGV`` in a forked child that cannot write a 0o555 folder.

    root writes through any permission bits, so a root child first becomes
    ``nobody``. Forked rather than spawned: the interpreter (which may live
    where ``nobody`` cannot read) is already loaded. Returns the exit code and
    everything the child wrote to stdout and stderr.
    """
    if os.name != "posix":
        pytest.skip("permission bits are POSIX")
    drop_to = None
    if os.geteuid() == 0:
        try:
            drop_to = pwd.getpwnam("nobody")
        except KeyError:
            pytest.skip("running as root and there is no 'nobody' user to drop to")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 70
        try:
            os.close(read_end)
            os.dup2(write_end, 1)
            os.dup2(write_end, 2)
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
            if drop_to is not None:
                os.setgroups([])
                os.setgid(drop_to.pw_gid)
                os.setuid(drop_to.pw_uid)
            code = cli_main(["demo", *argv])
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    os.close(write_end)
    with open(read_end, "rb") as pipe:
        output = pipe.read().decode("utf-8", "backslashreplace")
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), output


def test_a_read_only_dir_is_one_clear_line_and_exit_2() -> None:
    # mkdtemp (not tmp_path, whose parents are private to this user), so
    # that a child that dropped to nobody can reach the folder.
    folder = Path(tempfile.mkdtemp(prefix="ekit-demo-ro-"))
    try:
        folder.chmod(0o555)
        code, output = _demo_in_a_child(["--fast", "--dir", str(folder)])
        assert code == 2, output
        _one_demo_error(
            output, f"ekit: demo: --dir {folder}: cannot write the checkpoint file there",
            "Permission denied",
        )
        assert output.count("\n") == 1  # nothing but that line: no run started
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o755)
        shutil.rmtree(folder)


def test_a_dir_that_is_a_file_or_lies_under_one_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "notes.txt"
    afile.write_text("x")
    assert demo.main(["--fast", "--dir", str(afile)]) == 2
    _one_demo_error(capsys.readouterr().err, f"--dir {afile}: not a directory")
    assert cli_main(["demo", "--fast", "--dir", str(afile / "sub")]) == 2
    _one_demo_error(capsys.readouterr().err, f"--dir {afile / 'sub'}:", "Not a directory")
    assert afile.read_text() == "x"


def test_a_save_failing_during_the_run_names_the_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    saves: list[int] = []

    class FillsUp(JsonFileStore):
        def save(self, checkpoint: WorkflowCheckpoint) -> None:
            saves.append(1)
            # The second save holds at most five finished steps (the fetch and the
            # four summaries), so it always comes before the demo's cancel at the
            # sixth; a failing save in the same turn as that cancel is reported as
            # the cancellation, which made a later save flaky here under load.
            if len(saves) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
            super().save(checkpoint)

        __call__ = save

    monkeypatch.setattr(demo, "JsonFileStore", FillsUp)
    assert demo.main(["--fast", "--dir", str(tmp_path)]) == 2
    _one_demo_error(
        capsys.readouterr().err,
        f"ekit: demo: --dir {tmp_path}: writing {tmp_path / demo.CHECKPOINT_FILE} failed",
        os.strerror(errno.ENOSPC),
    )
