"""The documents hold together: every relative link in the project's Markdown files (README, docs/, the
maps and logs beside them) names a file that exists and, where it names a heading (``page.md#anchor``), a
heading of that page; the README stays an entry page of a size a newcomer reads, and every docs page is
listed in the site's navigation (``mkdocs.yml``) and in ``docs/index.md``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted([*REPO.glob("*.md"), *(REPO / "docs").rglob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
README_LIMIT = 30_000  # bytes: the field's READMEs are 10-30 KB; guides live in docs/


def prose(text: str) -> str:
    """``text`` without its fenced code blocks (a ``#`` there is a shell comment, a ``[x](y)`` is code)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of ``page``: lower case, punctuation dropped, spaces to hyphens,
    repeats numbered ``-1``, ``-2``."""
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", prose(page.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    return [target for target in LINK.findall(prose(page.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto:


@pytest.mark.parametrize("page", DOCUMENTS, ids=lambda page: page.relative_to(REPO).as_posix())
def test_every_relative_link_names_a_file_and_heading_that_exist(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with that anchor in {resolved.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_the_checker_finds_a_broken_file_and_a_broken_anchor(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A title\n\n## Two words\n\n[ok](#two-words) [bad](#three) [gone](missing.md)\n"
                    "```\n# not a heading\n[not a link](nowhere.md)\n```\n")
    assert anchors(page) == {"a-title", "two-words"}
    assert relative_links(page) == ["#two-words", "#three", "missing.md"]


def test_the_readme_is_an_entry_page_and_every_guide_is_reachable() -> None:
    assert (REPO / "README.md").stat().st_size <= README_LIMIT
    guides = {path.relative_to(REPO / "docs").as_posix() for path in (REPO / "docs").rglob("*.md")}
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    listed = set()
    for entry in config["nav"]:
        listed.update(entry.values() if isinstance(entry, dict) else [entry])
    assert listed == guides, f"mkdocs.yml nav and docs/ differ: {sorted(listed ^ guides)}"
    index_links = {link.partition("#")[0] for link in relative_links(REPO / "docs" / "index.md")}
    assert guides - {"index.md"} <= index_links, f"docs/index.md does not link {sorted(guides - index_links)}"
    readme_links = {link.partition("#")[0] for link in relative_links(REPO / "README.md")}
    assert "docs/index.md" in readme_links
