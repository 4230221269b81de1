"""``ekit cache list|show|prune``: what a cache holds, one entry in full, and bounding it.

What users rely on: the commands read a SQLite cache file, a cache directory
or a PostgreSQL URL, exit 0 on success, and turn every bad input (no such
cache, no entry with that key, no bound to prune by) into one ``ekit:`` line
on stderr and exit 2, creating nothing by looking.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from ekit_core import TokenUsage
from ekit_runtime import Cache, DirectoryCache, PatternResult, SqliteCache, Step, Workflow
from tests.support.cli_runs import ekit, one_error_line
from tests.support.queue_backends import fresh_postgres


def _fill(cache: Cache, topics: list[str]) -> None:
    def critique(ctx: Mapping[str, Any]) -> PatternResult[str]:
        return PatternResult(f"critique of {ctx['topic']}", cost=TokenUsage(100, 20, 1))

    for topic in topics:
        asyncio.run(Workflow([Step("critique", critique, cache=True)]).run({"topic": topic}, cache=cache))


@pytest.mark.parametrize("kind", ["sqlite", "directory", "postgres"])
def test_list_show_and_prune(kind: str, tmp_path: Path) -> None:
    if kind == "postgres":
        from ekit_runtime.cache.postgres import PostgresCache

        with fresh_postgres() as url:
            _fill(PostgresCache(url), ["tides", "moons", "stars"])
            _list_show_prune(url, tmp_path)
        return
    where = tmp_path / ("cache.db" if kind == "sqlite" else "cache")
    _fill(SqliteCache(where) if kind == "sqlite" else DirectoryCache(where), ["tides", "moons", "stars"])
    _list_show_prune(str(where), tmp_path)


def _list_show_prune(where: str, cwd: Path) -> None:
    listed = ekit(cwd, "cache", "list", where)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith("3 entries in ")
    assert "critique" in listed.stdout and "saved 100/20/1" in listed.stdout
    assert "read: topic" in listed.stdout
    as_json = json.loads(ekit(cwd, "cache", "list", where, "--json").stdout)
    keys = [e["key"] for e in as_json["entries"]]
    assert len(keys) == 3
    shown = ekit(cwd, "cache", "show", where, keys[0][:12])
    assert shown.returncode == 0, shown.stderr
    entry = json.loads(shown.stdout)
    assert entry["key"] == keys[0] and entry["output"].startswith("critique of ")
    assert set(entry["reads"]) == {"topic"}
    pruned = ekit(cwd, "cache", "prune", where, "--max-entries", "1")
    assert pruned.returncode == 0 and pruned.stdout.startswith("pruned 2 entries")
    assert json.loads(ekit(cwd, "cache", "list", where, "--json").stdout)["entries"][0]["key"] == keys[0]


def test_bad_inputs_are_one_line_and_exit_2(tmp_path: Path) -> None:
    one_error_line(ekit(tmp_path, "cache", "list", str(tmp_path / "none.db")), "no such cache")
    assert not (tmp_path / "none.db").exists()
    where = tmp_path / "cache.db"
    _fill(SqliteCache(where), ["tides"])
    one_error_line(ekit(tmp_path, "cache", "show", str(where), "ffff"), "no entry", "ffff")
    one_error_line(ekit(tmp_path, "cache", "prune", str(where)), "--max-entries")
    one_error_line(ekit(tmp_path, "cache", "prune", str(where), "--max-age", "-5"), "max_age")


_MODULE = '''
from ekit_runtime import Step, Workflow

PROMPT = {prompt!r}


def draft(ctx):
    return "draft"


def critique(ctx):
    return PROMPT + ctx["draft"]


workflow = Workflow([Step("draft", draft), Step("critique", critique, depends_on=("draft",))],
                    on_code_change={policy!r})
'''


@pytest.mark.parametrize("policy", ["again", "keep", "refuse"])
def test_audit_with_the_workflow_shows_steps_changed_since_recorded(policy: str, tmp_path: Path) -> None:
    import importlib
    import sys

    module = tmp_path / f"flow_{policy}.py"
    module.write_text(_MODULE.format(prompt="Critique: ", policy=policy))
    sys.path.insert(0, str(tmp_path))
    try:
        flow = importlib.import_module(module.stem)
        result = asyncio.run(flow.workflow.run())
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(module.stem, None)
    (tmp_path / "cp.json").write_text(json.dumps(result.checkpoint.to_dict()))
    module.write_text(_MODULE.format(prompt="Praise: ", policy=policy))
    audited = ekit(tmp_path, "audit", "cp.json", "--workflow", f"{module.stem}:workflow")
    expected = {"again": "code changed since recorded", "keep": "kept although the code changed",
                "refuse": "code_changed"}[policy]
    assert expected in audited.stdout, audited.stdout + audited.stderr
    assert audited.returncode == (1 if policy == "refuse" else 0)
