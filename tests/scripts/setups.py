"""Ordinary Lightning setups for the exact-resume tests: validation with EarlyStopping and ModelCheckpoint,
ReduceLROnPlateau, augmentation in the main process and in loader workers (fresh or persistent workers, with
Lightning's worker seeding from ``seed_everything(workers=True)`` or torch's own), an unsized stateful loader, manual
optimization with two optimizers, bf16-mixed; and Lightning's own callbacks that change the training during fit:
BackboneFinetuning (unfreezes the backbone and adds its parameter group at epoch 1), StochasticWeightAveraging
(swaps in SWALR and averages from epoch 1; with BatchNorm it adds an epoch), LearningRateMonitor with OneCycleLR per
step (logged through a CSVLogger), GradientAccumulationScheduler (1, 2, then 4 batches per step), EarlyStopping and
ModelCheckpoint monitoring an epoch aggregate of a training metric, ModelCheckpoint(every_n_train_steps=3,
save_top_k=2), EMAWeightAveraging (its averaged weights travel in on_save_checkpoint and are swapped in for
validation), a user callback whose state travels in on_save_checkpoint/on_load_checkpoint, an epoch-interval
scheduler with validation twice an epoch and ModelCheckpoint(save_last=True), and a torchmetrics Metric logged per
epoch and monitored by EarlyStopping, ModelPruning (prunes and resets the weights at each epoch end), torchdata's
StatefulDataLoader(shuffle=True) with augmentation in the main process, and the tuners LearningRateFinder and
BatchSizeFinder (trial steps in their on_fit_start); a curriculum (a datamodule whose train_dataloader() reads
the epoch, reloaded every 2 epochs), a CombinedLoader of two shuffled loaders whose shorter one cycles, and a batch
sampler of the user's own (bucketing by length, each bucket shuffled as it is reached) with augmentation in 2 loader
workers or in the main process; random masking drawn from a torch.Generator the model holds; ``big``: a wider
network whose two hidden weights are a megabyte each (511 x 512 and 513 x 511 float32: the first ends on a whole 64-bit
word, the second one value past it), for the replica check at real tensor sizes.

Usage: python setups.py --setup NAME --dir SNAPDIR --out RESULT.pt [--crash-at S] [--every K] [--max-steps N]
       [--max-epochs N] [--sigterm-at S] [--neutrality]

Writes everything a resumed run must reproduce to RESULT.pt (``fingerprint.capture``: weights, optimizer states
with their param groups, scheduler states, loop progress, every callback's state_dict, the precision plugin, the
torch/CUDA/numpy/python RNG, every value logged by metric and step), plus the checkpoint files ModelCheckpoint left
(``fingerprint.checkpoint_files``: names and contents), the validation steps and learning rates seen, the last batch
trained, which parameters are trainable, the gradient accumulation in force and what callbacks keep outside their
state_dict. A restore is printed when it happens
(``RESTORED step=S from=URL rank=R``). ``--neutrality`` first runs the same fit without lightning-snapshot in this
process (result RESULT.pt.nolib), for the comparison that shows the library does not change training.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import time

import lightning as L
import numpy as np
import torch
from fingerprint import MemoryLogger, ReportRestore, capture, checkpoint_files
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    EarlyStopping,
    EMAWeightAveraging,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
    StochasticWeightAveraging,
)
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_snapshot import SnapshotCallback
from lightning_snapshot.backends import LocalTier
from lightning_snapshot.persist.writer import committed_steps

SETUPS = (
    "val-epoch",
    "val-interval",
    "plateau-epoch",
    "plateau-step",
    "aug-main",
    "aug-workers",
    "aug-workers-persistent",
    "aug-workers-plain",
    "stateful-iterable",
    "manual-two-optimizers",
    "bf16-mixed",
    "finetune",
    "swa",
    "lr-monitor",
    "grad-accum",
    "early-stop-train",
    "ckpt-steps",
    "ema",
    "user-hooks",
    "epoch-sched",
    "metric-obj",
    "stateful-shuffle",
    "pruning",
    "lr-finder",
    "bs-finder",
    "curriculum",
    "combined",
    "bucket",
    "bucket-main",
    "own-generator",
    "big",
)
#: Setups that log through a CSVLogger (the values logged are compared).
LOGGED = ("lr-monitor", "early-stop-train", "metric-obj")


class Points(Dataset):
    """Regression samples; with ``augment`` every sample draws noise from torch, numpy and python ``random``
    (in whichever process loads it: the main process or a loader worker)."""

    def __init__(self, n: int = 64, augment: bool = False, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randn(n, 1, generator=g)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i]
        if self.augment:
            x = x + 0.1 * torch.randn(8) + float(np.random.uniform(-0.1, 0.1)) + random.uniform(-0.1, 0.1)
        return x, self.y[i]


class Stream(IterableDataset):
    """An unsized, stateful stream (what torchdata's StatefulDataLoader restores through Lightning)."""

    def __init__(self, n: int = 64) -> None:
        self.data = Points(n)
        self.pos = 0

    def __iter__(self):
        while self.pos < len(self.data):
            self.pos += 1
            yield self.data[self.pos - 1]
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


class Model(L.LightningModule):
    def __init__(self, setup: str) -> None:
        super().__init__()
        self.setup_name = setup
        if setup == "finetune":  # BackboneFinetuning needs a ``backbone``
            self.backbone = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
            self.top = nn.Sequential(nn.Dropout(0.2), nn.Linear(16, 1))
        elif setup == "big":  # net.2.weight: 261,632 float32 (1,046,528 B); net.4.weight: 262,143 (1,048,572 B)
            self.net = nn.Sequential(
                nn.Linear(8, 512),
                nn.ReLU(),
                nn.Linear(512, 511),
                nn.ReLU(),
                nn.Linear(511, 513),
                nn.ReLU(),
                nn.Linear(513, 1),
            )
        else:
            self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
        if setup == "metric-obj":  # a torchmetrics Metric logged per epoch (its state lives in the module)
            from torchmetrics import MeanSquaredError

            self.train_mse = MeanSquaredError()
        if setup == "own-generator":  # random masking drawn from a generator the model holds (in a submodule)
            self.net.mask_gen = torch.Generator().manual_seed(5)
        self.lr = 5e-2  # (LearningRateFinder sets it)
        self.val_steps: list[int] = []
        self.lrs: list[float] = []
        self.last_batch = torch.zeros(0)
        if setup == "manual-two-optimizers":
            self.automatic_optimization = False
            self.head = nn.Linear(8, 1)

    def forward(self, x):
        if self.setup_name == "finetune":
            return self.top(self.backbone(x))
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if isinstance(batch, dict):  # combined: one batch of each loader
            x, y = (torch.cat([batch[k][i] for k in sorted(batch)]) for i in (0, 1))
        else:
            x, y = batch
        if self.setup_name == "own-generator":
            x = x * (torch.rand(x.shape, generator=self.net.mask_gen) > 0.25)
        self.last_batch = x.detach().clone()
        loss = nn.functional.mse_loss(self(x), y)
        # early-stop-train monitors the epoch mean ("train_loss_epoch"), accumulated over the epoch's steps
        self.log("train_loss", loss, on_step=True, on_epoch=self.setup_name in ("early-stop-train", "lr-monitor"))
        if self.setup_name == "metric-obj":
            self.train_mse(self(x), y)
            self.log("train_mse", self.train_mse, on_step=False, on_epoch=True)
        if self.automatic_optimization:
            self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
            return loss
        opt_a, opt_b = self.optimizers()
        opt_a.zero_grad()
        self.manual_backward(loss)
        opt_a.step()
        loss_b = nn.functional.mse_loss(self.head(x), y)
        opt_b.zero_grad()
        self.manual_backward(loss_b)
        opt_b.step()
        return None

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            self.val_steps.append(self.trainer.global_step)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["history"] = {"val_steps": list(self.val_steps), "lrs": list(self.lrs)}

    def on_load_checkpoint(self, checkpoint):
        self.val_steps = list(checkpoint["history"]["val_steps"])
        self.lrs = list(checkpoint["history"]["lrs"])

    def configure_optimizers(self):
        if self.setup_name == "manual-two-optimizers":
            return [
                torch.optim.AdamW(self.net.parameters(), lr=1e-2),
                torch.optim.SGD(self.head.parameters(), lr=0.1, momentum=0.9),
            ]
        if self.setup_name == "finetune":
            # the backbone is frozen (BackboneFinetuning.freeze_before_training) until the callback adds it
            return torch.optim.AdamW(filter(lambda p: p.requires_grad, self.parameters()), lr=5e-2)
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        if self.setup_name == "lr-monitor":
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=self.trainer.max_steps)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if self.setup_name == "epoch-sched":
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=3)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}
        if self.setup_name == "plateau-epoch":
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5, threshold=10.0)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss", "interval": "epoch"}}
        if self.setup_name == "plateau-step":
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1, factor=0.7, threshold=10.0)
            return {
                "optimizer": opt,
                "lr_scheduler": {
                    "scheduler": sched,
                    "monitor": "val_loss",
                    "interval": "step",
                    "frequency": 2,
                    "strict": False,
                },
            }
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Tally(L.Callback):
    """A user callback written the pre-``state_dict`` way: its state travels in ``on_save_checkpoint`` /
    ``on_load_checkpoint`` (a running sum of the losses and a count of the validations seen)."""

    def __init__(self) -> None:
        self.loss_sum = torch.zeros(())
        self.validations = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.loss_sum = self.loss_sum + outputs["loss"].detach()

    def on_validation_end(self, trainer, pl_module):
        self.validations += 1

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        checkpoint["tally"] = {"loss_sum": self.loss_sum.clone(), "validations": self.validations}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        self.loss_sum = checkpoint["tally"]["loss_sum"].clone()
        self.validations = checkpoint["tally"]["validations"]


