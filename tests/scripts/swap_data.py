"""A trained parameter gets new storage through ``.data`` in ``training_step`` while the snapshot of the step before
is still being copied (the copy starts 0.3 s late).

``big``: one 41 MB weight, copied from its address; its old storage is freed (unmapped at once), and the snapshot
must still hold that step's values. ``small``: 150 small layers (18 MB of small tensors, more than are copied at
once), copied through the tensor objects by the copy thread: the snapshot being copied must not be committed.

Usage: swap_data.py DIR big|small. Prints ``OK <committed steps>`` when every committed snapshot holds the weights of
its step, then the library's warnings."""

from __future__ import annotations

import sys
import time
import warnings

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_snapshot import SnapshotCallback, load_snapshot
from lightning_snapshot.backends import LocalTier
from lightning_snapshot.staging.copier import SlotCopier

copy = SlotCopier._copy


def late(self, *args, **kwargs):
    time.sleep(0.3)
    return copy(self, *args, **kwargs)


SlotCopier._copy = late


class Swapping(L.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        width, count = (3200, 1) if kind == "big" else (100, 150)  # 41 MB: above any malloc mmap threshold
        self.net = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(count)))
        self.seen: dict[int, torch.Tensor] = {}

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 2:  # (the snapshot of step 2 is being copied)
            weight = self.net[0].weight
            with torch.no_grad():
                weight.data = weight.data + 1.0  # new storage; the old one is freed
                self.junk = [torch.full(weight.shape, 7.0) for _ in range(4)]  # (reusing its memory, if not unmapped)
        (x,) = batch
        return self.net(x).pow(2).mean()

    def on_train_batch_end(self, *args) -> None:
        self.seen[self.trainer.global_step] = self.net[0].weight.detach().clone()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(root: str, kind: str) -> None:
    model = Swapping(kind)
    width = model.net[0].in_features
    data = DataLoader(TensorDataset(torch.randn(48, width, generator=torch.Generator().manual_seed(0))), batch_size=8)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=5,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SnapshotCallback(LocalTier(root, every_n_train_steps=1, keep_last=10))],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data)
    steps = []
    for step in range(1, 6):
        try:
            saved = load_snapshot(root, step=step)["state_dict"]["net.0.weight"]
        except Exception:  # noqa: BLE001 - (not committed)
            continue
        assert torch.equal(saved, model.seen[step]), f"the snapshot of step {step} does not hold that step's weights"
        steps.append(step)
    print("OK", steps)
    for w in caught:
        if "lightning-snapshot" in str(w.message):
            print("WARNING", w.message)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
