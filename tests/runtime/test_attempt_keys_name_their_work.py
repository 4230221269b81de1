"""An attempt's key names its work: a bump or a rewind never reuses the key of other work.

What users rely on, deduplicating a paid call on ``attempt_key()`` as the
docs advise: after a ``version`` bump, a rewind (of the step, of what it
needs, of an item), or a change of shape, the attempts that run again have
keys no earlier attempt had, so an API that deduplicates on them does not
hand back the stale result; an attempt that finished but was never saved
runs again under the key it had (the same work); the checkpoint records
what a resume needs to compute the same new keys (``redone``), through JSON
and every store; and checkpoints without it still load.
"""

from __future__ import annotations

from typing import Any

import pytest

from ekit_core import (
    Answer,
    CheckpointError,
    WorkflowCheckpoint,
    answer,
    audit,
    questions,
    replay,
    rewind,
)
from ekit_runtime import JournalStore, JsonFileStore, RunWaiting, SqliteStore, Step, Workflow, ask
from ekit_runtime.attempt import attempt_key


def _chain(keys: list[str], version: str = "1", mapped: str = "1") -> Workflow:
    def record(value: Any) -> Any:
        def run(ctx: Any) -> Any:
            keys.append(str(attempt_key()))
            return value

        return run

    return Workflow([
        Step("a", record("a"), version=version),
        Step("s", record([1, 2]), ("a",)),
        Step("m", record("item"), ("s",), map_over="s", version=mapped),
    ])


def _names(keys: list[str]) -> list[str]:
    return sorted(k.split("/")[1] for k in keys)


def test_a_version_bump_gives_what_runs_again_new_keys() -> None:
    keys: list[str] = []
    first = _chain(keys).run_sync(run_id="r")
    assert first.checkpoint is not None
    assert sorted(keys) == ["r/a/1", "r/m[0]/1", "r/m[1]/1", "r/s/1"]
    seen = set(keys)
    keys.clear()
    second = _chain(keys, "2").run_sync(run_id="r", resume_from=first.checkpoint.to_dict())
    assert sorted(keys) == ["r/a/2", "r/s/2"]  # the items' input is unchanged: kept, not paid
    assert second.checkpoint is not None
    seen |= set(keys)
    keys.clear()
    third = _chain(keys, "2", mapped="2").run_sync(run_id="r", resume_from=second.checkpoint.to_dict())
    assert _names(keys) == ["m[0]", "m[1]"] and not seen & set(keys)
    assert third.checkpoint is not None
    seen |= set(keys)
    keys.clear()
    _chain(keys, "3", mapped="3").run_sync(run_id="r", resume_from=third.checkpoint.to_dict())
    assert _names(keys) == ["a", "m[0]", "m[1]", "s"] and not seen & set(keys)


@pytest.mark.parametrize(("rewound", "expected"), [
    ("a", ["a", "m[0]", "m[1]", "s"]),
    ("s", ["s"]),  # (the items' input is unchanged: an early cutoff keeps them)
    ("m", ["m[0]", "m[1]"]),
    ("m[1]", ["m[1]"]),
])
def test_a_rewind_gives_what_runs_again_new_keys(rewound: str, expected: list[str]) -> None:
    keys: list[str] = []
    workflow = _chain(keys)
    first = workflow.run_sync(run_id="r")
    assert first.checkpoint is not None
    seen = set(keys)
    keys.clear()
    again = workflow.run_sync(run_id="r", resume_from=rewind(workflow, first.checkpoint, rewound).to_dict())
    assert _names(keys) == expected and not seen & set(keys)
    assert again.checkpoint is not None
    seen |= set(keys)
    keys.clear()
    workflow.run_sync(run_id="r", resume_from=rewind(workflow, again.checkpoint, rewound).to_dict())
    assert _names(keys) == expected and not seen & set(keys)


def test_an_attempt_never_saved_runs_again_under_its_key() -> None:
    keys: list[str] = []
    saved: list[WorkflowCheckpoint] = []
    _chain(keys).run_sync(run_id="r", checkpoint_fn=saved.append)
    after_a = next(cp for cp in saved if "a" in cp.outputs)
    keys.clear()
    _chain(keys).run_sync(run_id="r", resume_from=after_a.to_dict())
    assert sorted(keys) == ["r/m[0]/1", "r/m[1]/1", "r/s/1"]  # the same work, the same keys