class Crash(L.Callback):
    """SIGKILL at ``global_step == at`` (before its training step), once the newest snapshot due is committed."""

    def __init__(self, at: int, tier: LocalTier) -> None:
        self.at = at
        self.tier = tier

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at:
            every = self.tier.every_n_train_steps
            due = (self.at // every) * every
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (committed_steps(self.tier) or [-1])[0] < due:
                time.sleep(0.01)
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


ROOT = ""


class Preempt(L.Callback):
    """Send this process SIGTERM at ``global_step == at`` (what SLURM or Kubernetes does before a preemption)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # (under DDP only rank 0 is signalled, as a container's main process is: Lightning forwards it to the
        # ranks it launched)
        if trainer.global_step == self.at and trainer.global_rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)


class Perturb(L.Callback):
    """On rank ``rank`` only, after the optimizer step of ``global_step == at`` (``each``: and of every later step):
    move the first value (``last``: the last value) of each parameter of ``names`` up by one ulp (silent data
    corruption on one GPU). DDP averages the gradients, so every rank applies the same update to its own copy: the
    replicas differ in those parameters only, until rounding in later updates happens to absorb a single change
    (hence ``each``: a fault that persists)."""

    def __init__(self, at: int, rank: int, names: list[str], each: bool, last: bool = False) -> None:
        self.at, self.rank, self.names, self.each, self.last = at, rank, names, each, last

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if (step == self.at or (self.each and step > self.at)) and trainer.global_rank == self.rank:
            with torch.no_grad():
                for name in self.names:
                    flat = dict(pl_module.named_parameters())[name].view(-1)
                    i = flat.numel() - 1 if self.last else 0
                    flat[i] = torch.nextafter(flat[i], torch.tensor(math.inf))


class Buckets(torch.utils.data.Sampler):
    """A batch sampler of the user's own, as for sequences of varied length: a shuffled order from the global torch
    RNG, cut into buckets of 4 batches that are sorted by a length key, and the batches of each bucket shuffled."""

    def __init__(self, n: int, batch_size: int) -> None:
        self.n, self.batch_size = n, batch_size
        self.lengths = torch.randint(1, 100, (n,), generator=torch.Generator().manual_seed(3)).tolist()

    def __len__(self) -> int:
        return math.ceil(self.n / self.batch_size)

    def __iter__(self):
        order = torch.randperm(self.n).tolist()
        span = 4 * self.batch_size
        for start in range(0, self.n, span):
            bucket = sorted(order[start : start + span], key=lambda i: self.lengths[i])
            batches = [bucket[i : i + self.batch_size] for i in range(0, len(bucket), self.batch_size)]
            for b in torch.randperm(len(batches)).tolist():
                yield batches[b]


class Curriculum(L.LightningDataModule):
    """A curriculum: each epoch's data depends on ``trainer.current_epoch`` (more samples, another seed), made again
    every ``reload_dataloaders_every_n_epochs``."""

    def train_dataloader(self):
        epoch = self.trainer.current_epoch
        return DataLoader(Points(32 + 16 * epoch, augment=True, seed=epoch), batch_size=4, shuffle=True)

    def val_dataloader(self):
        return DataLoader(Points(16, seed=1), batch_size=8)


def plain(obj):
    """``obj`` with tensors cloned to the CPU and everything else JSON-like (for torch.save/weights_only); the run's
    directory in strings (checkpoint paths) becomes ``<DIR>``, so runs in other directories compare equal."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {plain(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, str):
        return obj.replace(ROOT, "<DIR>") if ROOT else obj
    if obj is None or isinstance(obj, (bool, int, float)):
        return obj
    return repr(obj)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--setup", choices=SETUPS, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--max-epochs", type=int, default=-1, help="train by epochs (max_steps=-1)")
    p.add_argument("--crash-at", type=int, default=-1)
    p.add_argument("--sigterm-at", type=int, default=-1)
    p.add_argument("--workers", type=int, default=-1, help="train loader workers (default: the setup's)")
    p.add_argument(
        "--trainer",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="another Trainer argument (e.g. check_val_every_n_epoch=2), over the setup's own",
    )
    p.add_argument(
        "--snapshot",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="a SnapshotCallback argument (e.g. replica_check=1)",
    )
    p.add_argument(
        "--perturb",
        default="",
        metavar="STEP[+]:RANK:PARAM[,PARAM...][:last]",
        help="move the first value (:last: the last) of each PARAM by one ulp on RANK after the optimizer"
        " step of STEP (the snapshot of STEP sees it); STEP+: and after every later step",
    )
    p.add_argument(
        "--neutrality",
        action="store_true",
        help="first run the same fit without lightning-snapshot (in DIR/nolib, result OUT.nolib), in this"
        " process, then the fit with it",
    )
    a = p.parse_args()
    if a.neutrality:
        fit(a, os.path.join(a.dir, "nolib"), f"{a.out}.nolib", library=False)
    fit(a, a.dir, a.out, library=True)


