"""Every link between the project's pages leads somewhere: the file exists, and so does its heading.

A reader who follows a link from the README, the changelog, a page of
``docs/`` or a results note in ``benchmarks/results/`` lands on a file of the
checkout, and, when the link names a heading (``queue.md#workers``), on that
heading, spelled the way GitHub spells its anchors. Links to other sites are
not followed (the suite runs offline). Pages move and headings get renamed:
without this test a broken link is found by a reader, not by CI.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("**/*.md"),
     *(ROOT / "benchmarks" / "results").glob("*.md")]
)
# [text](target) not preceded by "!" is a link; an image's target must exist too.
LINK = re.compile(r"\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def _prose(path: Path) -> str:
    """The page without its code: a link written inside a code block or span is an example."""
    return CODE_SPAN.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation gone, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every anchor of a page: each heading's slug (repeats numbered, as GitHub does) and HTML ones."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    found = set(HTML_ANCHOR.findall(text))
    for _, heading in HEADING.findall(text):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """The links of ``path`` (a page under ``root``) that lead nowhere, each with the reason."""
    broken = []
    for target in LINK.findall(_prose(path)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: another site
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            shown = dest.relative_to(root) if dest.is_relative_to(root) else dest
            broken.append(f"{target}: no file {shown}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(root)}")
    return broken


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_of_a_page_leads_to_a_file_and_heading(path: Path) -> None:
    assert broken_links(path) == []


def test_the_checker_sees_a_broken_file_a_broken_heading_and_spares_code(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# The `queue`: a guide\n\n## Workers\n\n## Workers\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#the-queue-a-guide) [ok](other.md#workers-1) [ok](#here) [web](https://x.org/y)\n"
        "[gone](missing.md) [no heading](other.md#nowhere)\n\n# Here\n\n"
        "```text\n[in code](missing-too.md)\n```\n`[in a span](missing-three.md)`\n"
    )
    found = [why.split(":")[0] for why in broken_links(page, tmp_path)]
    assert found == ["missing.md", "other.md#nowhere"]

