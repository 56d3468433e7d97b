"""The README runs as written: every ```python block, each in a fresh Python, and its links;
and so do the blocks of the docs that CHECKED_DOCS names.

A block's test id is its section's title in lower case with dashes (`the-manager`), with
`-2`, `-3`, ... for later blocks of the same section.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 200


def python_blocks(text: str) -> list[tuple[str, str]]:
    """(test id, code) of every ```python block, in order."""
    blocks, seen = [], {}
    section = "top"
    fence = None  # the language of the fenced block we are in, if any
    code: list[str] = []
    for line in text.splitlines():
        if fence is None:
            if line.startswith("```"):
                fence, code = line[3:].strip(), []
            elif line.startswith("## "):
                title = re.sub(r"['\u2019]", "", line[3:].lower())
                section = re.sub(r"[^a-z0-9]+", "-", title).strip("-")
        elif line.startswith("```"):
            if fence == "python":
                seen[section] = seen.get(section, 0) + 1
                n = seen[section]
                blocks.append((section if n == 1 else f"{section}-{n}", "\n".join(code) + "\n"))
            fence = None
        else:
            code.append(line)
    assert fence is None, "README.md ends inside a fenced block"
    return blocks


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))
# docs whose blocks run as they are (others show a deployment's addresses and paths)
CHECKED_DOCS = ("docs/events-metrics.md",)
DOC_BLOCKS = [(f"{Path(doc).stem}-{name}", code) for doc in CHECKED_DOCS
              for name, code in python_blocks((ROOT / doc).read_text(encoding="utf-8"))]


def test_readme_is_short_and_has_blocks():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines, at most {MAX_LINES}"
    assert len(BLOCKS) >= 4, [name for name, _ in BLOCKS]


@pytest.mark.slow  # a fresh Python a block (~2 s each); make test runs them
@pytest.mark.parametrize("code", [code for _, code in BLOCKS + DOC_BLOCKS],
                         ids=[name for name, _ in BLOCKS + DOC_BLOCKS])
def test_readme_block_runs(code, tmp_path):
    if "zmq" in code:
        pytest.importorskip("zmq", reason="the block needs pyzmq (the events extra)")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_readme_links_exist():
    text = README.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
