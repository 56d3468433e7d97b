"""The GPU-check scripts' logic, on any machine: the sanitizer run's verdicts (with a stand-in
for compute-sanitizer). The stress run has its own test (test_stress_quick.py)."""

from __future__ import annotations

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
