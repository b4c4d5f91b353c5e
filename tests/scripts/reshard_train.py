"""Training run for the resharding tests: an MLP under ModelParallelStrategy (FSDP2), DDP or one process.

Usage: python reshard_train.py --dir SNAPDIR --out RESULT.pt --strategy mp|ddp|single [--devices 2] [--max-steps N]
           [--every K] [--crash-at S] [--resume STEP_DIR] [--dump-steps 6,9 --dump-dir DIR] [--dump-at-start FILE]
           [--samples N] [--record FILE] [--s3 s3://BUCKET/PREFIX --endpoint URL [--also-dir]] [--num-nodes N]
           [--count-reads FILE]

Writes, on rank 0, the final consolidated state (full tensors; optimizer state keyed ``<param name>/<key>``) to
RESULT.pt in the format of train.py, so ``conftest.assert_bitwise_equal`` compares it. ``--dump-steps`` also writes
the consolidated state at those steps (right when the snapshot of the step is taken) to DIR/step-N.pt;
``--dump-at-start`` writes the state a resumed run starts from (right after the restore) to FILE. Each rank prints
``RESTORED step=..`` and ``RESTORE_STATS rank=.. needed=.. planned=.. tier=..`` after a restore. ``--record`` writes,
per rank, FILE.rank<R> (JSON): one ``[epoch, global_step, batch_idx, [sample indices]]`` per batch trained on.
``--s3`` snapshots to (and resumes from) that object-store URL instead of --dir (with ``--also-dir``: to a local tier
at --dir as well); ``--resume`` may then be a step. ``--num-nodes``: the job's nodes, each --devices ranks launched
outside (conftest.launch_nodes). ``--count-reads``: count the bytes this rank reads from the data objects under --dir
at the OS interface (io_count.py) and write them to FILE.rank<R>.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from train import Crash, SendSignal  # (tests/scripts is the script's directory: on sys.path)

from lightning_snapshot import SnapshotCallback
from lightning_snapshot.backends import LocalTier, ObjectStoreTier

IN, HIDDEN, OUT = 32, 256, 5  # OUT=5 rows over 2 ranks: an uneven shard (3 + 2)


class Data(Dataset):
    def __init__(self, n: int = 96) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, IN, generator=g)
        self.y = torch.randn(n, OUT, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class MLP(L.LightningModule):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(IN, HIDDEN),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(HIDDEN, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, OUT),
        )

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None:  # DDP or one process
            return
        from torch.distributed.fsdp import fully_shard

        tp = mesh["tensor_parallel"]
        if tp.size() > 1:  # Megatron-style: net.0 column-wise (Shard(0)), net.3 row-wise (Shard(1)), net.5 column-wise
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            # (net.5 is sharded too: a plain parameter replicated over tensor-parallel ranks is not bitwise the same on
            # every rank after a few steps with gloo, so "replicated" copies would differ)
            parallelize_module(
                self.net,
                tp,
                {"0": ColwiseParallel(), "3": RowwiseParallel(), "5": ColwiseParallel(output_layouts=Replicate())},
            )
        dp = mesh["data_parallel"]
        if dp.size() > 1 or os.environ.get("RESHARD_FULLY_SHARD") == "1":  # (1: FSDP2 on a mesh of one, DTensors)
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=dp)
            fully_shard(self, mesh=dp)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):  # (under FSDP2 every forward gathers the weights: a collective)
        x, y, _ = batch
        if self.val_delay:
            time.sleep(self.val_delay)
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def consolidated(trainer: L.Trainer, model: MLP) -> dict | None:
    """The full model and optimizer state (every rank must call this; rank 0 gets it, the others None)."""
    opt = trainer.optimizers[0]
    if trainer.strategy.__class__.__name__ == "ModelParallelStrategy":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd = get_model_state_dict(model, options=options)
        osd = get_optimizer_state_dict(model, opt, options=options)
        state = osd.get("state", {})  # empty on ranks other than 0
    else:
        msd = model.state_dict()
        names = [n for n, _ in model.named_parameters()]
        raw = opt.state_dict()
        ids = [i for g in raw["param_groups"] for i in g["params"]]
        state = {names[ids.index(pid)]: st for pid, st in raw["state"].items()}
    if trainer.global_rank != 0:
        return None
    return {
        "global_step": trainer.global_step,
        "model": {k: v.detach().cpu().clone() for k, v in msd.items()},
        "optimizer": {f"{name}/{k}": v.detach().cpu().clone() for name, st in state.items() for k, v in st.items()},
        "lr": torch.tensor(opt.param_groups[0]["lr"], dtype=torch.float64),
        "rng": torch.get_rng_state(),
        **({"cuda_rng": torch.cuda.get_rng_state()} if torch.cuda.is_initialized() else {}),
    }


class Dump(L.Callback):
    """Write the consolidated state at the given steps (when the snapshot of that step is taken) and/or at the start
    of training (right after a restore)."""

    def __init__(self, steps: set[int], folder: str | None, at_start: str | None) -> None:
        self.steps, self.folder, self.at_start = steps, folder, at_start

    def on_train_start(self, trainer, pl_module):
        if self.at_start:
            state = consolidated(trainer, pl_module)
            if state is not None:
                torch.save(state, self.at_start)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.steps:
            state = consolidated(trainer, pl_module)
            if state is not None:
                torch.save(state, os.path.join(self.folder, f"step-{trainer.global_step}.pt"))


class Record(L.Callback):
    """Record the sample indices of every batch this rank trains on."""

    def __init__(self) -> None:
        self.batches: list[list] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append([trainer.current_epoch, trainer.global_step, batch_idx, batch[2].tolist()])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", choices=["mp", "ddp", "single"], default="mp")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (mp only); data-parallel is devices / tp")
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--crash-at", type=int, default=-1)
    p.add_argument("--resume", default=None, help="a snapshot directory to restore from (default: the newest in --dir)")
    p.add_argument("--dump-steps", default="")
    p.add_argument("--dump-dir", default=None)
    p.add_argument("--dump-at-start", default=None)
    p.add_argument("--chunk-bytes", type=int, default=4096)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--record", default=None)
    p.add_argument("--s3", default=None)
    p.add_argument("--ram", default=None, help="snapshot to a RAM tier of this name instead (one node)")
    p.add_argument("--endpoint", default=None)
    p.add_argument("--also-dir", action="store_true", help="with --s3: also snapshot to a local tier at --dir")
    p.add_argument("--num-nodes", type=int, default=1, help="nodes (each launched outside, --devices ranks each)")
    p.add_argument(
        "--count-reads",
        default=None,
        help="count the bytes read from the data objects under --dir at the OS interface (io_count.py)"
        " and write them to this path + .rank<global rank>",
    )
    p.add_argument("--signal-at", type=int, default=-1, help="SIGTERM at this global step (train.py's SendSignal)")
    p.add_argument("--signal-to", choices=["self", "launcher", "all"], default="launcher")
    p.add_argument("--signal-rank", type=int, default=0)
    p.add_argument("--signal-during", choices=["train", "validation"], default="train")
    p.add_argument("--val-every", type=int, default=0, help="validate every N training batches (0: never)")
    p.add_argument("--val-samples", type=int, default=32)
    p.add_argument("--val-delay", type=float, default=0.0, help="seconds each validation batch sleeps")
    p.add_argument("--sigterm-grace", type=float, default=25.0)
    a = p.parse_args()

    write_reads = None
    if a.count_reads:
        import io_count

        rank = int(os.environ.get("NODE_RANK", "0")) * a.devices + int(os.environ.get("LOCAL_RANK", "0"))
        write_reads = io_count.install(a.dir, f"{a.count_reads}.rank{rank}")
    L.seed_everything(42, verbose=False)
    model = MLP(a.dropout)
    loader = DataLoader(Data(a.samples), batch_size=4, shuffle=True)
    if a.s3:
        options = {
            "key": "testing-key",
            "secret": "testing-secret",
            "client_kwargs": {"endpoint_url": a.endpoint, "region_name": "us-east-1"},
        }
        tiers = [LocalTier(a.dir, every_n_train_steps=a.every, keep_last=2)] if a.also_dir else []
        tiers.append(ObjectStoreTier(a.s3, storage_options=options, every_n_train_steps=a.every, keep_last=2))
    elif a.ram:
        from lightning_snapshot.backends import RamTier

        tiers = [RamTier(every_n_train_steps=a.every, keep_last=2, name=a.ram, idle_timeout=300)]
    else:
        tiers = [LocalTier(a.dir, every_n_train_steps=a.every, keep_last=2)]
    resume = (int(a.resume) if a.resume.isdigit() else a.resume) if a.resume else True
    snapshots = SnapshotCallback(tiers, resume=resume, chunk_bytes=a.chunk_bytes, sigterm_grace=a.sigterm_grace)
    callbacks = [snapshots, Dump({int(s) for s in a.dump_steps.split(",") if s}, a.dump_dir, a.dump_at_start)]
    record = Record()
    if a.record:
        callbacks.append(record)
    if a.crash_at >= 0:
        callbacks.append(Crash(a.crash_at, tiers))
    if a.signal_at >= 0:
        callbacks.append(SendSignal(a.signal_at, a.signal_to, a.signal_rank, a.signal_during, signal.SIGTERM))
    if a.strategy == "mp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=a.devices // a.tp, tensor_parallel_size=a.tp)
    else:
        strategy = "ddp" if a.strategy == "ddp" else "auto"
    model.val_delay = a.val_delay
    val = {}
    if a.val_every:
        val = dict(val_check_interval=a.val_every, num_sanity_val_steps=0)
    trainer = L.Trainer(
        **val,
        accelerator=a.accelerator,
        devices=a.devices if a.strategy != "single" else 1,
        num_nodes=a.num_nodes,
        strategy=strategy,
        max_steps=a.max_steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    val_loader = DataLoader(Data(a.val_samples), batch_size=4) if a.val_every else None
    try:
        trainer.fit(model, loader, val_loader)
    except SystemExit as e:  # (a preemption: report the status each rank exits with)
        os.write(1, f"EXITING status={e.code} rank={trainer.global_rank} at={time.time():.3f}\n".encode())
        raise
    result = consolidated(trainer, model)
    if result is not None:
        torch.save(result, a.out)
    if trainer.global_rank != 0:
        torch.save({"rng": torch.get_rng_state()}, f"{a.out}.rank{trainer.global_rank}")
    if a.record:
        with open(f"{a.record}.rank{trainer.global_rank}", "w") as f:
            json.dump(record.batches, f)
    if snapshots.restored_from is not None:
        st = snapshots.restore_stats or {}
        print(f"RESTORED step={snapshots.restored_from[1]} rank={trainer.global_rank}", flush=True)
        print(
            f"RESTORE_STATS rank={trainer.global_rank} needed={st.get('bytes_needed')}"
            f" planned={st.get('bytes_read')} tier={st.get('tier_bytes_read')}"
            f" resharded={st.get('tensors_resharded')}",
            flush=True,
        )
    if write_reads is not None:
        write_reads()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
