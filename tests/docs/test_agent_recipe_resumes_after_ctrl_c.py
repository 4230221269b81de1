"""The tool-calling agent recipe (docs/recipes.md), stopped by a real Ctrl-C in the middle of
turn k and resumed from its checkpoint file: it ends as an uninterrupted run does, and the
model is paid once per turn; only the call cut off by the Ctrl-C (never answered) is made again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import JsonFileStore, WorkflowCheckpoint
from tests.support.agent_recipe import drive, recipe_namespace

CHILD = Path(__file__).parents[1] / "support" / "agent_recipe_child.py"
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
TURNS = 4  # the stand-in answers at its fourth turn
PERSON = "Oslo"
QUESTION = "asked agent#3: Paris or Oslo?"


@dataclass
class Calls:
    """What the stand-in saw: each call's turn, the calls it answered by turn, and when the
    call it holds arrived (released by the test)."""

    requested: list[int] = field(default_factory=list)
    answered: Counter[int] = field(default_factory=Counter)
    arrived: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)


def _stand_in(page: dict[str, Any], cut_off_turn: int) -> tuple[Calls, Any]:
    """The recipe's stand-in, holding the first call of ``cut_off_turn`` unanswered until
    released: the child is then in the middle of that turn."""
    calls = Calls()
    recipe_stand_in: Any = page["ModelStandIn"]

    class Holding(recipe_stand_in):  # type: ignore[misc]
        answered = calls.answered

        def answer(self, turn: int, reply: dict[str, Any]) -> None:
            calls.requested.append(turn)
            if turn == cut_off_turn and not calls.arrived.is_set():
                calls.arrived.set()
                calls.released.wait(60)  # a deadlock detector: the test releases it
                return  # never answered: the connection closes with no reply
            super().answer(turn, reply)

    server, _ = page["serve"](Holding)
    return calls, server


def _child(checkpoint: Path, server: Any) -> subprocess.Popen[str]:
    url = f"http://127.0.0.1:{server.server_port}/v1"
    return subprocess.Popen([sys.executable, str(CHILD), str(checkpoint), url, PERSON],
                            stdout=subprocess.PIPE, text=True, env=ENV)


def _finish(child: subprocess.Popen[str]) -> list[str]:
    try:
        out, _ = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 0, out
    return out.splitlines()


def _uninterrupted(tmp_path: Path) -> str:
    page = recipe_namespace(blocks=2)
    server, client = page["serve"](page["ModelStandIn"])
    try:
        result = drive(page, client, JsonFileStore(tmp_path / "whole.json"), PERSON, print)
    finally:
        server.shutdown()
        server.server_close()
    assert page["ModelStandIn"].answered == dict.fromkeys(range(1, TURNS + 1), 1)
    return str(result.outputs["agent"])


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("k", [2, 3, 4])
def test_a_ctrl_c_in_turn_k_resumes_at_turn_k_and_pays_no_recorded_turn_again(
    tmp_path: Path, k: int
) -> None:
    page = recipe_namespace(blocks=2)
    calls, server = _stand_in(page, cut_off_turn=k)
    checkpoint = tmp_path / "agent.json"
    try:
        first = _child(checkpoint, server)
        # (A child that ends before turn k wakes the test too, which then shows its output.)
        threading.Thread(target=lambda: (first.wait(), calls.arrived.set()), daemon=True).start()
        try:
            # Turn k's model call is in flight, its reply held: the child is mid-turn.
            assert calls.arrived.wait(120), "the child never reached turn k"
            assert first.poll() is None, f"the child ended before turn {k}: {_finish(first)}"
            first.send_signal(signal.SIGINT)
            said = _finish(first)
        finally:
            calls.released.set()
        assert said[-1] == "interrupted"
        saved = WorkflowCheckpoint.from_dict(json.loads(checkpoint.read_text()))
        assert {name for name in saved.outputs if name.startswith("agent#")} == {
            f"agent#{n}" for n in range(1, k)}

        resumed = _finish(_child(checkpoint, server))
    finally:
        server.shutdown()
        server.server_close()
    assert calls.answered == dict.fromkeys(range(1, TURNS + 1), 1)  # each turn paid once
    # Run 1 called turns 1..k (k cut off), the resume k..4: no recorded turn called again.
    assert calls.requested == [*range(1, k + 1), *range(k, TURNS + 1)]
    assert [*said, *resumed].count(QUESTION) == 1  # the person is asked once
    assert resumed[-1] == "answer " + json.dumps(_uninterrupted(tmp_path))