def _stores(tmp_path: Any) -> list[Any]:
    return [None, JsonFileStore(tmp_path / "cp.json"), JournalStore(tmp_path / "cp.jsonl"),
            SqliteStore(tmp_path / "cp.db", run_id="r")]


@pytest.mark.parametrize("which", range(4), ids=["json", "json-file", "journal", "sqlite"])
def test_a_resume_of_a_bumped_run_computes_the_same_new_keys_from_any_store(tmp_path: Any,
                                                                           which: int) -> None:
    keys: list[str] = []
    first = _chain(keys).run_sync(run_id="r")
    assert first.checkpoint is not None
    store = _stores(tmp_path)[which]
    saved: list[WorkflowCheckpoint] = []
    if store is not None:
        store.save(first.checkpoint)

    def save(cp: WorkflowCheckpoint) -> None:
        saved.append(cp)
        if store is not None:
            store.save(cp)
        if "a" in cp.outputs:
            raise KeyboardInterrupt  # a crash once the bumped step is saved, before s runs

    keys.clear()
    with pytest.raises(KeyboardInterrupt):
        _chain(keys, "2").run_sync(run_id="r", resume_from=first.checkpoint.to_dict(), checkpoint_fn=save)
    assert keys == ["r/a/2"]
    loaded = store.load() if store is not None else WorkflowCheckpoint.from_dict(saved[-1].to_dict())
    assert loaded is not None and "a" in loaded.outputs and "s" not in loaded.outputs
    keys.clear()
    _chain(keys, "2").run_sync(run_id="r", resume_from=loaded)
    assert sorted(keys) == ["r/s/2"]


def test_failures_and_rewinds_count_on_together() -> None:
    keys: list[str] = []
    tries = [0]

    def flaky(ctx: Any) -> str:
        keys.append(str(attempt_key()))
        tries[0] += 1
        if tries[0] == 1:
            raise RuntimeError("first try fails")
        return "ok"

    from ekit_core import RetryPolicy

    workflow = Workflow([Step("f", flaky, retry=RetryPolicy(max_attempts=3, backoff_base=0))])
    first = workflow.run_sync(run_id="r")
    assert first.checkpoint is not None and keys == ["r/f/1", "r/f/2"]
    keys.clear()
    workflow.run_sync(run_id="r", resume_from=rewind(workflow, first.checkpoint, "f").to_dict())
    assert keys == ["r/f/3"]


def test_a_checkpoint_without_redone_loads_and_a_bad_one_is_refused_by_name() -> None:
    plain = {"step_index": 0, "outputs": {}, "cost": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0}}
    assert dict(WorkflowCheckpoint.from_dict(plain).redone) == {}
    assert dict(WorkflowCheckpoint.from_dict({**plain, "redone": {"s": 2}}).redone) == {"s": 2}
    for bad in ({"s": -1}, {"s": "2"}, {"s": True}, ["s"]):
        with pytest.raises(CheckpointError, match="redone"):
            WorkflowCheckpoint.from_dict({**plain, "redone": bad})


def test_a_bump_in_a_graph_without_shapes_gives_new_keys_too() -> None:
    keys: list[str] = []

    def build(version: str) -> Workflow:
        def record(ctx: Any) -> str:
            keys.append(str(attempt_key()))
            return version

        return Workflow([Step("a", record, version=version), Step("b", record, ("a",))])

    first = build("1").run_sync(run_id="r")
    assert first.checkpoint is not None and sorted(keys) == ["r/a/1", "r/b/1"]
    keys.clear()
    build("2").run_sync(run_id="r", resume_from=first.checkpoint.to_dict())
    assert sorted(keys) == ["r/a/2", "r/b/2"]


def _asking(keys: list[str], heard: list[Any], version: str) -> Workflow:
    def run(ctx: Any) -> str:
        keys.append(str(attempt_key()))
        heard.append(ask(f"go ahead ({version})?"))
        return f"{version}:{heard[-1]}"

    return Workflow([Step("s", run, version=version)])


