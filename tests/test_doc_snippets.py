"""The Python snippets of the README and the guides run as printed.

Every ```python block in README.md and docs/ says on the line before its fence what it is, in an HTML comment
that renders as nothing on GitHub and in the site:

* ``<!-- snippet: run -->``: self-contained and cheap (CPU, one process, files in the working directory);
  it runs in a fresh interpreter whose working directory is an empty temporary folder, and must exit 0
  (marked ``e2e``, as every test that starts an interpreter);
* ``<!-- snippet: run, slow -->``: the same, but it starts several processes (``devices=2``): also ``slow``;
* ``<!-- snippet: no-run (why) -->``: not run, with the reason (GPUs, a bucket, a checkpoint of another
  system, a fragment of a class); it must still parse.

A new block without a marker fails here, so no snippet goes untested by accident.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(.*?)\s*-->\s*$")
KINDS = {"run": "run", "run, slow": "slow", "no-run": "no-run"}
TIMEOUT_S = {"run": 180, "slow": 300}


@dataclass(frozen=True)
class Snippet:
    document: str  # relative to the repository
    line: int  # the fence's, 1-based
    kind: str | None  # "run", "slow", "no-run", or None: no marker or one not understood
    reason: str  # a no-run snippet's reason
    code: str

    @property
    def id(self) -> str:
        return f"{self.document}:{self.line}"


def parse_marker(line: str) -> tuple[str | None, str]:
    """``(kind, reason)`` of a marker line; ``(None, "")`` when the line is no marker we know."""
    found = MARKER.match(line)
    if not found:
        return None, ""
    text = found[1]
    reason = re.fullmatch(r"no-run\s*\((.*)\)", text)
    if reason:
        return "no-run", reason[1].strip()
    return KINDS.get(text), ""


def python_blocks(text: str, document: str) -> list[Snippet]:
    """Every ```python (or ```py) block of ``text`` with the marker on the line before its fence."""
    lines = text.splitlines()
    found = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        indent, fence, language = opening.groups()
        end = index + 1
        while end < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]):
            end += 1
        if language in ("python", "py"):
            kind, reason = parse_marker(lines[index - 1]) if index > 0 else (None, "")
            body = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[index + 1:end])
            found.append(Snippet(document, index + 1, kind, reason, textwrap.dedent(body) + "\n"))
        index = end + 1
    return found


def all_snippets() -> list[Snippet]:
    return [snippet for page in DOCUMENTS
            for snippet in python_blocks(page.read_text(), page.relative_to(REPO).as_posix())]


SNIPPETS = all_snippets()
# Fresh interpreters: the e2e tier (`make test-fast` leaves them out, as tests/conftest.py's E2E_MODULES do).
RUNNABLE = [pytest.param(s, id=s.id, marks=[pytest.mark.e2e, *([pytest.mark.slow] if s.kind == "slow" else [])])
            for s in SNIPPETS if s.kind in ("run", "slow")]


def test_every_python_block_is_marked_to_run_or_not_with_a_reason() -> None:
    unmarked = [s.id for s in SNIPPETS if s.kind is None]
    assert not unmarked, ("python blocks without '<!-- snippet: run -->', '<!-- snippet: run, slow -->' or"
                          f" '<!-- snippet: no-run (why) -->' on the line before the fence: {unmarked}")
    no_reason = [s.id for s in SNIPPETS if s.kind == "no-run" and not s.reason]
    assert not no_reason, f"no-run snippets must say why in parentheses: {no_reason}"


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda s: s.id)
def test_every_python_block_parses(snippet: Snippet) -> None:
    ast.parse(snippet.code, filename=snippet.id)


def test_the_readme_has_snippets_that_run() -> None:
    readme = [s for s in SNIPPETS if s.document == "README.md" and s.kind in ("run", "slow")]
    assert len(readme) >= 2, f"the README's quick starts (Trainer, Fabric) are marked to run; found {readme}"


def test_the_parser_finds_markers_reasons_and_unmarked_blocks() -> None:
    text = ("intro\n<!-- snippet: run -->\n```python\nprint(1)\n```\n"
            "- item\n  <!-- snippet: no-run (needs a bucket) -->\n  ```python\n  x = 1\n  ```\n"
            "<!-- snippet: run, slow -->\n```py\npass\n```\n"
            "```python\nunmarked = True\n```\n```bash\necho not python\n```\n"
            "<!-- snippet: no-run -->\n```python\n```\n")
    found = python_blocks(text, "page.md")
    assert [(s.line, s.kind, s.reason) for s in found] == [
        (3, "run", ""), (8, "no-run", "needs a bucket"), (12, "slow", ""), (15, None, ""), (22, "no-run", "")]
    assert found[1].code == "x = 1\n"


@pytest.mark.parametrize("snippet", RUNNABLE)
def test_the_snippet_runs_in_a_fresh_interpreter(snippet: Snippet, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(snippet.code)
    # The checkout's package (not another install); Lightning's launcher starts the other ranks of a
    # devices=2 snippet by running this file again, with the same environment.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE"):
        env.pop(name, None)
    try:
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S[snippet.kind])
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{snippet.id} did not finish within {error.timeout} s")
    assert done.returncode == 0, f"{snippet.id} exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}"
