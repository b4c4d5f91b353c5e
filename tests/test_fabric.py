"""The Fabric integration (``lightning_snapshot.fabric.FabricSnapshots``): a LitGPT-shaped Fabric loop
(tests/scripts/fabric_train.py) killed with SIGKILL at a random optimizer step and run again ends bitwise equal to a
run that never stopped: weights, optimizer, scheduler, every value of its ``state`` (each step's loss and a checksum of
each batch trained on) and the torch, numpy and python RNG. Real processes, real SIGKILL, gloo under torchrun, moto on
127.0.0.1 for the object store."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, restores, run_job, run_script, slurm_job
from train import s3_options

from lightning_snapshot.backends import LocalTier, ObjectStoreTier
from lightning_snapshot.persist.commit import committed_steps

SCRIPT = "fabric_train.py"
# (one worker runs them all: the uninterrupted reference runs of the module's fixtures are made once, not per worker)
pytestmark = pytest.mark.xdist_group("test_fabric")
#: 48 samples in batches of 4 over 3 epochs, gradients accumulated over 2 batches: 18 optimizer steps (9 per rank
#: under DDP on 2 ranks), each epoch ending mid-way between snapshot steps
HARD = ("--shuffle", "--augment", "--dropout", "0.1", "--accum", "2")


def assert_same(ref: Path, got: Path, leave_out: tuple[str, ...] = ()) -> int:
    """Every tensor and value of two result files equal, bitwise (but the top-level entries ``leave_out``); returns
    the number of tensors compared."""
    a = {k: v for k, v in torch.load(ref, weights_only=True).items() if k not in leave_out}
    b = {k: v for k, v in torch.load(got, weights_only=True).items() if k not in leave_out}
    count = [0]

    def same(x, y, path: str) -> None:
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape, path
            assert torch.equal(x, y), f"{path} differs"
            count[0] += 1
        elif isinstance(x, dict):
            assert isinstance(y, dict) and set(x) == set(y), f"{path}: keys {set(x) ^ set(y)}"
            for k in x:
                same(x[k], y[k], f"{path}/{k}")
        elif isinstance(x, (list, tuple)):
            assert isinstance(y, (list, tuple)) and len(x) == len(y), f"{path}: {len(x)} vs {len(y)} items"
            for i, (u, v) in enumerate(zip(x, y, strict=True)):
                same(u, v, f"{path}[{i}]")
        else:
            assert x == y, f"{path}: {x!r} != {y!r}"

    same(a, b, "")
    return count[0]


def _newest(path: Path) -> int:
    """The newest step committed in the local tier at ``path`` (0: none yet)."""
    steps = committed_steps(LocalTier(path))
    return steps[0] if steps else 0


def _expected(step: int, url: str, ranks: int = 1) -> list[tuple[int, str, int]]:
    """The restores a rerun reports when ``step`` is the newest committed (none: 0, a fresh start)."""
    return [(step, url, r) for r in range(ranks)] if step else []


def _run(tiers: list[str], out: Path, *args: str, expect_kill: bool = False) -> subprocess.CompletedProcess[str]:
    return run_script(SCRIPT, "--tiers", *tiers, "--out", str(out), *args, expect_kill=expect_kill, timeout=240)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run per argument list (shared by the tests of this module)."""
    made: dict[tuple[str, ...], Path] = {}

    def get(*args: str) -> Path:
        if args not in made:
            base = tmp_path_factory.mktemp("fabric-ref")
            _run([f"{base / 'snaps'}?every=100"], base / "ref.pt", *args)
            made[args] = base / "ref.pt"
        return made[args]

    return get


