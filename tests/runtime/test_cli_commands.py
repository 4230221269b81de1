"""``ekit --version``, ``ekit graph --format``, ``ekit rewind``, changed steps and timeouts, run for real."""

from __future__ import annotations

import io
import json
import re
import runpy
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from ekit_core import WorkflowCheckpoint
from ekit_runtime import ProgressPrinter, StepTimeoutError
from tests.support.cli_runs import ekit, one_error_line

FLOWS = '''
import asyncio

from ekit_runtime import PatternResult, Step, TokenUsage, Workflow

ran = []


def make(name):
    def run(ctx):
        ran.append(name)
        return PatternResult(f"{name} done", cost=TokenUsage(12_000, 1_500, 1))
    return run


def flow(summary_version):
    return Workflow([
        Step("fetch", make("fetch")),
        Step("summarize", make("summarize"), ("fetch",), version=summary_version),
        Step("review", make("review"), ("fetch",)),
        Step("publish", make("publish"), ("summarize", "review")),
    ])


workflow = flow("1")
bumped = flow("2")

WEIRD = ['say "hi"', "a\\\\b", "two\\nlines", "x --> y", "#1; <b>", "end]", "caf\\u00e9", "tab\\tand`tick"]
weird = Workflow([Step(n, make(n), tuple(WEIRD[:i][-1:])) for i, n in enumerate(WEIRD)])


async def never(ctx):
    await asyncio.Event().wait()  # never set: only the timeout ends it


slow = Workflow([Step("quick", make("quick")), Step("slow", never, ("quick",), timeout=0.05)])
'''


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("commands")
    (d / "flows.py").write_text(FLOWS, encoding="utf-8")
    flows = runpy.run_path(str(d / "flows.py"))
    cp = flows["workflow"].run_sync().checkpoint
    (d / "final.json").write_text(json.dumps(cp.to_dict()), encoding="utf-8")
    return d


def test_version_and_description(tmp_path: Path) -> None:
    proc = ekit(tmp_path, "--version")
    assert proc.returncode == 0 and proc.stdout == f"ekit {version('ekit-workflows')}\n"
    helped = ekit(tmp_path, "--help").stdout
    for word in ("audit", "replay", "rewind", "graph", "worker", "queue", "journals", "PostgreSQL"):
        assert word in helped, word


def _mermaid_text(label: str) -> str:
    return re.sub(r"#(\d+);", lambda m: chr(int(m.group(1))), label)


def _dot_text(label: str) -> str:
    return re.sub(r"\\(.)", lambda m: m.group(1), label)


def test_graph_as_mermaid_dot_and_json_with_names_escaped(run_dir: Path) -> None:
    names = runpy.run_path(str(run_dir / "flows.py"))["WEIRD"]
    proc = ekit(run_dir, "graph", "--workflow", "flows:weird", "--format", "mermaid")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "flowchart TD"
    nodes = [re.fullmatch(r'    s(\d+)\["([^"#<>`\\]*(?:#\d+;[^"#<>`\\]*)*)"\]', line) for line in lines[1:9]]
    assert all(nodes), lines
    assert [_mermaid_text(m.group(2)) for m in nodes if m] == names
    assert lines[9:] == [f"    s{i} --> s{i + 1}" for i in range(len(names) - 1)]

    proc = ekit(run_dir, "graph", "--workflow", "flows:weird", "--format", "dot")
    lines = proc.stdout.splitlines()
    assert lines[0] == "digraph workflow {" and lines[-1] == "}"
    labels = [re.fullmatch(r'    n(\d+) \[label="((?:[^"\\\n]|\\.)*)"\];', line) for line in lines[2:10]]
    assert all(labels), lines
    shown = [_dot_text(m.group(2)) for m in labels if m]
    assert shown == [n.replace("\n", "\\x0a").replace("\t", "\\x09") for n in names]
    assert lines[10:-1] == [f"    n{i} -> n{i + 1};" for i in range(len(names) - 1)]

    data = json.loads(ekit(run_dir, "graph", "--workflow", "flows:weird", "--format", "json").stdout)
    assert [s["name"] for s in data["steps"]] == names
    one_error_line(ekit(run_dir, "graph", "--workflow", "flows:weird", "--format", "svg"), "invalid choice")


