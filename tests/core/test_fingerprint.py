"""Graph fingerprints and format versions: resuming refuses a checkpoint of another graph."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ekit_core import (
    FORMAT_VERSION,
    GraphMismatchError,
    GraphSpec,
    UnsupportedFormatError,
    WorkflowCheckpoint,
)
from ekit_runtime import Step, Workflow
from tests.support.helpers import recorded_graph

DIAMOND_STEPS = {"a": [], "b": ["a"], "c": ["a"], "d": ["b", "c"]}
# Pinned: a change to the hashing rule would orphan every stored checkpoint's
# fingerprint, so it must be a deliberate, visible change.
DIAMOND_FINGERPRINT = "sha256:ab1e51f76a5cda5a138744b4d3ea8047655d792a8263037db60640bf81c52a9b"


def _workflow(steps: dict[str, list[str]], calls: list[str]) -> Workflow:
    def make(name: str) -> Step:
        def run(ctx: dict[str, Any]) -> str:
            calls.append(name)
            return name.upper()

        return Step(name, run, tuple(steps[name]))

    return Workflow([make(n) for n in steps])


def _recorded(steps: dict[str, list[str]]) -> list[WorkflowCheckpoint]:
    saved: list[WorkflowCheckpoint] = []
    _workflow(steps, []).run_sync(checkpoint_fn=saved.append)
    return saved


def test_known_fingerprint_is_pinned() -> None:
    assert GraphSpec.of(DIAMOND_STEPS).fingerprint == DIAMOND_FINGERPRINT


def test_fingerprint_ignores_declaration_and_dependency_order() -> None:
    shuffled = GraphSpec.of([("d", ["c", "b"]), ("c", ["a"]), ("a", []), ("b", ["a"])])
    assert shuffled.fingerprint == DIAMOND_FINGERPRINT
    assert GraphSpec.of({**DIAMOND_STEPS, "d": ["b"]}).fingerprint != DIAMOND_FINGERPRINT
    assert GraphSpec.of({**DIAMOND_STEPS, "e": []}).fingerprint != DIAMOND_FINGERPRINT


@pytest.mark.parametrize("seed", ["0", "1", "12345"])
def test_fingerprint_is_stable_across_processes(seed: str) -> None:
    code = (
        "from ekit_core import GraphSpec\n"
        f"print(GraphSpec.of({DIAMOND_STEPS!r}).fingerprint)\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == DIAMOND_FINGERPRINT


def test_checkpoints_record_format_version_fingerprint_and_graph() -> None:
    data = _recorded(DIAMOND_STEPS)[0].to_dict()
    assert data["format_version"] == FORMAT_VERSION
    assert data["fingerprint"] == DIAMOND_FINGERPRINT
    assert "graph" not in data  # the mapping files written before the texts held
    assert recorded_graph(data) == DIAMOND_STEPS
    order = list(DIAMOND_STEPS)
    assert data["graph_steps"] == "|".join(order)
    assert data["graph_needs"] == "|".join(",".join(DIAMOND_STEPS[n]) for n in order)


def test_resuming_into_another_graph_raises_before_any_step_runs() -> None:
    partial = _recorded(DIAMOND_STEPS)[1]
    changed = {"a": [], "b": [], "d": ["b"], "e": ["a"]}
    calls: list[str] = []
    with pytest.raises(GraphMismatchError) as info:
        _workflow(changed, calls).run_sync(resume_from=partial)
    assert calls == []
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "added: 'e'" in message
    assert "removed: 'c'" in message
    assert "dependencies changed: 'b', 'd'" in message
    assert "allow_graph_change=True" in message
    changes = info.value.changes
    assert (changes.added, changes.removed, changes.changed) == (("e",), ("c",), ("b", "d"))


def test_resuming_from_a_dict_into_another_graph_also_raises() -> None:
    partial = _recorded(DIAMOND_STEPS)[0].to_dict()
    with pytest.raises(GraphMismatchError):
        asyncio.run(_workflow({**DIAMOND_STEPS, "e": ["d"]}, []).run(resume_from=partial))


def test_allow_graph_change_resumes_anyway() -> None:
    partial = _recorded(DIAMOND_STEPS)[0]  # "a" recorded
    grown = {**DIAMOND_STEPS, "e": ["d"]}
    calls: list[str] = []
    saved: list[WorkflowCheckpoint] = []
    result = _workflow(grown, calls).run_sync(
        resume_from=partial, allow_graph_change=True, checkpoint_fn=saved.append
    )
    assert "a" not in calls and sorted(calls) == ["b", "c", "d", "e"]
    assert set(result.outputs) == set(grown)
    assert saved[-1].fingerprint == GraphSpec.of(grown).fingerprint


def test_an_executionkit_checkpoint_without_fingerprint_resumes() -> None:
    legacy = {
        "step_index": 1,
        "outputs": {"a": "A"},
        "cost": {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0},
    }
    calls: list[str] = []
    result = _workflow(DIAMOND_STEPS, calls).run_sync(resume_from=legacy)
    assert sorted(calls) == ["b", "c", "d"]
    assert result.outputs["a"] == "A"


def test_a_newer_format_version_is_refused_clearly() -> None:
    data = _recorded(DIAMOND_STEPS)[0].to_dict()
    data["format_version"] = 99
    calls: list[str] = []
    with pytest.raises(UnsupportedFormatError, match="version 99 was written by a newer ekit"):
        _workflow(DIAMOND_STEPS, calls).run_sync(resume_from=data)
    assert calls == []


def _reference_fingerprint(steps: dict[str, list[str]]) -> str:
    """The hashing rule as first written: sha256 of the JSON of [[name, sorted deps]] by name."""
    canonical = json.dumps(
        sorted([name, sorted(set(deps))] for name, deps in steps.items()),
        ensure_ascii=True, separators=(",", ":"),
    )
    return "sha256:" + hashlib.sha256(canonical.encode("ascii")).hexdigest()


_names = st.text(min_size=1, max_size=6) | st.sampled_from(
    ['a"b', "back\\slash", "tab\there", "del\x7f", "é", "日本", "\x00", "plain", "s1", "s10"]
)


@given(st.lists(_names, min_size=1, max_size=12, unique=True), st.data())
def test_the_fingerprint_is_the_pinned_hashing_rule_for_any_names(
    names: list[str], data: st.DataObject
) -> None:
    # Dependencies only on earlier names: acyclic. Any number of them, repeated.
    steps = {
        name: data.draw(st.lists(st.sampled_from(names[:i]), max_size=4)) if i else []
        for i, name in enumerate(names)
    }
    assert GraphSpec.of(steps).fingerprint == _reference_fingerprint(steps)
