"""The diagnostic scripts still run (on any backend, tiny sizes): their GPU figures are not
checked here, only that they run to the end and print what their readers look for."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(*args: str) -> str:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", args[0]), *args[1:]],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_pipeline_probe_runs():
    out = run_script("pipeline_probe.py", "--sizes", "16K", "--directions", "d2h,d2d",
                     "--chains", "1,2")
    lines = [line for line in out.splitlines() if " k= " in line]
    assert len(lines) == 4, out  # 2 directions x 2 chain lengths
    for line in lines:
        assert "pipe  1:" in line and "pipe 16:" in line and "host dispatch" in line, line


def test_profile_manager_runs():
    out = run_script("profile_manager.py", "--calls", "16")
    for verb in ("offload", "onboard"):
        assert any(line.startswith(verb) and "stages (median us)" in line
                   for line in out.splitlines()), out


def test_profile_manager_trace_names_the_verbs_stages():
    """--trace: the verb's own functions and the jitted dispatch appear among its host events,
    with a time per call, and the dispatch alone shows none of the verb's Python."""
    out = run_script("profile_manager.py", "--calls", "8", "--trace")
    for verb in ("offload", "onboard"):
        verb_part = out.split(f"{verb}  verb:")[1].split(f"{verb}  dispatch alone:")[0]
        alone = out.split(f"{verb}  dispatch alone:")[1].split("onboard  verb:")[0]
        assert "check_batch" in verb_part and "PjitFunction(_copy_across_impl)" in verb_part, out
        assert "check_batch" not in alone and "PjitFunction(_copy_across_impl)" in alone, out


