"""Loader workers forked while the library's threads do their first work do not hang (lightning_snapshot/forksafe.py).

glibc's fork() leaves the exit-handler lock (``__exit_funcs_lock``) as it was in the parent, and torch takes it the
first time the process calls each operator: a DataLoader worker forked while the copy, allocation or persist thread
of the library made such a call hung for ever, and so did the training thread waiting for its batch (seen in CI: a
2-rank torchrun job, once in a few full runs). The race is a window of nanoseconds; ``fixtures/exit_lock`` keeps
glibc's behaviour (a lock a forked child inherits locked, around every registration) and widens the window to 50 ms
for the threads other than a process's main thread, so that the job hangs every time without the fix. The jobs must
end, bitwise equal to the same job run without the stand-in.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SCRIPTS, assert_bitwise_equal, run_job

from lightning_snapshot.backends import LocalTier
from lightning_snapshot.writer import committed_steps

ARGS = ("--devices", "2", "--max-steps", "40", "--every", "10", "--shuffle", "--dropout", "0.1", "--workers", "2",
        "--augment")


@pytest.fixture(scope="module")
def exit_lock(tmp_path_factory) -> Path:
    """The stand-in for glibc's exit-handler lock, built with the machine's C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc) to build tests/fixtures/exit_lock/exit_lock.c")
    out = tmp_path_factory.mktemp("exit_lock") / "exit_lock.so"
    source = Path(__file__).parent / "fixtures" / "exit_lock" / "exit_lock.c"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(source), "-ldl", "-lpthread"], check=True)
    return out


def _torchrun(base: Path, shm: Path, *args: str, preload: Path | None = None) -> subprocess.CompletedProcess[str]:
    # (each job its own node agents: the one of the job with the stand-in has it too)
    env = {**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning", "LIGHTNING_SNAPSHOT_SHM_DIR": str(shm)}
    if preload is not None:
        env["LD_PRELOAD"] = str(preload)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPTS / "train.py"), "--dir", str(base / "local"), "--out", str(base / "out.pt"), *args]
    return run_job(cmd, 180, env)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--ram-every", "5")], ids=["local-tier", "ram-and-local-tiers"])
def test_loader_workers_forked_during_the_first_snapshots_do_not_hang(tmp_path, exit_lock, shm, extra):
    """2 ranks, 2 loader workers each (forked anew each epoch of 8 steps); the first snapshot (step 10) is being
    copied and written while the workers of the epoch at step 16 are forked, and the arena allocates its second
    buffer in the background while the first epoch's are. Without the fix: hung in the first epochs."""
    ref = _torchrun(tmp_path / "ref", shm / "ref", *ARGS, *extra)
    assert ref.returncode == 0, ref.stderr[-4000:]
    got = _torchrun(tmp_path / "run", shm / "run", *ARGS, *extra, preload=exit_lock)
    assert got.returncode == 0, got.stderr[-6000:]
    assert committed_steps(LocalTier(tmp_path / "run" / "local"))[0] == 40
    for suffix in ("", ".rank1"):
        assert assert_bitwise_equal(Path(f"{tmp_path / 'ref' / 'out.pt'}{suffix}"),
                                    Path(f"{tmp_path / 'run' / 'out.pt'}{suffix}")) > 0
