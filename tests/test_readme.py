"""Every ```python block of README.md runs as pasted, and so do the ```bash blocks of its Install section.

The python blocks run in order, each in a fresh interpreter, in one fresh working directory: a later block may use
what an earlier one made (the `load_snapshot` block loads the snapshots the quickstart block wrote), as a reader
following the README would. Each Install block runs in a copy of the repository's files (what a clone holds), in a
fresh virtual environment, and must leave lightning-snapshot installed there; docs/getting-started.md shows the same
blocks.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_BASH = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


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
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, f"README.md line {line}: the block fails:\n{code}\n{proc.stderr[-4000:]}"
    assert (tmp_path / "snapshots" / "run-42" / "step-000000000300" / "manifest.json").is_file()


# ------------------------------------------------------------------------------------------------ Install
def install_blocks(page: Path = README) -> list[str]:
    """The ```bash blocks of the page's Install section."""
    section = page.read_text().split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    return _BASH.findall(section)


def _commands(block: str) -> list[str]:
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def test_the_install_section_installs_from_the_repository_not_the_package_index():
    """lightning-snapshot is not on the package index: every ``pip install`` of the Install section installs the
    clone (``.``, with an extra) or a wheel built from it, never the name; docs/getting-started.md shows the same."""
    blocks = install_blocks()
    assert len(blocks) >= 2, blocks
    installs = [c.split()[2:] for b in blocks for c in _commands(b) if c.startswith("pip install")]
    assert installs and all(len(a) == 1 for a in installs), installs
    targets = [a[0].strip('"') for a in installs]
    assert "." in targets and ".[s3]" in targets, targets
    assert all(t in (".", ".[s3]") or (t.startswith("dist/") and t.endswith(".whl")) for t in targets), targets
    assert any(c.startswith("pip wheel") for b in blocks for c in _commands(b))
    guide = ROOT / "docs" / "getting-started.md"
    assert install_blocks(guide)[: len(blocks)] == blocks, "docs/getting-started.md's Install differs from the README's"


def _clone(dest: Path) -> Path:
    """A copy of the files a clone of this checkout holds (tracked, and new files git does not ignore)."""
    try:
        listed = (
            subprocess.run(
                ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                cwd=ROOT,
                capture_output=True,
                check=True,
                timeout=60,
            )
            .stdout.decode()
            .split("\0")
        )
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no way to tell which files a clone holds")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def _fresh_environment(where: Path, deps: Path) -> dict[str, str]:
    """A new virtual environment at ``where`` without lightning-snapshot, whose ``pip`` installs into it, and the
    environment variables of a shell in it. Nothing is downloaded: its dependencies (and pip and the build backend)
    are this environment's, seen through ``deps``; pip reads no configuration file and no index."""
    venv.create(where, with_pip=False)
    python = where / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "_deps.pth").write_text(f"{deps}\n")
    pip = where / "bin" / "pip"
    pip.write_text(f'#!/bin/sh\nexec "{python}" -m pip "$@"\n')
    pip.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(
        PATH=f"{where / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        VIRTUAL_ENV=str(where),
        PIP_CONFIG_FILE=os.devnull,
        PIP_NO_INDEX="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_BUILD_ISOLATION="0",
    )  # (pip's inverted spelling: build with the installed setuptools)
    return env


def _without_this_package(dest: Path) -> Path:
    """This environment's installed packages, lightning-snapshot's own (an editable install) left out: links."""
    dest.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.lower().startswith(("lightning_snapshot", "__editable__")) and entry.suffix != ".pth":
            (dest / entry.name).symlink_to(entry)
    return dest


def test_the_install_blocks_install_the_package_in_a_fresh_environment(tmp_path):
    """Each Install block, run by bash in a copy of the repository in a fresh virtual environment, installs
    lightning-snapshot there: from the clone (with the s3 extra, which pip knows) or from the wheel built in it; the
    package then imports from the environment, its backends included, and the ``lightning-snapshot`` command runs."""
    clone = _clone(tmp_path / "lightning-snapshot")
    deps = _without_this_package(tmp_path / "deps")
    for i, block in enumerate(install_blocks()):
        where = tmp_path / f"env{i}"
        env = _fresh_environment(where, deps)
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block], cwd=clone, env=env, capture_output=True, text=True, timeout=300
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"the Install block fails:\n{block}\n{out[-4000:]}"
        assert "does not provide the extra" not in out, out[-4000:]
        probe = (
            "import importlib.metadata as m, lightning_snapshot, lightning_snapshot.backends as b;"
            " d = m.distribution('lightning-snapshot');"
            " print(lightning_snapshot.__file__, b.__file__, d.version, *d.requires, sep='\\n')"
        )
        got = subprocess.run(
            [str(where / "bin" / "python"), "-c", probe],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert got.returncode == 0, got.stderr[-3000:]
        package, backends, *requires = got.stdout.splitlines()
        assert Path(package).is_relative_to(where) and Path(backends).is_relative_to(where), (package, backends)
        assert any(r.startswith("s3fs") and 'extra == "s3"' in r for r in requires), requires
        cli = subprocess.run(
            [str(where / "bin" / "lightning-snapshot"), "--help"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert cli.returncode == 0 and cli.stdout.startswith("usage: lightning-snapshot"), cli.stderr[-2000:]
    assert len(list((clone / "dist").glob("lightning_snapshot-*-py3-none-any.whl"))) == 1
