"""The layers stay apart: a lower layer never imports a higher one (definition < schedules <
build and dispatch < binding and compat < tools)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: layer -> (its source folder, its rank)
LAYERS = {
    "tvm_deform.ir": (ROOT / "tvm_deform" / "ir", 0),
    "tvm_deform.schedules": (ROOT / "schedules", 1),
    "tvm_deform.runtime": (ROOT / "tvm_deform" / "runtime", 2),
    "tvm_deform.binding": (ROOT / "tvm_deform" / "binding", 3),
    "tvm_deform.compat": (ROOT / "tvm_deform" / "compat", 3),
    "tvm_deform.tools": (ROOT / "tvm_deform" / "tools", 4),
}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def rank_of(module: str) -> int | None:
    for layer, (_, rank) in LAYERS.items():
        if module == layer or module.startswith(layer + "."):
            return rank
    return None


def test_no_layer_imports_a_higher_one():
    offences = []
    for layer, (folder, rank) in LAYERS.items():
        for path in sorted(folder.glob("*.py")):
            for module in imported_modules(path):
                other = rank_of(module)
                if other is not None and other > rank:
                    offences.append(f"{path.relative_to(ROOT)} ({layer}) imports {module}")
    assert not offences, "\n".join(offences)
