"""The package's layers and boundary, checked from its sources (docs/design.md describes the
same).

From the bottom up, one folder a layer: ops (the block-copy op, with the compiled modules'
loader) <- observe (events, metrics) <- transfer (pools, the transfer manager) <- stores (the
tiers below the host) <- connector (the host pool and stores for an engine's own pages) <- cache
(the block manager) <- the package's API (its `__init__`) and `testing` (hooks for tests) <- the
integrations with engines, the demo and the bench, which use that API and do not import each
other <- `__main__`. ops, observe and transfer are the core. A module imports only from its own
layer and the layers below it; no module imports another module's private name (`_name`), nor a
private module (`_module`) of another folder, except that the core's folders (and `testing`)
share their private modules; no module lies outside a layer; the compiled modules
(`_kvxfer_cpu`, `_kvxfer_cuda`) are imported by `ops/_native.py` alone; and no chain of imports
inside the core is longer than MAX_CHAIN modules (the compiled ones counted).

Examples, which users copy, import no private module or name of the package, nor reach one as
an attribute of a module it imported (`kvx._lowering`). Tests and scripts may: they test and
check the insides, importing each from its own module (`jax_kvxfer.testing` holds hooks only).

The FFI target names are spelled in one table, `_native.py` (the `*_TARGET` constants), for
Python, and in `ffi/targets.h` for both compiled modules' registrations: the two lists are
equal, and no other module or C++ file spells a target (tests/native/test_targets.py checks
the compiled registrations against the table).

Sizes a reader can hold in mind: no module outside the demo over MAX_MODULE_LINES lines, no
function or method of the package over MAX_FUNCTION_LINES (its signature and docstring
counted).
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
RANKS = {"native": 0, "ops": 1, "observe": 2, "transfer": 3, "stores": 4, "connector": 5,
         "cache": 6, "api": 7, "testing": 7, "integrations": 8, "demo": 8, "bench": 8, "main": 9}
CORE = ("ops", "observe", "transfer")
SHARE_INSIDES = {*CORE, "testing"}  # layers that may import each other's private modules
MAX_CHAIN = 7  # modules in the core's deepest chain of imports (issue 56)
# The compiled extensions, which the build puts beside the package's modules, and the one module
# that imports them.
NATIVE = set(re.findall(r"nanobind_add_module\(\s*(\w+)",
                        (PACKAGE.parent / "CMakeLists.txt").read_text(encoding="utf-8")))
NATIVE_LOADER = "ops._native"
TOP_LEVEL = {"__init__": "api", "__main__": "main", "testing": "testing"}


def layer_of(module: str) -> str:
    """`module`: dotted, under jax_kvxfer ("transfer.manager", "cache.block_manager",
    "__init__"); "unplaced" for a module in no layer (a new top-level module)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "native" if parts[0] in NATIVE else TOP_LEVEL.get(parts[0], "unplaced")
    return parts[0] if parts[0] in RANKS else "unplaced"


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


def _package_modules(root: Path) -> list[tuple[str, Path]]:
    return [(".".join(p.relative_to(root).with_suffix("").parts), p)
            for p in sorted(root.rglob("*.py"))]


def violations(root: Path = PACKAGE) -> list[str]:
    """What runs against the layering in the package at `root`, one line each."""
    found = []
    for module, path in _package_modules(root):
        here = layer_of(module)
        if here == "unplaced":
            found.append(f"jax_kvxfer/{path.relative_to(root)}: in no layer (put it in a folder "
                         "of one)")
            continue
        for line, target, names in imports(root, module, path):
            there = layer_of(target)
            where = f"jax_kvxfer/{path.relative_to(root)}:{line}"
            if there == "unplaced":
                continue  # reported where it lies
            if here != there and RANKS[there] >= RANKS[here]:
                found.append(f"{where}: {here} imports {target}, of layer {there}")
            if there == "native" and module != NATIVE_LOADER:
                found.append(f"{where}: imports the compiled module {target}; only "
                             f"{NATIVE_LOADER} does")
            shared = here in SHARE_INSIDES and there in SHARE_INSIDES
            if (_private(target.split(".")[-1]) and folder(target) != folder(module)
                    and not shared and there != "native"):
                found.append(f"{where}: imports {target}, a private module of another folder")
            private = [n for n in names if _private(n)]
            if private and target != module:
                found.append(f"{where}: imports the private name(s) {private} of {target}")
    return found


