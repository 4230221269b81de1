"""docs/checkpoint.schema.json describes the checkpoints real runs write.

``jsonschema`` is a test-only dependency (the ``test`` extra); the library
itself never validates against the schema.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from ekit_core import TokenUsage, WorkflowCheckpoint
from ekit_runtime import Done, PatternResult, Repeat, RetryPolicy, Step, Workflow

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "docs" / "checkpoint.schema.json"
SCHEMA = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def _json(checkpoint: WorkflowCheckpoint) -> dict[str, Any]:
    # What a store would write and read back.
    data: dict[str, Any] = json.loads(json.dumps(checkpoint.to_dict()))
    return data


def _valid(data: dict[str, Any]) -> None:
    errors = sorted(VALIDATOR.iter_errors(data), key=str)
    assert not errors, [e.message for e in errors]


def _llm(name: str) -> Any:
    async def run(context: dict[str, Any]) -> PatternResult[str]:
        await asyncio.sleep(0)
        return PatternResult(f"{name}:{context.get('topic')}", cost=TokenUsage(12, 4, 1))

    return run


def _workflow(*, fail: bool = False) -> Workflow:
    def judge(context: dict[str, Any]) -> str:
        if fail:
            raise ValueError("model refused")
        return "verdict"

    return Workflow(
        [
            Step("draft", _llm("draft"), version="2"),
            Step("critique", _llm("critique"), depends_on=("draft",)),
            Step("judge", judge, depends_on=("critique",), retry=RetryPolicy(2, backoff_base=0)),
        ]
    )


def test_the_schema_is_a_valid_draft_2020_12_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert SCHEMA["required"] == ["step_index", "outputs", "cost"]


def test_checkpoints_of_a_fresh_run_with_context_validate() -> None:
    saved: list[WorkflowCheckpoint] = []
    _workflow().run_sync({"topic": "tides"}, checkpoint_fn=saved.append, durations=True, worker="host:1")
    assert saved and saved[-1].context == {"topic": "tides"}
    for checkpoint in saved:
        data = _json(checkpoint)
        _valid(data)
        # Every key the writer emits is one the schema describes.
        assert set(data) <= set(SCHEMA["properties"])
    assert _json(saved[-1])["drives"][0]["worker"] == "host:1"
    # All of them but "graph", which files written before graph_steps and
    # graph_needs hold (read, no longer written), and the two that only a run
    # with run-time shapes writes (see the shaped test below), and the one that
    # only a run whose steps asked a person writes (tests/runtime/test_human_input.py),
    # the two that only a run with fingerprints or a cache writes (the test below),
    # the two only a loop that keeps its last iterations writes (see the loop's test below),
    # and the one only a run whose attempts a limit held writes (the test after this one).
    assert set(_json(saved[-1])) == set(SCHEMA["properties"]) - {
        "graph", "skipped", "shapes", "asked", "code_fingerprints", "cache_hits", "compacted",
        "compacted_retries", "held"}


def test_checkpoints_naming_the_limit_that_held_an_attempt_validate() -> None:
    async def slow(ctx: Any) -> str:
        await asyncio.sleep(0.05)
        return "done"

    saved: list[WorkflowCheckpoint] = []
    Workflow([Step(n, slow) for n in ("a", "b", "c")]).run_sync(
        checkpoint_fn=saved.append, durations=True, max_concurrency=1)
    for checkpoint in saved:
        _valid(_json(checkpoint))
    assert set(_json(saved[-1])["held"]) == {"b", "c"}
    assert list(VALIDATOR.iter_errors({**_json(saved[-1]), "held": {"b": {}}}))  # a hold names its limit


def test_checkpoints_of_a_fingerprinted_run_with_cache_hits_validate(tmp_path: Path) -> None:
    from ekit_runtime import SqliteCache

    def steps() -> list[Step]:
        return [Step("draft", _llm("draft"), cache=True),
                Step("critique", _llm("critique"), depends_on=("draft",), cache=True)]

    cache = SqliteCache(tmp_path / "schema-cache.db")
    Workflow(steps(), on_code_change="again").run_sync({"topic": "tides"}, cache=cache)
    saved: list[WorkflowCheckpoint] = []
    Workflow(steps(), on_code_change="again").run_sync(
        {"topic": "tides"}, cache=cache, checkpoint_fn=saved.append)
    final = _json(saved[-1])
    assert set(final["code_fingerprints"]) == {"draft", "critique"}
    assert set(final["cache_hits"]) == {"draft", "critique"}
    for checkpoint in saved:
        _valid(_json(checkpoint))


def test_a_checkpoint_written_with_the_graph_mapping_still_validates_and_resumes() -> None:
    saved: list[WorkflowCheckpoint] = []
    _workflow().run_sync({"topic": "tides"}, checkpoint_fn=saved.append)
    data = _json(saved[1])
    old = {k: v for k, v in data.items() if k not in ("graph_steps", "graph_needs")}
    old["graph"] = {"draft": [], "critique": ["draft"], "judge": ["critique"]}
    _valid(old)
    resumed = WorkflowCheckpoint.from_dict(old)
    assert resumed.graph == WorkflowCheckpoint.from_dict(data).graph
    result = _workflow().run_sync(resume_from=old)
    assert result.outputs["judge"] == "verdict" and result.checkpoint.to_dict()["graph_steps"] == (
        "draft|critique|judge")


def test_checkpoints_of_a_failed_run_record_failures_and_validate() -> None:
    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(ValueError, match="model refused"):
        _workflow(fail=True).run_sync({"topic": "tides"}, checkpoint_fn=saved.append)
    final = _json(saved[-1])
    assert final["failures"]["judge"] == {
        "error_type": "ValueError",
        "message": "model refused",
        "attempts": 2,
    }
    for checkpoint in saved:
        _valid(_json(checkpoint))


def test_checkpoints_of_a_resumed_and_a_cancelled_run_validate() -> None:
    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(ValueError):
        _workflow(fail=True).run_sync({"topic": "tides"}, checkpoint_fn=saved.append)
    resumed: list[WorkflowCheckpoint] = []
    result = _workflow().run_sync(resume_from=_json(saved[-1]), checkpoint_fn=resumed.append)
    assert result.outputs["judge"] == "verdict"
    for checkpoint in resumed:
        _valid(_json(checkpoint))

    async def cancelled() -> list[WorkflowCheckpoint]:
        out: list[WorkflowCheckpoint] = []
        started = asyncio.Event()

        async def hang(context: dict[str, Any]) -> None:
            started.set()
            await asyncio.Event().wait()

        wf = Workflow([Step("a", _llm("a")), Step("hang", hang, depends_on=("a",))])
        run = asyncio.create_task(wf.run(checkpoint_fn=out.append))
        await started.wait()
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        return out

    for checkpoint in asyncio.run(cancelled()):
        _valid(_json(checkpoint))


def test_an_executionkit_three_key_checkpoint_validates_and_loads() -> None:
    old = {
        "step_index": 1,
        "outputs": {"draft": "d"},
        "cost": {"input_tokens": 1, "output_tokens": 2, "llm_calls": 1},
    }
    _valid(old)
    assert WorkflowCheckpoint.from_dict(old).outputs == {"draft": "d"}


def _odd(context: dict[str, Any]) -> bool:
    return bool(context["size"] % 2 == 1)


def _shaped() -> Workflow:
    """A run-time shaped workflow: a mapped step whose condition skips some items, a join."""
    return Workflow(
        [
            Step("split", lambda c: ["a", "bb", "ccc", "dddd"]),
            Step("size", lambda c: len(c["split"]), ("split",), map_over="split",
                 when=lambda c: len(c["split"]) % 2 == 1, context="dependencies"),
            Step("sum", lambda c: sum(c["size"]), ("size",), context="dependencies"),
            Step("check", lambda c: c["size"] * 2, ("size",), map_over="size", when=_odd,
                 context="dependencies"),
            Step("any", lambda c: sorted(c), ("sum", "check"), join="any", context="dependencies"),
        ]
    )


def test_checkpoints_of_a_shaped_run_with_items_and_skips_validate() -> None:
    saved: list[WorkflowCheckpoint] = []
    _shaped().run_sync({"topic": "t"}, checkpoint_fn=saved.append, max_concurrency=1, durations=True,
                       worker="host:2")
    for checkpoint in saved:
        _valid(_json(checkpoint))
    last = _json(saved[-1])
    assert last["format_version"] == 2
    assert {"size[0]", "size[2]", "size"} <= set(last["outputs"]) and last["skipped"]
    assert last["shapes"]["any"] == {"join": "any"}
    assert set(last) <= set(SCHEMA["properties"])
    assert set(last) | {"versions"} == set(SCHEMA["properties"]) - {
        "graph", "asked", "code_fingerprints", "cache_hits", "compacted", "compacted_retries"}
    assert WorkflowCheckpoint.from_dict(last) == saved[-1]


def test_checkpoints_of_a_loop_that_keeps_its_last_iterations_validate() -> None:
    failed: set[int] = set()

    def turn(ctx: Any) -> Any:
        it = ctx["agent"]
        if it.number == 2 and it.number not in failed:  # one failed attempt, compacted later
            failed.add(it.number)
            raise ConnectionError("overloaded")
        return Done(it.number) if it.number == 6 else it.number

    saved: list[WorkflowCheckpoint] = []
    Workflow([Step("agent", turn, repeat=Repeat(max_iterations=8, keep_last=2),
                   retry=RetryPolicy(max_attempts=2, backoff_base=0))]).run_sync(
        checkpoint_fn=saved.append)
    for checkpoint in saved:
        _valid(_json(checkpoint))
    last = _json(saved[-1])
    assert last["shapes"] == {"agent": {"repeat": 8, "keep_last": 2}}
    assert last["compacted"] == {"agent": 4} and last["compacted_retries"] == {"agent": 1}
    assert set(last) <= set(SCHEMA["properties"])
    assert WorkflowCheckpoint.from_dict(last) == saved[-1]


def test_a_resumed_shaped_run_writes_checkpoints_that_validate() -> None:
    saved: list[WorkflowCheckpoint] = []
    _shaped().run_sync({"topic": "t"}, checkpoint_fn=saved.append, max_concurrency=1)
    resumed: list[WorkflowCheckpoint] = []
    _shaped().run_sync(resume_from=_json(saved[len(saved) // 2]), checkpoint_fn=resumed.append)
    for checkpoint in resumed:
        _valid(_json(checkpoint))


def _shaped_json() -> dict[str, Any]:
    return _json(_shaped().run_sync({"topic": "t"}).checkpoint)


@pytest.mark.parametrize(
    "breakage",
    [
        lambda d: d.update(skipped={"size[1]": 3}),
        lambda d: d.update(skipped=["size[1]"]),
        lambda d: d.update(shapes={"size": {"map_over": "split", "join": "some"}}),
        lambda d: d.update(shapes={"size": {"map_over": ""}}),
        lambda d: d.update(shapes={"size": {"map_over": "split", "order": "random"}}),
        lambda d: d.update(shapes={"size": "split"}),
        lambda d: d.update(format_version=4),
    ],
)
def test_what_the_parser_refuses_of_a_shaped_checkpoint_the_schema_refuses(breakage: Any) -> None:
    data = _shaped_json()
    _valid(data)
    breakage(data)
    assert list(VALIDATOR.iter_errors(data))
    with pytest.raises(ValueError):
        WorkflowCheckpoint.from_dict(data)


@pytest.mark.parametrize(
    "breakage",
    [
        lambda d: d.pop("cost"),
        lambda d: d.pop("step_index"),
        lambda d: d.update(step_index=-1),
        lambda d: d.update(outputs=[1, 2]),
        lambda d: d["cost"].update(llm_calls=True),
        lambda d: d["cost"].pop("input_tokens"),
        lambda d: d.update(format_version=0),
        lambda d: d.update(failures={"x": {"error_type": "E"}}),
        lambda d: d.update(fingerprint=3),
        lambda d: d.update(graph={"draft": []}),  # beside graph_steps and graph_needs
        lambda d: d.pop("graph_needs"),
        lambda d: d.update(graph_steps=3),
        lambda d: d.update(graph_steps=None, graph_needs=None, graph={"a": "b"}),
    ],
)
def test_what_the_parser_refuses_the_schema_refuses(breakage: Any) -> None:
    saved: list[WorkflowCheckpoint] = []
    _workflow().run_sync({"topic": "t"}, checkpoint_fn=saved.append)
    data = _json(saved[-1])
    breakage(data)
    assert list(VALIDATOR.iter_errors(data))
    with pytest.raises(ValueError):
        WorkflowCheckpoint.from_dict(data)


def test_checkpoints_of_a_run_with_a_child_workflow_validate() -> None:
    from ekit_runtime import Child

    def fetch_list(context: dict[str, Any]) -> list[str]:
        return ["a", "b"]

    inner = Workflow([Step("polish", _llm("polish"))])
    child = Workflow([Step("fetch", fetch_list),
                      Step("tool", _llm("tool"), depends_on=("fetch",), map_over="fetch"),
                      Step("write", depends_on=("tool",), child=inner)])
    workflow = Workflow([Step("research", child=Child(child, output="write")),
                         Step("report", _llm("report"), depends_on=("research",))])
    saved: list[WorkflowCheckpoint] = []
    workflow.run_sync({"topic": "tides"}, checkpoint_fn=saved.append)
    for checkpoint in saved:
        _valid(_json(checkpoint))
    last = _json(saved[-1])
    assert last["shapes"]["research"] == {"child": "research/write"}
    assert last["shapes"]["research/write"] == {"child": "research/write/polish"}
    assert "research/tool[1]" in last["outputs"]
