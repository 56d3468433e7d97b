"""The package's layers, checked from its imports (docs/design.md describes the same).

From the bottom up: core (the top-level modules: ops, pools, the transfer manager) <- stores
(the tiers below the host) <- cache (the block manager) <- the package's API (its `__init__`)
<- the demo and the bench, which use that API and do not import each other <- `__main__`.
A module imports only from its own layer and the layers below it; no module imports another
module's private name (`_name`), nor a private module (`_module`) of another folder.
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jax_kvxfer"
# A module may import from a layer of lower rank, or from its own.
RANKS = {"core": 0, "stores": 1, "cache": 2, "api": 3, "demo": 4, "bench": 4, "main": 5}
# The compiled extensions, which the build puts beside the package's modules.
NATIVE = set(re.findall(r"nanobind_add_module\(\s*(\w+)",
                        (PACKAGE.parent / "CMakeLists.txt").read_text(encoding="utf-8")))


def layer_of(module: str) -> str:
    """`module`: dotted, under jax_kvxfer ("manager", "cache.block_manager", "__init__")."""
    parts = module.split(".")
    if len(parts) == 1 and parts[0] in ("__init__", "__main__"):
        return {"__init__": "api", "__main__": "main"}[parts[0]]
    return parts[0] if len(parts) > 1 and parts[0] in RANKS else "core"


def _is_module(root: Path, module: str) -> bool:
    """A module (Python or a compiled extension) or a package under `root`."""
    path = root.joinpath(*module.split("."))
    return path.is_dir() or path.with_suffix(".py").exists() or (
        path.parent == root and path.name in NATIVE)


def _module_name(root: Path, module: str) -> str:
    """A package's dotted name -> its __init__ module; a module's stays."""
    if root.joinpath(*module.split(".")).is_dir():
        return f"{module}.__init__" if module else "__init__"
    return module


def imports(root: Path, module: str, path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module under jax_kvxfer, names taken from it) for every import of the package in
    `module`, relative or absolute; `from pkg import name` of a submodule counts as importing
    that submodule."""
    package = module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, _module_name(root, a.name.partition(".")[2]), [])
                    for a in node.names
                    if a.name.startswith("jax_kvxfer.")]
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package[:len(package) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        elif node.module and (node.module + ".").startswith("jax_kvxfer."):
            target = node.module.partition(".")[2]
        else:
            continue
        for alias in node.names:
            sub = f"{target}.{alias.name}" if target else alias.name
            if _is_module(root, sub):
                out.append((node.lineno, _module_name(root, sub), []))
            else:
                out.append((node.lineno, _module_name(root, target), [alias.name]))
    return out


def folder(module: str) -> str:
    return module.rpartition(".")[0]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def violations(root: Path = PACKAGE) -> list[str]:
    """What runs against the layering in the package at `root`, one line each."""
    found = []
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        here = layer_of(module)
        for line, target, names in imports(root, module, path):
            there = layer_of(target)
            where = f"jax_kvxfer/{path.relative_to(root)}:{line}"
            if here != there and RANKS[there] >= RANKS[here]:
                found.append(f"{where}: {here} imports {target}, of layer {there}")
            if _private(target.split(".")[-1]) and folder(target) != folder(module):
                found.append(f"{where}: imports {target}, a private module of another folder")
            private = [n for n in names if _private(n)]
            if private and target != module:
                found.append(f"{where}: imports the private name(s) {private} of {target}")
    return found


def test_no_import_runs_against_the_layers():
    found = violations()
    assert not found, "imports against the layering:\n  " + "\n  ".join(found)


@pytest.mark.parametrize("module, expected", [
    ("manager", "core"), ("_native", "core"), ("cache.block_manager", "cache"),
    ("cache.__init__", "cache"), ("demo.cli", "demo"), ("bench.sweep", "bench"),
    ("__init__", "api"), ("__main__", "main")])
def test_layer_of(module, expected):
    assert layer_of(module) == expected


def test_the_check_sees_a_wrong_import(tmp_path):
    """A copy of the package with an import added against the layering, and a private name
    imported across modules: both found."""
    copy = tmp_path / "jax_kvxfer"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    manager = copy / "manager.py"
    manager.write_text(manager.read_text() + "\nfrom .cache import BlockManager\n"
                       "from .ops import _checked_view\n")
    found = violations(copy)
    assert any("manager.py" in f and "cache.__init__, of layer cache" in f for f in found), found
    assert any("private name(s) ['_checked_view'] of ops" in f for f in found), found
