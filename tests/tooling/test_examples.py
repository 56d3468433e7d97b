"""The examples run as a user would run them, each in a fresh Python, and check themselves
(each ends with assertions against NumPy)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# end to end: plain `pytest` leaves it out, `make test` runs it
pytestmark = pytest.mark.slow

# An example that serves through another engine needs that engine's environment, which
# scripts/easydel-check.sh makes and runs it in (too heavy for the suite).
EXAMPLES = sorted(p for p in (Path(__file__).resolve().parents[2] / "examples").glob("*.py")
                  if not p.name.startswith("easydel_"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path):
    # one device, as a user has; on a GPU the suite's own process holds most of its memory
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.strip(), "the example printed nothing"
