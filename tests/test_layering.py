"""The package's layers and boundary, checked from its sources (docs/design.md describes the
same).

From the bottom up: core (the top-level modules: ops, pools, the transfer manager) <- stores
(the tiers below the host) <- connector (the host pool and stores for an engine's own pages)
<- cache (the block manager) <- the package's API (its `__init__`) <- the integrations with
engines, the demo and the bench, which use that API and do not import each other <- `__main__`.
A module imports only from its own layer and the layers below it; no module imports another
module's private name (`_name`), nor a private module (`_module`) of another folder.

Outside the package (tests/, scripts/, examples/), no file imports a private module or a private
name of the package, nor reaches one as an attribute of a module it imported (`kvx._lowering`):
they reach the insides through `jax_kvxfer.testing`. OUTSIDE_EXCEPTIONS names the exceptions.

The FFI target names are spelled in one table, `_native.py` (the `*_TARGET` constants), for
Python, and in `ffi/targets.h` for both compiled modules' registrations: the two lists are
equal, and no other module or C++ file spells a target (tests/native/test_targets.py checks
the compiled registrations against the table).
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "jax_kvxfer"
# A module may import from a layer of lower rank, or from its own.
RANKS = {"core": 0, "stores": 1, "connector": 2, "cache": 3, "api": 4, "integrations": 5,
         "demo": 5, "bench": 5, "main": 6}
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


# ---------------------------------------------------------------------------------------------
# Outside the package: tests, scripts and examples use its public modules and names only.

OUTSIDE = ("tests", "scripts", "examples")
# (file, private module or name it may use) -> why.
OUTSIDE_EXCEPTIONS = {
    ("tests/test_jax_seams.py", "_jax_seams"):
        "the seams' canaries test what the library relies on in JAX, module by module",
}


def _private_part(dotted: str) -> str | None:
    """The first private part of a dotted name under jax_kvxfer ("_checks" of "_checks.X")."""
    return next((p for p in dotted.split(".") if _private(p)), None)


def outside_violations(root: Path = REPO, package: Path = PACKAGE) -> list[str]:
    """Private modules and names of the package that files under root's OUTSIDE folders use,
    one line each: imported, or reached as an attribute of an imported package module."""
    found = []
    for path in sorted(p for name in OUTSIDE for p in (root / name).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        bound: dict[str, str] = {}  # a local name -> the package module it stands for
        used: list[tuple[int, str]] = []  # (line, what: a module or module.name under jax_kvxfer)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "jax_kvxfer" or a.name.startswith("jax_kvxfer."):
                        sub = a.name.partition(".")[2]
                        used.append((node.lineno, sub))
                        if a.asname:
                            bound[a.asname] = sub
                        else:  # `import jax_kvxfer.x` binds jax_kvxfer
                            bound["jax_kvxfer"] = ""
            elif (isinstance(node, ast.ImportFrom) and not node.level and node.module
                  and (node.module + ".").startswith("jax_kvxfer.")):
                base = node.module.partition(".")[2]
                for a in node.names:
                    sub = f"{base}.{a.name}" if base else a.name
                    used.append((node.lineno, sub))
                    if _is_module(package, sub):
                        bound[a.asname or a.name] = sub
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in bound and _private(node.attr)):
                module = bound[node.value.id]
                used.append((node.lineno, f"{module}.{node.attr}" if module else node.attr))
        for line, what in sorted(set(used)):
            part = _private_part(what)
            if part is not None and (rel, part) not in OUTSIDE_EXCEPTIONS:
                found.append(f"{rel}:{line}: uses jax_kvxfer.{what}, private ({part}); use a "
                             "public name (jax_kvxfer.testing for the insides)")
    return found


def test_tests_scripts_and_examples_use_no_private_module_or_name():
    found = outside_violations()
    assert not found, "private imports outside the package:\n  " + "\n  ".join(found)


# ---------------------------------------------------------------------------------------------
# The table of FFI targets.

TABLE = "_native.py"  # the one module that spells the targets
NATIVE_TABLE = REPO / "ffi" / "targets.h"  # the one C++ file that does
TARGET_NAME = re.compile(r"\bjax_kvxfer_\w+")


def table(package: Path = PACKAGE) -> dict[str, str]:
    """The `*_TARGET = "..."` constants of the table module: name -> target."""
    found = {}
    for node in ast.parse((package / TABLE).read_text(encoding="utf-8")).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id.endswith("_TARGET")
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            found[node.targets[0].id] = node.value.value
    return found


def native_table(header: Path = NATIVE_TABLE) -> list[str]:
    """The names ffi/targets.h registers, in its order."""
    return re.findall(r'X\("(jax_kvxfer_\w+)"', header.read_text(encoding="utf-8"))


def spelled_targets(package: Path = PACKAGE, ffi: Path = REPO / "ffi") -> list[str]:
    """Strings spelling a target (`jax_kvxfer_...`; docstrings, which name them in prose, left
    out) in a module other than the table, and in C++ sources other than ffi/targets.h."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path == package / TABLE:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in prose and TARGET_NAME.search(node.value)):
                found.append(f"jax_kvxfer/{path.relative_to(package).as_posix()}:{node.lineno}: "
                             f"spells the target {node.value!r} outside {TABLE}")
    for path in sorted(ffi.iterdir()):
        if path.name == NATIVE_TABLE.name or path.suffix not in (".h", ".cc", ".cu", ".cuh"):
            continue
        for line, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r'"jax_kvxfer_\w+', text):
                found.append(f"ffi/{path.name}:{line}: spells a target outside "
                             f"{NATIVE_TABLE.name}")
    return found


