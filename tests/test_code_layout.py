"""The shape ARCHITECTURE.md describes, held by tests: dependencies one way (no import cycle, imports
inside functions included), no oversized module, the front ends entering the checkpoint package through
at most two modules (its public names and ``checkpoint/lightning/entry.py``), and the checkpoint
package's subpackages importing one way (``LAYERS``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lightning_zero
import lightning_zero.checkpoint

PACKAGE = Path(lightning_zero.__file__).parent
CHECKPOINT_LIMIT = 400  # lines, lightning_zero/checkpoint/
MODULE_LIMIT = 650  # lines, the rest of lightning_zero/


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports anywhere in its body (functions included)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in modules:
                    out.add(target)
                elif base in modules:
                    out.add(base)
    return out


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in edges[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in edges:
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_not_even_through_imports_inside_functions() -> None:
    modules = _modules()
    edges = {name: _imports(name, path, modules) - {name} for name, path in modules.items()}
    assert _cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("name", sorted(_modules()))
def test_no_module_is_oversized(name: str) -> None:
    path = _modules()[name]
    limit = CHECKPOINT_LIMIT if ".checkpoint" in name else MODULE_LIMIT
    lines = len(path.read_text().splitlines())
    assert lines <= limit, f"{path} has {lines} lines (at most {limit}): split it by concern"


FRONT_ENDS = ("lightning_zero.strategy", "lightning_zero.fabric")
ENTRY_MODULES = frozenset({"lightning_zero.checkpoint", "lightning_zero.checkpoint.lightning.entry"})
"""The only modules of the checkpoint package the Trainer's and Fabric's strategies import from: its public
names, and the one Lightning-side entry point."""


def _checkpoint_modules_imported(path: Path, modules: dict[str, Path]) -> dict[str, set[str]]:
    """The checkpoint package's modules ``path`` imports from (functions included) -> the names it takes."""
    used: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("lightning_zero.checkpoint"):
                    used.setdefault(alias.name, set())
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_zero.checkpoint"):
            for alias in node.names:
                # `from package import module` names the module it imports
                target = f"{node.module}.{alias.name}"
                module, name = (target, "*") if target in modules else (node.module or "", alias.name)
                used.setdefault(module, set()).add(name)
    return used