def test_a_bumped_version_is_audited_as_outdated_from_the_workflow_or_a_graph_file(run_dir: Path) -> None:
    proc = ekit(run_dir, "audit", "final.json", "--workflow", "flows:bumped")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line[:1].islower()}
    assert "run" in rows["summarize"].split()[:2]
    assert "output recorded but outdated: its version changed from '1' to '2'" in rows["summarize"]
    assert "it depends on 'summarize', which runs again" in rows["publish"]
    assert "resume skips 2 step(s), runs 2 (2 outdated)" in proc.stdout
    graph = ekit(run_dir, "graph", "--workflow", "flows:bumped")
    assert json.loads(graph.stdout)["versions"] == {"summarize": "2"}
    (run_dir / "bumped-graph.json").write_text(graph.stdout, encoding="utf-8")
    data = json.loads(ekit(run_dir, "audit", "final.json", "--graph", "bumped-graph.json", "--json").stdout)
    assert data["outdated"] == ["summarize", "publish"] and data["clean"] is True
    # The recorded graph keeps the recorded tags: nothing is outdated.
    assert json.loads(ekit(run_dir, "audit", "final.json", "--json").stdout)["outdated"] == []


def test_numbers_have_thousands_separators_and_budgets_read_them(run_dir: Path) -> None:
    out = ekit(run_dir, "audit", "final.json").stdout
    assert "usage 48,000/6,000/4" in out and "12,000/1,500/1" in out
    assert ekit(run_dir, "audit", "final.json", "--budget", "48,000/0/0").returncode == 0
    assert "48,000/6,000/4" in ekit(run_dir, "replay", "final.json").stdout


def test_rewind_writes_a_checkpoint_whose_resume_reruns_the_steps_downstream(run_dir: Path) -> None:
    proc = ekit(run_dir, "rewind", "final.json", "--step", "summarize", "--workflow", "flows:workflow",
                "-o", "rewound.json")
    assert proc.returncode == 0, proc.stderr
    assert "without 2 output(s) (summarize, publish)" in proc.stdout
    rewound = json.loads((run_dir / "rewound.json").read_text(encoding="utf-8"))
    assert sorted(rewound["outputs"]) == ["fetch", "review"] and rewound["step_index"] == 2
    flows = runpy.run_path(str(run_dir / "flows.py"))
    flows["workflow"].run_sync(resume_from=rewound)
    assert sorted(flows["ran"]) == ["publish", "summarize"]
    # The recorded graph serves as well; without -o the checkpoint goes to stdout.
    alone = ekit(run_dir, "rewind", "final.json", "--step", "summarize", "--graph-from-checkpoint")
    assert json.loads(alone.stdout) == rewound
    both = ekit(run_dir, "rewind", "final.json", "--step", "fetch", "--step", "review",
                "--graph-from-checkpoint")
    assert json.loads(both.stdout)["outputs"] == {}
    assert ekit(run_dir, "audit", "rewound.json").returncode == 0


def test_rewind_refuses_what_it_cannot_do_in_one_line(run_dir: Path, tmp_path: Path) -> None:
    one_error_line(ekit(run_dir, "rewind", "final.json", "--step", "nope", "--graph-from-checkpoint"),
                   "final.json: cannot rewind unknown step(s): 'nope'")
    one_error_line(ekit(run_dir, "rewind", "final.json", "--step", "fetch"), "one of the arguments")
    one_error_line(ekit(run_dir, "rewind", "final.json", "--graph-from-checkpoint"), "--step")
    bare = {"step_index": 1, "outputs": {"a": 1}, "cost": {"input_tokens": 0, "output_tokens": 0,
                                                           "llm_calls": 0}}
    (tmp_path / "bare.json").write_text(json.dumps(bare))
    one_error_line(ekit(tmp_path, "rewind", "bare.json", "--step", "a", "--graph-from-checkpoint"),
                   "bare.json: the checkpoint records no graph")
    one_error_line(
        ekit(run_dir, "rewind", "final.json", "--step", "fetch", "--graph-from-checkpoint",
             "-o", str(tmp_path / "missing" / "out.json")),
        "cannot write",
    )


def test_a_step_timeout_names_the_step_and_the_limit_in_audit_and_progress(run_dir: Path) -> None:
    flows = runpy.run_path(str(run_dir / "flows.py"))
    saved: list[WorkflowCheckpoint] = []
    shown = io.StringIO()
    with pytest.raises(StepTimeoutError, match=r"^step 'slow' timed out after 0\.05s"):
        flows["slow"].run_sync(checkpoint_fn=saved.append, trace=ProgressPrinter(shown, tty=False))
    assert "step 'slow' timed out after 0.05s" in shown.getvalue()
    (run_dir / "timed-out.json").write_text(json.dumps(saved[-1].to_dict()), encoding="utf-8")
    proc = ekit(run_dir, "audit", "timed-out.json")
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("slow "))
    assert row.endswith("recorded as failed once: StepTimeoutError: step 'slow' timed out after 0.05s")


def test_graph_from_any_source(run_dir: Path) -> None:
    data: Any = json.loads(ekit(run_dir, "graph", "--checkpoint", "final.json").stdout)
    assert data["versions"] == {"summarize": "1"}
    assert ekit(run_dir, "graph", "--checkpoint", "final.json", "--format", "dot").stdout.startswith(
        "digraph workflow {")
