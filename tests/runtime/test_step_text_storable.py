"""A step name or version tag that no store can write is refused when the step
or the workflow is built, naming the step and the field, before any step runs.

Every store writes UTF-8, which cannot hold a lone surrogate (what
``os.listdir`` returns for a file name that is not UTF-8). Such a name used
to pass every check and fail at the first save, after paid work, with the
store's or the driver's own error. Any other text is accepted, and stored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ekit_runtime import JournalStore, JsonFileStore, SqliteStore, Step, Workflow

SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
# Any text UTF-8 can hold (hypothesis leaves surrogates out of st.text()).
TEXT = st.text(min_size=1, max_size=12)


@st.composite
def unencodable(draw: st.DrawFn) -> str:
    """Text holding at least one lone surrogate, anywhere in it."""
    return draw(TEXT | st.just("")) + draw(SURROGATES) + draw(st.text(max_size=4))


def _first_surrogate(text: str) -> tuple[str, int]:
    i = next(i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)
    return text[i], i


def body(context: Any) -> str:
    return "out"


@given(unencodable())
def test_a_step_name_utf8_cannot_encode_is_refused_by_the_workflow(name: str) -> None:
    char, at = _first_surrogate(name)
    with pytest.raises(ValueError) as caught:
        Workflow([Step("ok", body), Step(name, body, ("ok",))])
    assert str(caught.value) == (
        f"step {name!r}: name holds {char!r} at {at}, which UTF-8 cannot encode, "
        "so no store could save it"
    )


@given(unencodable())
def test_a_step_name_utf8_cannot_encode_is_refused_by_a_step_with_options(name: str) -> None:
    with pytest.raises(ValueError, match=r"^step .*: name holds .* which UTF-8 cannot encode"):
        Step(name, body, timeout=5.0)


@given(unencodable())
def test_a_version_utf8_cannot_encode_is_refused_by_the_step(version: str) -> None:
    char, at = _first_surrogate(version)
    with pytest.raises(ValueError) as caught:
        Step("tagged", body, version=version)
    assert str(caught.value) == (
        f"step 'tagged': version holds {char!r} at {at}, which UTF-8 cannot encode, "
        "so no store could save it"
    )


def test_a_refused_name_fails_before_any_step_runs(tmp_path: Path) -> None:
    ran: list[str] = []
    store = JsonFileStore(tmp_path / "run.json")
    with pytest.raises(ValueError, match=r"^step 'bad\\udc80': name holds"):
        Workflow(
            [Step("paid", lambda ctx: ran.append("paid")), Step("bad\udc80", body, ("paid",))]
        ).run_sync(checkpoint_fn=store)
    assert ran == []  # it used to run, then fail at its first save
    assert store.load() is None


@pytest.mark.parametrize("kind", ["json", "journal", "sqlite"])
@settings(max_examples=15, deadline=None)
@given(name=TEXT, version=TEXT)
@example(name="a\x00b", version="v\x00")  # PostgreSQL alone cannot hold NUL: its store says so
def test_any_other_name_and_version_is_accepted_and_stored(
    tmp_path_factory: pytest.TempPathFactory, kind: str, name: str, version: str
) -> None:
    """The other side of the rule: text UTF-8 can hold (NUL and other control
    characters included) builds, runs, saves and resumes in every file store."""
    folder = tmp_path_factory.mktemp(kind)
    store: Any = {
        "json": lambda: JsonFileStore(folder / "run.json"),
        "journal": lambda: JournalStore(folder / "run.jsonl"),
        "sqlite": lambda: SqliteStore(folder / "run.db", run_id="r"),
    }[kind]()
    try:
        workflow = Workflow([Step(name, body, version=version)])
        workflow.run_sync(checkpoint_fn=store)
        loaded = store.load()
        assert loaded is not None and dict(loaded.outputs) == {name: "out"}
        ran: list[str] = []
        again = Workflow([Step(name, lambda ctx: ran.append(name), version=version)])
        assert again.run_sync(resume_from=loaded).outputs[name] == "out" and ran == []
    finally:
        close = getattr(store, "close", None)
        if close is not None:
            close()
