"""Loader workers forked while the library's threads do their first work do not hang (lightning_snapshot/dist/forksafe.py).

glibc's fork() leaves the exit-handler lock (``__exit_funcs_lock``) as it was in the parent, and torch takes it the
first time the process calls each operator: a DataLoader worker forked while the copy, allocation or persist thread
of the library made such a call hung for ever, and so did the training thread waiting for its batch (seen in CI: a
2-rank torchrun job, once in a few full runs). The race is a window of nanoseconds; ``fixtures/exit_lock`` keeps
glibc's behaviour (a lock a forked child inherits locked, around every registration) and widens the window to 50 ms
for the threads other than a process's main thread, so that the job hangs every time without the fix. The second
hazard is CPython's (before 3.12): ``fixtures/head_lock`` holds its thread-list lock 20 ms when a background thread
creates its Python thread state, as gloo's threads do after a collective (lightning_snapshot/dist/forkprep.py). The jobs
must end, bitwise equal to the same job run without the stand-in.
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
from lightning_snapshot.persist.writer import committed_steps

ARGS = (
    "--devices",
    "2",
    "--max-steps",
    "40",
    "--every",
    "10",
    "--shuffle",
    "--dropout",
    "0.1",
    "--workers",
    "2",
    "--augment",
)


def _build(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """tests/fixtures/NAME/NAME.c built with the machine's C compiler (an LD_PRELOAD stand-in)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip(f"no C compiler (cc) to build tests/fixtures/{name}/{name}.c")
    out = tmp_path_factory.mktemp(name) / f"{name}.so"
    source = Path(__file__).parent / "fixtures" / name / f"{name}.c"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(source), "-ldl", "-lpthread"], check=True)
    return out


@pytest.fixture(scope="module")
def exit_lock(tmp_path_factory) -> Path:
    """The stand-in for glibc's exit-handler lock."""
    return _build(tmp_path_factory, "exit_lock")


@pytest.fixture(scope="module")
def head_lock(tmp_path_factory) -> Path:
    """The stand-in that holds CPython's thread-list lock longer in a background thread's PyThreadState_New."""
    return _build(tmp_path_factory, "head_lock")


def _torchrun(base: Path, shm: Path, *args: str, preload: Path | None = None) -> subprocess.CompletedProcess[str]:
    # (each job its own node agents: the one of the job with the stand-in has it too)
    env = {**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning", "LIGHTNING_SNAPSHOT_SHM_DIR": str(shm)}
    if preload is not None:
        env["LD_PRELOAD"] = str(preload)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPTS / "train.py"),
        "--dir",
        str(base / "local"),
        "--out",
        str(base / "out.pt"),
        *args,
    ]
    return run_job(cmd, 180, env, retry_fork_hang=False)  # (a hang in os.fork is what these tests look for)


def _ends_as_without(preload: Path, tmp_path: Path, shm: Path, extra: tuple[str, ...] = ()) -> None:
    """The job (``ARGS`` and ``extra``) under the stand-in ``preload`` ends, with every snapshot committed, bitwise
    equal to the same job without it."""
    ref = _torchrun(tmp_path / "ref", shm / "ref", *ARGS, *extra)
    assert ref.returncode == 0, ref.stderr[-4000:]
    got = _torchrun(tmp_path / "run", shm / "run", *ARGS, *extra, preload=preload)
    assert got.returncode == 0, got.stderr[-6000:]
    assert committed_steps(LocalTier(tmp_path / "run" / "local"))[0] == 40
    for suffix in ("", ".rank1"):
        assert (
            assert_bitwise_equal(
                Path(f"{tmp_path / 'ref' / 'out.pt'}{suffix}"), Path(f"{tmp_path / 'run' / 'out.pt'}{suffix}")
            )
            > 0
        )


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--ram-every", "5")], ids=["local-tier", "ram-and-local-tiers"])
def test_loader_workers_forked_during_the_first_snapshots_do_not_hang(tmp_path, exit_lock, shm, extra):
    """2 ranks, 2 loader workers each (forked anew each epoch of 8 steps); the first snapshot (step 10) is being
    copied and written while the workers of the epoch at step 16 are forked, and the arena allocates its second
    buffer in the background while the first epoch's are. Without the fix: hung in the first epochs."""
    _ends_as_without(preload=exit_lock, tmp_path=tmp_path, shm=shm, extra=extra)


@pytest.mark.slow
@pytest.mark.skipif(sys.version_info >= (3, 12), reason="CPython 3.12 resets the thread-list lock in a forked child")
def test_loader_workers_forked_as_gloo_threads_create_thread_states_do_not_hang(tmp_path, head_lock, shm):
    """The same job under the stand-in for CPython's thread-list lock: gloo's worker threads create a Python thread
    state as each collective on Python-made tensors ends (the preemption agreement's every step, the library's and
    Lightning's collectives), and a worker forked while one holds that lock hung in ``os.fork`` (CPython gh-112275;
    the CI failures of test_preemption). The library gives gloo's worker threads thread states that they keep
    (``forkprep.pin_gloo_thread_states``). Without it: the first run hung, in the workers' ``_PyThreadState_DeleteExcept``."""
    _ends_as_without(preload=head_lock, tmp_path=tmp_path, shm=shm)
