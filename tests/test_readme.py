"""Every ```python block of README.md runs as pasted.

The blocks run in order, each in a fresh interpreter, in one fresh working directory: a later block may use what an
earlier one made (the `load_snapshot` block loads the snapshots the quickstart block wrote), as a reader following
the README would.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def readme_blocks() -> list[tuple[int, str]]:
    """(line number, code) of every ```python block of the README."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _BLOCK.finditer(text)]


def test_the_readme_has_python_blocks():
    blocks = readme_blocks()
    assert len(blocks) >= 2 and any("trainer.fit" in code for _, code in blocks)


@pytest.mark.slow
def test_every_python_block_of_the_readme_runs_as_pasted(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("LIGHTNING_SNAPSHOT_SHM_DIR", None)
    for line, code in readme_blocks():
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, f"README.md line {line}: the block fails:\n{code}\n{proc.stderr[-4000:]}"
    assert (tmp_path / "snapshots" / "run-42" / "step-000000000300" / "manifest.json").is_file()
