"""Every ``ekit`` command that imports workflows takes the same sources: a Workflow or a dict of them.

``ekit worker --workflows mod:WORKFLOWS`` takes a dict of name -> Workflow;
``ekit audit``, ``replay``, ``rewind``, ``graph`` and ``ui`` take that very
dict as ``--workflow``, picking the workflow whose graph the checkpoint
records (or the only one), or the one named as ``MODULE:ATTR:NAME``. A dict
that leaves the choice open, an unknown name and an empty dict are one
error line naming the choices, exit 2.
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from ekit_core import WorkflowCheckpoint
from tests.support.cli_runs import ekit, one_error_line

FLOWS = '''
from ekit_runtime import Step, Workflow

hello = Workflow([Step("greet", lambda ctx: "hi"),
                  Step("shout", lambda ctx: ctx["greet"].upper(), ("greet",))])
other = Workflow([Step("count", lambda ctx: 1)])
WORKFLOWS = {"hello": hello, "other": other}
ONE = {"hello": hello}
NONE = {}
'''


@pytest.fixture(scope="module")
def flows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("dicts")
    (d / "flows.py").write_text(FLOWS, encoding="utf-8")
    hello = runpy.run_path(str(d / "flows.py"))["hello"]
    saved: list[WorkflowCheckpoint] = []
    hello.run_sync(checkpoint_fn=saved.append)
    (d / "run.jsonl").write_text("".join(json.dumps(c.to_dict()) + "\n" for c in saved), encoding="utf-8")
    return d


@pytest.mark.timeout(120)  # processes, seconds each on a loaded machine
def test_audit_and_replay_pick_the_dict_s_workflow_whose_graph_the_checkpoint_records(flows: Path) -> None:
    for command in ("audit", "replay"):
        proc = ekit(flows, command, "run.jsonl", "--workflow", "flows:WORKFLOWS", "--json")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)
    rewound = ekit(flows, "rewind", "run.jsonl", "--workflow", "flows:WORKFLOWS", "--step", "shout")
    assert rewound.returncode == 0, rewound.stderr
    assert list(json.loads(rewound.stdout)["outputs"]) == ["greet"]


@pytest.mark.timeout(120)
def test_graph_takes_a_dict_of_one_or_a_named_entry(flows: Path) -> None:
    for spec in ("flows:ONE", "flows:WORKFLOWS:hello", "flows:hello"):
        proc = ekit(flows, "graph", "--workflow", spec)
        assert proc.returncode == 0, (spec, proc.stderr)
        assert [s["name"] for s in json.loads(proc.stdout)["steps"]] == ["greet", "shout"]


@pytest.mark.timeout(120)
def test_a_dict_that_leaves_the_choice_open_is_one_error_line_naming_the_choices(flows: Path) -> None:
    open_choice = ekit(flows, "graph", "--workflow", "flows:WORKFLOWS")
    one_error_line(open_choice, "'hello'", "'other'", "flows:WORKFLOWS:NAME")
    one_error_line(ekit(flows, "graph", "--workflow", "flows:WORKFLOWS:nope"), "'nope'", "'hello'", "'other'")
    one_error_line(ekit(flows, "graph", "--workflow", "flows:NONE"), "flows:NONE", "no workflow")
    # The checkpoint's graph is none of the dict's: the choice stays open.
    one_error_line(ekit(flows, "audit", "run.jsonl", "--workflow", "flows:NONE"), "no workflow")


def test_the_worker_takes_the_same_sources(flows: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ekit_runtime.cli import InputError
    from ekit_runtime.queue.cli import _registry

    monkeypatch.chdir(flows)
    monkeypatch.syspath_prepend(str(flows))
    assert sorted(_registry("flows:WORKFLOWS")) == ["hello", "other"]
    assert list(_registry("flows:WORKFLOWS:other")) == ["other"]
    assert list(_registry("flows:hello")) == ["hello"]
    with pytest.raises(InputError, match="no workflow named 'nope'"):
        _registry("flows:WORKFLOWS:nope")
