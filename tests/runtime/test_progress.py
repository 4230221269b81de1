"""ProgressPrinter: terminal and plain-line output, driven by a fake clock."""

from __future__ import annotations

import asyncio
import io
import re

import pytest

from ekit_core import (
    CheckpointSaved,
    RunSettled,
    RunStarted,
    StepFailed,
    StepFinished,
    StepInterrupted,
    StepRetried,
    StepSkipped,
    StepStarted,
    TokenUsage,
)
from ekit_runtime import PatternResult, ProgressPrinter, Step, Workflow


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _usage(n: int) -> TokenUsage:
    return TokenUsage(n, n // 2, 1)


def test_plain_lines_for_ci_logs() -> None:
    out, clock = io.StringIO(), FakeClock()
    p = ProgressPrinter(out, clock=clock, tty=False)
    p(RunStarted(total=3, recorded=1))
    p(StepSkipped("a"))
    p(StepStarted("b", 1, 0.0))
    p(StepStarted("c", 1, 0.0))
    clock.now += 1.5
    p(StepFinished("b", 1, _usage(100), 1.25))
    p(CheckpointSaved(2))
    p(StepRetried("c", 1, "TimeoutError", "slow", 0.5, 1.0))
    p(StepStarted("c", 2, 0.5))
    clock.now += 2.0
    p(StepFailed("c", 2, "ValueError", "bad", 0.25))
    p(RunSettled("failed", 2, 3, _usage(100)))
    assert out.getvalue().splitlines() == [
        "run started: 3 steps, 1 recorded",
        "[2/3 1.5s] done b in 1.2s, 150 tokens",
        "[2/3 1.5s] retry c after attempt 1: TimeoutError: slow (next in 0.5s)",
        "[2/3 3.5s] FAILED c on attempt 2: ValueError: bad",
        "run failed: 2/3 steps (1 skipped), 150 tokens this run, 3.5s",
    ]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_a_label_names_the_run_on_every_line_plain_and_on_a_terminal() -> None:
    plain, clock = io.StringIO(), FakeClock()
    p = ProgressPrinter(plain, clock=clock, tty=False, label="run r7")
    p(RunStarted(total=2, recorded=0))
    p(StepStarted("a", 1, 0.0))
    p(StepFinished("a", 1, _usage(10), 0.5))
    p(StepFailed("b", 1, "KeyError", "'x'", 0.1))
    p(RunSettled("failed", 1, 2, _usage(10)))
    lines = plain.getvalue().splitlines()
    assert len(lines) == 4 and all(line.startswith("run r7: ") for line in lines), lines
    assert lines[1] == "run r7: [1/2 0.0s] done a in 0.5s, 15 tokens"
    tty = io.StringIO()
    t = ProgressPrinter(tty, clock=FakeClock(), tty=True, interval=0, label="run r7")
    t(RunStarted(total=1, recorded=0))
    t(StepFailed("a", 1, "KeyError", "'x'", 0.1))
    assert tty.getvalue().startswith("\rrun r7: [....................] 0/1 steps")
    assert "\rrun r7: [0/1 0.0s] FAILED a on attempt 1: KeyError: 'x'\x1b[K\n" in tty.getvalue()


def test_tty_rewrites_one_line_and_throttles() -> None:
    out, clock = io.StringIO(), FakeClock()
    p = ProgressPrinter(out, clock=clock, tty=True, interval=0.5)
    p(RunStarted(total=4, recorded=0))
    assert out.getvalue() == "\r[....................] 0/4 steps | 0 tokens | 0.0s\x1b[K"
    for name in "abcd":
        p(StepStarted(name, 1, 0.0))
    # Four starts in the same instant: throttled, nothing redrawn.
    assert out.getvalue().count("\r") == 1
    assert p.running == ("a", "b", "c", "d")
    clock.now += 0.6
    p(StepFinished("a", 1, _usage(1000), 0.6))
    assert out.getvalue().endswith(
        "\r[#####...............] 1/4 steps, ~1.8s left | 3 running (b 0.6s, c 0.6s, d 0.6s) "
        "| 1,500 tokens | 0.6s\x1b[K"
    )
    clock.now += 0.1
    p(StepFailed("b", 1, "KeyError", "'x'", 0.7))
    # A failure is kept above the status line, which is redrawn at once.
    assert "\rFAILED" not in out.getvalue()
    assert "\r[1/4 0.7s] FAILED b on attempt 1: KeyError: 'x'\x1b[K\n" in out.getvalue()
    assert out.getvalue().endswith(
        "\r[#####...............] 1/4 steps, ~2.1s left | 2 running (c 0.7s, d 0.7s) "
        "| 1,500 tokens | 0.7s\x1b[K")
    p(StepInterrupted("c"))
    p(StepInterrupted("d"))
    p(RunSettled("failed", 1, 4, _usage(1000)))
    text = out.getvalue()
    assert text.endswith("\x1b[K\nrun failed: 1/4 steps, 1,500 tokens this run, 0.7s\n")
    assert p.running == () and p.done == 1 and p.tokens == 1500


def test_tty_shows_at_most_three_running_names() -> None:
    out = io.StringIO()
    p = ProgressPrinter(out, clock=FakeClock(), tty=True, interval=0)
    p(RunStarted(total=5, recorded=0))
    for name in "abcde":
        p(StepStarted(name, 1, 0.0))
    assert p.status() == (
        "[....................] 0/5 steps | 5 running (a 0.0s, b 0.0s, c 0.0s, +2) | 0 tokens | 0.0s")


def test_auto_detects_a_non_terminal_stream() -> None:
    out = io.StringIO()
    p = ProgressPrinter(out, clock=FakeClock())
    p(RunStarted(total=1, recorded=0))
    assert out.getvalue() == "run started: 1 steps\n"


def test_defaults_to_stderr_at_write_time(capsys: pytest.CaptureFixture[str]) -> None:
    p = ProgressPrinter(tty=False, clock=FakeClock())
    p(RunStarted(total=2, recorded=0))
    assert capsys.readouterr().err == "run started: 2 steps\n"


def test_minutes_are_shown_as_minutes() -> None:
    out, clock = io.StringIO(), FakeClock()
    p = ProgressPrinter(out, clock=clock, tty=False)
    p(RunStarted(total=1, recorded=0))
    clock.now += 125
    p(RunSettled("finished", 1, 1, TokenUsage()))
    assert out.getvalue().splitlines()[-1] == "run finished: 1/1 steps, 0 tokens this run, 2m05s"


def test_a_new_run_resets_the_counts() -> None:
    out = io.StringIO()
    p = ProgressPrinter(out, clock=FakeClock(), tty=False)
    p(RunStarted(total=1, recorded=0))
    p(StepStarted("a", 1, 0.0))
    p(StepFinished("a", 1, _usage(10), None))
    p(RunStarted(total=2, recorded=0))
    assert (p.done, p.tokens, p.total, p.running) == (0, 0, 2, ())


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"clock": 3}, "clock"),
        ({"tty": "yes"}, "tty"),
        ({"interval": -1}, "interval"),
        ({"label": 7}, "label"),
    ],
)
def test_bad_arguments_name_themselves(kwargs: dict[str, object], argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        ProgressPrinter(io.StringIO(), **kwargs)  # type: ignore[arg-type]


def test_with_a_real_run() -> None:
    out = io.StringIO()

    async def step(context: dict[str, object]) -> PatternResult[str]:
        await asyncio.sleep(0)
        return PatternResult("x", cost=TokenUsage(10, 5, 1))

    wf = Workflow([Step("a", step), Step("b", step, depends_on=("a",))])
    result = wf.run_sync(trace=ProgressPrinter(out, tty=False))
    assert set(result.outputs) == {"a", "b"}
    lines = out.getvalue().splitlines()
    assert lines[0] == "run started: 2 steps"
    assert re.fullmatch(r"\[1/2 \d+\.\ds\] done a in \d+\.\ds, 15 tokens", lines[1])
    assert re.fullmatch(r"\[2/2 \d+\.\ds\] done b in \d+\.\ds, 15 tokens", lines[2])
    assert re.fullmatch(r"run finished: 2/2 steps, 30 tokens this run, \d+\.\ds", lines[3])
