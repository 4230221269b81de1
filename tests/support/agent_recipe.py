"""The tool-calling agent of docs/recipes.md, taken from the page itself, and how a person drives it.

The Ctrl-C test and its child process run the recipe's own code (its blocks,
by heading), so the test cannot pass against a copy that has drifted from
what the page shows.
"""

from __future__ import annotations

import re
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ekit_runtime import JsonFileStore, RunWaiting, Workflow, WorkflowResult

RECIPES = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"
HEADING = "## A tool-calling agent on the OpenAI SDK"
TASK = {"task": "Where should I go today?"}


def recipe_namespace(blocks: int) -> dict[str, Any]:
    """Run the section's first ``blocks`` python blocks (the agent; then the stand-in) in a
    fresh module's namespace, as the docs test does, and return it."""
    text = RECIPES.read_text(encoding="utf-8")
    section = text[text.index(HEADING):]
    section = section[: section.find("\n## ", len(HEADING))]
    sources = re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)
    assert len(sources) >= blocks, f"{HEADING!r} has {len(sources)} python blocks"
    module = types.ModuleType("agent_recipe_page")
    sys.modules[module.__name__] = module  # (a block's classes look their module up)
    for number, source in enumerate(sources[:blocks], 1):
        exec(compile(source, f"recipes.md[{HEADING[3:]} {number}]", "exec"), module.__dict__)
    return module.__dict__


def drive(namespace: dict[str, Any], client: Any, store: JsonFileStore, answer: str,
          said: Callable[[str], None]) -> WorkflowResult:
    """Run the agent to its end from ``store`` (or from the start), answering each question
    the way a person would: the run parks, and a resume hands it the answer."""
    answers: dict[str, str] = {}
    while True:
        try:
            workflow: Workflow = namespace["trip_agent"](client)
            return workflow.run_sync(TASK, resume_from=store.load(), checkpoint_fn=store, answers=answers)
        except RunWaiting as parked:
            for name, question in parked.questions.items():
                said(f"asked {name}: {question.prompt}")
            answers = dict.fromkeys(parked.questions, answer)
