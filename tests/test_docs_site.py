"""The documentation site as a reader sees it: ``make docs`` builds it, headless Chromium (Debian's
``chromium`` package) renders the home page and a guide, and every image those pages show and every link
they hold, in the DOM the browser built (its scripts run), names a file of the site; no line of code is
wider than the page's column; the screenshots are pictures of a page, not a blank one. Skipped only where no Chromium can be found (``.ci/run`` installs it
where it is missing)."""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest
from test_docs import site_build

REPO = Path(__file__).resolve().parents[1]
PAGES = ["index.html", "tiers/index.html"]  # the home page (install, code, a plot) and the longest guide
WINDOW = (1280, 1600)
CODE_COLUMNS = 80  # characters of a code line that the page's column shows at WINDOW's width, beside the contents
CHROMIUM = next((path for name in ("chromium", "chromium-browser") if (path := shutil.which(name))), None)

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH: install Debian's chromium package (apt-get install chromium) "
                             "to render the docs site; .ci/run installs it")


@pytest.fixture(scope="module")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built by ``make docs`` (strict, its links checked) into a folder of this run."""
    site = tmp_path_factory.mktemp("site")
    built = subprocess.run(["make", "-s", "docs", f"SITE_DIR={site}"], cwd=REPO, capture_output=True, text=True,
                           timeout=900)
    assert built.returncode == 0, f"make docs failed:\n{built.stdout[-3000:]}\n{built.stderr[-3000:]}"
    return site


def chromium(*arguments: str, profile: Path) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
         f"--user-data-dir={profile}", "--virtual-time-budget=5000", *arguments],
        capture_output=True, text=True, timeout=180)


class _CodeText(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.depth = 0
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.depth += tag == "pre"

    def handle_endtag(self, tag: str) -> None:
        self.depth -= tag == "pre"

    def handle_data(self, data: str) -> None:
        if self.depth:
            self.text.append(data)


def code_lines(html: str) -> list[str]:
    """The lines of a page's code blocks (``<pre>``), as the reader sees them."""
    parser = _CodeText()
    parser.feed(html)
    return "".join(parser.text).splitlines()


def png_picture(path: Path) -> tuple[int, int, int]:
    """``(width, height, distinct rows)`` of an 8-bit PNG: a page rendered blank has a handful of distinct
    rows, a page with text and a plot hundreds."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    offset, idat, header = 8, b"", b""
    while offset < len(data):
        length, kind = struct.unpack(">I4s", data[offset:offset + 8])
        body = data[offset + 8:offset + 8 + length]
        header = body if kind == b"IHDR" else header
        idat += body if kind == b"IDAT" else b""
        offset += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", header[:10])
    assert depth == 8, f"{path.name}: {depth}-bit PNG"
    row = 1 + width * {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[colour]  # the filter byte, then the pixels
    pixels = zlib.decompress(idat)
    return width, height, len({pixels[start:start + row] for start in range(0, len(pixels), row)})


def test_png_picture_tells_a_blank_page_from_a_drawn_one(tmp_path: Path) -> None:
    def write(rows: list[bytes]) -> Path:
        def chunk(kind: bytes, body: bytes) -> bytes:
            return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        png = tmp_path / f"{len(list(tmp_path.iterdir()))}.png"
        png.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 4, len(rows), 8, 0, 0, 0, 0))
                        + chunk(b"IDAT", zlib.compress(b"".join(b"\x00" + row for row in rows))) + chunk(b"IEND", b""))
        return png

    assert png_picture(write([b"\xff" * 4] * 30)) == (4, 30, 1)
    assert png_picture(write([bytes([index] * 4) for index in range(30)])) == (4, 30, 30)


@needs_chromium
@pytest.mark.parametrize("page", PAGES)
def test_a_page_renders_with_every_image_and_link_in_place(page: str, built_site: Path, tmp_path: Path) -> None:
    url = (built_site / page).as_uri()
    rendered = chromium("--dump-dom", url, profile=tmp_path / "profile")
    assert rendered.returncode == 0 and "</html>" in rendered.stdout, rendered.stderr[-2000:]
    dom = rendered.stdout

    hooks = site_build()
    broken = hooks.broken_links(built_site / page, built_site, html=dom)
    assert not broken, f"{page}, as Chromium renders it: " + "; ".join(broken)
    references, _ = hooks.page_references(dom)
    links = [target for tag, target in references if tag == "a" and not target.startswith(("http:", "https:"))]
    assert len(links) > 20, f"{page}: {len(links)} links; the navigation alone has more"
    for image in (target for tag, target in references if tag == "img" and target.endswith(".png")):
        width, height, rows = png_picture((built_site / page).parent / image)
        assert width >= 600 and rows > 50, f"{page}: {image} is {width}x{height} px with {rows} distinct rows"
    if page == "index.html":
        assert any(tag == "img" for tag, _ in references), "the home page shows no plot"
    wide = [line for line in code_lines(dom) if len(line) > CODE_COLUMNS]
    assert not wide, f"{page}: code lines cut off on the right: {wide}"

    screenshot = tmp_path / "screenshot.png"
    shot = chromium(f"--screenshot={screenshot}", f"--window-size={WINDOW[0]},{WINDOW[1]}", url,
                    profile=tmp_path / "profile")
    assert shot.returncode == 0 and screenshot.is_file(), shot.stderr[-2000:]
    width, height, rows = png_picture(screenshot)
    assert (width, height) == WINDOW
    assert rows > 200, f"{page}: the screenshot has {rows} distinct rows of {height}: a blank page?"