# ------------------------------------------------------------------------------------------------ misuse
def test_misuse_gets_errors_that_name_the_fix(tmp_path):
    """In this process (one device): a step before resume, a key the format cannot hold, and a snapshot of another
    state each fail with an error that says what to do; nothing is left running after each (the suite's thread and
    shared-memory check)."""
    import lightning as L
    from torch import nn

    from lightning_snapshot.errors import ConfigError, SnapshotError, StateMismatchError
    from lightning_snapshot.fabric import FabricSnapshots

    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = nn.Linear(2, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    tier = f"{tmp_path / 'snaps'}?every=1"
    before = r"call FabricSnapshots.resume\(state\) once before the training loop"
    with FabricSnapshots(fabric, tier) as snapshots, pytest.raises(ConfigError, match=before):
        snapshots.step({"model": model})
    with pytest.raises(ConfigError, match="without '/'"), FabricSnapshots(fabric, tier) as snapshots:
        snapshots.resume({"model/a": model})
    with FabricSnapshots(fabric, tier) as snapshots:  # (a snapshot of step 1 of {"model", "optimizer"})
        snapshots.resume({"model": model, "optimizer": optimizer})
        optimizer.step()
        snapshots.step()
    assert committed_steps(LocalTier(tmp_path / "snaps")) == [1]
    with pytest.raises(SnapshotError) as raised, FabricSnapshots(fabric, tier) as snapshots:
        snapshots.resume({"net": model, "optimizer": optimizer})
    assert isinstance(raised.value, StateMismatchError), raised.value
    assert "holds no module 'net' (it holds ['model'])" in str(raised.value)
    assert "resume=False" in str(raised.value)


def test_metrics_reach_fabrics_logger_and_a_raising_loop_still_ends_clean(tmp_path):
    """The snapshot metrics go through ``fabric.log_dict`` to the loggers given to Fabric (a CSV logger here); a loop
    that raises leaves the ``with`` block with its own exception, the snapshots handed over before it committed, and
    no thread or shared memory of the library behind (the suite's check); the CLI verifies what was written."""
    import csv

    import lightning as L
    from lightning.fabric.loggers import CSVLogger
    from torch import nn

    from lightning_snapshot.fabric import FabricSnapshots

    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=CSVLogger(tmp_path / "logs", name="run"))
    model = nn.Linear(4, 1)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    with (
        pytest.raises(RuntimeError, match="the loop failed"),
        FabricSnapshots(fabric, f"{tmp_path}/snaps?every=2") as s,
    ):
        s.resume(state)
        for _ in range(7):
            fabric.backward(model(torch.randn(3, 4)).sum())
            optimizer.step()
            optimizer.zero_grad()
            state["step"] += 1
            s.step(state)
        raise RuntimeError("the loop failed")
    fabric.loggers[0].finalize("success")
    assert committed_steps(LocalTier(tmp_path / "snaps"))[0] == 6  # (not 7: nothing is taken after the exception)
    with open(next((tmp_path / "logs").glob("**/metrics.csv"))) as f:
        logged = {k for row in csv.DictReader(f) for k, v in row.items() if v}
    assert {"snapshot/stall_ms", "snapshot/bytes", "snapshot/local/persist_ms"} <= logged, logged
    cli = subprocess.run(
        [sys.executable, "-m", "lightning_snapshot.cli.main", "verify", str(tmp_path / "snaps")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr


# ------------------------------------------------------------------------------------------------ one process
@pytest.mark.parametrize(
    "extra",
    [(), ("--workers", "2")],
    ids=["no-workers", "2-workers"],
)
def test_one_process_sigkill_at_a_random_step_resumes_bitwise(tmp_path, reference, crash_rng, extra):
    """Shuffled loader with random augmentation (torch, numpy, python RNG, in the workers too), dropout and gradient
    accumulation; snapshots every 2 steps into a local tier; SIGKILL in the middle of a random step."""
    args = (*HARD, *extra)
    ref = reference(*args)
    kill = crash_rng.randrange(3, 18)
    tier = f"{tmp_path / 'snaps'}?every=2"
    _run([tier], tmp_path / "out.pt", *args, "--kill-at", str(kill), expect_kill=True)
    newest = _newest(tmp_path / "snaps")  # (the newest scheduled may still have been on its way)
    assert newest <= kill - 1 and newest % 2 == 0 and (newest or kill <= 4), (kill, newest)
    proc = _run([tier], tmp_path / "out.pt", *args)
    assert restores(proc.stdout) == _expected(newest, str(tmp_path / "snaps")), proc.stdout
    assert assert_same(ref, tmp_path / "out.pt") > 0


def test_a_run_with_snapshots_is_bitwise_equal_to_one_without_resuming_and_ends_with_its_last_step_committed(
    tmp_path, reference
):
    """The library is neutral (a run that snapshots every step equals the reference, which snapshots never but at its
    end), and ``close`` commits the last step (18) in every tier."""
    proc = _run([f"{tmp_path / 'a'}?every=1&keep=2", f"{tmp_path / 'b'}?every=5"], tmp_path / "out.pt", *HARD)
    assert not restores(proc.stdout)
    assert assert_same(reference(*HARD), tmp_path / "out.pt") > 0
    assert committed_steps(LocalTier(tmp_path / "a")) == [18, 17]
    assert committed_steps(LocalTier(tmp_path / "b"))[0] == 18
    # the CLI's export finds the weights (one module: under its own names) and load_snapshot reads them
    from safetensors.torch import load_file

    from lightning_snapshot import load_snapshot
    from lightning_snapshot.cli.export import export_snapshot

    weights = torch.load(tmp_path / "out.pt", weights_only=True)["model"]
    exported = load_file(str(export_snapshot(tmp_path / "b", tmp_path / "model.safetensors", progress=False)))
    loaded = load_snapshot(tmp_path / "a", keys=["state_dict"])["state_dict"]
    for got in (exported, loaded):
        assert set(got) == set(weights) and all(torch.equal(got[k], v) for k, v in weights.items())


def test_stateful_dataloader_resumes_bitwise(tmp_path, reference):
    """torchdata's StatefulDataLoader (shuffled, augmentation in the main process): its own state_dict is the data
    position."""
    pytest.importorskip("torchdata")
    args = (*HARD, "--stateful")
    ref = reference(*args)
    tier = f"{tmp_path / 'snaps'}?every=3"
    _run([tier], tmp_path / "out.pt", *args, "--kill-at", "11", expect_kill=True)
    newest = _newest(tmp_path / "snaps")  # (9, or an earlier one when 9 was still being written)
    assert newest in (3, 6, 9), newest
    proc = _run([tier], tmp_path / "out.pt", *args)
    assert restores(proc.stdout) == _expected(newest, str(tmp_path / "snaps")), proc.stdout
    assert assert_same(ref, tmp_path / "out.pt") > 0


def test_stateful_dataloader_with_workers_resumed_mid_epoch_warns_that_their_augmentation_is_not_exact(tmp_path):
    """With workers, a StatefulDataLoader restores its own position but its workers restart their RNG from their seeds
    (a torch DataLoader's are restored): a resume inside an epoch says so, naming the fix."""
    pytest.importorskip("torchdata")
    args = (*HARD, "--stateful", "--workers", "2")
    tier = f"{tmp_path / 'snaps'}?every=1"
    # (steps of 0.1 s at least: the snapshots of steps 7 and 8 are written before the kill even on a loaded machine)
    _run([tier], tmp_path / "out.pt", *args, "--kill-at", "9", "--step-sleep", "0.1", expect_kill=True)
    assert _newest(tmp_path / "snaps") in (7, 8), "the test needs a snapshot inside the second epoch (6 steps each)"
    proc = _run([tier], tmp_path / "out.pt", *args)
    assert "worker processes restart their global RNG" in proc.stderr and "use a torch DataLoader" in proc.stderr


@pytest.mark.slow
def test_ram_tier_restores_after_sigkill_bitwise(tmp_path, reference, shm):
    """The RAM tier (its node agent outlives the killed trainer) every 2 steps beside a local tier every 100 (which
    holds nothing when the trainer is killed at step 9): the resume comes from RAM."""
    ref = reference(*HARD)
    tiers = ["ram://fabric?every=2&erasure=none", f"{tmp_path / 'local'}?every=100"]
    _run(tiers, tmp_path / "out.pt", *HARD, "--kill-at", "9", expect_kill=True)
    assert _newest(tmp_path / "local") == 0
    proc = _run(tiers, tmp_path / "out.pt", *HARD)
    # (step 8, or an earlier one when the kill came before step 8 reached the agent)
    got = [(s, url.split("?")[0]) for s, url, _ in restores(proc.stdout)]
    assert len(got) == 1 and got[0][1] == "ram://fabric" and got[0][0] in (2, 4, 6, 8), proc.stdout
    assert assert_same(ref, tmp_path / "out.pt") > 0


@pytest.mark.slow
def test_object_store_tier_restores_after_sigkill_bitwise(tmp_path, reference, s3_server, bucket):
    """An object store (moto's S3 server on 127.0.0.1) every 3 steps beside a local tier every 100."""
    ref = reference(*HARD)
    url = f"s3://{bucket}/run"
    s3 = ("--s3", url, "--endpoint", s3_server.endpoint, "--s3-every", "3", "--step-sleep", "0.1")
    tier = f"{tmp_path / 'local'}?every=100"
    _run([tier], tmp_path / "out.pt", *HARD, *s3, "--kill-at", "14", expect_kill=True)
    store = ObjectStoreTier(url, storage_options=s3_options(s3_server.endpoint))
    newest = committed_steps(store)[0]  # (12, or an earlier one when 12 was still being uploaded)
    assert newest in (3, 6, 9, 12) and not committed_steps(LocalTier(tmp_path / "local")), newest
    proc = _run([tier], tmp_path / "out.pt", *HARD, *s3)
    assert restores(proc.stdout) == [(newest, url, 0)], proc.stdout
    assert assert_same(ref, tmp_path / "out.pt") > 0


# ------------------------------------------------------------------------------------------------ every=auto
#: 48 samples in batches of 4 over 3 epochs: 36 optimizer steps
AUTO = ("--shuffle", "--augment", "--dropout", "0.1")


def _logged(logs: Path, name: str) -> dict[int, float]:
    """Step -> the value of metric ``name`` in the CSV logger's file under ``logs`` (the logger given to Fabric)."""
    import csv

    (path,) = logs.glob("**/metrics.csv")
    with open(path) as f:
        return {int(row["step"]): float(row[name]) for row in csv.DictReader(f) if row.get(name)}


@pytest.mark.slow
def test_every_auto_tunes_the_interval_from_the_mtbf_and_resumes_bitwise(tmp_path, reference):
    """A tier ``every=auto&min_every=2`` with ``mtbf`` 0.1 ms (Young/Daly's interval is then far below one step): the
    first snapshot comes after 10 steps, the second 10 steps later (no cost measured before it), and from then on
    every 2 steps; the chosen interval reaches the CSV logger given to Fabric at each snapshot step
    (``snapshot/local/interval_steps``, with the measured ``cost_ms``) and the committed steps follow it. The run
    ends bitwise equal to one with a fixed interval; a run SIGKILLed at step 27 resumes from a step of the tuned
    interval and ends bitwise equal too."""
    ref = reference(*AUTO)
    tier = f"{tmp_path / 'auto'}?every=auto&min_every=2&keep=all"
    auto = (*AUTO, "--mtbf", "0.0001", "--step-sleep", "0.02")
    proc = _run([tier], tmp_path / "auto.pt", *auto, "--csv-logs", str(tmp_path / "logs"))
    assert assert_same(ref, tmp_path / "auto.pt") > 0
    due = {10: 10.0, 20: 2.0, **{s: 2.0 for s in range(22, 37, 2)}}
    assert _logged(tmp_path / "logs", "snapshot/local/interval_steps") == due
    assert set(_logged(tmp_path / "logs", "snapshot/local/cost_ms")) == set(due) - {10}  # (measured from step 20)
    said = proc.stdout + proc.stderr
    skipped = {int(s) for s in re.findall(r"skipped the snapshot of step (\d+)", said)}
    skipped |= {int(s) for s in re.findall(r"step (\d+) skipped for the", said)}
    assert committed_steps(LocalTier(tmp_path / "auto")) == sorted(set(due) - skipped, reverse=True), said[-4000:]

    tier = f"{tmp_path / 'killed'}?every=auto&min_every=2&keep=all"
    _run([tier], tmp_path / "out.pt", *auto, "--kill-at", "27", expect_kill=True)
    newest = _newest(tmp_path / "killed")
    assert newest in (22, 24, 26), f"expected a snapshot of the tuned interval before the kill, got {newest}"
    proc = _run([tier], tmp_path / "out.pt", *auto)
    assert restores(proc.stdout) == [(newest, str(tmp_path / "killed"), 0)], proc.stdout
    assert assert_same(ref, tmp_path / "out.pt") > 0


# ------------------------------------------------------------------------------------------------ the command
def test_the_command_lists_inspects_copies_and_prunes_fabric_snapshots(tmp_path):
    """``lightning-snapshot`` on a local tier written by a Fabric loop (every 3 steps, 2 epochs of 12 steps): ``list``
    shows every snapshot step with the loop's epoch; ``inspect`` shows the model's weights and the AdamW state with
    their shapes; ``copy --step 15`` into another directory gives a tier that a rerun resumes from (step 15, inside the
    second epoch) and ends bitwise equal to the run that never stopped; ``gc --keep-last 2`` leaves the 2 newest,
    which still verify."""
    import json

    from test_cli import cli

    args = (*HARD[:4], "--epochs", "2")  # (shuffled, augmented, dropout: 24 optimizer steps)
    snaps, copy = tmp_path / "snaps", tmp_path / "copy"
    _run([f"{snaps}?every=3&keep=all"], tmp_path / "full.pt", *args)
    steps = list(range(24, 0, -3))

    rc, out, err = cli("list", str(snaps), "--json")
    assert rc == 0, err
    rows = json.loads(out)["snapshots"]
    assert [(r["step"], r["epoch"], r["world_size"], r["health"]) for r in rows] == [
        (s, (s - 1) // 12, 1, "healthy") for s in steps
    ], rows
    rc, out, _ = cli("list", str(snaps))
    assert rc == 0 and [int(line.split()[0]) for line in out.splitlines()[1:]] == steps, out

    rc, out, err = cli("inspect", str(snaps), "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert (doc["step"], doc["epoch"], doc["world_size"]) == (24, 1, 1)
    weights = {"0.weight": [16, 8], "0.bias": [16], "3.weight": [1, 16], "3.bias": [1]}
    adamw = {
        f"optimizer_states/0/state/{i}/{k}": [] if k == "step" else shape
        for i, shape in enumerate(weights.values())
        for k in ("step", "exp_avg", "exp_avg_sq")
    }
    shown = {t["name"]: t["shape"] for t in doc["tensors"]}
    assert shown == {**{f"state_dict/{k}": v for k, v in weights.items()}, **adamw}, shown
    rc, out, _ = cli("inspect", str(snaps / "step-000000000015"))
    assert rc == 0 and out.startswith("step 15, epoch 1, world size 1,") and "state_dict/0.weight" in out, out

    rc, out, err = cli("copy", str(snaps), str(copy), "--step", "15")
    assert rc == 0 and "copied step 15 " in out, out + err
    assert committed_steps(LocalTier(copy)) == [15]
    proc = _run([f"{copy}?every=3"], tmp_path / "resumed.pt", *args)
    assert restores(proc.stdout) == [(15, str(copy), 0)], proc.stdout
    assert assert_same(tmp_path / "full.pt", tmp_path / "resumed.pt") > 0

    rc, out, err = cli("gc", str(snaps), "--keep-last", "2")
    assert rc == 0, err
    assert committed_steps(LocalTier(snaps)) == [24, 21]
    assert sorted(p.name for p in snaps.iterdir()) == ["step-000000000021", "step-000000000024"]
    rc, out, err = cli("verify", str(snaps), "--all")
    assert rc == 0 and out.count(": OK") == 2, out + err


# ------------------------------------------------------------------------------------------------ torchrun
def _torchrun(base: Path, *args: str, timeout: int = 240, script: str = SCRIPT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning", "LIGHTNING_SNAPSHOT_SHM_DIR": str(base)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPTS / script),
        *(("--strategy", "ddp") if script == SCRIPT else ()),
        "--devices",
        "2",
        *args,
    ]
    return run_job(cmd, timeout, env)


def _requeued_ddp_equal(base: Path, common: tuple[str, ...], step: int, ref: Path) -> None:
    """Run the 2-rank job ``common`` again under torchrun: both ranks restore ``step`` from ``base / "snaps"`` (0: a
    fresh start) and end bitwise equal to ``ref`` (rank 1's: ``ref.rank1``)."""
    proc = _torchrun(base, *common)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(restores(proc.stdout)) == _expected(step, str(base / "snaps"), 2), proc.stdout
    for suffix in ("", ".rank1"):
        assert assert_same(Path(f"{ref}{suffix}"), Path(f"{base / 'out.pt'}{suffix}")) > 0


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    base = tmp_path_factory.mktemp("fabric-ddp-ref")
    proc = _torchrun(
        base, "--tiers", f"{base / 'snaps'}?every=100", "--out", str(base / "ref.pt"), *HARD, "--workers", "1"
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return base / "ref.pt"


@pytest.mark.slow
def test_ddp_torchrun_sigkill_of_one_rank_resumes_both_bitwise(tmp_path, ddp_reference, crash_rng):
    """DDP on 2 ranks under torchrun (gloo), one loader worker each, DistributedSampler (shuffled) with
    augmentation, dropout and accumulation: SIGKILL of rank 1 at a random step; the rerun resumes both ranks."""
    kill = crash_rng.randrange(3, 9)
    tier = f"{tmp_path / 'snaps'}?every=2"
    common = ("--tiers", tier, "--out", str(tmp_path / "out.pt"), *HARD, "--workers", "1")
    proc = _torchrun(tmp_path, *common, "--kill-at", str(kill), "--kill-rank", "1")
    assert proc.returncode != 0
    newest = _newest(tmp_path / "snaps")
    assert newest <= kill - 1 and newest % 2 == 0 and (newest or kill <= 4), (kill, newest)
    _requeued_ddp_equal(tmp_path, common, newest, ddp_reference)


@pytest.mark.slow
def test_ddp_launched_by_fabric_itself_sigkill_of_rank_1_resumes_bitwise(tmp_path, ddp_reference):
    """DDP started by ``fabric.launch()`` (no torchrun: Lightning starts rank 1 from rank 0): rank 1 SIGKILLed at
    step 6, Lightning's launcher kills rank 0; the rerun resumes both ranks and ends equal to the torchrun reference
    (the same job)."""
    tier = f"{tmp_path / 'snaps'}?every=2"
    common = ("--strategy", "ddp", "--devices", "2", *HARD, "--workers", "1")
    _run([tier], tmp_path / "out.pt", *common, "--kill-at", "6", "--kill-rank", "1", expect_kill=True)
    newest = _newest(tmp_path / "snaps")
    assert newest in (0, 2, 4), newest
    proc = _run([tier], tmp_path / "out.pt", *common)
    assert sorted(restores(proc.stdout)) == _expected(newest, str(tmp_path / "snaps"), 2), proc.stdout
    for suffix in ("", ".rank1"):
        assert assert_same(Path(f"{ddp_reference}{suffix}"), Path(f"{tmp_path / 'out.pt'}{suffix}")) > 0


@pytest.mark.slow
def test_ddp_stateful_dataloader_resumes_bitwise(tmp_path):
    """torchdata's StatefulDataLoader (shuffled) under DDP: Fabric wraps its RandomSampler in a
    DistributedSamplerWrapper, which draws the epoch's order from the global RNG, and the loader's own state only
    fast-forwards; the RNG of that draw is recorded and replayed (without it the resumed order differs)."""
    pytest.importorskip("torchdata")
    args = (*HARD, "--stateful")
    ref = _torchrun(
        tmp_path / "ref", "--tiers", f"{tmp_path / 'ref'}?every=100", "--out", str(tmp_path / "ref.pt"), *args
    )
    assert ref.returncode == 0, ref.stderr[-4000:]
    common = ("--tiers", f"{tmp_path / 'snaps'}?every=3", "--out", str(tmp_path / "out.pt"), *args)
    assert _torchrun(tmp_path, *common, "--kill-at", "7", "--kill-rank", "1").returncode != 0
    newest = _newest(tmp_path / "snaps")
    assert newest in (0, 3, 6), newest
    _requeued_ddp_equal(tmp_path, common, newest, tmp_path / "ref.pt")


@pytest.mark.slow
@pytest.mark.parametrize(
    "how",
    [("--signal-rank", "1"), ("--signal-rank", "0", "--signal-launcher")],
    ids=["to-rank1-only", "to-torchrun"],
)
def test_ddp_sigterm_stops_both_ranks_at_one_step_exit_143_and_the_requeue_resumes_bitwise(
    tmp_path, ddp_reference, how
):
    """SIGTERM after step 5 (snapshots every 100 steps) to rank 1 only, or to torchrun (which forwards it to every
    rank): both ranks agree to stop at the same step, snapshot it durably, exit 143; the rerun resumes both ranks from
    it and ends bitwise equal."""
    tier = f"{tmp_path / 'snaps'}?every=100"
    common = ("--tiers", tier, "--out", str(tmp_path / "out.pt"), *HARD, "--workers", "1")
    proc = _torchrun(tmp_path, *common, "--signal-at", "5", *how)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0, said[-4000:]
    assert sorted(re.findall(r"EXITING status=(\d+) rank=(\d+)", proc.stdout)) == [("143", "0"), ("143", "1")], said
    stopped = committed_steps(LocalTier(tmp_path / "snaps"))
    assert len(stopped) == 1 and 5 <= stopped[0] <= 8, stopped
    # (rank 0 says where the step is held, as the callback's preemption does)
    assert said.count(f"SIGTERM: step {stopped[0]} is held by {tmp_path / 'snaps'} (") == 1, said[-4000:]
    _requeued_ddp_equal(tmp_path, common, stopped[0], ddp_reference)


@pytest.mark.slow
def test_ddp_plain_dataloader_with_its_own_distributed_sampler_resumes_bitwise(tmp_path):
    """A plain PyTorch loader that Fabric did not set up, under torchrun on 2 ranks: the user's own
    ``DistributedSampler(shuffle=True)``, ``sampler.set_epoch(epoch)`` called by the loop, one loader worker with
    random augmentation, dropout; rank 1 SIGKILLed at step 10 (inside the second epoch of 6 steps) with snapshots
    every step: the rerun resumes both ranks from a step inside the second epoch and ends bitwise equal to a run that
    never stopped."""
    args = (*HARD[:4], "--workers", "1", "--own-sampler")
    ref = _torchrun(
        tmp_path / "ref", "--tiers", f"{tmp_path / 'ref'}?every=100", "--out", str(tmp_path / "ref.pt"), *args
    )
    assert ref.returncode == 0, ref.stderr[-4000:]
    common = ("--tiers", f"{tmp_path / 'snaps'}?every=1", "--out", str(tmp_path / "out.pt"), *args)
    killed = _torchrun(tmp_path, *common, "--kill-at", "10", "--kill-rank", "1", "--step-sleep", "0.1")
    assert killed.returncode != 0
    newest = _newest(tmp_path / "snaps")
    assert newest in (7, 8, 9), f"the test needs a snapshot inside the second epoch (steps 7-11), got {newest}"
    _requeued_ddp_equal(tmp_path, common, newest, tmp_path / "ref.pt")


# ------------------------------------------------------------------------------------------------ preemption limits
@pytest.mark.slow
def test_a_step_longer_than_the_grace_ends_within_it_and_says_which_step_is_durable(tmp_path, reference):
    """SIGTERM inside step 10, which then lasts 30 s more (grace 5 s, snapshots every 4 steps): the loop never reaches
    ``step()`` in time, so the preemption watchdog makes the snapshots already handed over durable (step 8), says in
    one error line what is lost, and ends the process with 143 within the grace; the rerun resumes from step 8 and
    ends bitwise equal to the run that never stopped."""
    ref = reference(*HARD)
    tier = f"{tmp_path / 'snaps'}?every=4"
    slow = ("--slow-at", "10", "--signal-rank", "0", "--slow-seconds", "30", "--sigterm-grace", "5")
    proc = run_script(SCRIPT, "--tiers", tier, "--out", str(tmp_path / "out.pt"), *HARD, *slow, expect_rc=143)
    said = proc.stdout + proc.stderr
    assert (
        "lightning-snapshot: SIGTERM: the job was at step 9 and could not reach the next step boundary within"
        " sigterm_grace=5 s (a training step, validation batch or hook outlasted it): step 8 is the newest durable"
        " snapshot; 1 step(s) lost"
    ) in said, said[-3000:]
    assert said.count("could not reach the next step boundary") == 1
    assert committed_steps(LocalTier(tmp_path / "snaps")) == [8, 4]
    rerun = _run([tier], tmp_path / "out.pt", *HARD)
    assert restores(rerun.stdout) == [(8, str(tmp_path / "snaps"), 0)], rerun.stdout[-2000:]
    assert assert_same(ref, tmp_path / "out.pt") > 0


@pytest.mark.slow
def test_slurm_auto_requeue_signal_snapshots_requeues_and_exits_138(tmp_path, reference):
    """Under SLURM (Fabric's ``SLURMEnvironment``, auto-requeue on SIGUSR1 by default) the loop owns SIGUSR1 too (not
    listed in ``preemption_signals``): SIGUSR1 after step 7 snapshots step 7, runs ``scontrol requeue <job>`` once it is
    durable (a stand-in scontrol on PATH records its arguments), and exits 128 + SIGUSR1; the requeued run resumes
    from step 7, bitwise."""
    import signal

    ref = reference(*HARD)
    slurm, record = slurm_job(tmp_path)
    tier = f"{tmp_path / 'snaps'}?every=100"
    cmd = [sys.executable, str(SCRIPTS / SCRIPT), "--tiers", tier, "--out", str(tmp_path / "out.pt"), *HARD]
    env = {**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning", **slurm}
    signalled = ("--signal-at", "7", "--signal-rank", "0", "--signal", "SIGUSR1")
    proc = subprocess.run([*cmd, *signalled], capture_output=True, text=True, timeout=240, env=env)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 128 + signal.SIGUSR1, said[-3000:]
    assert "SIGUSR1: step 7 is held by" in said and "SLURM job 4242 requeued" in said, said[-3000:]
    assert record.read_text().split() == ["requeue", "4242"]
    assert committed_steps(LocalTier(tmp_path / "snaps")) == [7]
    rerun = _run([tier], tmp_path / "out.pt", *HARD)
    assert restores(rerun.stdout) == [(7, str(tmp_path / "snaps"), 0)], rerun.stdout[-2000:]
    assert assert_same(ref, tmp_path / "out.pt") > 0


CAUGHT = re.compile(r"the replicas of the model disagree at step (\d+)")


@pytest.mark.slow
@pytest.mark.parametrize("action", ["warn", "raise"])
def test_ddp_replicas_that_disagree_are_caught_named_and_acted_on(tmp_path, action):
    """DDP on 2 ranks under torchrun, every tensor compared at each snapshot (``replica_check=1``), snapshots every 2
    steps: rank 1 moves the last layer's first weight by one ulp after step 6. ``warn`` (the default): the snapshot of
    step 6 names that parameter and rank 1, is committed as unhealthy, the one of step 4 agrees. ``raise``: both ranks
    stop with ``ReplicaMismatchError`` at step 6, and nothing from it is committed."""
    from lightning_snapshot.restore.loader import read_manifest

    tier = f"{tmp_path / 'snaps'}?every=2&keep=all"
    args = ("--tiers", tier, "--out", str(tmp_path / "out.pt"), "--epochs", "1", "--perturb-at", "6")
    proc = _torchrun(
        tmp_path, *args, "--replica-check", "1", "--on-replica-mismatch", action, "--samples", "64", "--batch-size", "2"
    )
    said = proc.stdout + proc.stderr
    caught = sorted({int(m.group(1)) for m in CAUGHT.finditer(said)})
    snaps = LocalTier(tmp_path / "snaps")
    if action == "raise":
        assert proc.returncode != 0 and "ReplicaMismatchError" in said, said[-4000:]
        assert "on_replica_mismatch='raise'" in said and "'3.weight' (rank 1)" in said, said[-4000:]
        assert caught == [6] and committed_steps(snaps) == [4, 2], (caught, committed_steps(snaps))
        return
    assert proc.returncode == 0, said[-4000:]
    assert caught[:1] == [6] and "'3.weight' (rank 1)" in said and "committed as unhealthy" in said, said[-4000:]
    m = read_manifest(snaps, 6)
    assert m.replicas.disagree == (("3.weight", (1,)),) and not m.healthy, m.replicas
    before = read_manifest(snaps, 4)
    assert before.replicas.disagree_count == 0 and before.healthy and before.replicas.checked == m.replicas.checked


# ----------------------------------------------------------------------------------------- another number of processes
#: 48 samples in batches of 4, shuffled, 3 epochs, no accumulation: 6 optimizer steps an epoch on 2 ranks, 12 on one
RESIZE = ("--shuffle", "--epochs", "3")
#: what a snapshot taken with another number of processes does not give back (the warning says so)
RNG = ("torch_rng", "numpy_rng", "python_rng")
RNG_WARNING = "the per-rank RNG is not restored"


def _trained(log: Path, ranks: int, upto: int | None = None) -> dict[int, list[int]]:
    """Epoch -> the dataset indices of every batch the ranks of one run trained on (``--index-log``), of the optimizer
    steps up to ``upto`` only (None: all)."""
    epochs: dict[int, list[int]] = {}
    for r in range(ranks):
        for line in Path(f"{log}.rank{r}").read_text().splitlines():
            epoch, step, *indices = map(int, line.split())
            if upto is None or step <= upto:
                epochs.setdefault(epoch, []).extend(indices)
    return epochs


def _assert_each_sample_once_per_epoch(
    before: dict[int, list[int]], after: dict[int, list[int]], epochs: int, samples: int = 48
) -> None:
    """Across the interrupted run (``before``: up to its snapshot) and the resumed run (``after``), every sample of
    every epoch was trained on exactly once."""
    assert sorted(set(before) | set(after)) == list(range(epochs)), (sorted(before), sorted(after))
    for e in range(epochs):
        seen = Counter(before.get(e, []) + after.get(e, []))
        missing = sorted(set(range(samples)) - set(seen))
        repeated = sorted(i for i, n in seen.items() if n > 1)
        assert not missing and not repeated and sorted(seen) == list(range(samples)), (
            f"epoch {e}: skipped {missing}, trained twice {repeated}; before the snapshot {sorted(before.get(e, []))},"
            f" after the resume {after.get(e, [])}"
        )


@pytest.mark.slow
def test_ddp_snapshot_resumed_in_one_process_trains_each_sample_of_every_epoch_once(tmp_path):
    """DDP on 2 ranks under torchrun (Fabric's DistributedSampler, shuffled) stopped by SIGTERM inside the second
    epoch (the stop step is snapshotted durably, exit 143) and resumed in ONE process: the samples the two ranks
    trained on up to the snapshot and those the one process trains on after it cover every sample of each of the 3
    epochs exactly once; the resumed process starts from the weights, optimizer, scheduler and values the
    interrupted run had at that step, bitwise, and says that the per-rank RNG is not restored."""
    tier, snaps = f"{tmp_path / 'snaps'}?every=100", tmp_path / "snaps"
    proc = _torchrun(
        tmp_path,
        *("--tiers", tier, "--out", str(tmp_path / "ddp.pt"), *RESIZE),
        *("--index-log", str(tmp_path / "ddp-idx"), "--dump-weights", str(tmp_path / "ddp-dump")),
        *("--signal-at", "8", "--signal-rank", "1"),
    )
    said = proc.stdout + proc.stderr
    assert sorted(re.findall(r"EXITING status=(\d+) rank=(\d+)", proc.stdout)) == [("143", "0"), ("143", "1")], said
    (stop,) = committed_steps(LocalTier(snaps))
    assert 6 < stop < 12, f"the test needs a snapshot inside the second epoch (steps 7-11), got {stop}"
    proc = _run(
        [tier],
        tmp_path / "one.pt",
        *RESIZE,
        "--index-log",
        str(tmp_path / "one-idx"),
        "--dump-weights",
        str(tmp_path / "one-dump"),
    )
    assert restores(proc.stdout) == [(stop, str(snaps), 0)], proc.stdout
    assert "taken with 2 process(es), this run has 1" in proc.stderr and RNG_WARNING in proc.stderr, proc.stderr
    restored, saved = tmp_path / "one-dump" / "resumed.pt", tmp_path / "ddp-dump" / f"step-{stop}.pt"
    assert assert_same(saved, restored, leave_out=RNG) > 0
    before, after = _trained(tmp_path / "ddp-idx", 2, upto=stop), _trained(tmp_path / "one-idx", 1)
    assert len(before[1]) == 2 * 4 * (stop - 6)  # (both ranks' batches of the second epoch up to the snapshot)
    _assert_each_sample_once_per_epoch(before, after, epochs=3)


@pytest.mark.slow
def test_one_process_snapshot_resumed_on_2_ranks_trains_each_sample_of_every_epoch_once(tmp_path):
    """The other way: one process (a shuffled RandomSampler) stopped by SIGTERM inside its second epoch, resumed by
    DDP on 2 ranks under torchrun (Fabric's DistributedSampler): every sample of each epoch is trained on exactly once
    across the two runs, and both ranks start from the weights, optimizer, scheduler and values of the snapshot's
    step, with the warning that the per-rank RNG is not restored."""
    tier, snaps = f"{tmp_path / 'snaps'}?every=100", tmp_path / "snaps"
    run_script(
        SCRIPT,
        *("--tiers", tier, "--out", str(tmp_path / "one.pt"), *RESIZE),
        *("--index-log", str(tmp_path / "one-idx"), "--dump-weights", str(tmp_path / "one-dump")),
        *("--signal-at", "16", "--signal-rank", "0"),
        expect_rc=143,
        timeout=240,
    )
    (stop,) = committed_steps(LocalTier(snaps))
    assert 12 < stop < 24, f"the test needs a snapshot inside the second epoch (steps 13-23), got {stop}"
    proc = _torchrun(
        tmp_path,
        *("--tiers", tier, "--out", str(tmp_path / "ddp.pt"), *RESIZE),
        *("--index-log", str(tmp_path / "ddp-idx"), "--dump-weights", str(tmp_path / "ddp-dump")),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(restores(proc.stdout)) == [(stop, str(snaps), 0), (stop, str(snaps), 1)], proc.stdout
    assert proc.stderr.count(RNG_WARNING) == 2, proc.stderr[-4000:]  # (each rank)
    restored, saved = tmp_path / "ddp-dump" / "resumed.pt", tmp_path / "one-dump" / f"step-{stop}.pt"
    assert assert_same(saved, restored, leave_out=RNG) > 0
    assert assert_same(tmp_path / "ddp.pt", tmp_path / "ddp.pt.rank1", leave_out=(*RNG, "values")) > 0  # (replicas)
    before, after = _trained(tmp_path / "one-idx", 1, upto=stop), _trained(tmp_path / "ddp-idx", 2)
    assert len(before[1]) == 4 * (stop - 12)
    _assert_each_sample_once_per_epoch(before, after, epochs=3)


# ------------------------------------------------------------------------------------------------ FSDP2, resharding
def assert_same_full(ref: Path, got: Path) -> None:
    """Two results of tests/scripts/fabric_fsdp.py (gathered weights and optimizer state by parameter name, the
    learning rates, the step) equal, bitwise."""
    a, b = torch.load(ref, weights_only=True), torch.load(got, weights_only=True)
    assert a["step"] == b["step"] and a["lr"] == b["lr"], (a["step"], b["step"], a["lr"], b["lr"])
    # (the optimizer state of a sharded parameter was read into DTensor shards, not loaded as full tensors)
    assert a["layouts_match"] and b["layouts_match"]
    assert assert_same_tree(a["model"], b["model"]) == 6  # (3 Linear layers)
    assert assert_same_tree(a["optimizer"], b["optimizer"]) == 18  # (AdamW: step, exp_avg, exp_avg_sq per parameter)


def assert_same_tree(a: dict, b: dict) -> int:
    torch.save(a, "/dev/null")  # (plain tensors only)
    count = 0
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    for k in a:
        if isinstance(a[k], dict):
            count += assert_same_tree(a[k], b[k])
        else:
            assert torch.equal(a[k], b[k]), k
            count += 1
    return count


def _fsdp(base: Path, snaps: Path, out: Path, strategy: str, steps: int, *extra: str) -> None:
    """Train with tests/scripts/fabric_fsdp.py to step 6 (``steps`` 6) or resume at step 6 (``steps`` 0)."""
    args = ("--dir", str(snaps), "--out", str(out), "--strategy", strategy, "--until", "6", *extra)
    if strategy == "single":
        run_script("fabric_fsdp.py", *args, timeout=240)
        return
    proc = _torchrun(base, *args, script="fabric_fsdp.py")
    if "--kill-at" in extra:
        assert proc.returncode != 0
        return
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    if steps == 0:
        assert sorted(restores(proc.stdout)) == [(6, str(snaps), 0), (6, str(snaps), 1)], proc.stdout


@pytest.mark.slow
def test_fsdp2_snapshot_on_2_ranks_loads_into_one_process_ddp_and_fsdp2_exactly(tmp_path):
    """ModelParallelStrategy (FSDP2, each Linear fully_shard-ed over 2 ranks) snapshots its DTensor shards, never
    gathered; loaded into one process, into DDP on 2 ranks and into FSDP2 on 2 ranks, every weight, every AdamW state
    tensor and the scheduler's learning rate equal the FSDP2 run's (gathered), bitwise."""
    import shutil

    _fsdp(tmp_path, tmp_path / "snaps", tmp_path / "full.pt", "fsdp", 6)
    assert committed_steps(LocalTier(tmp_path / "snaps")) == [6, 3]
    for strategy in ("single", "ddp", "fsdp"):
        copy = tmp_path / f"snaps-{strategy}"  # (each load resumes and closes: it commits nothing new, on a copy)
        shutil.copytree(tmp_path / "snaps", copy)
        _fsdp(tmp_path, copy, tmp_path / f"{strategy}.pt", strategy, 0)
        assert_same_full(tmp_path / "full.pt", tmp_path / f"{strategy}.pt")


@pytest.mark.slow
def test_one_process_snapshot_loads_into_fsdp2_shards_exactly(tmp_path):
    """The other way: a snapshot of one process read by FSDP2 on 2 ranks, each rank reading only its shards of the
    weights and of the optimizer state (made for the run, then read into)."""
    _fsdp(tmp_path, tmp_path / "snaps", tmp_path / "full.pt", "single", 6)
    _fsdp(tmp_path, tmp_path / "snaps", tmp_path / "fsdp.pt", "fsdp", 0)
    assert_same_full(tmp_path / "full.pt", tmp_path / "fsdp.pt")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "tp"])
def test_sharded_rank_sigkilled_and_requeued_resumes_bitwise(tmp_path, strategy):
    """FSDP2 (each Linear sharded over 2 ranks) or tensor parallelism (Megatron-style column/row split over 2 ranks):
    rank 1 SIGKILLed after step 6 (snapshot at step 3); the requeue resumes both ranks' shards and ends at step 6
    bitwise equal to a run that never stopped (weights and AdamW state, gathered)."""
    _fsdp(tmp_path / "a", tmp_path / "ref", tmp_path / "ref.pt", strategy, 6)
    _fsdp(tmp_path / "b", tmp_path / "snaps", tmp_path / "out.pt", strategy, 6, "--kill-at", "6")
    newest = _newest(tmp_path / "snaps")  # (3; 0 when step 3 was still being written at the kill)
    assert newest in (0, 3), newest
    args = ("--dir", str(tmp_path / "snaps"), "--out", str(tmp_path / "out.pt"), "--strategy", strategy, "--until", "6")
    proc = _torchrun(tmp_path / "b", *args, script="fabric_fsdp.py")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(restores(proc.stdout)) == _expected(newest, str(tmp_path / "snaps"), 2), proc.stdout
    assert_same_full(tmp_path / "ref.pt", tmp_path / "out.pt")


@pytest.mark.slow
def test_tensor_parallel_snapshot_loads_into_one_process_and_back_exactly(tmp_path):
    """A snapshot of tensor parallelism on 2 ranks (DTensor shards split by rows and by columns, and replicated
    plain tensors) loads exactly into one process; one of a single process loads exactly into tensor parallelism."""
    import shutil

    _fsdp(tmp_path, tmp_path / "tp", tmp_path / "tp.pt", "tp", 6)
    shutil.copytree(tmp_path / "tp", tmp_path / "tp-copy")
    _fsdp(tmp_path, tmp_path / "tp-copy", tmp_path / "tp-single.pt", "single", 0)
    assert_same_full(tmp_path / "tp.pt", tmp_path / "tp-single.pt")
    _fsdp(tmp_path, tmp_path / "one", tmp_path / "one.pt", "single", 6)
    _fsdp(tmp_path, tmp_path / "one", tmp_path / "one-tp.pt", "tp", 0)
    assert_same_full(tmp_path / "one.pt", tmp_path / "one-tp.pt")


# ------------------------------------------------------------------------------------------------ the example
@pytest.mark.slow
def test_the_fabric_gpt_example_resumes_after_its_sigkill_bitwise(tmp_path):
    """examples/fabric_gpt.py as a user runs it: a reference run, a run with RAM, local and object-store (moto on
    127.0.0.1) tiers SIGKILLed at step 37, the rerun resumed from the RAM tier's step 35, compared bitwise."""
    pytest.importorskip("moto")
    example = Path(__file__).parent.parent / "examples" / "fabric_gpt.py"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(example), "--workdir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # (step 35 from RAM; 30 when the kill came before step 35 reached the agent)
    assert re.search(r"resumed from step (35|30) \(ram://fabric-gpt", proc.stdout), proc.stdout
    assert "bitwise equal to the reference: True" in proc.stdout, proc.stdout
    assert committed_steps(LocalTier(tmp_path / "demo" / "local"))[0] == 60