def test_no_import_runs_against_the_layers():
    found = violations()
    assert not found, "imports against the layering:\n  " + "\n  ".join(found)


def deepest_chain(root: Path = PACKAGE) -> list[str]:
    """The longest chain of imports among the core's modules (the compiled modules counted),
    as the modules along it. A package's `__init__` counts only where a module imports it."""
    inside = {m for m, _ in _package_modules(root) if layer_of(m) in CORE} | NATIVE
    edges = {m: set() for m in inside}
    for module, path in _package_modules(root):
        if module in inside:
            edges[module] = {t for _, t, _ in imports(root, module, path)
                             if t in inside and t != module}
    memo: dict[str, list[str]] = {}

    def longest(m: str) -> list[str]:
        if m not in memo:
            memo[m] = [m] + max((longest(t) for t in edges[m]), key=len, default=[])
        return memo[m]

    return max((longest(m) for m in inside), key=len)


def test_the_core_s_imports_are_at_most_max_chain_deep():
    chain = deepest_chain()
    assert len(chain) <= MAX_CHAIN, " -> ".join(chain)


# ---------------------------------------------------------------------------------------------
# Outside the package: tests, scripts and examples use its public modules and names only.

OUTSIDE = ("examples",)
# (file, private module or name it may use) -> why.
OUTSIDE_EXCEPTIONS: dict[tuple[str, str], str] = {}


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
                             "public name")
    return found


def test_examples_use_no_private_module_or_name():
    found = outside_violations()
    assert not found, "private imports in the examples:\n  " + "\n  ".join(found)


# ---------------------------------------------------------------------------------------------
# The table of FFI targets.

TABLE = "ops/_native.py"  # the one module that spells the targets
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
    ("transfer.manager", "transfer"), ("ops._native", "ops"), ("ops.__init__", "ops"),
    ("observe.events", "observe"), ("observe.metrics", "observe"), ("_kvxfer_cpu", "native"),
    ("cache.block_manager", "cache"), ("connector.worker", "connector"),
    ("integrations.easydel", "integrations"), ("testing", "testing"),
    ("cache.__init__", "cache"), ("demo.cli", "demo"), ("bench.sweep", "bench"),
    ("__init__", "api"), ("__main__", "main"), ("manager", "unplaced")])
def test_layer_of(module, expected):
    assert layer_of(module) == expected


def test_the_layers_are_ordered_as_the_core_is_built():
    assert RANKS["native"] < RANKS["ops"] < RANKS["observe"] < RANKS["transfer"] < RANKS["stores"]
    assert RANKS["cache"] < RANKS["api"] < RANKS["demo"] < RANKS["main"]


def _plant(copy: Path, module: str, source: str) -> None:
    """Appends `source` to `module`'s file (dotted, under the copy), or makes the file."""
    path = copy.joinpath(*module.split(".")).with_suffix(".py")
    path.write_text((path.read_text() if path.exists() else "") + "\n" + source + "\n")


@pytest.mark.parametrize("module, source, expected", [
    # the core's own order: ops below observe below transfer
    ("ops._plan", "from ..transfer.pool import KVCacheBlockPool",
     "ops imports transfer.pool, of layer transfer"),
    ("ops.copy", "from ..observe import metrics", "ops imports observe.metrics, of layer observe"),
    ("observe.metrics", "from ..transfer.manager import TransferStats",
     "observe imports transfer.manager, of layer transfer"),
    # the core against the layers above it, and the layers above against each other
    ("transfer.manager", "from ..cache import BlockManager",
     "transfer imports cache.__init__, of layer cache"),
    ("connector.worker", "from ..cache.block_manager import BlockManager",
     "connector imports cache.block_manager, of layer cache"),
    ("demo.cli", "from ..bench import config", "demo imports bench.config, of layer bench"),
    # privacy: a private name; a private module of the core from above it
    ("transfer.manager", "from ..ops.copy import _one_count",
     "imports the private name(s) ['_one_count'] of ops.copy"),
    ("cache.block_manager", "from ..transfer._engines import Fence",
     "imports transfer._engines, a private module of another folder"),
    # the compiled modules: ops/_native.py alone loads them
    ("transfer._batch", "from .. import _kvxfer_cpu",
     "imports the compiled module _kvxfer_cpu; only ops._native does"),
    # a module in no layer
    ("helpers", "import numpy", "helpers.py: in no layer"),
])
def test_the_check_sees_a_planted_arrow(tmp_path, module, source, expected):
    """A copy of the package with one import planted against the layering: found, and nothing
    else is."""
    copy = tmp_path / "jax_kvxfer"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert violations(copy) == []
    _plant(copy, module, source)
    found = violations(copy)
    assert len(found) == 1 and expected in found[0], found


