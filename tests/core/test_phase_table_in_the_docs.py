"""docs/concepts.md shows the phase table the fold runs on, as the code renders it."""

from __future__ import annotations

from tools.phase_table import CONCEPTS, in_the_docs, rendered

REGENERATE = "python -m tools.phase_table --write"


def test_the_phase_table_in_the_docs_is_the_one_in_the_code() -> None:
    shown = in_the_docs(CONCEPTS.read_text(encoding="utf-8"))
    assert shown == rendered(), (
        f"docs/concepts.md shows another phase table than ekit_core.transitions.TRANSITIONS; "
        f"regenerate it with: {REGENERATE}")


def test_the_table_names_every_phase_and_every_input_the_shell_sends() -> None:
    table = rendered()
    for phase in ("waiting", "ready", "delayed", "gated", "running", "recorded", "failed",
                  "asked", "skipped", "held", "collecting"):
        assert f"| {phase} |" in table
    for kind in ("Start", "Began", "Succeeded", "Failed", "Denied", "Interrupted", "Asked",
                 "Skipped", "Cancelled"):
        assert f"`{kind}`" in table
