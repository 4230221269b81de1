"""The ``ekit`` command, run for real in a subprocess against files a real run wrote."""

from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from ekit_core import WorkflowCheckpoint
from ekit_runtime.cli import main
from tests.support.cli_runs import ekit, one_error_line

FLOWS = '''
from ekit_runtime import PatternResult, Step, TokenUsage, Workflow


def make(name):
    def run(ctx):
        if name == "publish" and ctx.get("publisher_down"):
            raise RuntimeError("publisher down")
        return PatternResult(f"{name} done", cost=TokenUsage(100, 20, 1))
    return run


workflow = Workflow([
    Step("fetch", make("fetch")),
    Step("summarize", make("summarize"), ("fetch",)),
    Step("review", make("review"), ("fetch",)),
    Step("publish", make("publish"), ("summarize", "review")),
])
other = Workflow([
    Step("fetch", make("fetch")),
    Step("summarize", make("summarize"), ("fetch",)),
    Step("translate", make("translate"), ("summarize",)),
])
graph_only = workflow.graph
not_a_workflow = 42
'''


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding flows.py and the checkpoints of a failed run and its resume."""
    d = tmp_path_factory.mktemp("cli")
    (d / "flows.py").write_text(FLOWS, encoding="utf-8")
    workflow = runpy.run_path(str(d / "flows.py"))["workflow"]
    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(RuntimeError, match="publisher down"):
        workflow.run_sync({"publisher_down": True}, checkpoint_fn=saved.append)
    (d / "first.json").write_text(json.dumps(saved[0].to_dict()), encoding="utf-8")
    (d / "failed.json").write_text(json.dumps(saved[-1].to_dict()), encoding="utf-8")
    workflow.run_sync({"publisher_down": False}, checkpoint_fn=saved.append, resume_from=saved[-1])
    (d / "final.json").write_text(json.dumps(saved[-1].to_dict()), encoding="utf-8")
    (d / "run.jsonl").write_text(
        "".join(json.dumps(cp.to_dict()) + "\n" for cp in saved), encoding="utf-8"
    )
    return d


def ekit_patched(cwd: Path, patch: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``main(args)`` in a fresh interpreter after ``patch`` (code given ``cli``)."""
    code = (
        "import sys\nimport ekit_runtime.cli.command as cli\n"
        f"{patch}\nraise SystemExit(cli.main({list(args)!r}))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=60
    )


ZERO = {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0}


def test_graph_prints_the_workflow_graph_as_json(run_dir: Path) -> None:
    proc = ekit(run_dir, "graph", "--workflow", "flows:workflow")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [s["name"] for s in data["steps"]] == ["fetch", "summarize", "review", "publish"]
    assert data["fingerprint"] == json.loads((run_dir / "final.json").read_text())["fingerprint"]
    (run_dir / "graph.json").write_text(proc.stdout, encoding="utf-8")
    from_cp = ekit(run_dir, "graph", "--checkpoint", "final.json")
    assert json.loads(from_cp.stdout) == data


def test_audit_of_a_failed_run_explains_each_step(run_dir: Path) -> None:
    proc = ekit(run_dir, "audit", "failed.json", "--workflow", "flows:workflow")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "graph given by the caller" in out
    assert "resume skips 3 step(s), runs 1" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line[:1].islower()}
    assert "skip" in rows["fetch"] and "100/20/1" in rows["fetch"]
    assert "run" in rows["publish"]
    assert "recorded as failed once: RuntimeError: publisher down" in rows["publish"]
    assert "no anomalies" in out


def test_audit_without_a_graph_uses_the_recorded_one_and_says_so(run_dir: Path) -> None:
    proc = ekit(run_dir, "audit", "first.json")
    assert proc.returncode == 0, proc.stderr
    assert "graph recorded in the checkpoint" in proc.stdout
    assert "waiting on summarize, review" in proc.stdout


