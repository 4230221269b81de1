"""``replay`` calls legal every checkpoint sequence a real run makes, and still catches forgeries.

The promise: whatever a run went through (mapped steps and item-wise
chains, conditions per step and per item, joins over alternatives, crashes
at any point, failed upstreams, version bumps and rewinds between resumes,
resumes that keep items by an early cutoff), the checkpoints its ``checkpoint_fn`` saw,
each read back from JSON, replay as a legal execution of the graph; the
timeline names every output a resume dropped (a bumped mapped step's items
too) among the outdated; and a checkpoint forged to drop or change a
recorded output is reported, naming the step.
"""

from __future__ import annotations

import hashlib
import json
from itertools import pairwise
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ekit_core import GraphSpec, WorkflowCheckpoint, replay, rewind
from ekit_runtime import RetryPolicy, Step, Workflow
from tests.support.strategies import shaped_dags


class Crash(BaseException):
    """The process dies while a step runs (what a kill looks like to the run)."""


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:8]


class _Segment:
    """One run of the workflow: its version tags, and where it crashes or fails, if anywhere."""

    def __init__(self, versions: dict[str, str], crash_at: int | None, fail: str | None,
                 rewind: int | None = None) -> None:
        self.versions, self.crash_at, self.fail, self.calls = versions, crash_at, fail, 0
        self.rewind = rewind  # which recorded output to rewind before it runs (by position)

    def body(self, name: str, mapped: bool) -> Any:
        async def run(ctx: dict[str, Any]) -> Any:
            self.calls += 1
            if self.calls == self.crash_at:
                raise Crash(name)
            if name == self.fail:
                raise RuntimeError(f"{name} failed")
            code = self.versions.get(name)
            if mapped:
                return f"{name}:{_digest([ctx, code])}"
            # Some new code gives the old output: what an early cutoff keeps items for.
            seed = _digest([ctx, code if int(_digest([name, code]), 16) % 2 else None])
            return [f"{name}:{seed}:{j}" for j in range(int(seed[:2], 16) % 4)]

        return run


def cond(ctx: dict[str, Any]) -> bool:
    return int(_digest(ctx), 16) % 3 != 0


def _workflow(graph: GraphSpec, segment: _Segment) -> Workflow:
    steps = []
    for name in graph.names:
        shape = graph.shapes.get(name)
        mapped = shape is not None and shape.map_over is not None
        steps.append(Step(
            name, segment.body(name, mapped), graph.deps[name], context="dependencies",
            version=segment.versions.get(name), retry=RetryPolicy(max_attempts=1),
            map_over=shape.map_over if shape is not None else None,
            when=cond if shape is not None and shape.when is not None else None,
            join=shape.join if shape is not None else "all",
        ))
    return Workflow(steps)


def _run(wf: Workflow, resume_from: WorkflowCheckpoint | None, saved: list[WorkflowCheckpoint]) -> bool:
    """Run to its end, a crash or a failure; whether it finished."""
    def save(cp: WorkflowCheckpoint) -> None:
        saved.append(WorkflowCheckpoint.from_dict(json.loads(json.dumps(cp.to_dict()))))

    try:
        wf.run_sync(checkpoint_fn=save, resume_from=resume_from)
    except (Crash, Exception, BaseExceptionGroup):  # (several steps may fail at once: a group)
        return False
    return True


@st.composite
def _segments(draw: st.DrawFn, graph: GraphSpec) -> list[_Segment]:
    """Runs with bumps between them; each may crash early or fail a step (often one just
    bumped, and often one that steps map over: what leaves items set aside)."""
    over = sorted({s.map_over for s in graph.shapes.values() if s.map_over is not None})
    names = st.sampled_from(graph.names) | (st.sampled_from(over) if over else st.nothing())
    versions: dict[str, str] = {}
    segments = []
    for k in range(draw(st.integers(1, 4), label="runs before the last")):
        bumped = draw(st.lists(names, max_size=2, unique=True), label="bumped")
        versions = {**versions, **{n: f"v{k}" for n in bumped}}
        crash_at = draw(st.none() | st.integers(1, 6), label="crash at call")
        fail = draw(st.none() | (st.sampled_from(bumped) if bumped else names), label="fails")
        rewound = draw(st.none() | st.integers(0, 20), label="rewind before")
        segments.append(_Segment(versions, crash_at, fail, rewound))
    bumped = draw(st.lists(names, max_size=2, unique=True), label="bumped last")
    segments.append(_Segment({**versions, **{n: "last" for n in bumped}}, None, None))
    return segments


def _record(graph: GraphSpec, segments: list[_Segment]) -> tuple[Workflow, list[WorkflowCheckpoint]]:
    saved: list[WorkflowCheckpoint] = []
    wf = _workflow(graph, segments[0])
    for segment in segments:
        wf = _workflow(graph, segment)
        if saved and saved[-1].outputs and segment.rewind is not None:
            # What ekit rewind writes into the run's journal: a checkpoint of its own.
            names = list(saved[-1].outputs)
            cp = rewind(wf.graph, saved[-1], [names[segment.rewind % len(names)]])
            saved.append(WorkflowCheckpoint.from_dict(json.loads(json.dumps(cp.to_dict()))))
        _run(wf, saved[-1] if saved else None, saved)
    return wf, saved


