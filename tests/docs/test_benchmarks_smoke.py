"""The benchmark suite runs end to end, and its baselines compute what ekit computes.

No timing is asserted here: CI machines are too noisy for that. The point is
that ``python -m benchmarks.run`` keeps working and that the floor it
measures ekit against is a correct scheduler, not a cheaper wrong one.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import baselines, run
from benchmarks import workloads as wl

# The quick benchmark the module's fixture runs takes seconds on an idle
# machine and several times that at a load of 8: past the suite's default.
pytestmark = pytest.mark.timeout(180)

GRAPHS = {
    "fan_out": wl.fan_out(30),
    "chain": wl.chain(25),
    "layered": wl.layered(60, 6, seed=3),
    "makespan_dag": wl.makespan_dag(seed=4, n=30),
}


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("bench") / "out.json"
    run.main(["--quick", "--repeats", "1", "--json", str(path)])
    written: dict[str, Any] = json.loads(path.read_text())
    return written


def test_every_workload_has_numeric_medians(result: dict[str, Any]) -> None:
    assert set(result["workloads"]) == set(run.WORKLOADS)
    for name, entry in result["workloads"].items():
        if entry["status"] == "skipped":
            # Only the store workload may be absent, and it must say why.
            assert name == "persistence" and entry["note"]
            continue
        assert entry["cases"], name
        for case in entry["cases"]:
            assert "ekit" in case["runners"], (name, case["label"])
            for runner, stats in case["runners"].items():
                if "skipped" in stats:
                    assert stats["skipped"], (name, runner)
                    continue
                median = stats["median_s"]
                assert isinstance(median, float) and median > 0, (name, runner)


def test_floor_and_level_baselines_run_in_every_case(result: dict[str, Any]) -> None:
    for name in ("fan_out", "chain", "layered", "resume"):
        for case in result["workloads"][name]["cases"]:
            assert "median_s" in case["runners"]["floor"], (name, case["label"])
    for case in result["workloads"]["makespan"]["cases"]:
        assert case["lower_bound_s"] > 0
        for runner in ("ekit", "floor", "level-by-level"):
            assert case["runners"][runner]["ratio_to_bound"] > 0


def test_targets_are_reported(result: dict[str, Any]) -> None:
    assert result["targets"]
    for target in result["targets"]:
        assert target["met"] in (True, False, None)
        assert target["figure"] is None or isinstance(target["figure"], float | int)


def _ekit(graph: wl.Graph, **options: Any) -> dict[str, Any]:
    return asyncio.run(wl.ekit_run(graph, wl.checking_factory, **options))


@pytest.mark.parametrize("shape", sorted(GRAPHS))
@pytest.mark.parametrize("max_concurrency", [None, 3])
def test_floor_computes_what_ekit_computes(shape: str, max_concurrency: int | None) -> None:
    graph = GRAPHS[shape]
    expected = _ekit(graph, max_concurrency=max_concurrency)
    assert len(expected) == len(graph)
    assert _ekit(graph, mode="all", max_concurrency=max_concurrency) == expected
    floor = asyncio.run(
        baselines.floor_run(graph, wl.checking_factory, max_concurrency=max_concurrency)
    )
    assert floor == expected
    level = asyncio.run(
        baselines.level_run(graph, wl.checking_factory, max_concurrency=max_concurrency)
    )
    assert level == expected


@pytest.mark.parametrize("shape", sorted(GRAPHS))
def test_executionkit_baseline_computes_what_ekit_computes(shape: str) -> None:
    if baselines.missing("executionkit"):
        pytest.skip("executionkit not installed (the bench extra)")
    graph = GRAPHS[shape]
    got = asyncio.run(baselines.executionkit_run(graph, wl.checking_factory))
    assert got == _ekit(graph)


def test_floor_resume_skips_recorded_steps() -> None:
    graph = wl.chain(12)
    full = _ekit(graph)
    recorded = {name: full[name] for name in list(graph.deps)[:9]}
    ran: list[str] = []

    def counting(name: str, deps: tuple[str, ...]) -> wl.StepBody:
        body = wl.checking_factory(name, deps)

        async def counted(context: dict[str, Any]) -> Any:
            ran.append(name)
            return await body(context)

        return counted

    got = asyncio.run(baselines.floor_run(graph, counting, resume=recorded))
    assert got == full
    assert ran == ["s9", "s10", "s11"]


def test_lower_bound_is_a_bound() -> None:
    graph = wl.makespan_dag(seed=1)
    bound = wl.lower_bound(graph, 10)
    assert bound >= wl.critical_path(graph)
    assert bound >= sum(graph.durations.values()) / 10
    # One worker: nothing beats doing all the work back to back.
    assert wl.lower_bound(graph, 1) == pytest.approx(sum(graph.durations.values()))


def test_runs_as_a_script_too() -> None:
    # `python benchmarks/run.py` (not -m) must find the package on its own.
    script = Path(run.__file__)
    done = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "--quick" in done.stdout


def test_map_workload_is_timed_beside_the_fan_out(result: dict[str, Any]) -> None:
    entry = result["workloads"]["map"]
    summary = entry["summary"]
    assert set(summary["map_over_fan_out"]) == {"dependencies", "all"}
    assert all(r > 0 for r in summary["map_over_fan_out"].values())
    assert set(summary["growth"]) == {"ekit", "ekit[all]", "fan-out", "fan-out[all]"}
    journal = [c for c in entry["cases"] if c["label"].startswith("journal")]
    assert [c["label"] for c in journal] == [f"journal {n}" for n in run.QUICK.map_journal]
    for case in journal:
        for runner in ("ekit+journal", "ekit+journal(one save per item)"):
            assert case["runners"][runner]["bytes_per_item"] > 0
    names = [t["target"] for t in result["targets"]]
    assert sum("map" in name for name in names) == 4


def test_map_runs_one_item_per_element() -> None:
    got = asyncio.run(wl.ekit_map_run(5, wl.checking_factory, mode="all"))
    assert got == {"root": [0, 1, 2, 3, 4], "m": [(k * 31 + 1) % 1_000_003 for k in range(5)]}
    assert asyncio.run(wl.ekit_map_run(5, wl.checking_factory)) == got


def test_queue_benchmark_reports_rates_save_costs_fsync_and_verdicts(tmp_path: Path) -> None:
    from benchmarks import queue as queue_bench

    path = tmp_path / "queue.json"
    argv = ["--quick", "--no-cost", "--backends", "sqlite", "--runs", "6", "--json", str(path)]
    assert queue_bench.main(argv) == 0
    written = json.loads(path.read_text())
    sqlite = written["backends"]["sqlite"]
    assert set(sqlite["runs_per_s"]) == {"1", "2"}
    assert all(rate > 0 for rate in sqlite["runs_per_s"].values())
    assert sqlite["workers_2_over_1"] > 0
    # Commits a run: never more than a claim, a save per step and a finish, each alone.
    assert all(0 < c <= sqlite["steps"] + 2 for c in sqlite["commits_per_run"].values())
    assert sqlite["save_us"] > 0 and sqlite["insert_us"] > 0
    assert sqlite["save_over_insert"] > 0
    # The figure judged is the median of the rounds' readings (one a round), each kept.
    assert len(sqlite["save_over_insert_each"]) == sqlite["rounds"]
    assert sqlite["save_over_insert"] == statistics.median(sqlite["save_over_insert_each"])
    assert sqlite["save_over_insert_of_medians"] == pytest.approx(sqlite["save_us"] / sqlite["insert_us"])
    assert sqlite["fsync_us"] > 0 and sqlite["fsyncs_per_s"] > 0
    # Every save the figures come from was durable.
    assert "synchronous=FULL" in sqlite["durability"] and "journal_mode=wal" in sqlite["durability"]
    targets = {(t["backend"], t["target"]): t for t in written["targets"]}
    assert len(targets) == 3
    for (backend, _), target in targets.items():
        if backend == "sqlite":
            assert target["met"] in (True, False) and isinstance(target["figure"], float)
        else:
            assert target["met"] is None and target["figure"] is None  # not measured here
