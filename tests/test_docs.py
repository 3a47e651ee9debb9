"""The documents hold together: every relative link in the project's Markdown files (README, docs/, the
maps and logs beside them) names a file that exists and, where it names a heading (``page.md#anchor``), a
heading of that page; the README stays an entry page of a size a newcomer reads, and every docs page, and
every root file the site shows as a page (``docs/site_build.py``'s ``ROOT_PAGES``), is listed in the site's
navigation (``mkdocs.yml``) and linked from ``docs/index.md``; the API reference documents every public
name, by its public path only (``lightning_zero.X``, ``lightning_zero.checkpoint.X``). The built site is
checked by ``make docs`` and ``tests/test_docs_site.py``."""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted([*REPO.glob("*.md"), *(REPO / "docs").rglob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
README_LIMIT = 15_000  # bytes: an entry page; guides live in docs/
PUBLIC_MODULES = {"lightning_zero": "lightning_zero/__init__.py",
                  "lightning_zero.checkpoint": "lightning_zero/checkpoint/__init__.py"}


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


def site_build() -> Any:
    """docs/site_build.py, the site's MkDocs hooks (the standard library only at its top: no MkDocs needed)."""
    spec = importlib.util.spec_from_file_location("site_build", REPO / "docs" / "site_build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def site_config() -> dict[str, Any]:
    """mkdocs.yml (plain YAML: no ``!!python/name:`` tags, which ``safe_load`` refuses)."""
    return yaml.safe_load((REPO / "mkdocs.yml").read_text())


def nav_pages(nav: Any) -> Iterator[str]:
    """The page files of a MkDocs ``nav``, sections (``{"title": [...]}``) walked into."""
    if isinstance(nav, str):
        yield nav
    elif isinstance(nav, list):
        for entry in nav:
            yield from nav_pages(entry)
    elif isinstance(nav, dict):
        for value in nav.values():
            yield from nav_pages(value)


def public_names(module: str) -> set[str]:
    """``module``'s ``__all__``, read from its source (nothing imported)."""
    tree = ast.parse((REPO / PUBLIC_MODULES[module]).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{module} has no __all__")


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
    root_pages = site_build().ROOT_PAGES
    pages = guides | set(root_pages.values())
    listed = set(nav_pages(site_config()["nav"]))
    assert listed == pages, f"mkdocs.yml nav and the site's pages differ: {sorted(listed ^ pages)}"
    index_links = {link.partition("#")[0] for link in relative_links(REPO / "docs" / "index.md")}
    linked = guides - {"index.md"} | {f"../{source}" for source in root_pages}
    assert linked <= index_links, f"docs/index.md does not link {sorted(linked - index_links)}"
    readme_links = {link.partition("#")[0] for link in relative_links(REPO / "README.md")}
    assert "docs/index.md" in readme_links


def test_nav_pages_walks_into_sections() -> None:
    nav = ["index.md", {"Guides": [{"A": "a.md"}, "b.md"]}, {"Reference": [{"X": "reference/x.md"}]}]
    assert list(nav_pages(nav)) == ["index.md", "a.md", "b.md", "reference/x.md"]


def test_the_api_reference_documents_every_public_name_by_its_public_path() -> None:
    """``::: lightning_zero.X`` / ``::: lightning_zero.checkpoint.X`` for every name of those ``__all__`` (a
    name both export may appear under either), and nothing else: the modules that define them move."""
    referenced = re.findall(r"^::: *([\w.]+)", "\n".join(
        page.read_text() for page in sorted((REPO / "docs" / "reference").glob("*.md"))), flags=re.M)
    public = {f"{module}.{name}" for module in PUBLIC_MODULES for name in public_names(module)}
    assert not set(referenced) - public, f"the reference names non-public paths: {sorted(set(referenced) - public)}"
    assert len(referenced) == len(set(referenced)), "a name is documented twice"
    documented = {path.rsplit(".", 1)[1] for path in referenced}
    missing = {name for module in PUBLIC_MODULES for name in public_names(module)} - documented
    assert not missing, f"public names without a reference entry: {sorted(missing)}"


def test_the_site_points_links_at_its_own_pages_and_names_files_it_lacks() -> None:
    hooks = site_build()
    assert hooks.site_target("../BENCHMARKS.md#test-tiers", "getting-started.md") == "project/benchmarks.md#test-tiers"
    assert hooks.site_target("../../ARCHITECTURE.md", "reference/checkpoint.md") == "../project/architecture.md"
    assert hooks.site_target("docs/benchmarks.md", "project/benchmarks.md") == "../benchmarks.md"
    assert hooks.site_target("#engine-benchenginepy", "project/benchmarks.md") == "#engine-benchenginepy"
    assert hooks.site_target("tiers.md#the-data-position", "index.md") == "tiers.md#the-data-position"
    assert hooks.site_target("../bench/HISTORY.md", "benchmarks.md") is None
    assert hooks.site_links("earlier runs are in [bench/HISTORY.md](../bench/HISTORY.md), `[x](y.md)`",
                            "benchmarks.md") == "earlier runs are in `bench/HISTORY.md`, `[x](y.md)`"
    assert hooks.site_links("[the notes](bench/HISTORY.md) and [figures](BENCHMARKS.md)", "project/architecture.md") == (
        "the notes (`bench/HISTORY.md` in the repository) and [figures](benchmarks.md)")


def test_the_site_makes_githubs_anchors_and_lists_under_a_line_of_text() -> None:
    hooks = site_build()
    assert hooks.github_slug("Checkpoint save beside DeepSpeed ZeRO-2 (bench/checkpoint.py --peers)") == (
        "checkpoint-save-beside-deepspeed-zero-2-benchcheckpointpy---peers")
    assert hooks.blank_line_before_lists("Refused:\n- one\n- two\n  more\n\n```\ntext\n- code\n```") == (
        "Refused:\n\n- one\n- two\n  more\n\n```\ntext\n- code\n```")


def test_the_built_sites_check_names_a_missing_page_image_and_anchor(tmp_path: Path) -> None:
    (tmp_path / "guide").mkdir()
    (tmp_path / "guide" / "index.html").write_text('<h2 id="here">x</h2>')
    (tmp_path / "img.png").write_bytes(b"")
    page = tmp_path / "index.html"
    page.write_text('<a href="guide/#here">ok</a> <a href="#top" id="top">ok</a> <a href="https://x.org/">out</a>'
                    '<a href="gone/">1</a> <a href="guide/#there">2</a> <img src="img.png"> <img src="none.png">')
    assert site_build().broken_links(page, tmp_path) == [
        "<a> gone/: no such file in the site", "<a> guide/#there: no element with that id",
        "<img> img.png: an empty file", "<img> none.png: no such file in the site"]
