"""CI runs the stress script's quick mode; the GPU run is the full mode.

A subprocess, so that its live-array and memory counts see only its own arrays.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# end to end: plain `pytest` leaves it out, `make test` runs it
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "stress.py"
# On a GPU the test process already holds XLA's preallocated 75 % of the memory.
ENV = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")


def test_stress_quick_mode_passes():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick"], check=False,
                          capture_output=True, text=True, timeout=300, env=ENV)
    output = proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, f"stress --quick failed (exit {proc.returncode}):\n{output[-6000:]}"
    summary = lines[-1]
    m = re.match(r"stress: (\d+) ops, (\d+) syncs, (\d+) mismatches, (\d+) bookkeeping errors, "
                 r"live arrays (\d+)->(\d+)", summary)
    assert m, f"unexpected summary line: {summary!r}"
    ops, syncs, mismatches, bookkeeping, live0, live1 = map(int, m.groups())
    assert ops >= 3000 and syncs >= 10
    assert mismatches == 0 and bookkeeping == 0
    assert live1 <= live0 + 2
    assert summary.endswith(": OK"), summary


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_programs_with_ordinary_updates_match_a_numpy_shadow(seed):
    """1,000 random operations: manager calls, donated steps and ordinary (non-donated)
    updates assigned back, each seed a different program; on a GPU the copies run on the lanes,
    beside the updates."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--ops", "1000", "--seed", str(seed)],
                          check=False, capture_output=True, text=True, timeout=300, env=ENV)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, f"seed {seed}:\n{(proc.stdout + proc.stderr)[-6000:]}"
    mix = re.search(r"op mix: (\{.*?\})", proc.stdout)
    assert mix and "'user_update'" in mix.group(1) and "'user_write'" in mix.group(1), proc.stdout
    assert re.search(r" 0 mismatches, 0 bookkeeping errors", summary), summary


# The GPU sanitizer scripts, run here in their CPU dry-run modes so that CI keeps them working.

FAKE_SANITIZER = """#!/usr/bin/env bash
# Stands in for compute-sanitizer: drops its options, runs the program, prints a summary.
[ "${1:-}" = --version ] && { echo "fake compute-sanitizer version 0"; exit 0; }
tool=memcheck
while [ $# -gt 0 ] && [[ "$1" == --* ]]; do [ "$1" = --tool ] && tool=$2; shift 2; done
"$@"; rc=$?
if [ "$tool" = racecheck ]; then
  echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
else
  echo "========= ERROR SUMMARY: ${FAKE_ERRORS:-0} errors"
fi
exit $rc
"""


def test_sanitize_cases_pass_on_the_cpu_handler():
    proc = subprocess.run([sys.executable, str(SCRIPT.parent / "sanitize_cases.py"), "--allow-cpu"],
                          check=False, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert re.search(r"^sanitize_cases: \d+ cases, 0 failed", proc.stdout, re.MULTILINE), proc.stdout


def test_sanitize_script_logic_with_a_stand_in_sanitizer(tmp_path):
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(FAKE_SANITIZER)
    fake.chmod(0o755)
    env = dict(ENV, COMPUTE_SANITIZER=str(fake), SANITIZE_ALLOW_CPU="1", SANITIZE_PYTEST="",
               PYTHON=sys.executable)
    script = str(SCRIPT.parent / "sanitize.sh")
    ok = subprocess.run(["bash", script, "initcheck"], check=False, capture_output=True, text=True,
                        timeout=300, env=env)
    assert ok.returncode == 0, ok.stdout[-4000:] + ok.stderr[-2000:]
    assert ok.stdout.strip().splitlines()[-1].endswith(": OK")
    assert "========= ERROR SUMMARY: 0 errors" in ok.stdout
    bad = subprocess.run(["bash", script, "synccheck"], check=False, capture_output=True, text=True,
                         timeout=300, env=dict(env, FAKE_ERRORS="2"))
    assert bad.returncode == 1, bad.stdout[-4000:]
    assert "sanitize synccheck: ERROR SUMMARY: 2 errors" in bad.stdout