def _entry_breaks(name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    used = _checkpoint_modules_imported(path, modules)
    breaks = [f"{name} imports {module}" for module in sorted(set(used) - ENTRY_MODULES)]
    public = set(lightning_zero.checkpoint.__all__)
    breaks += [f"{name} imports {n} from lightning_zero.checkpoint, not one of its public names"
               for n in sorted(used.get("lightning_zero.checkpoint", set()) - public)]
    return breaks


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_a_front_end_enters_the_checkpoint_package_through_its_public_names_and_one_entry_module(
        front_end: str) -> None:
    modules = _modules()
    assert _checkpoint_modules_imported(modules[front_end], modules)  # it does use the package
    assert _entry_breaks(front_end, modules[front_end], modules) == []


def test_the_entry_check_finds_a_front_end_reaching_past_the_entry(tmp_path: Path) -> None:
    modules = _modules()
    module = tmp_path / "front.py"
    module.write_text("from lightning_zero.checkpoint import ZeroCheckpointIO, saver\n"
                      "from lightning_zero.checkpoint.lightning import entry, resume\n"
                      "def f():\n    from lightning_zero.checkpoint.lightning.plugin import link_of\n"
                      "import lightning_zero.checkpoint.engine_tree\n")
    assert _entry_breaks("front", module, modules) == [
        "front imports lightning_zero.checkpoint.engine_tree",
        "front imports lightning_zero.checkpoint.lightning.plugin",
        "front imports lightning_zero.checkpoint.lightning.resume",
        "front imports lightning_zero.checkpoint.saver",
    ]


LAYERS: dict[str, set[str]] = {
    # group: the groups it may import (lightning_zero.checkpoint's own top-level modules are "verbs")
    "store": set(),
    "formats": {"store"},
    "runtime": {"store", "formats"},
    "dcp": {"store", "formats", "runtime"},
    "modes": {"store", "formats", "dcp", "runtime"},
    "tiered": {"store", "formats", "runtime", "modes"},
    "verbs": {"store", "formats", "dcp", "runtime", "modes", "tiered"},
    "interop": {"store", "formats", "verbs"},
    "lightning": {"store", "formats", "dcp", "runtime", "modes", "verbs", "tiered"},
}
"""Which subpackage of ``lightning_zero.checkpoint`` may import which (the package's docstring, and each
subpackage's, say the same in words)."""


def _group(name: str) -> str | None:
    parts = name.split(".")
    if parts[:2] != ["lightning_zero", "checkpoint"] or len(parts) == 2:
        return None
    return parts[2] if len(parts) > 3 or parts[2] in LAYERS else "verbs"


def _layer_breaks(edges: dict[str, set[str]]) -> list[str]:
    breaks = []
    for name, targets in edges.items():
        group = _group(name)
        if group is None:
            continue
        for target in targets:
            other = _group(target)
            if other is not None and other != group and other not in LAYERS[group]:
                breaks.append(f"{name} ({group}) imports {target} ({other})")
    return sorted(breaks)


def test_the_checkpoint_subpackages_import_one_way() -> None:
    modules = _modules()
    groups = {_group(name) for name in modules} - {None}
    assert groups == set(LAYERS), groups ^ set(LAYERS)  # every subpackage has its row, no row is stale
    edges = {name: _imports(name, path, modules) - {name} for name, path in modules.items()}
    assert _layer_breaks(edges) == []


def test_the_layer_check_finds_an_import_against_the_order() -> None:
    edges = {"lightning_zero.checkpoint.store.storage": {"lightning_zero.checkpoint.tiered.tiers"},
             "lightning_zero.checkpoint.tiered.tiers": {"lightning_zero.checkpoint.store.storage"}}
    assert _layer_breaks(edges) == [
        "lightning_zero.checkpoint.store.storage (store) imports lightning_zero.checkpoint.tiered.tiers (tiered)"]


STORE_KIND = {
    "is_local": r"\.is_local\b",
    "a file system class": r"\b(LocalFileSystem|S3FileSystem|AbstractFileSystem)\b",
    "a client library": r"\b(import|from)\s+(fsspec|s3fs|botocore|aiobotocore|s3torchconnector|boto3)\b"
                        r"|\b(fsspec|s3fs|botocore|aiobotocore|s3torchconnector|boto3)\.\w",
    "a class name compared": r"type\([^)]*\)\.__name__\s*(==|!=|in\b)",
    "the fsspec file system of a location": r"(?<!self)\.fs\b",
    "a URL scheme": r"""["'](s3a?|gs|gcs|az|abfs|file|memory)://["']|startswith\(\(?["'](s3a?|gs|file)://""",
    "an error's text": r"AccessDenied|Forbidden|NoSuchBucket|NoSuchKey|EndpointConnectionError",
}
"""What branching on the kind of store looks like in code (comments and docstrings left out): only ``store/``
may do it ([Note: storage seam] in store/backend.py). ``_compat`` names DCP's fsspec classes for the store."""

STORE_KIND_ALLOWED = ("lightning_zero.checkpoint.store", "lightning_zero._compat")


def _code_only(path: Path) -> str:
    """The module's source with comments and docstrings blanked, so that prose may name stores."""
    import io
    import tokenize

    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            for statement in node.body:
                if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant) and isinstance(
                        statement.value.value, str):
                    docstrings.add((statement.lineno, statement.col_offset))
    lines = source.splitlines(keepends=True)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        prose = token.type == tokenize.COMMENT or (token.type == tokenize.STRING and (
            token.start in docstrings or token.string.startswith(('"""', "'''"))))
        if prose:  # blanked in place, so that the code around it keeps its exact text
            (first, start), (last, end) = token.start, token.end
            for row in range(first, last + 1):
                line = lines[row - 1]
                left = start if row == first else 0
                right = end if row == last else len(line.rstrip("\n"))
                lines[row - 1] = line[:left] + " " * (right - left) + line[right:]
    return "".join(lines)


def _store_kind_branches(name: str, code: str) -> list[str]:
    import re

    if name.startswith(STORE_KIND_ALLOWED):
        return []
    return [f"{name}: {what} ({found.group(0)!r})" for what, pattern in STORE_KIND.items()
            for found in re.finditer(pattern, code)]


def test_no_module_outside_store_branches_on_the_kind_of_store() -> None:
    found = [branch for name, path in sorted(_modules().items())
             for branch in _store_kind_branches(name, _code_only(path))]
    assert found == []


@pytest.mark.parametrize("line", [
    "if loc.is_local:", "isinstance(loc.fs, LocalFileSystem)", 'type(fs).__name__ == "S3FileSystem"',
    "names = loc.fs.ls(loc.path)", 'if url.startswith(("s3://", "s3a://")):', '"NoSuchBucket" in text',
    "import botocore", "fs = fsspec.filesystem('s3')",
])
def test_the_store_check_finds_a_branch_on_the_kind_of_store(line: str) -> None:
    assert _store_kind_branches("lightning_zero.checkpoint.saver", line)


def test_the_store_check_leaves_prose_and_the_store_alone(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text('"""Saves to s3:// through s3fs."""\n# loc.is_local once lived here\nx = 1\n')
    assert _store_kind_branches("lightning_zero.checkpoint.saver", _code_only(module)) == []
    assert _store_kind_branches("lightning_zero.checkpoint.store.local", "if loc.is_local:") == []


def test_a_backend_is_a_module_of_store_and_one_row_of_its_registry() -> None:
    # Adding a store touches store/ alone: every backend the registry names lives there.
    from lightning_zero.checkpoint.store.registry import BACKENDS

    assert {opener.__module__.rsplit(".", 1)[0] for opener in BACKENDS.values()} == {"lightning_zero.checkpoint.store"}