def test_audit_json_and_graph_file(run_dir: Path) -> None:
    graph = ekit(run_dir, "graph", "--workflow", "flows:graph_only")
    (run_dir / "graph2.json").write_text(graph.stdout, encoding="utf-8")
    proc = ekit(run_dir, "audit", "failed.json", "--graph", "graph2.json", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["checkpoint"] == "failed.json" and data["clean"] is True
    assert data["skip"] == ["fetch", "summarize", "review"] and data["run"] == ["publish"]
    publish = data["steps"][3]
    assert publish["reason"] == "failed" and publish["failure"]["error_type"] == "RuntimeError"


def test_audit_against_another_graph_finds_anomalies(run_dir: Path) -> None:
    proc = ekit(run_dir, "audit", "final.json", "--workflow", "flows:other")
    assert proc.returncode == 1, proc.stderr
    assert "fingerprint_mismatch" in proc.stdout
    assert "added: 'translate'" in proc.stdout
    assert "removed: 'review', 'publish'" in proc.stdout
    assert "unknown_output" in proc.stdout


def test_audit_of_a_tampered_checkpoint_exits_1(run_dir: Path, tmp_path: Path) -> None:
    data = json.loads((run_dir / "failed.json").read_text())
    del data["outputs"]["fetch"]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    proc = ekit(tmp_path, "audit", "bad.json")
    assert proc.returncode == 1
    assert "missing_dependency" in proc.stdout and "'fetch'" in proc.stdout


def test_replay_of_the_real_run_is_clean(run_dir: Path) -> None:
    proc = ekit(run_dir, "replay", "run.jsonl", "--workflow", "flows:workflow")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no violations" in proc.stdout
    assert "failed: publish" in proc.stdout
    data = json.loads(ekit(run_dir, "replay", "run.jsonl", "--json").stdout)
    assert data["ok"] is True and data["graph_source"] == "checkpoint"
    finished = [name for entry in data["timeline"] for name in entry["finished"]]
    assert sorted(finished) == ["fetch", "publish", "review", "summarize"]


def test_replay_reports_tampering_by_checkpoint_and_step(run_dir: Path, tmp_path: Path) -> None:
    lines = (run_dir / "run.jsonl").read_text().splitlines()
    cps = [json.loads(line) for line in lines]
    last = len(cps) - 1
    cps[last]["outputs"]["fetch"] = "forged"
    (tmp_path / "bad.jsonl").write_text("\n".join(json.dumps(cp) for cp in cps) + "\n")
    proc = ekit(tmp_path, "replay", "bad.jsonl")
    assert proc.returncode == 1
    assert f"checkpoint {last}: output_changed: output of 'fetch'" in proc.stdout


def test_console_script(run_dir: Path) -> None:
    script = Path(sys.executable).with_name("ekit")
    found = str(script) if script.exists() else shutil.which("ekit")
    if found is None:
        pytest.skip("the ekit console script is not installed next to this Python")
    proc = subprocess.run(
        [found, "audit", "final.json", "--workflow", "flows:workflow"],
        cwd=run_dir, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "resume skips 4 step(s), runs 0" in proc.stdout


@pytest.mark.parametrize(
    ("content", "fragments"),
    [
        (None, ["nope.json", "no such file"]),
        ("{not json", ["bad.json", "invalid JSON at line 1 column 2"]),
        ('{"step_index": 0, "outputs": [], "cost": {}}', ["bad.json", "'outputs'", "must be"]),
        ('{"outputs": {}, "cost": {}}', ["bad.json", "'step_index'", "missing"]),
        ("[1, 2]", ["bad.json", "must be a dict"]),
        (
            '{"format_version": 99, "step_index": 0, "outputs": {}, "cost": {}}',
            ["bad.json", "version 99", "newer ekit"],
        ),
        (
            '{"step_index": 0, "outputs": {}, '
            '"cost": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0}}',
            ["bad.json", "records no graph", "--workflow"],
        ),
        # Valid JSON syntax, but past the int digit limit: json raises a plain ValueError.
        ('{"step_index": ' + "1" * 5000 + "}", ["bad.json", "unreadable JSON", "4300 digits"]),
        ("\ufeff{}", ["bad.json", "invalid JSON", "BOM"]),
    ],
)
def test_audit_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, content: str | None, fragments: list[str]
) -> None:
    name = "nope.json" if content is None else "bad.json"
    if content is not None:
        (tmp_path / name).write_text(content)
    one_error_line(ekit(tmp_path, "audit", name), *fragments)


def test_replay_bad_lines_name_the_line(run_dir: Path, tmp_path: Path) -> None:
    good = (run_dir / "run.jsonl").read_text().splitlines()[0]
    (tmp_path / "bad.jsonl").write_text(good + "\n\n{oops\n")
    one_error_line(ekit(tmp_path, "replay", "bad.jsonl"), "bad.jsonl line 3", "invalid JSON")
    (tmp_path / "bad2.jsonl").write_text(good + '\n{"step_index": -1, "outputs": {}, "cost": {}}\n')
    one_error_line(ekit(tmp_path, "replay", "bad2.jsonl"), "bad2.jsonl line 2", "step_index")
    (tmp_path / "empty.jsonl").write_text("\n")
    one_error_line(ekit(tmp_path, "replay", "empty.jsonl"), "empty.jsonl", "no checkpoint")
    (tmp_path / "big.jsonl").write_text(good + '\n{"step_index": ' + "7" * 4301 + "}\n")
    one_error_line(
        ekit(tmp_path, "replay", "big.jsonl"), "big.jsonl line 2", "unreadable JSON", "4301 digits"
    )
    # A field named after a step whose name holds ": " comes through whole.
    colon = {
        "step_index": 0, "outputs": {}, "cost": ZERO,
        "failures": {"fetch: v2": {"error_type": "E", "message": "m", "attempts": 0}},
    }
    (tmp_path / "colon.jsonl").write_text(good + "\n" + json.dumps(colon) + "\n")
    one_error_line(
        ekit(tmp_path, "replay", "colon.jsonl"),
        "colon.jsonl line 2", "'failures.fetch: v2.attempts': must be at least 1",
    )


# Characters str.splitlines() breaks at but JSON allows raw inside a string
# (it also breaks at \x0b, \x0c and \x1c-\x1e, which JSON requires escaped).
LINE_BREAKS = "\u2028\u2029\x85"


def test_replay_splits_lines_on_newline_only(tmp_path: Path) -> None:
    cps = [
        {"step_index": 0, "outputs": {}, "cost": ZERO, "graph": {"a": [], "b": ["a"]}},
        {
            "step_index": 1, "outputs": {"a": f"x{LINE_BREAKS}y"}, "cost": ZERO,
            "graph": {"a": [], "b": ["a"]},
        },
    ]
    # As the stores write them (ensure_ascii=False), with CRLF line ends.
    lines = [json.dumps(cp, ensure_ascii=False) for cp in cps]
    assert all(ch in lines[1] for ch in LINE_BREAKS)
    (tmp_path / "run.jsonl").write_bytes("\r\n".join(lines).encode() + b"\r\n")
    proc = ekit(tmp_path, "replay", "run.jsonl", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["ok"] is True and len(data["timeline"]) == 2
    # An error after such a line is reported on its real line number.
    (tmp_path / "bad.jsonl").write_bytes(
        "\r\n".join([*lines, "", "{oops"]).encode() + b"\r\n"
    )
    one_error_line(
        ekit(tmp_path, "replay", "bad.jsonl"), "bad.jsonl line 4", "invalid JSON at line 1 column 2"
    )


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("flows", "expected MODULE:ATTR"),
        ("nosuchmodule:workflow", "no module named 'nosuchmodule'"),
        ("flows:missing", "has no attribute 'missing'"),
        ("flows:not_a_workflow", "'not_a_workflow': graph must be a GraphSpec"),
    ],
)
def test_bad_workflow_option_is_exit_2(run_dir: Path, spec: str, fragment: str) -> None:
    one_error_line(ekit(run_dir, "audit", "final.json", "--workflow", spec), fragment)


