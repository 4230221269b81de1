"""``ekit queue`` and ``ekit worker`` as a new user meets them: help text, durations, Ctrl-C.

Every option says what it takes; ``prune --older-than`` reads the durations
people write (``1d``, ``15m``, ``1h30m``) and refuses the rest with the forms
it accepts; a worker stopped by a Ctrl-C gives its runs back and exits 130,
as any command a person interrupts, while a SIGTERM still exits 0.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ekit_runtime.cli import EXIT_INTERRUPTED, EXIT_USAGE, main
from ekit_runtime.durations import UNITS, parse_duration
from ekit_runtime.queue import STATUSES, open_queue

ROOT = Path(__file__).resolve().parents[2]


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main([*argv, "--help"]) == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width


@pytest.mark.parametrize(
    ("argv", "texts"),
    [
        (
            ["queue", "--queue", "q.db", "submit"],
            [
                "--context JSON the run's initial context, a JSON object",
                "--run-id ID the run's id (default: a new random one)",
                "a retried submit never queues a run twice",
                "--priority N workers claim runs of higher N first, then the oldest (default 0",
            ],
        ),
        (["queue", "--queue", "q.db", "list"], ["only the runs in this status (default: every run)"]),
        (
            ["queue", "--queue", "q.db", "prune"],
            ["--older-than AGE delete the finished, failed and cancelled runs not updated for AGE",
             "seconds (90) or a duration such as 90s, 15m, 2h, 1d, 1w or 1h30m"],
        ),
        (["queue", "--queue", "q.db", "limits"], ["--max-in-flight N at most N runs holding a live lease"]),
        (["queue"], ["--queue URL sqlite:///PATH, a file path, or postgresql://..."]),
        (["graph"], ["--workflow MODULE:ATTR the graph of the workflow", "--format {json,mermaid,dot} json"]),
        ([], ["130 interrupted by Ctrl-C"]),
    ],
)
def test_every_option_says_what_it_takes(
    argv: list[str], texts: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    out = _help(capsys, *argv)
    for text in texts:
        assert text in out


def test_list_status_names_the_statuses(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert "{" + ",".join(STATUSES) + "}" in _help(capsys, "queue", "--queue", "q.db", "list")
    assert main(["queue", "--queue", str(tmp_path / "q.db"), "list", "--status", "done"]) == EXIT_USAGE
    assert "invalid choice: 'done'" in capsys.readouterr().err


# -- durations -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90), ("0", 0), ("0.5", 0.5), (".5", 0.5), ("90s", 90), ("15m", 900), ("2h", 7200),
        ("1d", 86_400), ("1w", 604_800), ("1h30m", 5400), ("1w2d3h4m5s", 788_645), ("1.5h", 5400),
        (" 2H ", 7200), ("1D", 86_400), ("0s", 0),
    ],
)
def test_durations_people_write_are_read(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text",
    ["", " ", "-5", "-1h", "1y", "2mo", "1 h", "1h 30m", "30m1h", "1h1h", "h", "1h30", "1e3", "inf", "nan",
     "1,5h", "1hh", "+5", "٣", "9" * 400, "1m30m"],
)
def test_other_durations_are_refused_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match=r"is not a duration: expected seconds \(90, 0.5\) or .*1h30m"):
        parse_duration(text)


@given(st.lists(st.tuples(st.sampled_from(list(UNITS)), st.integers(0, 10_000)), min_size=1, max_size=5))
def test_parts_largest_first_add_up(parts: list[tuple[str, int]]) -> None:
    ordered = sorted(dict(parts).items(), key=lambda p: -UNITS[p[0]])  # each unit once, largest first
    text = "".join(f"{n}{unit}" for unit, n in ordered)
    assert parse_duration(text) == sum(n * UNITS[unit] for unit, n in ordered)
    if len(ordered) > 1:
        with pytest.raises(ValueError):
            parse_duration("".join(f"{n}{unit}" for unit, n in reversed(ordered)))


@given(st.text(max_size=12))
def test_any_text_is_a_duration_or_a_value_error(text: str) -> None:
    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        assert "is not a duration" in str(exc)
    else:
        assert seconds >= 0 and seconds != float("inf")


def test_prune_takes_a_duration_and_refuses_others_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = str(tmp_path / "q.db")
    queue = open_queue(url)
    old, fresh = queue.submit("flow", run_id="old"), queue.submit("flow", run_id="fresh")
    for run in (old, fresh):
        queue.cancel(run)
    # Backdate one run's last update by two days (the SQLite queue's own column).
    queue.conn.execute(  # type: ignore[attr-defined]
        "UPDATE ekit_queue_runs SET updated_at = ? WHERE run_id = ?", (time.time() - 2 * 86_400, old)
    )
    queue.close()
    assert main(["queue", "--queue", url, "prune", "--older-than", "1d"]) == 0
    assert json.loads(capsys.readouterr().out) == {"deleted": 1}
    assert [r.run_id for r in open_queue(url).runs()] == ["fresh"]
    assert main(["queue", "--queue", url, "prune", "--older-than", "1y"]) == EXIT_USAGE
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("ekit:")]
    assert lines == [
        "ekit: queue prune: argument --older-than: '1y' is not a duration: expected seconds (90, 0.5) "
        "or a number and a unit, largest first: 90s, 15m, 2h, 1d, 1w, 1h30m"
    ]
    assert "invalid float value" not in err


# -- Ctrl-C --------------------------------------------------------------------------

FLOWS = """
import asyncio, os
from ekit_runtime import Step, Workflow


def first(ctx):
    return "first"


async def waits(ctx):  # an LLM call that takes its time; cancellable, as async steps are
    os.write(2, b"test: the step is running\\n")
    await asyncio.Event().wait()


WORKFLOWS = {"slow": Workflow([Step("first", first), Step("waits", waits, ("first",))])}
"""


def _worker(tmp_path: Path, url: str) -> subprocess.Popen[str]:
    (tmp_path / "flows.py").write_text(FLOWS)
    return subprocess.Popen(
        [sys.executable, "-m", "ekit_runtime", "worker", "--queue", url, "--workflows", "flows:WORKFLOWS"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _read_until(proc: subprocess.Popen[str], marker: str) -> list[str]:
    assert proc.stderr is not None
    lines: list[str] = []
    while not lines or marker not in lines[-1]:
        line = proc.stderr.readline()
        assert line, f"the worker exited before {marker!r}:\n{''.join(lines)}"
        lines.append(line)
    return lines


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, EXIT_INTERRUPTED), (signal.SIGTERM, 0)])
def test_a_worker_stopped_by_ctrl_c_gives_its_run_back_and_exits_130(
    tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    url = str(tmp_path / "q.db")
    queue = open_queue(url)
    run = queue.submit("slow", run_id="slow")
    proc = _worker(tmp_path, url)
    try:
        _read_until(proc, "test: the step is running")
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert "ekit worker: stopping, giving the runs in flight back" in err
    assert json.loads(out.splitlines()[-1])["runs"] == {"released": 1}
    assert queue.status(run).status == "queued"  # back in the queue for any worker, at once
    checkpoint = queue.checkpoint(run)
    assert checkpoint is not None and dict(checkpoint.outputs) == {"first": "first"}
    queue.close()
