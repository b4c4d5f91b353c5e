"""The documentation site builds with ``mkdocs build --strict``: no warning (a broken link or anchor, a page missing
from the nav, a docstring mkdocstrings cannot parse) gets through CI; the python blocks of the guides run as pasted;
every CHANGELOG entry is one or two lines a user reads (under 300 characters)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_docs_site_builds_strict_without_warnings(tmp_path):
    assert importlib.util.find_spec("mkdocs") is not None, (
        'mkdocs is not installed: pip install -e ".[docs]" (scripts/test.sh installs it)'
    )
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    warnings = [line for line in out.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert proc.returncode == 0 and not warnings, f"mkdocs build --strict failed:\n{out[-6000:]}"
    site = tmp_path / "site"
    api = (site / "api" / "index.html").read_text()
    # the API reference is generated from the docstrings, not written by hand
    for name in (
        "SnapshotCallback",
        "load_snapshot",
        "export_snapshot",
        "LocalTier",
        "ObjectStoreTier",
        "RamTier",
        "parse_tier",
        "Backend",
        "TierUnavailableError",
        "collective_timeout",
    ):
        assert name in api, f"the API reference lacks {name}"
    assert (site / "img" / "tensorboard-scalars.png").stat().st_size > 10_000
    assert 'src="../img/tensorboard-scalars.png"' in (site / "metrics" / "index.html").read_text()


# pages in reading order: later blocks may use what earlier ones made (the quickstart's snapshots/run-42)
_PAGES = ("getting-started.md", "index.md", "configuration.md", "tiers.md", "resharding.md")
_RUNNER = """
import pathlib, re, sys, traceback
block = re.compile(r"^```python\\n(.*?)^```", re.S | re.M)
for page in sys.argv[1:]:
    text = pathlib.Path(page).read_text()
    for m in block.finditer(text):
        line = text.count("\\n", 0, m.start()) + 1
        try:
            exec(compile(m.group(1), f"{page}:{line}", "exec"), {"__name__": "__main__"})
        except BaseException:
            print(f"FAILED {page} line {line}:\\n{m.group(1)}", file=sys.stderr)
            traceback.print_exc()
            sys.exit(1)
        print(f"ran {page}:{line}")
"""


@pytest.mark.slow
def test_every_python_block_of_the_docs_runs_as_pasted(tmp_path):
    """One interpreter runs every block, each in a fresh namespace (cheaper than a process per block)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("LIGHTNING_SNAPSHOT_SHM_DIR", None)
    pages = [str(ROOT / "docs" / p) for p in _PAGES]
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, *pages], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    ran = proc.stdout.count("ran ")
    assert ran >= 9, proc.stdout
    assert (tmp_path / "snapshots" / "run-42" / "step-000000000300" / "manifest.json").is_file()
    assert (tmp_path / "model.safetensors").stat().st_size > 0 and (tmp_path / "state.pt").stat().st_size > 0


#: the most characters of one CHANGELOG entry (its lines joined): one or two lines a user reads
CHANGELOG_ENTRY_MAX = 300


def changelog_entries(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every entry of a CHANGELOG: a line starting with ``- `` or ``* `` and the indented lines
    that continue it, joined by single spaces."""
    entries: list[list] = []
    open_entry = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith(("- ", "* ")):
            entries.append([number, line[2:].strip()])
            open_entry = True
        elif open_entry and line.startswith(" ") and line.strip():
            entries[-1][1] += " " + line.strip()
        else:
            open_entry = False
    return [(n, t) for n, t in entries]


def test_every_changelog_entry_is_under_300_characters():
    """An entry says what changed for a user in one or two lines; the how and the measurements go to the commit
    message and the docs."""
    entries = changelog_entries((ROOT / "CHANGELOG.md").read_text())
    assert len(entries) > 100
    long = [
        f"CHANGELOG.md line {n}: {len(t)} characters: {t[:80]}..." for n, t in entries if len(t) >= CHANGELOG_ENTRY_MAX
    ]
    assert not long, "entries of 300 characters or more (shorten them to one or two lines):\n" + "\n".join(long)
    # (the parser sees an entry's continuation lines)
    assert changelog_entries("- a\n  b\n\n- c\nd\n  e\n") == [(1, "a b"), (4, "c")]