HOSTILE = '''
from ekit_runtime import Workflow


class Raising:
    @property
    def graph(self):
        raise RuntimeError("no graph\\nfor you")


class Holder:
    @property
    def flow(self):
        raise RuntimeError("property failed")


raising = Raising()
holder = Holder()


def __getattr__(name):
    raise KeyError(name)
'''


@pytest.mark.parametrize(
    ("module", "spec", "fragments"),
    [
        ("import sys\nsys.exit(0)\n", "exits:workflow", ["importing 'exits'", "sys.exit(0)"]),
        ("raise SystemExit\n", "exits:workflow", ["importing 'exits'", "sys.exit(None)"]),
        ("raise ValueError('bad\\nconfig')\n", "exits:w", ["raised ValueError: bad config"]),
        (HOSTILE, "hostile:missing", ["reading 'missing' raised KeyError: 'missing'"]),
        (HOSTILE, "hostile:holder.flow", ["reading 'holder.flow' raised RuntimeError"]),
        (HOSTILE, "hostile:raising", ["reading raising.graph raised RuntimeError: no graph for"]),
    ],
)
def test_a_workflow_module_that_exits_or_raises_is_exit_2(
    run_dir: Path, tmp_path: Path, module: str, spec: str, fragments: list[str]
) -> None:
    (tmp_path / f"{spec.partition(':')[0]}.py").write_text(module, encoding="utf-8")
    shutil.copy(run_dir / "final.json", tmp_path / "final.json")
    proc = ekit(tmp_path, "audit", "final.json", "--workflow", spec)
    one_error_line(proc, f"--workflow {spec}", *fragments)
    assert proc.stdout == ""