def _waiting_of(workflow: Workflow, **options: Any) -> WorkflowCheckpoint:
    with pytest.raises(RunWaiting) as caught:
        workflow.run_sync(run_id="r", **options)
    assert caught.value.checkpoint is not None
    return caught.value.checkpoint


def test_a_bump_of_a_step_waiting_on_a_question_asks_anew_under_a_new_key() -> None:
    keys: list[str] = []
    heard: list[Any] = []
    waiting = _waiting_of(_asking(keys, heard, "1"))
    assert keys == ["r/s/1"]
    keys.clear()
    # The old code's question is not the new code's: an answer to it is refused by name...
    with pytest.raises(ValueError, match=r"'s'.*version"):
        _asking(keys, heard, "2").run_sync(run_id="r", resume_from=waiting.to_dict(),
                                           answers={"s": "yes"})
    assert keys == [] and heard == []
    # ...and an answer recorded before the bump is not handed to the new code: it asks its own.
    answered = answer(waiting, "s", Answer("yes"))
    [row] = audit(_asking(keys, heard, "2"), answered).steps  # audit reads the same rule
    assert (row.action, row.asked) == ("run", ())
    [row] = audit(_asking(keys, heard, "1"), answered).steps
    assert len(row.asked) == 1
    again = _waiting_of(_asking(keys, heard, "2"), resume_from=answered.to_dict())
    assert keys == ["r/s/2"] and heard == []
    assert [q.prompt for q in questions(again).values()] == ["go ahead (2)?"]
    keys.clear()
    done = _asking(keys, heard, "2").run_sync(run_id="r", resume_from=again.to_dict(),
                                              answers={"s": "sure"})
    assert keys == ["r/s/2"] and dict(done.outputs) == {"s": "2:sure"}
    assert replay(_asking(keys, heard, "2"), [waiting, answered, again, done.checkpoint]).violations == ()


class _Interrupted(BaseException):
    pass


def test_a_bump_gives_a_dependent_interrupted_under_the_old_code_a_new_key() -> None:
    keys: list[str] = []

    def build(version: str, interrupt: bool) -> Workflow:
        def a(ctx: Any) -> str:
            keys.append(str(attempt_key()))
            return version

        def b(ctx: Any) -> str:
            keys.append(str(attempt_key()))
            if interrupt:
                raise _Interrupted  # not recorded: the checkpoint cannot know b started
            return f"b of {ctx['a']}"

        return Workflow([Step("a", a, version=version), Step("b", b, ("a",), context="dependencies")])

    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(_Interrupted):
        build("1", True).run_sync(run_id="r", checkpoint_fn=saved.append)
    assert keys == ["r/a/1", "r/b/1"] and "a" in saved[-1].outputs
    keys.clear()
    done = build("2", False).run_sync(run_id="r", resume_from=saved[-1].to_dict())
    assert keys[0] == "r/a/2" and keys[1] != "r/b/1"  # b's input changed: other work
    assert dict(done.outputs) == {"a": "2", "b": "b of 2"}
    # A later resume of the same code does not count again.
    assert done.checkpoint is not None
    keys.clear()
    again = rewind(build("2", False), done.checkpoint, "b")
    build("2", False).run_sync(run_id="r", resume_from=again.to_dict())
    assert keys == ["r/b/3"]


def test_a_rewind_gives_a_dependent_interrupted_under_the_old_input_a_new_key() -> None:
    keys: list[str] = []

    def build(interrupt: bool) -> Workflow:
        def a(ctx: Any) -> int:
            keys.append(str(attempt_key()))
            return len(keys)

        def b(ctx: Any) -> str:
            keys.append(str(attempt_key()))
            if interrupt:
                raise _Interrupted
            return f"b of {ctx['a']}"

        return Workflow([Step("a", a), Step("b", b, ("a",), context="dependencies")])

    saved: list[WorkflowCheckpoint] = []
    with pytest.raises(_Interrupted):
        build(True).run_sync(run_id="r", checkpoint_fn=saved.append)
    assert keys == ["r/a/1", "r/b/1"]
    keys.clear()
    build(False).run_sync(run_id="r", resume_from=rewind(build(False), saved[-1], "a").to_dict())
    assert keys[0] == "r/a/2" and keys[1] != "r/b/1"
