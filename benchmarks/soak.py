"""Soak: long uninterrupted DDP jobs that snapshot at every step into the RAM tier and a local tier, under torchrun.

    python benchmarks/soak.py                      # 3 jobs of 300 steps, 2 ranks each (about 10 minutes on 2 cores)
    python benchmarks/soak.py --jobs 1 --steps 40  # a short look

What a user runs: ``torchrun --standalone --nproc-per-node 2 train.py`` with Lightning ``strategy="ddp"`` on CPU and
``SnapshotCallback([RamTier(every_n_train_steps=1, keep_last=2), LocalTier(dir, every_n_train_steps=1)])``, nothing
killed. The local tier is written by the node's snapshot agent (the RAM tier's), rank 0's agent merging the ranks'
manifest parts, at every step: the path where a part read while it was still being written used to stop jobs within
a few hundred commits. The local tier keeps every snapshot here (``keep_last=None``), so the commits can be counted
after the job: one per step is expected. A job passes when torchrun exits 0 and every step is committed.

The table: per job, torchrun's exit status, the steps committed to the local tier out of those expected, the wall
time, and the RAM tier's newest step. Target: every job passes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness


def worker(args: argparse.Namespace) -> None:
    """One rank of a job (started by torchrun)."""
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_snapshot import SnapshotCallback
    from lightning_snapshot.backends import LocalTier, RamTier

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 16, generator=g), torch.randn(4096, 1, generator=g))
    snapshots = SnapshotCallback(
        [
            RamTier(every_n_train_steps=1, keep_last=2, name=args.name),
            LocalTier(args.dir, every_n_train_steps=1, keep_last=None),
        ]
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=args.steps,
        callbacks=[snapshots],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(), DataLoader(data, batch_size=32, shuffle=True))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def job(args: argparse.Namespace, root: Path, index: int) -> dict:
    """One torchrun job; returns its figures."""
    from lightning_snapshot.agent import stop_agent
    from lightning_snapshot.backends import LocalTier
    from lightning_snapshot.persist.writer import committed_steps

    base = root / f"job{index}"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "LIGHTNING_SNAPSHOT_SHM_DIR": str(base / "shm")}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        os.path.abspath(__file__),
        "worker",
        "--dir",
        str(base / "local"),
        "--steps",
        str(args.steps),
        "--name",
        f"soak{index}",
    ]
    t0 = time.monotonic()
    with open(base.with_suffix(".log"), "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.timeout)
    wall = time.monotonic() - t0
    for sock in list((base / "shm").glob("**/agent.sock")):
        stop_agent(sock.parent)
    committed = committed_steps(LocalTier(base / "local")) if (base / "local").exists() else []
    tail = base.with_suffix(".log").read_text(errors="replace")[-1500:] if proc.returncode else ""
    return {
        "job": index,
        "rc": proc.returncode,
        "committed": len(committed),
        "expected": args.steps,
        "missing": sorted(set(range(1, args.steps + 1)) - set(committed))[:10],
        "wall_s": wall,
        "tail": tail,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", default="run", choices=["run", "worker"], help=argparse.SUPPRESS)
    p.add_argument("--jobs", type=int, default=3, help="jobs run one after the other (default 3)")
    p.add_argument("--steps", type=int, default=300, help="steps per job, one snapshot each (default 300)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds a job may take (default 1200)")
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--name", help=argparse.SUPPRESS)
    harness.add_arguments(p, markdown=True)
    args = p.parse_args()
    if args.mode == "worker":
        worker(args)
        return 0
    out = harness.Report("soak", args)
    out.header(jobs=args.jobs, steps=args.steps, ranks=2, tiers="RamTier(every 1) + LocalTier(every 1) via the agent")
    results = []
    with tempfile.TemporaryDirectory(prefix="ls-soak-") as tmp:
        for i in range(args.jobs):
            (Path(tmp) / f"job{i}").mkdir()
            r = job(args, Path(tmp), i)
            results.append(r)
            out.say(f"job {i}: rc={r['rc']}, {r['committed']}/{r['expected']} steps committed in {r['wall_s']:.0f} s")
            if r["tail"]:
                out.say(r["tail"])
    table = harness.Table("Jobs", ["job", "exit", "committed", "wall"], key="jobs")
    for r in results:
        table.add(
            r["job"],
            r["rc"],
            f"{r['committed']}/{r['expected']}",
            f"{r['wall_s']:.0f} s",
            data={k: v for k, v in r.items() if k != "tail"},
        )
    out.table(table)
    total = sum(r["committed"] for r in results)
    failed = [r["job"] for r in results if r["rc"] != 0 or r["committed"] != r["expected"]]
    out.targets.check(
        not failed,
        f"every job exits 0 with every step committed ({total} commits in all; failed jobs: {failed or 'none'})",
    )
    return out.finish(results=results)


if __name__ == "__main__":
    sys.exit(main())
