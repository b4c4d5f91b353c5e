"""Lightning runs with built-in callbacks that change the optimizer or the schedulers during fit, for the
optimizer/scheduler compatibility check (lightning_snapshot.state.compat).

Usage: python compat_runs.py --setup SETUP --dir DIR --out RESULT.pt [--resume-setup SETUP] [--resume-epoch E]

Fits 4 short epochs (4 steps each) with Lightning's ModelCheckpoint saving every epoch into DIR/first, then, in a
fresh model and trainer (of --resume-setup, default the same), continues with fit(ckpt_path=DIR/first/epoch=E.ckpt)
as Lightning restores.

Setups: ``swa``: SGD(momentum) + StepLR and StochasticWeightAveraging(swa_epoch_start=2), which swaps StepLR for
SWALR at (0-based) epoch 1. ``finetune``: Adam over the head and BackboneFinetuning(unfreeze_backbone_at_epoch=1),
which adds the backbone's parameter group at epoch 1. ``plain``: AdamW + StepLR. ``sgd``: SGD(momentum) +
CosineAnnealingLR (a changed setup for a ``plain`` checkpoint).

RESULT.pt (torch.save, read back with weights_only=False) holds "first" and "resumed", each:
  records: per epoch end {"epoch", "step", "optimizer_states", "lr_schedulers", "description"} (the states as
           Lightning's checkpoint holds them, and compat.describe(trainer) then);
  fit_start: at on_fit_start, after the other callbacks' on_fit_start: {"description", "callbacks"};
  weights: the final weights; lrs: the learning rates of every training step; fit_error: what fit raised;
and in "resumed" only: check / check_without_description: compat.check(trainer, the description stored in the
checkpoint / None, the checkpoint's optimizer_states, lr_schedulers) run in on_fit_start: "ok" or the
StateMismatchError message; pairs: the live scheduler classes compat.schedulers_to_load pairs.
"ckpt" holds the checkpoint's optimizer_states, lr_schedulers, callbacks and compat_description.
With --mid-step N also "mid" (resumed from the step-N checkpoint, within an epoch, with
compat.reinstate_epoch_start_schedulers at on_train_start; "reinstated" is what it returned) and "mid_plain" (the
same without it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, ModelCheckpoint, StochasticWeightAveraging
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_snapshot.errors import StateMismatchError
from lightning_snapshot.state import compat

SETUPS = ("swa", "finetune", "plain", "sgd")


class Model(L.LightningModule):
    def __init__(self, setup: str) -> None:
        super().__init__()
        self.setup_name = setup
        self.backbone = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        if self.setup_name == "swa":
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}
        if self.setup_name == "finetune":
            return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=1e-2)
        if self.setup_name == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)}
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g))
        return DataLoader(data, batch_size=4)


class Recorder(L.Callback):
    """Records what the check needs; placed after the callbacks under test, so its on_fit_start runs after theirs."""

    def __init__(self, out: dict, reinstate: bool = False) -> None:
        self.out = out
        self.reinstate = reinstate
        self.out.update(records=[], lrs=[])

    def on_fit_start(self, trainer, pl_module):
        self.out["fit_start"] = {
            "description": compat.describe(trainer),
            "callbacks": [type(cb).__name__ for cb in trainer.callbacks],
        }
        ckpt = trainer._checkpoint_connector._loaded_checkpoint
        if ckpt:
            saved = ckpt.get("compat_description")
            try:
                compat.check(trainer, saved, ckpt["optimizer_states"], ckpt["lr_schedulers"], "the checkpoint")
                self.out["check"] = "ok"
            except StateMismatchError as e:
                self.out["check"] = str(e)
            self.out["check_without_description"] = _try(trainer, None, ckpt)
            self.out["pairs"] = [
                type(cfg.scheduler).__name__ for cfg, _ in compat.schedulers_to_load(trainer, ckpt["lr_schedulers"])
            ]

    def on_train_start(self, trainer, pl_module):
        if self.reinstate:
            self.out["reinstated"] = compat.reinstate_epoch_start_schedulers(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.out["lrs"].append([g["lr"] for opt in trainer.optimizers for g in opt.param_groups])

    def on_train_epoch_end(self, trainer, pl_module):
        self.out["records"].append(
            {
                "epoch": trainer.current_epoch,
                "step": trainer.global_step,
                "optimizer_states": [opt.state_dict() for opt in trainer.optimizers],
                "lr_schedulers": [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
                "description": compat.describe(trainer),
            }
        )

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        # what the snapshot callback stores: the description next to the states
        checkpoint["compat_description"] = compat.describe(trainer)


def _try(trainer, saved, ckpt) -> str:
    try:
        compat.check(trainer, saved, ckpt["optimizer_states"], ckpt["lr_schedulers"], "the checkpoint")
        return "ok"
    except StateMismatchError as e:
        return str(e)


def fit(
    setup: str, dirpath: str, max_epochs: int, ckpt_path: str | None = None, mid_step: int = 0, reinstate: bool = False
) -> dict:
    torch.manual_seed(0)
    model = Model(setup)
    out: dict = {}
    callbacks: list = []
    if setup == "swa":
        callbacks.append(StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2, annealing_epochs=2))
    elif setup == "finetune":
        callbacks.append(BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5))
    callbacks.append(Recorder(out, reinstate))
    callbacks.append(ModelCheckpoint(dirpath=dirpath, filename="{epoch}", every_n_epochs=1, save_top_k=-1))
    if mid_step:
        callbacks.append(
            ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=mid_step, save_top_k=-1)
        )
    trainer = L.Trainer(
        max_epochs=max_epochs,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        deterministic=True,
    )
    try:
        trainer.fit(model, ckpt_path=ckpt_path)
    except Exception as e:  # noqa: BLE001 - what Lightning itself does with a changed setup is part of the result
        out["fit_error"] = f"{type(e).__name__}: {e}"
    out["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--setup", required=True, choices=SETUPS)
    ap.add_argument("--resume-setup", default=None, choices=SETUPS, help="the setup of the resumed run")
    ap.add_argument("--resume-epoch", type=int, default=1, help="resume from the checkpoint of this epoch")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-epochs", type=int, default=4)
    ap.add_argument(
        "--mid-step",
        type=int,
        default=0,
        help="also save a checkpoint at this step and resume from it (within an epoch), calling"
        " compat.reinstate_epoch_start_schedulers at on_train_start: result 'mid'",
    )
    args = ap.parse_args()

    first = fit(args.setup, str(Path(args.dir) / "first"), args.max_epochs, mid_step=args.mid_step)
    ckpt_path = Path(args.dir) / "first" / f"epoch={args.resume_epoch}.ckpt"
    resumed = fit(args.resume_setup or args.setup, str(Path(args.dir) / "resumed"), args.max_epochs, str(ckpt_path))
    ckpt = torch.load(ckpt_path, weights_only=False)
    out = {
        "first": first,
        "resumed": resumed,
        "ckpt": {k: ckpt[k] for k in ("optimizer_states", "lr_schedulers", "callbacks", "compat_description")},
    }
    if args.mid_step:
        out["mid"] = fit(
            args.setup,
            str(Path(args.dir) / "mid"),
            args.max_epochs,
            str(Path(args.dir) / "first" / f"step={args.mid_step}.ckpt"),
            reinstate=True,
        )
        out["mid_plain"] = fit(
            args.setup,
            str(Path(args.dir) / "mid_plain"),
            args.max_epochs,
            str(Path(args.dir) / "first" / f"step={args.mid_step}.ckpt"),
        )
    torch.save(out, args.out)
    print(json.dumps({"check": resumed.get("check"), "fit_error": resumed.get("fit_error")}))


if __name__ == "__main__":
    main()
