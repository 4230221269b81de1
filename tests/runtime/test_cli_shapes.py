"""``ekit graph``, ``audit``, ``replay`` and ``rewind`` on a shaped run: items, skips, mapped nodes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ekit_core import WorkflowCheckpoint
from ekit_runtime.cli import main

FLOWS = '''
from ekit_runtime import Step, Workflow


def urgent(ctx):
    return ctx["route"] == "urgent"


pipeline = Workflow([
    Step("split", lambda c: ["a", "b", "c"]),
    Step("summarize", lambda c: c["split"].upper(), ("split",), map_over="split",
         context="dependencies"),
    Step("critique", lambda c: c["summarize"] + "!", ("summarize",), map_over="summarize",
         context="dependencies"),
    Step("route", lambda c: "calm"),
    Step("escalate", lambda c: "E", ("route",), when=urgent),
    Step("merge", lambda c: "m", ("critique", "escalate"), join="any"),
])
'''


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "shaped_cli_flows.py").write_text(FLOWS, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import shaped_cli_flows  # type: ignore[import-not-found]

    saved: list[WorkflowCheckpoint] = []
    shaped_cli_flows.pipeline.run_sync(checkpoint_fn=saved.append)
    lines = "".join(json.dumps(cp.to_dict()) + "\n" for cp in saved)
    (tmp_path / "run.jsonl").write_text(lines, encoding="utf-8")
    return tmp_path


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().out


def test_a_mapped_step_is_one_node_marked_with_its_items_when_a_checkpoint_says(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run(capsys, "graph", "--workflow", "shaped_cli_flows:pipeline", "--format", "mermaid")
    assert code == 0
    assert '    s1[["summarize (map over split)"]]' in out.splitlines()
    assert "    s0 ==> s1" in out and "    s3 --> s4" in out
    assert '    s4["escalate (when urgent)"]' in out and '    s5["merge (join any)"]' in out
    code, out = run(capsys, "graph", "--checkpoint", "run.jsonl", "--format", "mermaid")
    assert '    s2[["critique (map over summarize #215;3)"]]' in out.splitlines()
    assert not re.search(r"summarize\[", out)  # items are never nodes
    code, out = run(capsys, "graph", "--checkpoint", "run.jsonl", "--format", "dot")
    assert '    n1 [label="summarize (map over split \u00d73)", peripheries=2];' in out
    assert '    n4 [label="escalate (when urgent)", style=dashed];' in out
    assert "    n0 -> n1 [style=bold];" in out
    code, out = run(capsys, "graph", "--checkpoint", "run.jsonl", "--format", "json")
    data = json.loads(out)
    assert data["items"] == {"summarize": 3, "critique": 3}
    assert data["steps"][1]["shape"] == {"map_over": "split"}


def test_audit_and_replay_of_a_shaped_run_are_clean_from_the_recorded_graph_or_a_graph_file(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run(capsys, "audit", "run.jsonl")
    assert code == 0, out
    assert re.search(r"escalate\s+skip\s+-\s+skipped: condition urgent was false", out)
    assert re.search(r"summarize\[2\]\s+skip\s+-\s+output recorded", out)
    assert run(capsys, "replay", "run.jsonl")[0] == 0
    _, graph = run(capsys, "graph", "--workflow", "shaped_cli_flows:pipeline")
    (run_dir / "graph.json").write_text(graph, encoding="utf-8")
    code, out = run(capsys, "audit", "run.jsonl", "--graph", "graph.json", "--json")
    assert code == 0 and json.loads(out)["clean"] is True
    # The graph a checkpoint records, shapes included, read as a graph file.
    last = run_dir / "run.jsonl"
    (run_dir / "last.json").write_text(last.read_text().splitlines()[-1], encoding="utf-8")
    assert run(capsys, "audit", "run.jsonl", "--graph", "last.json")[0] == 0


def test_rewinding_one_item_writes_a_checkpoint_that_runs_that_item_again(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run(capsys, "rewind", "run.jsonl", "--step", "summarize[1]",
                    "--graph-from-checkpoint", "-o", "rewound.json")
    assert code == 0
    assert "without 5 output(s) (summarize[1], summarize, critique[1], critique, merge)" in out
    code, out = run(capsys, "audit", "rewound.json", "--workflow", "shaped_cli_flows:pipeline",
                    "--json")
    data = json.loads(out)
    assert data["clean"] and data["run"] == ["summarize[1]", "summarize", "critique[1]", "critique",
                                             "merge"]
    code, out = run(capsys, "rewind", "run.jsonl", "--step", "route", "--graph-from-checkpoint",
                    "-o", "rerouted.json")
    assert "and 1 skip(s) (escalate)" in out
