"""MkDocs hooks for the site (mkdocs.yml's ``hooks``): the pages the repository keeps outside ``docs/``, links
that work on the site, GitHub's heading anchors, and a check of the built site.

* **Pages from the repository's root.** ``ARCHITECTURE.md``, ``BENCHMARKS.md`` and ``COMPATIBILITY.md`` stay
  where they are, the only copy; every build reads them into the site as the pages of ``ROOT_PAGES``.
* **Links.** A page's links are written for the repository (``docs/index.md`` links ``../BENCHMARKS.md``,
  ``BENCHMARKS.md`` links ``docs/benchmarks.md``) so that they work on any Markdown viewer; the build points
  each at the page of the site that holds its target. A link to a file that is no page of the site
  (``bench/HISTORY.md``) becomes the file's path as code: the site has no copy of it.
* **Anchors.** Headings get GitHub's anchors (``benchcheckpointpy---peers``, where Python-Markdown writes
  ``benchcheckpointpy-peers``), so a ``page.md#heading`` link means the same heading on GitHub and on the site
  (``tests/test_docs.py`` checks the sources with the same rule).
* **Lists.** A list right under a line of text is a list on GitHub and a paragraph for Python-Markdown: the
  build puts the blank line between them.
* **The built site.** After the build, every ``href`` and ``src`` of every page that stays on the site names a
  file of the site, and, where it names an anchor of a page, an ``id`` of that page; no page of the API
  reference shows a ``[Note: ...]`` of the sources (``griffe_docstrings.py`` takes them out). The build fails otherwise (``broken_links`` is also what
  ``tests/test_docs_site.py`` runs on the DOM Chromium renders).

The module imports only the standard library at its top, so the tests load it without MkDocs.
"""

from __future__ import annotations

import posixpath
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

if TYPE_CHECKING:
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.files import Files
    from mkdocs.structure.pages import Page

