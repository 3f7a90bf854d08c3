"""The package's layers point down: no module of align imports from a layer above its own.

Every import counts, a function-level one too, since it runs when the function does.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ALIGN = Path(__file__).resolve().parents[1] / "align"

# Lowest first. A module may import from its own layer or any layer listed before it.
LAYERS = (
    ("__init__", "exit_codes", "constants", "log"),
    ("topology", "paths", "receipts"),
    ("config",),
    ("utils", "losses"),
    ("kernels", "data"),
    ("model",),
    ("eval",),
    ("train",),
    ("stages", "launch"),
    ("report",),
    ("workflow", "cli"),
)
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def part_of(module: str) -> str:
    """The top-level part of align a dotted module name belongs to (`align` alone: its root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    parts = path.relative_to(ALIGN.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def from_import(node: ast.ImportFrom) -> list[str]:
    """`from align import paths` imports align.paths; `from align import __version__`, the root."""
    if node.module != "align":
        return [node.module]
    return [f"align.{a.name}" if a.name in RANK else "align" for a in node.names]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every align import in `path`, wherever it sits in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, name) for name in from_import(node)]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] == "align"]


MODULES = sorted(ALIGN.rglob("*.py"))


def test_every_part_of_the_package_has_a_layer():
    parts = {part_of(module_name(path)) for path in MODULES}
    assert parts == set(RANK), parts ^ set(RANK)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_no_module_imports_from_a_layer_above_its_own(path):
    own = part_of(module_name(path))
    upward = [
        f"{path.relative_to(ALIGN.parent)}:{line} imports {name} ({part_of(name)} is above {own})"
        for line, name in imported_modules(path)
        if RANK[part_of(name)] > RANK[own]
    ]
    assert not upward, "\n".join(upward)


def test_an_upward_import_is_reported_with_its_file_and_line(tmp_path):
    module = tmp_path / "align" / "data" / "bad.py"
    module.parent.mkdir(parents=True)
    module.write_text("import os\n\ndef f():\n    from align.train.trainer import Trainer\n")
    assert imported_modules(module) == [(4, "align.train.trainer")]
    assert RANK[part_of("align.train.trainer")] > RANK[part_of("align.data.bad")]
