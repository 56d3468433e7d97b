"""The copy kernel's index arithmetic (ffi/copy_units.cuh) and the copy engines' plan
(ffi/dma_plan.h) run on the host: every work unit and thread of a launch, one after another, and
the plan's copies with memcpy, against a reference that applies the pairs in order, on random
geometries and batches (tests/native/copy_units_emulation.cc). It needs only a C++ compiler, so
it runs where no GPU does; with AddressSanitizer when the compiler has it."""

from __future__ import annotations

import os
import shutil
import subprocess

import jax.ffi
import pytest

# end to end: plain `pytest` leaves it out, `make test` runs it
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE = os.path.join(ROOT, "tests", "native", "copy_units_emulation.cc")
CXX = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


@pytest.fixture(scope="module")
def emulation(tmp_path_factory):
    if CXX is None:
        pytest.skip("no C++ compiler")
    exe = str(tmp_path_factory.mktemp("emulation") / "copy_units_emulation")
    base = [CXX, "-std=c++17", "-O1", "-g", "-Wno-unknown-pragmas", "-I", os.path.join(ROOT, "ffi"),
            "-isystem", jax.ffi.include_dir(), SOURCE, "-o", exe]
    sanitized = subprocess.run(base[:1] + ["-fsanitize=address,undefined"] + base[1:],
                               capture_output=True, text=True, check=False)
    if sanitized.returncode != 0:  # no sanitizer runtime: the guard bytes still catch strays
        plain = subprocess.run(base, capture_output=True, text=True, check=False)
        assert plain.returncode == 0, plain.stderr[-3000:]
    return exe


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_copy_units_match_the_reference(emulation, seed, rng):
    seed = seed * 1_000_003 + int(rng.integers(1 << 30))
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0")  # LeakSanitizer needs ptrace
    proc = subprocess.run([emulation, "300", str(seed)], capture_output=True, text=True,
                          timeout=300, check=False, env=env)
    assert proc.returncode == 0 and proc.stdout.startswith("ok 300 cases"), (
        proc.stdout[-2000:] + proc.stderr[-3000:])
