"""Early cutoff: when an upstream runs again, items whose input is unchanged keep their output.

What users rely on, iterating on a document or a prompt: a changed
``version`` (or a rewind) of the step a map runs over re-runs it, and then
only the items whose new input differs, by encoded value under the same
key, from the input they were made from; an item-wise chain keeps the
items downstream of a kept item; a mapped step whose own code changed runs
every item again.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_runtime import Step, Workflow
from tests.support.shaped_runs import cutoff_pipeline


def test_only_the_changed_items_and_their_chains_run_again() -> None:
    calls: list[str] = []
    first = cutoff_pipeline(calls, split_version="1").run_sync({"pieces": ["a", "b", "c"]})
    assert first.checkpoint is not None
    calls.clear()
    second = cutoff_pipeline(calls, split_version="2").run_sync(
        {"pieces": ["a", "B2", "c", "d"]}, resume_from=first.checkpoint.to_dict())
    assert calls == ["summarize B2", "summarize d", "critique B2", "critique D"]
    assert second.outputs["merge"] == "A! B2! C! D!"
    assert second.checkpoint is not None and not second.checkpoint.superseded  # all let go


def test_keys_make_a_reordered_input_cost_nothing() -> None:
    calls: list[str] = []
    pieces = [{"id": "p1", "text": "a"}, {"id": "p2", "text": "b"}]
    first = cutoff_pipeline(calls, split_version="1", item_key="id").run_sync({"pieces": pieces})
    assert first.checkpoint is not None
    calls.clear()
    second = cutoff_pipeline(calls, split_version="2", item_key="id").run_sync(
        {"pieces": pieces[::-1]}, resume_from=first.checkpoint.to_dict())
    assert calls == []  # same items under the same keys, in another order
    assert second.outputs["merge"] == "B! A!"

    calls.clear()
    by_position = cutoff_pipeline(calls, split_version="1").run_sync({"pieces": ["a", "b"]})
    assert by_position.checkpoint is not None
    calls.clear()
    cutoff_pipeline(calls, split_version="2").run_sync(
        {"pieces": ["b", "a"]}, resume_from=by_position.checkpoint.to_dict())
    assert sorted(calls) == ["critique A", "critique B", "summarize a", "summarize b"]


def test_a_mapped_step_whose_own_code_changed_runs_every_item() -> None:
    calls: list[str] = []
    first = cutoff_pipeline(calls, split_version="1").run_sync({"pieces": ["a", "b"]})
    assert first.checkpoint is not None
    calls.clear()
    cutoff_pipeline(calls, split_version="2", summary_version="2").run_sync(
        {"pieces": ["a", "b"]}, resume_from=first.checkpoint.to_dict())
    assert sorted(calls) == ["critique A", "critique B", "summarize a", "summarize b"]


@settings(max_examples=60, deadline=None)
@given(old=st.lists(st.sampled_from("abcd"), max_size=6), new=st.lists(st.sampled_from("abcd"), max_size=6))
def test_the_cutoff_keeps_exactly_the_equal_items(old: list[str], new: list[str]) -> None:
    calls: list[str] = []
    first = cutoff_pipeline(calls, split_version="1").run_sync({"pieces": old})
    assert first.checkpoint is not None
    calls.clear()
    second = cutoff_pipeline(calls, split_version="2").run_sync(
        {"pieces": new}, resume_from=first.checkpoint.to_dict())
    changed = [p for i, p in enumerate(new) if i >= len(old) or old[i] != p]
    assert sorted(c for c in calls if c.startswith("summarize")) == sorted(f"summarize {p}" for p in changed)
    assert second.outputs["merge"] == " ".join(p.upper() + "!" for p in new)


def test_what_is_set_aside_survives_every_store(tmp_path: Any) -> None:
    from ekit_core import checkpoint_of
    from ekit_runtime import JournalStore, JsonFileStore, SqliteStore

    calls: list[str] = []
    first = cutoff_pipeline(calls, split_version="1").run_sync({"pieces": ["a", "b"]})
    assert first.checkpoint is not None
    # The state a resume with a new version starts from: nothing re-run yet.
    state = cutoff_pipeline(calls, split_version="2").start_state(resume_from=first.checkpoint)
    aside = checkpoint_of(state)
    assert set(aside.superseded) == {"split", "summarize[0]", "summarize[1]", "critique[0]", "critique[1]"}
    for store in (JsonFileStore(tmp_path / "cp.json"), JournalStore(tmp_path / "cp.jsonl"),
                  SqliteStore(tmp_path / "cp.db", run_id="r")):
        store.save(aside)
        loaded = store.load()
        assert loaded is not None and dict(loaded.superseded) == dict(aside.superseded), store
        calls.clear()
        again = cutoff_pipeline(calls, split_version="2").run_sync({"pieces": ["a", "c"]}, resume_from=loaded)
        assert calls == ["summarize c", "critique C"] and again.outputs["merge"] == "A! C!"


def test_a_half_done_map_resumes_after_its_upstream_changed() -> None:
    calls: list[str] = []
    saved: list[Any] = []
    flaky = {"b": 1}

    def summarize(ctx: Any) -> str:
        calls.append(ctx["split"])
        if flaky.get(ctx["split"]):
            flaky[ctx["split"]] -= 1
            raise ConnectionError("overloaded")
        return ctx["split"].upper()

    def wf(version: str) -> Workflow:
        return Workflow([
            Step("split", lambda ctx: ctx["pieces"], version=version),
            Step("summarize", summarize, ("split",), map_over="split", context="dependencies"),
        ])

    with pytest.raises(ConnectionError):
        wf("1").run_sync({"pieces": ["a", "b"]}, checkpoint_fn=saved.append)
    assert "summarize[0]" in saved[-1].outputs and "summarize" not in saved[-1].outputs
    calls.clear()
    result = wf("2").run_sync({"pieces": ["a", "c"]}, resume_from=saved[-1].to_dict())
    assert calls == ["c"] and result.outputs["summarize"] == ["A", "C"]


def test_only_the_skips_below_a_changed_step_are_decided_again() -> None:
    asked: list[str] = []

    def cond(name: str) -> Any:
        def holds(ctx: Any) -> bool:
            asked.append(name)
            return False

        holds.__qualname__ = f"never_{name}"
        return holds

    def wf(version: str) -> Workflow:
        return Workflow([
            Step("a", lambda ctx: 1, version=version),
            Step("below", lambda ctx: 2, ("a",), when=cond("below")),
            Step("apart", lambda ctx: 3, when=cond("apart")),
        ])

    first = wf("1").run_sync()
    assert first.checkpoint is not None and set(first.checkpoint.skipped) == {"below", "apart"}
    asked.clear()
    second = wf("2").run_sync(resume_from=first.checkpoint.to_dict())
    assert asked == ["below"]  # "apart" needs nothing that changed: its skip stands
    assert second.checkpoint is not None and set(second.checkpoint.skipped) == {"below", "apart"}