def test_targets_are_spelled_in_the_table_only():
    found = spelled_targets()
    assert not found, "targets spelled outside the table:\n  " + "\n  ".join(found)


def test_the_python_and_native_tables_agree():
    python, native = sorted(table().values()), native_table()
    assert len(native) == len(set(native)), native
    assert python == sorted(native), (python, native)


# ---------------------------------------------------------------------------------------------
# The checks themselves.

@pytest.mark.parametrize("module, expected", [
    ("manager", "core"), ("_native", "core"), ("events", "core"), ("metrics", "core"),
    ("cache.block_manager", "cache"), ("connector.worker", "connector"),
    ("integrations.easydel", "integrations"),
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
    worker = copy / "connector" / "worker.py"
    worker.write_text(worker.read_text() + "\nfrom ..cache.block_manager import BlockManager\n")
    found = violations(copy)
    assert any("manager.py" in f and "cache.__init__, of layer cache" in f for f in found), found
    assert any("connector/worker.py" in f and "connector imports cache.block_manager" in f
               for f in found), found
    assert any("private name(s) ['_checked_view'] of ops" in f for f in found), found


def test_the_check_sees_private_use_outside_the_package(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "import jax_kvxfer as kvx\n"
        "from jax_kvxfer import _native, testing\n"
        "from jax_kvxfer.ops._checks import IndexFacts\n"
        "from jax_kvxfer.ops import _checked_view\n"
        "from jax_kvxfer.ops._jax_seams import host_byte_views\n"
        "from jax_kvxfer.demo import cli\n"
        "kvx._lowering.eager_fn\n"
        "cli._private_helper\n"
        "testing.dma_batches()\n")
    (tmp_path / "tests" / "test_jax_seams.py").write_text(
        "from jax_kvxfer import _jax_seams as seams\n")
    found = outside_violations(tmp_path)
    for line, what in [(2, "_native"), (3, "_checks.IndexFacts"), (4, "ops._checked_view"),
                       (5, "_jax_seams.host_byte_views"),
                       (7, "_lowering"), (8, "demo.cli._private_helper")]:
        assert any(f.startswith(f"tests/test_x.py:{line}: uses jax_kvxfer.{what},")
                   for f in found), (what, found)
    assert len(found) == 6, found  # the seams' own test may import them; public names pass


def test_the_check_sees_a_target_spelled_outside_the_table(tmp_path):
    copy, ffi = tmp_path / "jax_kvxfer", tmp_path / "ffi"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "ffi", ffi)
    assert spelled_targets(copy, ffi) == []
    manager = copy / "manager.py"
    manager.write_text(manager.read_text() + '\nTARGET = "jax_kvxfer_block_copy"\n'
                       'def f():\n    """Docs may name `jax_kvxfer_block_copy`."""\n')
    cuda = ffi / "block_copy_cuda.cu"
    cuda.write_text(cuda.read_text() + '\n// d["jax_kvxfer_extra"] = nullptr;\n')
    found = spelled_targets(copy, ffi)
    assert len(found) == 2, found
    assert "jax_kvxfer/transfer/manager.py" in found[0] and "ffi/block_copy_cuda.cu" in found[1], found
