"""A griffe extension for the API reference (mkdocs.yml loads it): habits of the package's sources that
read well there but not on a reference page for users, rewritten before the pages are rendered. The sources
are not changed.

* Sphinx roles (``:class:`~lightning_zero.engine.ZeroEngine```) become inline code of the name as
  Sphinx shows it (``ZeroEngine`` for ``~``, the whole path otherwise); Markdown would print the role.
* An ``Args:`` entry that documents several parameters at once (``num_replicas, rank: as in
  DistributedSampler``, its names possibly continued on the next line) becomes one entry per parameter,
  each with the description, so every parameter is listed under its own name and matches the signature.
* ``[Note: ...]`` blocks and the references to them are for the package's readers, and the notes are not on
  the site: a paragraph that opens a note is dropped, a reference (``([Note: x] in file.py)``, ``see [Note:
  x]``) is cut out of its sentence.
* Signatures name public types only. A type alias the package defines (``Mode``, a ``Literal``) is written
  out; a parameter typed with one of the package's internal classes is left out of the signature when it has
  a default (an argument for the package's own callers) and loses its annotation otherwise, as does a return
  or attribute annotation. Public: the names of ``lightning_zero.__all__`` and
  ``lightning_zero.checkpoint.__all__``.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import (
    AliasResolutionError,
    Attribute,
    CyclicAliasError,
    Expr,
    ExprName,
    Extension,
    Function,
    GriffeLoader,
    Object,
)

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj):`(~?)([\w.]+)`")
ARGS_HEADER = re.compile(r"^(\s*)(?:Args|Arguments|Parameters):\s*$")
NAMES = r"\w+(?:\s*,\s*\w+)*"
GROUP_START = re.compile(rf"^({NAMES}),\s*$")  # names that go on after a comma on the next line
GROUP = re.compile(rf"^({NAMES}\s*,\s*\w+)\s*:(.*)$")  # two names or more, then the description
NOTE = r"\[Note:\s[^\]]+\](?:\s+in\s+[\w./]+\.py)?(?:\s+there)?"
NOTE_PARENTHESIS = re.compile(rf"\s*\((?:see\s+)?{NOTE}\)")  # "([Note: x] in file.py)": the whole aside
NOTE_OPENS_PARENTHESIS = re.compile(rf"\((?:see\s+)?{NOTE}[:;,]?\s*")  # "([Note: x] there: more" -> "(more"
NOTE_IN_SENTENCE = re.compile(rf"[,;:]?\s*(?:see\s+)?{NOTE}")  # "(Muon: [Note: x] in f.py)" -> "(Muon)"
PUBLIC_MODULES = ("lightning_zero", "lightning_zero.checkpoint")


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


def without_notes(text: str) -> str:
    paragraphs = re.split(r"(\n\s*\n)", text)  # the separators kept, at odd indices
    kept = [part for index, part in enumerate(paragraphs)
            if index % 2 or not re.match(r"\s*\[Note:\s[^\]]+\]", part)]
    text = re.sub(r"^(\s*\n)+|(\n\s*)+$", "", "".join(kept))
    text = re.sub(r"\n\s*\n(\s*\n)+", "\n\n", text)  # where a dropped note left two blank lines
    text = NOTE_PARENTHESIS.sub("", text)
    text = NOTE_OPENS_PARENTHESIS.sub("(", text)
    return NOTE_IN_SENTENCE.sub("", text)


class LightningZeroDocstrings(Extension):
    def __init__(self) -> None:
        super().__init__()
        self.public: set[str] | None = None

    def on_object(self, *, obj: Object, loader: GriffeLoader, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = without_notes(split_grouped_args(plain_roles(obj.docstring.value)))

    def on_function(self, *, func: Function, loader: GriffeLoader, **kwargs: Any) -> None:
        for parameter in list(func.parameters):
            annotation = self.public_annotation(parameter.annotation, loader)
            if annotation is False and parameter.default is not None:
                del func.parameters[parameter.name]
            else:
                parameter.annotation = annotation or None
        func.returns = self.public_annotation(func.returns, loader) or None

    def on_attribute(self, *, attr: Attribute, loader: GriffeLoader, **kwargs: Any) -> None:
        attr.annotation = self.public_annotation(attr.annotation, loader) or None

    def public_annotation(self, annotation: str | Expr | None, loader: GriffeLoader) -> str | Expr | None | bool:
        """``annotation`` with the package's type aliases written out; False where it names an internal class."""
        if not isinstance(annotation, Expr):
            return annotation
        public = self.public_names(loader)
        parts: list[str] = []
        changed = False
        for part in annotation.iterate(flat=True):
            path = part.canonical_path if isinstance(part, ExprName) else ""
            if not path.startswith("lightning_zero.") or path.rsplit(".", 1)[-1] in public:
                parts.append(str(part))
                continue
            try:
                target = loader.modules_collection.get_member(path)
                target = target.final_target if target.is_alias else target
            except (KeyError, ValueError, AliasResolutionError, CyclicAliasError):
                return False  # or a private name of another package, re-exported by the package's _compat
            if not (isinstance(target, Attribute) and target.value is not None):
                return False  # an internal class: a reader cannot build one
            parts.append(str(target.value))
            changed = True
        return "".join(parts) if changed else annotation

    def public_names(self, loader: GriffeLoader) -> set[str]:
        if self.public is None:
            self.public = {str(name) for module in PUBLIC_MODULES
                           for name in (loader.modules_collection.get_member(module).exports or ())}
        return self.public
