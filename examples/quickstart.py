"""Quickstart: snapshots every few steps, a SIGKILL mid-epoch, an automatic resume, a bitwise comparison.

    python examples/quickstart.py            # (or: bash scripts/demo.sh)

What happens:
1. A reference run trains a small model on CPU for 40 steps, uninterrupted.
2. The same run is started again with snapshots to ./snapshots/run; this script SIGKILLs it from outside
   mid-epoch, at a step that is not a snapshot step.
3. The run is started again, unchanged: SnapshotCallback finds the newest committed snapshot and resumes.
4. The final weights and optimizer state of the resumed run are compared bitwise with the reference run.

The model uses dropout, a shuffled plain DataLoader and an LR schedule, so an inexact resume (RNG, data order,
optimizer state) would show up as a difference.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import torch

MAX_STEPS = 40
KILL_AT = 23  # mid-epoch (16 steps per epoch) and between two snapshots (every 5 steps)


def train(snapshot_dir: str, out: str) -> None:
    import lightning as L
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_snapshot import SnapshotCallback
    from lightning_snapshot.backends import LocalTier

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            print(f"step {self.trainer.global_step}", flush=True)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            return {
                "optimizer": opt,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 10, 0.5), "interval": "step"},
            }

    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 32, generator=g), torch.randn(256, 1, generator=g))
    snapshots = SnapshotCallback(LocalTier(snapshot_dir, every_n_train_steps=5, keep_last=2))
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=MAX_STEPS,
        callbacks=[snapshots],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    model = Model()
    trainer.fit(model, DataLoader(data, batch_size=16, shuffle=True))
    if snapshots.restored_from is not None:
        url, step, seconds = snapshots.restored_from
        print(f"resumed from step {step} of {url} in {seconds:.2f} s", flush=True)
    opt_state = trainer.optimizers[0].state_dict()["state"]
    torch.save(
        {"model": model.state_dict(), "optimizer": {f"{i}.{k}": v for i, s in opt_state.items() for k, v in s.items()}},
        out,
    )


def run_child(snapshot_dir: Path, out: Path, kill_at: int | None = None) -> int:
    cmd = [sys.executable, __file__, "--child", str(snapshot_dir), str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.strip()
        if line.startswith("resumed"):
            print(f"  {line}")
        if kill_at is not None and line == f"step {kill_at}":
            os.kill(proc.pid, signal.SIGKILL)
            print(f"  SIGKILL sent at step {kill_at}")
    return proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", nargs=2, metavar=("SNAPSHOT_DIR", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--dir", default="snapshots", help="where snapshots go (default: ./snapshots)")
    args = p.parse_args()
    if args.child:
        train(*args.child)
        return 0

    root = Path(args.dir)
    for sub in ("reference", "run"):
        shutil.rmtree(root / sub, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    print(f"1/4 reference run, {MAX_STEPS} steps, uninterrupted")
    if run_child(root / "reference", root / "reference.pt") != 0:
        print("reference run failed")
        return 1
    print(f"2/4 run with snapshots to {root / 'run'} (every 5 steps), killed mid-epoch")
    rc = run_child(root / "run", root / "run.pt", kill_at=KILL_AT)
    print(f"  exit code {rc} ({'SIGKILL' if rc == -signal.SIGKILL else 'unexpected'})")
    from lightning_snapshot.backends import LocalTier
    from lightning_snapshot.persist.writer import committed_steps

    committed = committed_steps(LocalTier(str(root / "run")))  # (newest first)
    print(f"  committed snapshots (manifest written): steps {sorted(committed)}")
    unfinished = sorted(
        int(p.name.split("-")[1]) for p in (root / "run").glob("step-*") if not (p / "manifest.json").exists()
    )
    if unfinished:
        print(
            f"  not committed (data only, no manifest yet when the kill came; a resume ignores them): steps "
            f"{unfinished}"
        )
    print(
        f"3/4 restart the same command: it resumes from the newest committed snapshot"
        f"{f' (step {committed[0]})' if committed else ''}"
    )
    if run_child(root / "run", root / "run.pt") != 0:
        print("resumed run failed")
        return 1
    print("4/4 compare final weights and optimizer state bitwise")
    ref = torch.load(root / "reference.pt", weights_only=True)
    res = torch.load(root / "run.pt", weights_only=True)
    diffs = [
        f"{sec}/{k}"
        for sec in ("model", "optimizer")
        for k in ref[sec]
        if k not in res[sec] or not torch.equal(ref[sec][k], res[sec][k])
    ]
    if diffs:
        print(f"MISMATCH: {len(diffs)} tensors differ: {diffs[:5]}")
        return 1
    n = sum(len(ref[s]) for s in ("model", "optimizer"))
    print(f"OK: the resumed run matches the uninterrupted one bitwise ({n} tensors compared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