def test_the_chain_check_sees_a_chain_too_deep(tmp_path):
    """A synthetic core of MAX_CHAIN + 1 modules importing one another in a row."""
    root = tmp_path / "jax_kvxfer"
    (root / "ops").mkdir(parents=True)
    (root / "ops" / "__init__.py").write_text('"""ops."""\n')
    names = [f"_m{k}" for k in range(MAX_CHAIN + 1)]
    for name, below in zip(names, names[1:] + [None]):
        (root / "ops" / f"{name}.py").write_text(
            "" if below is None else f"from .{below} import X\n")
    chain = deepest_chain(root)
    assert chain == [f"ops.{n}" for n in names], chain
    (root / "ops" / f"{names[0]}.py").write_text("")  # cut the first link: MAX_CHAIN deep
    assert len(deepest_chain(root)) == MAX_CHAIN


def test_the_check_sees_private_use_in_the_examples(tmp_path):
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "x.py").write_text(
        "import jax_kvxfer as kvx\n"
        "from jax_kvxfer.ops import _native, copy_blocks\n"
        "from jax_kvxfer.ops._checks import IndexFacts\n"
        "from jax_kvxfer.ops.copy import _one_count\n"
        "from jax_kvxfer.transfer import pool\n"
        "from jax_kvxfer.demo import cli\n"
        "kvx._lowering.eager_fn\n"
        "cli._private_helper\n"
        "pool.KVCacheBlockPool\n")
    found = outside_violations(tmp_path)
    for line, what in [(2, "ops._native"), (3, "ops._checks.IndexFacts"),
                       (4, "ops.copy._one_count"), (7, "_lowering"),
                       (8, "demo.cli._private_helper")]:
        assert any(f.startswith(f"examples/x.py:{line}: uses jax_kvxfer.{what},")
                   for f in found), (what, found)
    assert len(found) == 5, found  # public modules and names pass


def test_the_check_sees_a_target_spelled_outside_the_table(tmp_path):
    copy, ffi = tmp_path / "jax_kvxfer", tmp_path / "ffi"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "ffi", ffi)
    assert spelled_targets(copy, ffi) == []
    manager = copy / "transfer" / "manager.py"
    manager.write_text(manager.read_text() + '\nTARGET = "jax_kvxfer_block_copy"\n'
                       'def f():\n    """Docs may name `jax_kvxfer_block_copy`."""\n')
    cuda = ffi / "block_copy_cuda.cu"
    cuda.write_text(cuda.read_text() + '\n// d["jax_kvxfer_extra"] = nullptr;\n')
    found = spelled_targets(copy, ffi)
    assert len(found) == 2, found
    assert "jax_kvxfer/transfer/manager.py" in found[0], found
    assert "ffi/block_copy_cuda.cu" in found[1], found


MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80


def _too_large(package: Path) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        source = path.read_text()
        where = path.relative_to(package.parent)
        lines = source.count("\n")
        if "demo" not in path.relative_to(package).parts and lines > MAX_MODULE_LINES:
            found.append(f"{where}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{where}:{node.lineno} {node.name}: {length} lines")
    return found


def test_modules_and_functions_stay_small():
    assert _too_large(PACKAGE) == []


def test_the_size_check_sees_a_long_function_and_a_long_module(tmp_path):
    copy = tmp_path / "jax_kvxfer"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (copy / "ops" / "long.py").write_text("def long():\n" + body + "\n" * MAX_MODULE_LINES)
    module_lines = MAX_FUNCTION_LINES + 1 + MAX_MODULE_LINES
    assert _too_large(copy) == [f"jax_kvxfer/ops/long.py: {module_lines} lines",
                                f"jax_kvxfer/ops/long.py:1 long: {MAX_FUNCTION_LINES + 1} lines"]