def _surrogate_checkpoint() -> str:
    # json.dumps writes a lone surrogate as the escape "\\ud800", which
    # json.loads turns back into the lone surrogate.
    graph = {"caf\u00e9": [], "\ud800": ["caf\u00e9"]}
    cp = {"step_index": 1, "outputs": {"caf\u00e9": 1, "\ud800": 2}, "cost": ZERO, "graph": graph}
    text = json.dumps(cp)
    assert "\\ud800" in text
    return text


def test_unencodable_names_are_escaped_not_a_crash(tmp_path: Path) -> None:
    text = _surrogate_checkpoint()
    (tmp_path / "cp.json").write_text(text)
    (tmp_path / "run.jsonl").write_text(text + "\n")
    proc = ekit(tmp_path, "audit", "cp.json")
    assert proc.returncode == 0, proc.stderr
    assert "\\ud800" in proc.stdout and "caf\u00e9" in proc.stdout and "no anomalies" in proc.stdout
    proc = ekit(tmp_path, "replay", "run.jsonl")
    assert proc.returncode == 0, proc.stderr
    assert "\\ud800" in proc.stdout and "no violations" in proc.stdout
    # A locale that cannot encode the names: escaped, not a crash.
    proc = ekit(tmp_path, "audit", "cp.json", env={"PYTHONIOENCODING": "ascii"})
    assert proc.returncode == 0, proc.stderr
    assert "caf\\xe9" in proc.stdout and "\\ud800" in proc.stdout
    data = json.loads(ekit(tmp_path, "audit", "cp.json", "--json").stdout)
    assert data["skip"] == ["caf\u00e9", "\ud800"]


def test_an_unexpected_error_is_exit_2_not_1(run_dir: Path) -> None:
    proc = ekit_patched(
        run_dir,
        "def boom(*a, **k):\n    raise RuntimeError('bug\\nhere')\ncli.audit = boom",
        "audit", "final.json",
    )
    one_error_line(proc, "internal error: RuntimeError: bug here")
    proc = ekit_patched(
        run_dir,
        "def stop(*a):\n    raise KeyboardInterrupt\ncli.replay = stop",
        "replay", "run.jsonl",
    )
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc
    assert proc.stderr == "ekit: interrupted\n"


def test_a_closed_stdout_is_quiet(run_dir: Path) -> None:
    read, write = os.pipe()
    os.close(read)  # every write to the pipe now fails with EPIPE
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ekit_runtime", "replay", "run.jsonl"],
            cwd=run_dir, stdout=write, stderr=subprocess.PIPE, text=True, timeout=60,
        )
    finally:
        os.close(write)
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr == ""


@pytest.mark.timeout(120)  # eight processes, each seconds long on a loaded machine
def test_bad_graph_file_and_usage_are_exit_2(run_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "g.json").write_text('{"steps": [{"name": "a", "depends_on": ["a"]}]}')
    shutil.copy(run_dir / "final.json", tmp_path / "final.json")
    one_error_line(ekit(tmp_path, "audit", "final.json", "--graph", "g.json"), "g.json", "itself")
    one_error_line(ekit(tmp_path, "audit"), "SOURCE")
    one_error_line(ekit(tmp_path, "frobnicate"), "invalid choice")
    one_error_line(ekit(tmp_path))
    both = ekit(tmp_path, "audit", "final.json", "--graph", "g.json", "--workflow", "x:y")
    one_error_line(both, "not allowed with")
    bad_graph = {"step_index": 0, "outputs": {}, "cost": ZERO, "graph": {"a": ["a"]}}
    (tmp_path / "cp.json").write_text(json.dumps(bad_graph))
    one_error_line(ekit(tmp_path, "graph", "--checkpoint", "cp.json"), "recorded graph:", "itself")
    (tmp_path / "nograph.json").write_text(json.dumps({**bad_graph, "graph": None}))
    one_error_line(
        ekit(tmp_path, "graph", "--checkpoint", "nograph.json"), "nograph.json", "records no graph"
    )


def test_help_exits_0(tmp_path: Path) -> None:
    proc = ekit(tmp_path, "--help")
    assert proc.returncode == 0 and "audit" in proc.stdout and "replay" in proc.stdout


