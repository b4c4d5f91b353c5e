"""A fit with a state part of its own (registered here, touching no library file): a tally held by a test-only
object, in no state_dict and no checkpoint, that every training step changes (from the batch and the global RNG).

Usage: python state_part.py --dir SNAPDIR --out RESULT.pt [--max-steps N] [--crash-at S] [--phase PHASE]
Writes the tally (and the weights) to RESULT.pt. ``LS_TEST_BREAK_PART=1``: the part's restore does nothing (the
test's negative control).
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from fingerprint import ReportRestore
from torch.utils.data import DataLoader, TensorDataset
from train import Crash

from lightning_snapshot import SnapshotCallback
from lightning_snapshot.backends import LocalTier
from lightning_snapshot.state.builtin import register
from lightning_snapshot.state.parts import Part, Phase


class Tally:
    """Test-only state: a step count and a float64 accumulator."""

    def __init__(self) -> None:
        self.count = 0
        self.acc = torch.zeros(4, dtype=torch.float64)


TALLY = Tally()


def capture_tally(ctx) -> dict:
    return {"count": TALLY.count, "acc": TALLY.acc}


def restore_tally(ctx, state) -> None:
    if state is None or os.environ.get("LS_TEST_BREAK_PART") == "1":
        return
    TALLY.count = int(state["count"])
    TALLY.acc = state["acc"].clone()


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        TALLY.count += 1
        TALLY.acc = TALLY.acc * 0.5 + x.double().sum(0) + torch.rand(4, dtype=torch.float64)
        return self.layer(torch.nn.functional.dropout(x, 0.2)).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        data = torch.randn(48, 4, generator=torch.Generator().manual_seed(3))
        return DataLoader(TensorDataset(data), batch_size=4, shuffle=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--crash-at", type=int, default=-1)
    p.add_argument("--phase", default="TRAIN_START", choices=[ph.name for ph in Phase])
    args = p.parse_args()
    register(Part("test_tally", capture_tally, restore_tally, Phase[args.phase], per_rank=True))
    L.seed_everything(7, verbose=False)
    tier = LocalTier(args.dir, every_n_train_steps=2, keep_last=3)
    snapshots = SnapshotCallback([tier])
    callbacks = [snapshots, ReportRestore(snapshots)]
    if args.crash_at >= 0:
        callbacks.append(Crash(args.crash_at, [tier]))
    trainer = L.Trainer(
        max_steps=args.max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        deterministic=True,
    )
    model = Model()
    trainer.fit(model)
    torch.save({"count": TALLY.count, "acc": TALLY.acc, "weight": model.layer.weight.detach()}, args.out)


if __name__ == "__main__":
    main()
