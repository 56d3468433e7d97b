"""Whether a change to the native sources changed the CUDA kernels' machine code, without a GPU.

    python scripts/compare_kernels.py REV [--arch sm_90]

Compiles ffi/block_copy_cuda.cu of the working tree and of git revision REV (all of ffi/ taken
from REV) to cubins and compares the machine code (.text sections) kernel by kernel, with the
anonymous namespace's per-file hash taken out of the names. A refactor whose kernels all come out
byte-identical needs no new GPU run; any kernel listed as changed does (benchmarks/NOTES.md,
"Checking a change without a GPU"). Needs nvcc, and jax, nanobind and Python's headers as the
build uses them. Exit status: 0 identical, 1 changed, 2 could not compile.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys
import sysconfig
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def include_flags() -> list[str]:
    import jax.ffi
    import nanobind

    nb = pathlib.Path(nanobind.include_dir())
    dirs = [jax.ffi.include_dir(), sysconfig.get_paths()["include"], str(nb),
            str(nb.parent / "ext" / "robin_map" / "include")]
    return [flag for d in dirs for flag in ("-I", d)]


def compile_cubin(ffi_dir: pathlib.Path, out: pathlib.Path, arch: str) -> None:
    cmd = ["nvcc", "-O3", "-std=c++17", f"-arch={arch}", "-cubin", "-I", str(ffi_dir),
           *include_flags(), str(ffi_dir / "block_copy_cuda.cu"), "-o", str(out)]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if result.returncode != 0:
        sys.stderr.write(result.stderr[-4000:])
        raise SystemExit(2)


def kernel_code(cubin: pathlib.Path) -> dict[str, bytes]:
    """The .text sections of a cubin by name, the anonymous namespace's hashes normalised."""
    listing = subprocess.run(["readelf", "-SW", str(cubin)], capture_output=True, text=True,
                             check=True).stdout
    data = cubin.read_bytes()
    sections = {}
    for line in listing.splitlines():
        m = re.search(r"\]\s+(\.text\.\S+)\s+\S+\s+\S+\s+([0-9a-f]+)\s+([0-9a-f]+)", line)
        if m:
            offset, size = int(m.group(2), 16), int(m.group(3), 16)
            # The anonymous namespace's name holds two hashes, which change with the file's
            # text (e.g. _GLOBAL__N__e79f4fe4_18_block_copy_cuda_cu_8e7a2786).
            name = re.sub(r"_GLOBAL__N__[0-9a-f]+_(\d+_\w+?_cu_)[0-9a-f]{8}", r"ANON_\1",
                          m.group(1))
            sections[name] = data[offset:offset + size]
    return sections


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", help="git revision to compare the working tree against")
    parser.add_argument("--arch", default="sm_90")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        old_ffi = tmp / "ffi"
        old_ffi.mkdir()
        names = subprocess.run(["git", "ls-tree", "--name-only", f"{args.rev}:ffi"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.split()
        for name in names:
            blob = subprocess.run(["git", "show", f"{args.rev}:ffi/{name}"], cwd=ROOT,
                                  capture_output=True, check=True).stdout
            (old_ffi / name).write_bytes(blob)
        compile_cubin(old_ffi, tmp / "old.cubin", args.arch)
        compile_cubin(ROOT / "ffi", tmp / "new.cubin", args.arch)
        old, new = kernel_code(tmp / "old.cubin"), kernel_code(tmp / "new.cubin")
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    for name in changed:
        print(f"changed: {name} ({len(old.get(name, b''))} -> {len(new.get(name, b''))} bytes)")
    print(f"{len(new)} kernels in the working tree, {len(old)} at {args.rev}: "
          f"{len(changed)} changed")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
