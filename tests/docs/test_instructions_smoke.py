"""The instruction-count benchmark's child runs every runner correctly; no valgrind needed.

``python -m benchmarks.instructions`` runs :mod:`benchmarks.icount_child` under
callgrind. These tests run that child without valgrind, at tiny sizes: each
runner must compute what ekit computes (checking step bodies), run exactly the
steps a resume leaves, import no other runner's library, and the command must
say clearly when valgrind is missing.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import icount_child as child
from benchmarks import instructions
from benchmarks import workloads as wl

ROOT = Path(__file__).resolve().parents[2]
N = 6
RUNNERS = [r for r in ("floor", "executionkit", "ekit", "ekit[dependencies]")
           if r != "executionkit" or importlib.util.find_spec("executionkit") is not None]


@pytest.fixture(scope="module")
def children(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every child process the tests look at, started at once (each imports a runner)."""
    tmp = tmp_path_factory.mktemp("icount")
    argvs: dict[str, list[str]] = {}
    for runner in RUNNERS:
        argvs[f"check {runner}"] = ["-m", "benchmarks.icount_child", "--check", runner, str(N)]
        path = tmp / f"{runner}.json"
        path.write_text(child.checkpoint_text("executionkit" if runner == "floor" else runner, N))
        argvs[f"fork {runner}"] = ["-m", "benchmarks.icount_child", runner, f"chain:{N}",
                                   f"fan_out:{N}", f"fan_in:{N}", f"resume:{N}:{path}",
                                   *([f"map:{N}"] if runner in child.MAPPED else [])]
    argvs["fork setup"] = ["-m", "benchmarks.icount_child", "setup", f"chain:{N}",
                           f"resume:{N}:{tmp / 'floor.json'}", f"map:{N}"]
    argvs["map floor"] = ["-m", "benchmarks.icount_child", "--no-fork", "floor", f"map:{N}"]
    argvs["foreign"] = ["-c", "import ekit_runtime, sys; from benchmarks import icount_child; "
                        "sys.exit(icount_child.main(['--no-fork', 'floor', 'chain:3']))"]
    argvs["no valgrind"] = ["-m", "benchmarks.instructions", "--quick", "--json",
                            str(tmp / "out.json")]
    env = {**os.environ, "PYTHONHASHSEED": "0",
           instructions.VALGRIND_ENV: str(tmp / "no-valgrind")}
    procs = {key: subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for key, argv in argvs.items()}
    out: dict[str, Any] = {"argv": argvs, "tmp": tmp}
    for key, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=15)
        out[key] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return out


def _expected(workload: str, n: int) -> dict[str, Any]:
    """The outputs and the count of steps run, computed here step by step."""
    if workload == "loop":  # (its iterations are its own body, not the factory's: none counted)
        return {"outputs": {"agent": n}, "ran": 0}
    if workload == "map":  # the root's items 0..n-1; each item's output from its item
        return {"outputs": {"root": list(range(n)),
                            "m": [(k * 31 + len("m")) % 1_000_003 for k in range(n)]},
                "ran": n}
    deps = child.graph_for(workload, n)
    recorded = set(list(deps)[:n]) if workload == "resume" else set()
    outputs: dict[str, int] = {}
    for name, ds in deps.items():  # declaration order is topological
        outputs[name] = 1 if name in recorded else (
            sum(outputs[d] for d in ds) * 31 + len(name)) % 1_000_003
    return {"outputs": outputs, "ran": len(deps) - len(recorded)}


def test_graphs_are_the_workload_graphs() -> None:
    for workload, make in (("chain", wl.chain), ("fan_out", wl.fan_out), ("fan_in", wl.fan_in)):
        assert child.graph_for(workload, 7) == make(7).deps
    assert child.graph_for("resume", 7) == wl.chain(7 + child.LEFT).deps


def test_expected_outputs_are_ekits() -> None:
    for workload in ("chain", "fan_out", "fan_in"):
        graph = wl.Graph(child.graph_for(workload, N))
        got = asyncio.run(wl.ekit_run(graph, wl.checking_factory, mode="all"))
        assert got == _expected(workload, N)["outputs"], workload


def test_every_runner_computes_the_same_outputs_in_a_process_of_its_own(
        children: dict[str, Any]) -> None:
    for runner in RUNNERS:
        proc = children[f"check {runner}"]
        # Exit 3 would mean the process imported another runner's library.
        assert proc.returncode == 0, (runner, proc.stderr)
        got = json.loads(proc.stdout)
        for workload in child.WORKLOADS:
            if workload in ("map", "loop") and runner not in child.MAPPED:
                assert workload not in got, runner  # the baselines have no run-time map
                continue
            assert got[workload] == _expected(workload, N), (runner, workload)


