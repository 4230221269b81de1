"""A run's page says which recorded steps changed since, where it knows the run's workflow (issue 45).

The promise (docs/dashboard.md, "Changed since recorded"): with the
workflow known (``ekit ui --queue URL --workflows M:A``, a store file's
``--workflow``), each recorded step whose ``version`` tag or code
fingerprint differs from the workflow's now is listed with how it changed,
marked in the step table, and the audit is the workflow's (what a resume by
it does, its code policies included); a step that runs again only because a
dependency changed is not listed. Without the workflow the page says it
cannot tell and how to let it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import urllib.request
from html import unescape
from pathlib import Path
from typing import Any

import pytest

from ekit_core import changed_since_recorded
from ekit_runtime import JsonFileStore, Step, Workflow
from ekit_runtime.queue import SqliteQueue, Worker
from ekit_runtime.ui import FileSource, QueueSource
from ekit_runtime.ui.pages import run_page


def plan(ctx: object) -> int:
    return 1


def draft(ctx: dict[str, int]) -> int:
    return ctx["plan"] + 1


def draft_edited(ctx: dict[str, int]) -> int:
    return ctx["plan"] + 2  # the code changed


def publish(ctx: dict[str, int]) -> int:
    return ctx["draft"] * 10


def workflow(version: str, drafting: object) -> Workflow:
    return Workflow([Step("plan", plan, version=version), Step("draft", drafting, ("plan",)),
                     Step("publish", publish, ("draft",), on_code_change="keep")], on_code_change="again")


BEFORE = workflow("1", draft)
AFTER = workflow("2", draft_edited)
REGISTRY = {"wf": AFTER}
"""What ``ekit ui --workflows`` imports in the command's test below."""


def test_a_queued_runs_page_lists_what_changed_against_the_registered_workflow(tmp_path: Path) -> None:
    queue = SqliteQueue(str(tmp_path / "q.db"))
    run_id = queue.submit("wf", {})
    asyncio.run(Worker(queue, {"wf": BEFORE}).run_until_idle())
    assert queue.status(run_id).status == "finished"

    view = QueueSource(queue, "q", {"wf": AFTER}).view(run_id)
    assert view is not None and view.changed is not None
    assert list(view.changed) == ["plan", "draft"]  # publish runs again, but only for draft's sake
    assert view.changed["plan"] == "its version changed from '1' to '2'"
    assert view.changed["draft"].startswith("its code changed (fingerprint ")
    # A finished run's steps stay drawn as recorded, though a resume by the workflow would redo them.
    assert view.states == {"plan": "recorded", "draft": "recorded", "publish": "recorded"}
    html = unescape(run_page("q", view, None))
    section = html[html.index('<section id="changed">'):]
    section = section[:section.index("</section>")]
    assert "<b>plan</b>: its version changed from '1' to '2'" in section
    assert "<b>draft</b>: its code changed" in section and "<b>publish</b>" not in section
    assert html.count('class="changed"') == 2 and html.count("changed since recorded</span>") == 2
    # Audited as the registered workflow: its code is compared, as a resume by it would.
    assert "its code changed since recorded (fingerprint" in view.report.format()  # type: ignore[union-attr]

    unchanged = QueueSource(queue, "q", {"wf": BEFORE}).view(run_id)
    assert unchanged is not None and unchanged.changed == {}
    assert "nothing: each recorded step's version and code are the workflow's now" in unescape(
        run_page("q", unchanged, None))

    unknown = QueueSource(queue, "q").view(run_id)
    assert unknown is not None and unknown.changed is None
    page = unescape(run_page("q", unknown, None))
    assert 'id="changed-unknown"' in page and "--workflows MODULE:ATTR" in page
    assert 'class="changed"' not in page
    queue.close()


def test_a_store_files_page_compares_with_its_workflow(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    BEFORE.run_sync(checkpoint_fn=JsonFileStore(str(path)))
    source = FileSource(str(path), AFTER.graph, {"plan": "2"}, workflow=AFTER)
    view = source.read()
    assert view.changed == changed_since_recorded(AFTER, view.checkpoint)  # type: ignore[arg-type]
    assert list(view.changed or {}) == ["plan", "draft"]
    assert 'id="changed-unknown"' in run_page("f", FileSource(str(path)).read(), None)


def test_a_step_kept_by_its_policy_is_listed_and_the_audit_says_it_was_kept(tmp_path: Path) -> None:
    def publish_edited(ctx: dict[str, int]) -> int:
        return ctx["draft"] * 100

    after = Workflow([Step("plan", plan, version="1"), Step("draft", draft, ("plan",)),
                      Step("publish", publish_edited, ("draft",), on_code_change="keep")],
                     on_code_change="again")
    cp = BEFORE.run_sync().checkpoint
    assert list(changed_since_recorded(after, cp)) == ["publish"]
    path = tmp_path / "run.json"
    JsonFileStore(str(path))(cp)
    view = FileSource(str(path), after.graph, None, workflow=after).read()
    assert "kept although the code changed since recorded" in view.report.format()  # type: ignore[union-attr]


@pytest.mark.timeout(120)
def test_ekit_ui_workflows_names_the_registry_it_compares_with(tmp_path: Path, capsys: Any) -> None:
    from ekit_runtime.cli import main

    db = str(tmp_path / "q.db")
    with SqliteQueue(db) as queue:
        run_id = queue.submit("wf", {})
        asyncio.run(Worker(queue, {"wf": BEFORE}).run_until_idle())
    spec = f"{__name__}:REGISTRY"
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", os.getcwd())}
    proc = subprocess.Popen([sys.executable, "-m", "ekit_runtime", "ui", "--queue", db, "--workflows", spec],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        with urllib.request.urlopen(f"{url}run/{run_id}", timeout=60) as r:
            page = unescape(r.read().decode())
        assert "<b>plan</b>: its version changed from '1' to '2'" in page
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert main(["ui", str(tmp_path / "x.json"), "--workflows", spec]) == 2
    assert "--workflows goes with --queue" in capsys.readouterr().err