def test_demo_subcommand_forwards_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    fake = types.ModuleType("ekit_runtime.demo")

    def fake_main(argv: list[str] | None = None) -> int:
        seen.append(argv)
        return 0

    fake.main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ekit_runtime.demo", fake)
    assert main(["demo", "--fast", "x"]) == 0
    assert seen == [["--fast", "x"]]


def test_demo_subcommand_without_the_module_is_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "ekit_runtime.demo", None)
    assert main(["demo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ekit: demo:") and err.count("\n") == 1


# A --workflow module may raise any BaseException, not only an Exception:
# every failure to load the workflow is one line and exit 2, never a
# traceback and exit 1 (which reads as "anomalies found").

BASE_RAISING = '''
class Halt(BaseException):
    """Neither an Exception nor SystemExit."""


class Raising:
    @property
    def graph(self):
        raise Halt("graph\\nrefused")


class Holder:
    @property
    def flow(self):
        raise GeneratorExit("closed")


raising = Raising()
holder = Holder()


def __getattr__(name):
    raise Halt(name)
'''


@pytest.mark.parametrize("command", ["audit", "replay", "graph"])
@pytest.mark.parametrize(
    ("module", "spec", "fragments"),
    [
        (
            "class Halt(BaseException):\n    pass\n\nraise Halt('stop\\nnow')\n",
            "importer:workflow", ["importing 'importer' raised Halt: stop now"],
        ),
        (BASE_RAISING, "hostile:flow", ["reading 'flow' raised Halt: flow"]),
        (BASE_RAISING, "hostile:raising", ["reading raising.graph raised Halt: graph refused"]),
    ],
    ids=["on-import", "on-attribute", "on-graph"],
)
def test_a_workflow_raising_a_base_exception_is_exit_2_for_every_command(
    run_dir: Path, tmp_path: Path, command: str, module: str, spec: str, fragments: list[str]
) -> None:
    (tmp_path / f"{spec.partition(':')[0]}.py").write_text(module, encoding="utf-8")
    shutil.copy(run_dir / "final.json", tmp_path / "final.json")
    shutil.copy(run_dir / "run.jsonl", tmp_path / "run.jsonl")
    target = {"audit": ["final.json"], "replay": ["run.jsonl"], "graph": []}[command]
    proc = ekit(tmp_path, command, *target, "--workflow", spec)
    one_error_line(proc, f"--workflow {spec}", *fragments)
    assert proc.stdout == ""


@pytest.mark.parametrize(
    ("module", "spec", "fragment"),
    [
        ("raise GeneratorExit\n", "gen:workflow", "importing 'gen' raised GeneratorExit"),
        (
            "import asyncio\nraise asyncio.CancelledError('gone')\n",
            "cancel:workflow", "importing 'cancel' raised CancelledError: gone",
        ),
        (BASE_RAISING, "hostile:holder.flow", "reading 'holder.flow' raised GeneratorExit: closed"),
        (
            # An exception whose own __str__ raises still gives its one line.
            "class Odd(Exception):\n    def __str__(self):\n        raise RuntimeError('no')\n"
            "\nraise Odd()\n",
            "odd:workflow", "importing 'odd' raised Odd: <Odd whose str() raised>",
        ),
    ],
    ids=["generator-exit", "cancelled-error", "property-generator-exit", "unprintable"],
)
def test_any_exception_from_a_workflow_module_is_one_line(
    run_dir: Path, tmp_path: Path, module: str, spec: str, fragment: str
) -> None:
    (tmp_path / f"{spec.partition(':')[0]}.py").write_text(module, encoding="utf-8")
    shutil.copy(run_dir / "final.json", tmp_path / "final.json")
    one_error_line(ekit(tmp_path, "audit", "final.json", "--workflow", spec), fragment)


def test_ctrl_c_while_importing_the_workflow_exits_130(run_dir: Path, tmp_path: Path) -> None:
    # Decided: Ctrl-C is the user's, not the module's failure; it exits 130
    # as everywhere else, with one line and no traceback.
    (tmp_path / "slow.py").write_text("raise KeyboardInterrupt\n", encoding="utf-8")
    shutil.copy(run_dir / "final.json", tmp_path / "final.json")
    proc = ekit(tmp_path, "audit", "final.json", "--workflow", "slow:workflow")
    assert proc.returncode == 130, proc
    assert proc.stderr == "ekit: interrupted\n" and proc.stdout == ""


def test_a_base_exception_anywhere_else_is_an_internal_error_not_exit_1(run_dir: Path) -> None:
    proc = ekit_patched(
        run_dir,
        "class Halt(BaseException):\n    pass\n"
        "def boom(*a, **k):\n    raise Halt('deep')\ncli.audit = boom",
        "audit", "final.json",
    )
    one_error_line(proc, "internal error: Halt: deep")


# Audit flags everything a resume from the checkpoint would refuse.


def test_audit_flags_a_context_key_that_resume_refuses(run_dir: Path, tmp_path: Path) -> None:
    data = json.loads((run_dir / "failed.json").read_text())
    data["context"] = {**data["context"], "publish": "shadowed"}
    (tmp_path / "cp.json").write_text(json.dumps(data))
    proc = ekit(tmp_path, "audit", "cp.json")
    assert proc.returncode == 1, proc
    assert "context_collision: context key 'publish' is also a step name" in proc.stdout
    workflow = runpy.run_path(str(run_dir / "flows.py"))["workflow"]
    with pytest.raises(ValueError, match="collide with step name"):
        workflow.run_sync(resume_from=data)


def test_audit_budget_option(run_dir: Path) -> None:
    # failed.json recorded three steps of 100/20/1 each.
    proc = ekit(run_dir, "audit", "failed.json", "--budget", "0/0/3", "--json")
    assert proc.returncode == 1, proc
    [anomaly] = json.loads(proc.stdout)["anomalies"]
    assert anomaly["kind"] == "budget_reached" and "300/60/3" in anomaly["message"]
    proc = ekit(run_dir, "audit", "failed.json", "--budget", "0/0/4")
    assert proc.returncode == 0, proc
    for bad in ("1/2", "a/b/c", "-1/0/0", "1/2/3/4", "\u00b2/0/0"):
        one_error_line(
            ekit(run_dir, "audit", "failed.json", f"--budget={bad}"), "--budget", "IN/OUT/CALLS"
        )


# replay of a real run whose outputs hold NaN, saved as the docs' example
# saves (json.dumps allows NaN): not a resume, not a change.

NAN_FLOWS = '''
from ekit_runtime import Step, Workflow

workflow = Workflow([
    Step("score", lambda ctx: float("nan")),
    Step("stats", lambda ctx: {"mean": float("nan"), "n": [float("inf")]}, ("score",)),
    Step("report", lambda ctx: "done", ("stats",)),
])
'''


def test_replay_of_a_run_with_nan_outputs_is_clean(tmp_path: Path) -> None:
    (tmp_path / "nanflows.py").write_text(NAN_FLOWS, encoding="utf-8")
    workflow = runpy.run_path(str(tmp_path / "nanflows.py"))["workflow"]
    lines: list[str] = []
    workflow.run_sync(checkpoint_fn=lambda cp: lines.append(json.dumps(cp.to_dict())))
    (tmp_path / "run.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    proc = ekit(tmp_path, "replay", "run.jsonl", "--workflow", "nanflows:workflow", "--json")
    assert proc.returncode == 0, proc
    data = json.loads(proc.stdout)
    assert data["ok"] is True and data["resumes"] == []
    assert [e["finished"] for e in data["timeline"]] == [["score"], ["stats"], ["report"]]


def test_a_checkpoint_file_gives_its_recorded_graph_to_graph_option(run_dir: Path, tmp_path: Path) -> None:
    # --graph takes a checkpoint (its graph_steps and graph_needs) as well as
    # 'ekit graph' output and the mapping older checkpoints hold.
    shutil.copy(run_dir / "final.json", tmp_path / "final.json")
    final = json.loads((tmp_path / "final.json").read_text())
    assert "graph_steps" in final
    as_graph = json.loads(ekit(tmp_path, "audit", "final.json", "--graph", "final.json", "--json").stdout)
    by_itself = json.loads(ekit(tmp_path, "audit", "final.json", "--json").stdout)
    assert as_graph["fingerprint"] == by_itself["fingerprint"] == final["fingerprint"]
    assert as_graph["steps"] == by_itself["steps"] and as_graph["graph_source"] == "given"
    (tmp_path / "half.json").write_text(json.dumps({"graph_steps": "a|b", "graph_needs": 3}))
    one_error_line(ekit(tmp_path, "audit", "final.json", "--graph", "half.json"), "half.json", "strings")
    (tmp_path / "dup.json").write_text(json.dumps({"graph_steps": "a|a", "graph_needs": "|"}))
    one_error_line(ekit(tmp_path, "audit", "final.json", "--graph", "dup.json"), "dup.json", "twice")
