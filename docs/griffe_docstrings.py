"""A griffe extension for the API reference (mkdocs.yml loads it): two habits of the package's docstrings
that read well in the source but that griffe's Google parser and Markdown do not know, rewritten before
the docstrings are parsed. The sources are not changed.

* Sphinx roles (``:class:`~lightning_zero.engine.ZeroEngine```) become inline code of the name as
  Sphinx shows it (``ZeroEngine`` for ``~``, the whole path otherwise); Markdown would print the role.
* An ``Args:`` entry that documents several parameters at once (``num_replicas, rank: as in
  DistributedSampler``, its names possibly continued on the next line) becomes one entry per parameter,
  each with the description, so every parameter is listed under its own name and matches the signature.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, GriffeLoader, Object

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj):`(~?)([\w.]+)`")
ARGS_HEADER = re.compile(r"^(\s*)(?:Args|Arguments|Parameters):\s*$")
NAMES = r"\w+(?:\s*,\s*\w+)*"
GROUP_START = re.compile(rf"^({NAMES}),\s*$")  # names that go on after a comma on the next line
GROUP = re.compile(rf"^({NAMES}\s*,\s*\w+)\s*:(.*)$")  # two names or more, then the description


def plain_roles(text: str) -> str:
    return ROLE.sub(lambda match: f"`{match[2].rsplit('.', 1)[-1] if match[1] else match[2]}`", text)


def split_grouped_args(text: str) -> str:
    lines = text.splitlines()
    out: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        out.append(line)
        index += 1
        header = ARGS_HEADER.match(line)
        if not header:
            continue
        section_indent = len(header[1])
        item_indent: int | None = None
        while index < len(lines):
            line = lines[index]
            indent = len(line) - len(line.lstrip())
            if line.strip() and indent <= section_indent:
                break  # the section ended
            if not line.strip() or (item_indent is not None and indent > item_indent):
                out.append(line)
                index += 1
                continue
            item_indent = indent if item_indent is None else item_indent
            entry = line.strip()
            index += 1
            while GROUP_START.match(entry) and index < len(lines):  # the names go on on the next line
                entry = f"{entry} {lines[index].strip()}"
                index += 1
            grouped = GROUP.match(entry)
            if not grouped:
                out.append(" " * indent + entry)
                continue
            continuation = []
            while index < len(lines) and lines[index].strip() and (
                    len(lines[index]) - len(lines[index].lstrip()) > indent):
                continuation.append(lines[index])
                index += 1
            for name in re.split(r"\s*,\s*", grouped[1]):
                out.append(f"{' ' * indent}{name}:{grouped[2]}")
                out.extend(continuation)
    return "\n".join(out)


class LightningZeroDocstrings(Extension):
    def on_object(self, *, obj: Object, loader: GriffeLoader, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = split_grouped_args(plain_roles(obj.docstring.value))