def test_the_map_is_ekits_only(children: dict[str, Any]) -> None:
    proc = children["map floor"]
    assert proc.returncode == 1 and "ekit's runners only" in proc.stderr
    assert set(child.MAPPED) == {"ekit", "ekit[dependencies]", "setup"}
    plan = instructions.plan(["map"], list(instructions.RUNNERS), instructions.QUICK, 1)
    assert {j.runner for j in plan} == set(child.MAPPED) - (
        set() if importlib.util.find_spec("executionkit") else {"executionkit"})


def test_measured_mode_forks_one_child_per_measurement(children: dict[str, Any]) -> None:
    for runner in [*RUNNERS, "setup"]:
        proc = children[f"fork {runner}"]
        assert proc.returncode == 0, (runner, proc.stderr)
        specs = children["argv"][f"fork {runner}"][3:]
        assert [ln.split(" ", 2)[1:] for ln in proc.stdout.splitlines()] == [
            ["0", spec] for spec in specs], runner


def test_a_foreign_import_fails_the_child(children: dict[str, Any]) -> None:
    proc = children["foreign"]
    assert proc.returncode == 3 and "imported ekit_core, ekit_runtime" in proc.stderr


def test_bad_arguments_are_a_usage_error() -> None:
    assert child.main(["floor", "chain:3x"]) == 2
    assert child.main(["nobody", "chain:3"]) == 2
    assert child.main(["floor", "resume:3"]) == 2  # resume needs its checkpoint file


def test_missing_valgrind_is_a_clear_message_not_a_traceback(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, children: dict[str, Any]) -> None:
    status = instructions.main(["--quick", "--valgrind", str(tmp_path / "no-valgrind"),
                                "--json", str(tmp_path / "out.json")])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and "valgrind not found" in err
    assert not (tmp_path / "out.json").exists()
    # The same through the environment variable, as a user runs it.
    proc = children["no valgrind"]
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "valgrind not found" in proc.stderr
    assert not (children["tmp"] / "out.json").exists()


def test_figures_are_differences_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(instructions, "installed", lambda library: True)  # counts are made up
    text = "events: Ir\nsummary: 1234\ntotals: 1234\n"
    assert instructions.parse_total(text) == 1234
    jobs = []
    for runner, per_step in (("floor", 100), ("executionkit", 150), ("ekit", 120),
                             ("ekit[dependencies]", 110)):
        for n in (40, 80):
            job = instructions.Job(runner, "fan_out", n, 0)
            job.count = 5_000_000 + per_step * n
            jobs.append(job)
    sizes = instructions.Sizes(fan_out=((40, 80),))
    table = instructions.figures(jobs, ["fan_out"], list(instructions.RUNNERS), sizes)
    cells = table["fan_out"]["pairs"][0]["runners"]
    assert cells["ekit"]["per_step"] == 120
    assert cells["ekit"]["vs_floor"] == pytest.approx(1.2)
    assert cells["ekit"]["vs_executionkit"] == pytest.approx(0.8)
    fan_out = [t for t in instructions.targets(table) if t["target"].startswith("fan-out:")]
    assert fan_out[0]["met"] is True and fan_out[0]["figure_dependencies"] == pytest.approx(
        110 / 150)


def test_the_map_target_is_per_item_over_fan_out_per_step() -> None:
    sizes = instructions.Sizes(fan_out=((40, 80),), map=((40, 80), (400, 800), (800, 1600)))
    # Made-up counts: the fan-out costs 120 (100) per step; the map 130 per item up to
    # 800 items, 143 per item beyond.
    counts = {"fan_out": {40: 120 * 40, 80: 120 * 80},
              "map": {n: 130 * min(n, 800) + 143 * max(n - 800, 0)
                      for n in (40, 80, 400, 800, 1600)}}
    jobs = []
    for runner in ("ekit", "ekit[dependencies]"):
        for workload, by_n in counts.items():
            for n, count in by_n.items():
                job = instructions.Job(runner, workload, n, 0)
                scale = 100 / 120 if (runner, workload) == ("ekit[dependencies]",
                                                            "fan_out") else 1
                job.count = 7_000_000 + round(count * scale)
                jobs.append(job)
    runners = ["ekit", "ekit[dependencies]"]
    table = instructions.figures(jobs, ["fan_out", "map"], runners, sizes)
    assert [p["runners"]["ekit"]["per_step"] for p in table["map"]["pairs"]] == [130, 130, 143]
    by_name = {t["target"]: t for t in instructions.targets(table)}
    ratio = by_name["map per item / fan-out per step"]
    assert ratio["figure"] == pytest.approx(130 / 120) and ratio["met"] is True
    assert ratio["figure_dependencies"] == pytest.approx(130 / 100)
    linear = by_name["linear map: per step 800 to 1600 items / 400 to 800 items"]
    assert linear["figure"] == pytest.approx(1.1) and linear["met"] is True
    assert [ln["of"] for ln in instructions.linearity(table, runners)] == [
        "800 to 1600 items / 400 to 800 items"] * 2