@st.composite
def _mapping_dags(draw: st.DrawFn) -> GraphSpec:
    """A random shaped graph with at least one mapped step (item-wise chained, at times)."""
    from ekit_core.shapes import Shape

    graph = draw(shaped_dags())
    deps, shapes = dict(graph.deps), dict(graph.shapes)
    over = draw(st.sampled_from(graph.names), label="mapped over")
    others = draw(st.lists(st.sampled_from(graph.names), max_size=1), label="other input")
    deps["m"] = tuple(dict.fromkeys((over, *others)))
    shapes["m"] = Shape(map_over=over, when="cond" if draw(st.booleans()) else None)
    if draw(st.booleans(), label="chained"):
        deps["n"], shapes["n"] = ("m",), Shape(map_over="m")
    return GraphSpec.of(deps, shapes)


@pytest.mark.timeout(600)
@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(graph=shaped_dags() | _mapping_dags(), data=st.data())
def test_every_recorded_sequence_replays_as_legal_and_forgeries_are_caught(
        graph: GraphSpec, data: st.DataObject) -> None:
    wf, saved = _record(graph, data.draw(_segments(graph), label="runs"))
    report = replay(wf.graph, saved)
    assert report.ok, report.format()
    outdated = {n for e in report.timeline for n in e.outdated}
    event(f"outdated items: {any('[' in n for n in outdated)}")
    event(f"items set aside: {any(cp.superseded for cp in saved)}")
    event(f"segments: {report.timeline[-1].segment + 1 if report.timeline else 0}")
    # Every output a checkpoint lost against its predecessor is named among the outdated.
    for entry, (before, after) in zip(report.timeline[1:], pairwise(saved), strict=True):
        assert set(before.outputs) - set(after.outputs) <= set(entry.outdated), report.format()
    last = saved[-1]
    if not last.outputs:
        return
    name = data.draw(st.sampled_from(sorted(last.outputs)), label="forged")
    dropped = WorkflowCheckpoint.from_dict(
        {**last.to_dict(), "outputs": {k: v for k, v in last.outputs.items() if k != name}})
    changed = WorkflowCheckpoint.from_dict(
        {**last.to_dict(), "outputs": {**last.outputs, name: "forged"}})
    for forged, kind in ((dropped, "output_removed"), (changed, "output_changed")):
        caught = replay(wf.graph, [*saved, forged])
        assert (len(saved), name, kind) in {(v.index, v.step, v.kind) for v in caught.violations}, \
            caught.format()


def _mapped(version: str) -> Workflow:
    return Workflow([
        Step("src", lambda ctx: [1, 2, 3]),
        Step("m", lambda ctx: ctx["src"] * (10 if version == "1" else 100), ("src",), map_over="src",
             version=version),
        Step("total", lambda ctx: sum(ctx["m"]), ("m",)),
    ])


def test_a_bumped_mapped_step_replays_as_legal_and_its_items_are_outdated() -> None:
    saved: list[WorkflowCheckpoint] = []
    _mapped("1").run_sync(checkpoint_fn=saved.append)
    result = _mapped("2").run_sync(checkpoint_fn=saved.append, resume_from=saved[-1])
    assert result.outputs["m"] == [100, 200, 300]
    report = replay(_mapped("2"), saved)
    assert report.ok, report.format()
    resumed = next(e for e in report.timeline if e.outdated)
    assert {"m", "m[0]", "m[1]", "m[2]", "total"} <= set(resumed.outdated)
    assert "'m'" in resumed.outdated["m[0]"]


def test_an_early_cutoff_after_a_failed_upstream_replays_as_legal() -> None:
    def flow(version: str, broken: bool) -> Workflow:
        def src(ctx: Any) -> list[int]:
            if broken:
                raise RuntimeError("the new upstream is broken")
            return [1, 2, 3]

        return Workflow([
            Step("src", src, version=version, retry=RetryPolicy(max_attempts=1)),
            Step("m", lambda ctx: ctx["src"] * 10, ("src",), map_over="src"),
        ])

    saved: list[WorkflowCheckpoint] = []
    flow("1", False).run_sync(checkpoint_fn=saved.append)
    with pytest.raises(RuntimeError):
        flow("2", True).run_sync(checkpoint_fn=saved.append, resume_from=saved[-1])
    assert "m[0]" not in saved[-1].outputs and "m[0]" in saved[-1].superseded
    result = flow("2", False).run_sync(checkpoint_fn=saved.append, resume_from=saved[-1])
    assert result.outputs["m"] == [10, 20, 30]
    report = replay(flow("2", False), saved)
    assert report.ok, report.format()


def test_a_rewind_and_its_resume_replay_as_legal_and_a_plain_drop_does_not() -> None:
    wf = Workflow([Step("a", lambda ctx: "A"), Step("b", lambda ctx: "B", ("a",)),
                   Step("c", lambda ctx: "C")])
    saved: list[WorkflowCheckpoint] = []
    wf.run_sync(checkpoint_fn=saved.append)
    rewound = rewind(wf.graph, saved[-1], ["a"])
    wf.run_sync(checkpoint_fn=saved.append, resume_from=rewound)
    sequence = [*saved[:2], rewound, *saved[2:]]
    report = replay(wf, sequence)
    assert report.ok, report.format()
    assert set(report.timeline[2].outdated) == {"a", "b"}
    # The same drop, not counted as redone, is a lost output.
    forged = WorkflowCheckpoint.from_dict({**rewound.to_dict(), "redone": {}})
    caught = replay(wf, [saved[0], saved[1], forged])
    assert {("a", "output_removed"), ("b", "output_removed")} <= {(v.step, v.kind) for v in caught.violations}