def test_ab_kernel_builds_each_version_with_its_files(tmp_path):
    """scripts/ab-kernel.sh with two old versions and two benches (`--and`): each build sees
    its own ffi files (and the working tree's for the rest) and runs both benches, the summary
    has a row per case and batch size and a column per version, and the working tree's files
    are back at the end. pip and the bench are stood in for by a fake python3 that records which
    ffi files each build saw and writes a bench JSON."""
    ffi = pathlib.Path(ROOT, "ffi")
    originals = {f: (ffi / f).read_bytes() for f in ("block_copy_cuda.cu", "copy_units.cuh")}
    for name, marker in (("va", "A"), ("vb", "B")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "copy_units.cuh").write_text(f"// version {marker}\n")
    (tmp_path / "vb" / "block_copy_cuda.cu").write_text("// version B\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
if args[:2] == ["-m", "pip"]:
    seen = [open(os.path.join("ffi", f)).readline().strip()
            for f in ("block_copy_cuda.cu", "copy_units.cuh")]
    with open({str(tmp_path / "builds.log")!r}, "a") as log:
        log.write(" | ".join(seen) + "\\n")
elif args[:3] == ["-m", "jax_kvxfer", "bench"]:
    out = args[args.index("--out") + 1]
    os.makedirs(out, exist_ok=True)
    blocks = int(args[args.index("--blocks") + 1])
    rec = dict(path="ours", direction="d2d", block_bytes=1 << 20, n_label="T", ratio=blocks / 1e4,
               blocks=blocks)
    json.dump({{"results": [rec]}}, open(os.path.join(out, f"b{{blocks}}.json"), "w"))
else:
    os.execv({sys.executable!r}, [{sys.executable!r}, *args])
""")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"))
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "ab-kernel.sh"),
                           f"{tmp_path / 'vb'},{tmp_path / 'va'}", "2", "--blocks", "256",
                           "--and", "--blocks", "4096"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for f, data in originals.items():
        assert (ffi / f).read_bytes() == data, f"{f} not restored"
    new_cu = originals["block_copy_cuda.cu"].decode().splitlines()[0]
    new_cuh = originals["copy_units.cuh"].decode().splitlines()[0]
    builds = (tmp_path / "builds.log").read_text().splitlines()
    assert builds == [f"{new_cu} | {new_cuh}", "// version B | // version B",
                      f"{new_cu} | // version A"] * 2, builds
    rows = [" ".join(line.split()) for line in proc.stdout.splitlines() if line.startswith("AB ")]
    want = [f"AB d2d {b}x1024K ours n=T new {r} / {r} vb {r} / {r} va {r} / {r}"
            for b, r in ((256, "2.6%"), (4096, "41.0%"))]
    assert sorted(rows) == want, proc.stdout
    summary = (tmp_path / "out" / "ab-summary.txt").read_text().splitlines()
    assert [" ".join(line.split()) for line in summary] == rows, summary


FAKE_SANITIZER = """#!/usr/bin/env bash
# A stand-in for compute-sanitizer. FAKE_MODE: crash_once (a signal without a report on the
# first run, then a clean report), crash_always, errors (a report of 2 errors, exit 86).
[ "$1" = --version ] && { echo "Version 0 (stand-in)"; exit 0; }
runs="$FAKE_DIR/runs"; echo run >> "$runs"
if [ "$FAKE_MODE" = crash_always ] || { [ "$FAKE_MODE" = crash_once ] && [ "$(wc -l < "$runs")" = 1 ]; }; then
  kill -SEGV $$
fi
echo "sanitize_cases: 1 cases, 0 failed (0 s)"
if [ "$FAKE_MODE" = errors ]; then echo "========= ERROR SUMMARY: 2 errors"; exit 86; fi
echo "========= ERROR SUMMARY: 0 errors"
"""


@pytest.mark.parametrize("mode, rc, verdict, runs", [
    ("crash_once", 0, "ok (after a crash without a report, exit 139, and one rerun)", 2),
    ("crash_always", 1, "FAILED (no summary line) (after a crash without a report", 2),
    ("errors", 1, "ERRORS", 1)])
def test_sanitize_reruns_a_tool_once_after_a_crash_without_a_report(tmp_path, mode, rc, verdict,
                                                                    runs):
    """scripts/sanitize.sh: a tool whose process died of a signal before any report runs once
    more, and says so; an error report is never rerun."""
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(FAKE_SANITIZER)
    fake.chmod(0o755)
    env = dict(os.environ, COMPUTE_SANITIZER=str(fake), SANITIZE_ALLOW_CPU="1",
               SANITIZE_PYTEST="", FAKE_MODE=mode, FAKE_DIR=str(tmp_path))
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "sanitize.sh"), "memcheck"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
                          check=False)
    assert proc.returncode == rc, proc.stdout + proc.stderr
    line = [x for x in proc.stdout.splitlines() if x.startswith("sanitize memcheck:")]
    assert len(line) == 1 and verdict in line[0], proc.stdout
    assert (tmp_path / "runs").read_text().count("run") == runs


@pytest.mark.skipif(any(shutil.which(tool) is None for tool in ("nvcc", "readelf", "git"))
                    or not os.path.exists(os.path.join(ROOT, ".git")),
                    reason="needs nvcc, readelf and a git checkout")
def test_compare_kernels_finds_every_kernel_and_a_change(tmp_path):
    """scripts/compare_kernels.py: the working tree against HEAD lists every kernel and, in a
    clean checkout, none changed; the helper that reads a cubin sees a kernel's code change
    when one constant of it changes."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import compare_kernels
    finally:
        sys.path.pop(0)
    dirty = subprocess.run(["git", "status", "--porcelain", "ffi"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.strip()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compare_kernels.py"),
                           "HEAD"], check=False, capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    counts = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    kernels = int(counts.split(" kernels")[0])
    assert kernels >= 10, proc.stdout  # CopyPairsKernel's instances, the lean and scan kernels
    if not dirty:
        assert proc.returncode == 0 and counts.endswith(": 0 changed"), proc.stdout

    src = "__global__ void Fill(int* p) { p[threadIdx.x] = %d; }\n"
    code = {}
    for value in (7, 9):
        cu = tmp_path / f"fill{value}.cu"
        cu.write_text(src % value)
        subprocess.run(["nvcc", "-arch=sm_90", "-cubin", str(cu), "-o", str(cu) + ".cubin"],
                       check=True, capture_output=True)
        code[value] = compare_kernels.kernel_code(pathlib.Path(str(cu) + ".cubin"))
    assert list(code[7]) == list(code[9]) == [".text._Z4FillPi"]
    assert code[7] != code[9]


def test_readme_table_reads_its_figures_from_the_json(tmp_path):
    # A bench JSON written here with fresh ratios: each cell must show the figure of its own case
    # (path, direction, size, n), so a table built from the wrong case or column fails.
    import json
    import random

    rng = random.Random()
    sizes = (16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
    results = []
    for path in ("ours", "ours_dma", "manager", "manager_dma", "eager", "eager_kernel", "naive",
                 "trt_loop"):
        for direction in ("d2h", "h2d", "d2d"):
            for size in sizes:
                for n in ("T", "T-1", "T/2", "1"):
                    results.append({"path": path, "direction": direction, "block_bytes": size,
                                    "n_label": n, "ratio": rng.uniform(0.1, 0.99),
                                    "gpu_ratio": rng.uniform(0.1, 0.99),
                                    "same_bytes_ratio": rng.uniform(0.1, 0.99),
                                    "same_bytes_gpu_ratio": rng.uniform(0.1, 0.99),
                                    "gbps": rng.uniform(1.0, 60.0), "error": None})
    doc = tmp_path / "bench.json"
    doc.write_text(json.dumps({"results": results}))
    rows = run_script("readme_table.py", str(doc)).splitlines()
    by = {(r["path"], r["direction"], r["block_bytes"], r["n_label"]): r for r in results}

    def cells(title):
        row = next(r for r in rows if r.startswith(f"| {title} |"))
        return [c.strip() for c in row.strip("|").split("|")[1:]]

    def pct(case, key="ratio", gpu_key="gpu_ratio"):
        return f"{100 * by[case][key]:.0f} ({100 * by[case][gpu_key]:.0f})"

    for size, cell in zip(sizes, cells("offload, whole blocks")):
        assert cell == pct(("ours", "d2h", size, "T")) + " %"
    for size, cell in zip(sizes, cells("offload / onboard, n = T/2")):
        assert cell == (f"{pct(('ours', 'd2h', size, 'T/2'))} / "
                        f"{pct(('ours', 'h2d', size, 'T/2'))} %")
    for size, cell in zip(sizes, cells("device→device, whole / n = T−1 / n = T/2")):
        cases = [("ours", "d2d", size, n) for n in ("T", "T-1", "T/2")]
        wall = " / ".join(f"{100 * by[c]['ratio']:.0f}" for c in cases)
        gpu = " / ".join(f"{100 * by[c]['gpu_ratio']:.0f}" for c in cases)
        assert cell == f"{wall} % ({gpu} %)"
    for size, cell in zip(sizes, cells("vs naive `device_put` loop (offload / onboard)")):
        x = [by[("ours", d, size, "T")]["gbps"] / by[("naive", d, size, "T")]["gbps"]
             for d in ("d2h", "h2d")]
        assert cell == " / ".join(f"{v:.0f}" if v >= 10 else f"{v:.2f}" for v in x) + "×"
