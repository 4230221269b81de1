"""``python -m benchmarks.agent_loop`` runs without LangGraph (its rows skipped with a message,
exit 0), and ekit's own figures hold: a loop keeping its last iteration stores bytes growing
linearly with its iterations, and a resume after a crash pays no answered turn again."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from benchmarks import agent_loop


def test_agent_loop_benchmark_runs_and_ekit_grows_linearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "agent_loop.json"
    assert agent_loop.main(["--sizes", "10,20,40", "--crash-at", "5", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    kept = [rows["bytes"][n]["ekit_keep_last_1"] for n in ("10", "20", "40")]
    # Linear: doubling the iterations doubles the bytes, give or take the fixed part.
    assert 1.8 < kept[1] / kept[0] < 2.2 and 1.8 < kept[2] / kept[1] < 2.2, kept
    assert rows["paid_again"]["ekit"] == [0, 1]  # no answered turn; the crashed turn's call
    if importlib.util.find_spec("langgraph") is None:
        assert "langgraph rows skipped" in capsys.readouterr().out