def fit(a: argparse.Namespace, root: str, out: str, library: bool) -> None:
    """One fit of setup ``a.setup`` in directory ``root``, its result saved to ``out``; ``library=False``: without
    lightning-snapshot (no SnapshotCallback: Lightning's default checkpointing off unless the setup has a
    ModelCheckpoint of its own)."""
    global ROOT
    ROOT = os.path.abspath(root)

    # aug-workers-plain: what a new user writes, no worker seeding of Lightning's (torch seeds each worker from the
    # loader's base seed, numpy and python included)
    L.seed_everything(42, workers=a.setup != "aug-workers-plain", verbose=False)
    setup = a.setup
    model = Model(setup)
    workers = 2 if setup.startswith("aug-workers") else 0
    workers = a.workers if a.workers >= 0 else workers
    if setup == "stateful-iterable":
        from torchdata.stateful_dataloader import StatefulDataLoader

        train = StatefulDataLoader(Stream(), batch_size=4, num_workers=workers)
    elif setup == "stateful-shuffle":
        from torchdata.stateful_dataloader import StatefulDataLoader

        train = StatefulDataLoader(Points(augment=True), batch_size=4, shuffle=True, num_workers=workers)
    elif setup.startswith(
        "bucket"
    ):  # a batch sampler of the user's own; augmentation in 2 workers or in the main process
        train = DataLoader(
            Points(augment=True),
            batch_sampler=Buckets(64, 4),
            num_workers=2 if setup == "bucket" and a.workers < 0 else workers,
        )
    else:
        train = DataLoader(
            Points(augment=setup.startswith("aug-")),
            batch_size=4,
            shuffle=os.environ.get("SETUPS_SHUFFLE", "1") == "1",
            num_workers=workers,
            persistent_workers=setup == "aug-workers-persistent",
        )
    val = DataLoader(Points(16, seed=1), batch_size=8)
    ckpt_dir = os.path.join(ROOT, "ckpts")
    callbacks: list[L.Callback] = []
    trainer_kw: dict = {}
    if setup in ("val-epoch", "plateau-epoch"):
        # validation at every epoch end; EarlyStopping stops once val_loss failed to improve by 10 twice
        callbacks.append(EarlyStopping(monitor="val_loss", patience=2, min_delta=10.0))
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss", save_top_k=2))
    elif setup in ("val-interval", "plateau-step"):
        trainer_kw["val_check_interval"] = 4
        callbacks.append(EarlyStopping(monitor="val_loss", patience=3, min_delta=10.0, check_on_train_epoch_end=False))
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss", save_top_k=2))
    elif setup in ("ema", "user-hooks"):
        trainer_kw["val_check_interval"] = 4
    elif setup == "epoch-sched":
        trainer_kw["val_check_interval"] = 0.5
    else:
        trainer_kw["limit_val_batches"] = 0
    max_steps, max_epochs = (a.max_steps, -1) if a.max_epochs < 0 else (-1, a.max_epochs)
    if setup == "finetune":
        callbacks.append(BackboneFinetuning(unfreeze_backbone_at_epoch=1))
    elif setup == "swa":
        # SWA needs max_epochs: epochs 1 and 2 average (SWALR anneals over one epoch), epoch 3 updates BatchNorm
        callbacks.append(StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1, annealing_epochs=1))
        max_steps, max_epochs = -1, 3
    elif setup == "lr-monitor":
        callbacks.append(LearningRateMonitor(logging_interval="step", log_momentum=True))
    elif setup == "grad-accum":
        callbacks.append(GradientAccumulationScheduler({0: 1, 1: 2, 2: 4}))
    elif setup == "early-stop-train":
        # stops at the end of epoch 1 (no improvement by 10); the epoch mean is in ModelCheckpoint's scores
        callbacks.append(EarlyStopping(monitor="train_loss_epoch", patience=1, min_delta=10.0))
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, monitor="train_loss_epoch", save_top_k=2))
    elif setup == "ckpt-steps":
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, monitor="train_loss", save_top_k=2))
    elif setup == "ema":
        callbacks.append(EMAWeightAveraging(decay=0.9))
    elif setup == "user-hooks":
        callbacks.append(Tally())
    elif setup == "lr-finder":  # tunes model.lr in its on_fit_start (20 steps, then the state is put back)
        from lightning.pytorch.callbacks import LearningRateFinder

        callbacks.append(LearningRateFinder(min_lr=1e-4, max_lr=0.5, num_training_steps=20))
    elif setup == "bs-finder":  # scales the batch size in its on_fit_start (trial steps, then the state is put back)
        from lightning.pytorch.callbacks import BatchSizeFinder

        callbacks.append(BatchSizeFinder(mode="power", init_val=2, max_trials=2, steps_per_trial=2))
    elif setup == "pruning":
        from lightning.pytorch.callbacks import ModelPruning

        callbacks.append(ModelPruning("l1_unstructured", amount=0.2))
    elif setup == "epoch-sched":
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss", save_top_k=2, save_last=True))
    elif setup == "curriculum":  # reloaded every 2 epochs: epochs of 8, 8, 16, 16 batches
        trainer_kw["reload_dataloaders_every_n_epochs"] = 2
    elif setup == "metric-obj":
        callbacks.append(EarlyStopping(monitor="train_mse", patience=1, min_delta=10.0))
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, monitor="train_mse", save_top_k=2))
    if setup in LOGGED:
        trainer_kw["logger"] = CSVLogger(ROOT, name="logs", version=0, flush_logs_every_n_steps=1)
        trainer_kw["log_every_n_steps"] = 1
    else:
        trainer_kw["logger"] = False
    if setup == "bf16-mixed":
        trainer_kw["precision"] = "bf16-mixed"
    for item in a.trainer:
        key, _, value = item.partition("=")
        trainer_kw[key] = json.loads(value)
    memory = MemoryLogger()  # (every value logged, compared)
    trainer_kw["logger"] = [trainer_kw["logger"], memory] if trainer_kw["logger"] else [memory]
    trainer_kw.setdefault("log_every_n_steps", 1)
    snapshot = None
    if library:
        tier = LocalTier(os.path.join(root, "snaps"), every_n_train_steps=a.every, keep_last=2)
        snapshot = SnapshotCallback([tier], **{k: json.loads(v) for k, _, v in (o.partition("=") for o in a.snapshot)})
        if a.perturb:  # (before the snapshot callback: its hooks run first)
            at, rank, names, *where = a.perturb.split(":")
            callbacks.append(
                Perturb(int(at.rstrip("+")), int(rank), names.split(","), at.endswith("+"), last=where == ["last"])
            )
        callbacks += [snapshot, ReportRestore(snapshot)]
        if a.crash_at >= 0:
            callbacks.append(Crash(a.crash_at, tier))
        if a.sigterm_at >= 0:
            callbacks.append(Preempt(a.sigterm_at))
    elif not any(isinstance(cb, ModelCheckpoint) for cb in callbacks):
        trainer_kw["enable_checkpointing"] = False
    trainer = L.Trainer(
        **{
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": max_steps,
            "max_epochs": max_epochs,
            "callbacks": callbacks,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "deterministic": True,
            "num_sanity_val_steps": 0,
            "default_root_dir": ROOT,
            **trainer_kw,
        }
    )
    if setup == "bs-finder":  # the loaders come from a datamodule whose batch_size the finder scales
        dm = L.LightningDataModule.from_datasets(
            train_dataset=Points(augment=True), val_dataset=Points(16, seed=1), batch_size=4
        )
        dm.batch_size = 4
        dm.train_dataloader = lambda: DataLoader(Points(augment=True), batch_size=dm.batch_size, shuffle=True)
        trainer.fit(model, datamodule=dm)
    elif setup == "curriculum":
        trainer.fit(model, datamodule=Curriculum())
    elif setup == "combined":  # a shorter loader cycles within the epoch (6 of its batches, 16 of the longer one's)
        from lightning.pytorch.utilities import CombinedLoader

        short = DataLoader(Points(24, augment=True, seed=2), batch_size=4, shuffle=True)
        trainer.fit(model, CombinedLoader({"long": train, "short": short}, mode="max_size_cycle"), val)
    else:
        trainer.fit(model, train, val)
    result = capture(trainer, model, ROOT, memory)
    result.update(
        {
            "checkpoint_files": checkpoint_files(ckpt_dir, ROOT),
            "val_steps": list(model.val_steps),
            "lrs": list(model.lrs),
            "last_batch": plain(model.last_batch),
            "own_generator": model.net.mask_gen.get_state() if a.setup == "own-generator" else torch.zeros(0),
            "trainable": {n: p.requires_grad for n, p in model.named_parameters()},
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            # what callbacks keep outside their state_dict (EMAWeightAveraging's averaged model, a user callback's
            # on_save_checkpoint state)
            "extra": {
                type(cb).__name__: plain(
                    cb._average_model.state_dict()
                    if isinstance(cb, EMAWeightAveraging)
                    else {"loss_sum": cb.loss_sum, "validations": cb.validations}
                )
                for cb in trainer.callbacks
                if isinstance(cb, (EMAWeightAveraging, Tally))
            },
        }
    )
    if trainer.global_rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        torch.save(result, out)


if __name__ == "__main__":
    main()
