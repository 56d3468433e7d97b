"""The README's code blocks that a user can paste run as written, each in a fresh Python."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
# The sections whose Python blocks run as written (the rest still show fragments).
RUNNABLE_SECTIONS = ("Use it from an engine",)


def python_blocks(section: str) -> list[str]:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end if end > 0 else None],
                      re.DOTALL)


@pytest.mark.parametrize("section", RUNNABLE_SECTIONS)
def test_readme_block_runs(section):
    blocks = python_blocks(section)
    assert blocks, f"no Python block under '## {section}'"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    for code in blocks:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=300, env=env, check=False)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