REPO = Path(__file__).resolve().parents[1]
ROOT_PAGES = {  # the repository's file -> its page on the site
    "ARCHITECTURE.md": "project/architecture.md",
    "BENCHMARKS.md": "project/benchmarks.md",
    "COMPATIBILITY.md": "project/compatibility.md",
}
LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(([^()\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)[^`]*?\1")
LIST_ITEM = re.compile(r"^([-*+]|1[.)]) ")  # what starts a list inside a paragraph on GitHub
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


# --- the sources -------------------------------------------------------------------------------------------

def repository_path(page_uri: str) -> str:
    """The repository file a page of the site is built from."""
    by_page = {page: source for source, page in ROOT_PAGES.items()}
    return by_page.get(page_uri, f"docs/{page_uri}")


def site_target(target: str, page_uri: str) -> str | None:
    """``target``, a link as the repository file behind ``page_uri`` writes it, as the page ``page_uri`` must
    write it on the site; None when what it names is no file of the site."""
    if SCHEME.match(target) or target.startswith(("#", "/")):
        return target
    path, hash_mark, anchor = target.partition("#")
    source = repository_path(page_uri)
    named = posixpath.normpath(posixpath.join(posixpath.dirname(source), path))
    if named in ROOT_PAGES:
        site_uri = ROOT_PAGES[named]
    elif named.startswith("docs/"):
        site_uri = named.removeprefix("docs/")
    else:
        return None
    relative = posixpath.relpath(site_uri, posixpath.dirname(page_uri) or ".")
    return relative + hash_mark + anchor


def outside_code(markdown: str, rewrite: Any) -> str:
    """``markdown`` with ``rewrite`` applied to the text outside fenced blocks and inline code."""
    out = []
    fenced = False
    for line in markdown.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
        if fenced or FENCE.match(line):
            out.append(line)
            continue
        pieces, last = [], 0
        for code in INLINE_CODE.finditer(line):
            pieces += [rewrite(line[last:code.start()]), code[0]]
            last = code.end()
        out.append("".join([*pieces, rewrite(line[last:])]))
    return "\n".join(out)


def site_links(markdown: str, page_uri: str) -> str:
    def one(link: re.Match[str]) -> str:
        image, text, target = link[1], link[2], link[3]
        rewritten = site_target(target, page_uri)
        if rewritten is not None:
            return f"{image}[{text}]({rewritten})"
        if image:
            return link[0]  # left broken: the built site's check names it
        named = posixpath.normpath(posixpath.join(posixpath.dirname(repository_path(page_uri)),
                                                  target.partition("#")[0]))
        plain = text.strip("`")
        return f"`{named}`" if named.endswith(plain) else f"{text} (`{named}` in the repository)"

    return outside_code(markdown, lambda text: LINK.sub(one, text))


def blank_line_before_lists(markdown: str) -> str:
    out: list[str] = []
    fenced = False
    for line in markdown.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
        previous = out[-1] if out else ""
        if (not fenced and LIST_ITEM.match(line) and previous.strip() and not previous[0].isspace()
                and not LIST_ITEM.match(previous) and not previous.startswith(("#", "|", "<", ">"))):
            out.append("")
        out.append(line)
    return "\n".join(out)


def github_slug(value: str, separator: str = "-") -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", value.strip().lower()).replace(" ", separator)


# --- the built site ----------------------------------------------------------------------------------------

class _References(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.references: list[tuple[str, str]] = []  # (tag, url)
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("href", "src") and value is not None:
                self.references.append((tag, value))
            elif name in ("id", "name") and value:
                self.ids.add(value)


def page_references(html: str) -> tuple[list[tuple[str, str]], set[str]]:
    """The ``(tag, href or src)`` of a page's elements and the ids it defines."""
    parser = _References()
    parser.feed(html)
    return parser.references, parser.ids


def broken_links(page: Path, site: Path, html: str | None = None) -> list[str]:
    """Every internal ``href``/``src`` of ``page`` (a file of the built ``site``; its text ``html``, or the file
    read) that names no file of the site, or an anchor that the page it names does not define."""
    page, site = page.resolve(), site.resolve()
    text = page.read_text(encoding="utf-8") if html is None else html
    references, own_ids = page_references(text)
    broken = []
    for tag, url in references:
        parts = urlsplit(url)
        if parts.scheme or parts.netloc or url.startswith(("mailto:", "javascript:", "data:")):
            continue
        if not parts.path:
            target = page
        else:
            target = (page.parent / unquote(parts.path)).resolve()
            if parts.path.endswith("/") or target.is_dir():
                target = target / "index.html"
        if not target.is_relative_to(site) or not target.is_file():
            broken.append(f"<{tag}> {url}: no such file in the site")
        elif tag != "a" and target.stat().st_size == 0:
            broken.append(f"<{tag}> {url}: an empty file")
        elif parts.fragment and target.suffix == ".html":
            ids = own_ids if target == page else page_references(target.read_text(encoding="utf-8"))[1]
            if unquote(parts.fragment) not in ids:
                broken.append(f"<{tag}> {url}: no element with that id")
    return broken


def site_problems(site: Path) -> list[str]:
    """``broken_links`` of every page of ``site``, and every page of the API reference showing a ``[Note: ...]``."""
    problems = []
    for page in sorted(site.rglob("*.html")):
        if page.name == "404.html":
            continue  # served for any missing URL: its links are absolute to the site's root
        html = page.read_text(encoding="utf-8")
        name = page.relative_to(site).as_posix()
        problems += [f"{name}: {problem}" for problem in broken_links(page, site, html)]
        if name.startswith("reference/") and "[Note:" in html:
            problems.append(f"{name}: shows a [Note: ...] of the sources")
    return problems


# --- the hooks ---------------------------------------------------------------------------------------------

def on_config(config: MkDocsConfig) -> MkDocsConfig:
    config.mdx_configs.setdefault("toc", {})["slugify"] = github_slug
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    from mkdocs.structure.files import File

    for source, page_uri in ROOT_PAGES.items():
        files.append(File.generated(config, page_uri, content=(REPO / source).read_text(encoding="utf-8")))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    return site_links(blank_line_before_lists(markdown), page.file.src_uri)


def on_post_build(config: MkDocsConfig) -> None:
    from mkdocs.exceptions import Abort

    problems = site_problems(Path(config.site_dir))
    if problems:
        raise Abort("The built site has broken links:\n  " + "\n  ".join(problems))


def on_serve(server: Any, config: MkDocsConfig, builder: Any) -> Any:
    for source in ROOT_PAGES:
        server.watch(str(REPO / source))
    return server
