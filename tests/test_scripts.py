"""The diagnostic scripts still run (on any backend, tiny sizes): their GPU figures are not
checked here, only that they run to the end and print what their readers look for."""

from __future__ import annotations

import os
import subprocess
import sys

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
