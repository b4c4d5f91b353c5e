"""DDP with 4 (3+) ranks resumes bitwise when the rebuilt gradient bucket layout is carried over (ddp_layout).

Usage:
  ddp4_train.py --out REF.pt                                      # uninterrupted, --max-steps steps
  ddp4_train.py --out X.pt --dir D --stop-at K                    # K steps, Lightning checkpoint + layout, exit
  ddp4_train.py --out Y.pt --dir D --resume [--no-apply]          # resume from D up to --max-steps

The state (weights, optimizer, scheduler, loops) travels in Lightning's own checkpoint (``ModelCheckpoint`` at step
K, the last batch of an epoch, and ``fit(ckpt_path=...)``); only the DDP bucket layout travels in D/layout.json,
written by :func:`lightning_snapshot.ddp_layout.capture_layout` and given back with ``apply_layout`` in
``on_fit_start`` (after the strategy wrapped the model in DDP, before the first forward). With ``--no-apply`` the
layout is not given back (the negative control). Writes the result in train.py's format (rank 0) and prints the
layout as ``LAYOUT {...}``.
"""

from __future__ import annotations

import argparse
import json
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_snapshot.ddp_layout import apply_layout, capture_layout


class Squares(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class BucketLayout(L.Callback):
    """Capture the DDP bucket layout at ``global_step == stop_at`` (all ranks call it; rank 0 writes it), or give a
    saved one back in ``on_fit_start``."""

    def __init__(self, path: str, stop_at: int, apply: bool) -> None:
        self.path = path
        self.stop_at = stop_at
        self.apply = apply

    def on_fit_start(self, trainer, pl_module):
        if self.apply and os.path.exists(self.path):
            with open(self.path) as f:
                apply_layout(trainer.strategy.model, json.load(f))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.stop_at:
            layout = capture_layout(trainer.strategy.model)
            if trainer.global_rank == 0:
                print("LAYOUT " + json.dumps(layout), flush=True)
                with open(self.path, "w") as f:
                    json.dump(layout, f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--dir", default=None)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--stop-at", type=int, default=-1, help="stop after this many steps (an epoch's end), saving")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--no-apply", action="store_true", help="resume without the saved bucket layout")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--steps-per-epoch", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--bucket-cap-mb", type=float, default=None)
    a = p.parse_args()

    L.seed_everything(42, verbose=False)
    model = Model()
    # shuffle=False: Lightning's DistributedSampler deals the same fixed batches to each rank in every epoch
    loader = DataLoader(Squares(a.devices * a.batch_size * a.steps_per_epoch), batch_size=a.batch_size, shuffle=False)
    callbacks: list[L.Callback] = []
    ckpt_path = None
    if a.dir:
        os.makedirs(a.dir, exist_ok=True)
        callbacks.append(BucketLayout(os.path.join(a.dir, "layout.json"), a.stop_at, apply=not a.no_apply))
        if a.stop_at > 0:
            # saved in on_train_batch_end of the epoch's last batch: Lightning resumes at the next epoch's first batch
            assert a.stop_at % a.steps_per_epoch == 0, "stop at an epoch's end (a plain DataLoader resumes there)"
            callbacks.append(ModelCheckpoint(dirpath=a.dir, filename="last", every_n_train_steps=a.stop_at,
                                             save_top_k=-1))
        if a.resume:
            ckpt_path = os.path.join(a.dir, "last.ckpt")
    strategy = "ddp"
    if a.bucket_cap_mb is not None:
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy(bucket_cap_mb=a.bucket_cap_mb)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=a.devices,
        strategy=strategy,
        max_steps=a.stop_at if a.stop_at > 0 else a.max_steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=a.stop_at > 0,
        deterministic=True,
    )
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    opt = trainer.optimizers[0]
    result = {
        "global_step": trainer.global_step,
        "model": {k: v.cpu().clone() for k, v in model.state_dict().items()},
        "optimizer": {f"{pid}/{k}": v.cpu().clone() for pid, st in opt.state_dict()["state"].items()
                      for k, v in st.items()},
        "lr": torch.tensor(opt.param_groups[0]["lr"], dtype=torch.float64),
        "rng": torch.get_rng_state(),
    }
    out = a.out if trainer.global_rank == 0 else f"{a.out}.rank{trainer.global_rank}"
    torch.save(result, out)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
