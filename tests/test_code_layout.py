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


def _engine_breaks(name: str, imported: set[str]) -> list[str]:
    """What an engine module imports that the engine must not: Lightning, or any of this package outside
    ``lightning_zero.engine`` (the checkpoint package, the front ends, the Lightning side's ``_compat``)."""
    if not name.startswith("lightning_zero.engine"):
        return []
    return sorted(f"{name} imports {target}" for target in imported
                  if target.split(".")[0] == "lightning"
                  or (target.startswith("lightning_zero") and not target.startswith("lightning_zero.engine")))


def _all_imports(path: Path) -> set[str]:
    """Every module ``path`` names in an import statement, this package's and others' (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found |= {node.module or ""} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_the_engine_imports_neither_lightning_nor_the_checkpoint_package() -> None:
    engine = {name: path for name, path in _modules().items() if name.startswith("lightning_zero.engine")}
    assert len(engine) > 5  # the package is where the check looks
    assert [b for name, path in sorted(engine.items()) for b in _engine_breaks(name, _all_imports(path))] == []


def test_the_engine_check_finds_lightning_and_the_checkpoint_package() -> None:
    imports = {"torch", "lightning.pytorch", "lightning_zero.checkpoint.saver", "lightning_zero.engine.sharding"}
    assert _engine_breaks("lightning_zero.engine.optimizer", imports) == [
        "lightning_zero.engine.optimizer imports lightning.pytorch",
        "lightning_zero.engine.optimizer imports lightning_zero.checkpoint.saver"]


def test_the_engine_trains_with_lightning_and_the_checkpoint_package_blocked(tmp_path: Path) -> None:
    """``lightning_zero.engine`` imported where ``lightning`` cannot be: one gloo rank's ZeRO-2 AdamW steps
    equal plain AdamW's, and neither Lightning nor the checkpoint package was imported."""
    import subprocess
    import sys

    program = f"""
import sys
sys.modules["lightning"] = None  # an import of it raises ImportError
import torch, torch.distributed as dist
from lightning_zero.engine import ZeroConfig, ZeroEngine
dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
plain.load_state_dict(model.state_dict())
engine = ZeroEngine(model, [torch.optim.AdamW(model.parameters(), lr=0.01)], ZeroConfig(stage=2))
reference = torch.optim.AdamW(plain.parameters(), lr=0.01)
for step in range(3):
    x = torch.randn(5, 8)
    for net, opt in ((model, engine.optimizers[0]), (plain, reference)):
        net(x).square().mean().backward(); opt.step(); opt.zero_grad()
engine.close()
for a, b in zip(model.parameters(), plain.parameters()):
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "lightning" or m.startswith("lightning_zero.checkpoint"))
print("loaded:", loaded)
dist.destroy_process_group()
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                          cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loaded: ['lightning']" in done.stdout, done.stdout  # only the blocking entry itself


MODE_NAMES_ALLOWED = "lightning_zero.checkpoint.modes"
"""The one package that may compare mode names ([Note: modes as objects] in checkpoint/modes/base.py)."""


def _names_a_mode(node: ast.expr) -> bool:
    """``mode``, ``checkpoint_mode``, ``x.mode``, and a mode's ``.name``."""
    if isinstance(node, ast.Name):
        return node.id == "mode" or node.id.endswith("_mode")
    if isinstance(node, ast.Attribute):
        return node.attr == "mode" or node.attr.endswith("_mode") or (node.attr == "name" and _names_a_mode(node.value))
    return False


def _holds_a_mode_name(node: ast.expr) -> bool:
    """A string literal that is a registered mode's name, alone or in a tuple, list or set (a file's open mode,
    ``"w" in mode``, is no checkpoint mode)."""
    from lightning_zero.checkpoint.modes import MODES

    if isinstance(node, ast.Constant):
        return node.value in MODES if isinstance(node.value, str) else False
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_holds_a_mode_name(element) for element in node.elts)
    return False


def _mode_name_comparisons(name: str, source: str) -> list[str]:
    """Where module ``name`` compares a mode with a mode's name as a literal (``mode == "full"``, ``opened.mode in
    (...)``, ``match mode: case "local"``): a branch that belongs on the mode object."""
    if name == MODE_NAMES_ALLOWED or name.startswith(MODE_NAMES_ALLOWED + "."):
        return []
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_names_a_mode(o) for o in operands) and any(_holds_a_mode_name(o) for o in operands):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Match) and _names_a_mode(node.subject):
            cases = [case.pattern for case in node.cases]
            if any(isinstance(p, ast.MatchValue) and _holds_a_mode_name(p.value) for c in cases for p in ast.walk(c)):
                found.append(f"{name}:{node.lineno}: match {ast.unparse(node.subject)}")
    return found


def test_no_module_outside_modes_compares_mode_names() -> None:
    found = [comparison for name, path in sorted(_modules().items())
             for comparison in _mode_name_comparisons(name, path.read_text())]
    assert found == []


@pytest.mark.parametrize("source", [
    'if mode == "full":\n    pass', "x = opened.mode != 'sharded'", 'x = self.mode in ("local", "sharded")',
    'x = "full" == io.mode', 'x = checkpoint_mode.name == "local"', 'x = mode not in ["full"]',
    'match opened.mode:\n    case "full":\n        pass',
])
def test_the_mode_check_finds_a_comparison_of_mode_names(source: str) -> None:
    assert _mode_name_comparisons("lightning_zero.checkpoint.saver", source)


def test_the_mode_check_leaves_other_comparisons_and_modes_alone() -> None:
    others = ('x = mode == RunningStage.TRAINING\ny = opened.mode.lightning_format\n'
              'z = checkpoint.get(TREE_TAG) != self.mode\nw = tier == "local"\nv = "w" not in mode\n'
              '"""mode == \'full\'"""\n')
    assert _mode_name_comparisons("lightning_zero.checkpoint.saver", others) == []
    assert _mode_name_comparisons("lightning_zero.checkpoint.modes.full", 'x = mode == "full"') == []


def test_a_mode_is_a_module_of_modes_and_one_row_of_its_registry() -> None:
    # Adding a mode touches modes/ alone: each registered object's class lives in the module named for it, and
    # implements the whole interface (CheckpointMode is abstract: a missing method fails at registration).
    from lightning_zero.checkpoint.modes import MODES
    from lightning_zero.checkpoint.modes.base import CheckpointMode

    assert list(MODES) == ["local", "sharded", "full"]  # the names users pass
    for name, mode in MODES.items():
        assert isinstance(mode, CheckpointMode) and mode.name == name
        assert type(mode).__module__ == f"{MODE_NAMES_ALLOWED}.{name}"
