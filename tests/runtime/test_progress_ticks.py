"""ProgressPrinter keeps a terminal's status line alive: it ticks, shows a bar and the time left.

What users rely on: while a long step runs its time keeps growing on the
status line (the printer redraws every ``tick`` seconds on the run's loop,
with no event needed); the line shows a bar of steps done and, once a step
of this run finished, an estimate of the time left; ``NO_COLOR`` or a dumb
terminal get plain lines with no control codes; thousands of steps in
flight keep the line short.
"""

from __future__ import annotations

import asyncio
import io
from typing import Any

import pytest

from ekit_core import RunStarted, StepFinished, StepStarted, TokenUsage
from ekit_runtime import ProgressPrinter, Step, Workflow


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_long_steps_time_grows_on_each_tick() -> None:
    out, clock = io.StringIO(), Clock()
    p = ProgressPrinter(out, clock=clock, tty=True)
    p(RunStarted(total=4, recorded=0))
    p(StepStarted("summarize", 1, 0.0))
    for now in (101.0, 102.5):
        clock.now = now
        p.tick()
    frames = out.getvalue().split("\r")
    assert "summarize 1.0s" in frames[-2] and "summarize 2.5s" in frames[-1]


def test_the_bar_and_the_time_left_follow_this_runs_pace() -> None:
    clock = Clock()
    p = ProgressPrinter(io.StringIO(), clock=clock, tty=True)
    p(RunStarted(total=8, recorded=4))  # a resume: four recorded, not part of the pace
    assert p.status().startswith("[##########..........] 4/8 steps |")
    assert p.remaining() is None  # nothing of this run finished yet
    clock.now += 2.0
    p(StepFinished("s4", 1, TokenUsage(), 2.0))
    assert p.remaining() == pytest.approx(6.0)  # 2 s a step, three to go
    assert "5/8 steps, ~6.0s left" in p.status()


@pytest.mark.parametrize("env", [{"NO_COLOR": "1"}, {"TERM": "dumb"}])
def test_no_color_and_dumb_terminals_get_plain_lines(env: dict[str, str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    Workflow([Step("a", lambda ctx: 1), Step("b", lambda ctx: 2, ("a",))]).run_sync(
        trace=ProgressPrinter(out))
    text = out.getvalue()
    assert "\x1b" not in text and "\r" not in text
    assert text.splitlines()[-1].startswith("run finished: 2/2 steps")


def test_the_printer_ticks_on_the_runs_loop_while_a_step_runs() -> None:
    seen_running = asyncio.Event()

    class Terminal(io.StringIO):
        frames = 0

        def isatty(self) -> bool:
            return True

        def write(self, text: str) -> int:
            if "1 running (slow " in text:
                self.frames += 1
                if self.frames >= 3:  # redrawn with no event: the ticks
                    seen_running.set()
            return super().write(text)

    async def slow(ctx: Any) -> str:
        await asyncio.wait_for(seen_running.wait(), 10)  # (a printer that never ticks fails here)
        return "done"

    out = Terminal()
    result = Workflow([Step("slow", slow)]).run_sync(trace=ProgressPrinter(out, tick=0.01))
    assert result.outputs["slow"] == "done" and out.frames >= 3
    assert out.getvalue().rstrip().splitlines()[-1].startswith("run finished: 1/1 steps")


def test_thousands_of_steps_in_flight_keep_the_line_short() -> None:
    p = ProgressPrinter(io.StringIO(), clock=Clock(), tty=True)
    p(RunStarted(total=5000, recorded=0))
    for i in range(5000):
        p(StepStarted(f"s{i}", 1, 0.0))
    assert len(p.status()) < 160 and "5000 running (s0 0.0s, s1 0.0s, s2 0.0s, +4997)" in p.status()


def test_bad_tick_is_refused() -> None:
    for bad in (0, -1, True, "1"):
        with pytest.raises(ValueError, match="tick"):
            ProgressPrinter(tick=bad)  # type: ignore[arg-type]
