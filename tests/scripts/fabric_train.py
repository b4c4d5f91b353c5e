"""A Lightning Fabric training loop (LitGPT's shape) with FabricSnapshots, used by tests/test_fabric.py.

Usage: python fabric_train.py --tiers URL [URL...] --out RESULT.pt [--epochs 3] [--kill-at STEP] [--kill-rank R]
    [--workers 2] [--shuffle] [--augment] [--dropout 0.1] [--accum 2] [--stateful] [--strategy ddp --devices 2]
    [--signal-at STEP --signal-rank R] [--index-log PATH] [--dump-weights DIR] [--own-sampler] [--mtbf SECONDS]
    [--csv-logs DIR]

Under torchrun (``--strategy ddp --devices 2``) every rank writes RESULT.pt (rank 0) or RESULT.pt.rank<R>. The result
holds everything a resume must give back: weights, optimizer, scheduler, the values of ``state`` (with every step's
loss and a checksum of every batch trained on), and the RNG of torch, numpy and python at the end.

``--index-log PATH``: each rank appends one line per batch to ``PATH.rank<R>`` as it trains on it: ``epoch step
i0 i1 ...`` (the optimizer step the batch counts toward, the dataset indices in it). ``--dump-weights DIR``: rank 0
writes the result (as ``--out`` holds it) after each optimizer step to ``DIR/step-<N>.pt``, and right after
``resume`` to ``DIR/resumed.pt``. ``--own-sampler``: the train loader is a plain ``DataLoader`` with the script's own
``DistributedSampler`` (not set up by Fabric); the loop calls ``set_epoch`` itself.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time

import lightning as L
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_snapshot.fabric import FabricSnapshots


class Squares(Dataset):
    """Regression samples; with ``augment`` each sample adds noise from torch, numpy and python ``random``."""

    def __init__(self, n: int, augment: bool, with_index: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randn(n, 1, generator=g)
        self.augment = augment
        self.with_index = with_index

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i]
        if self.augment:
            x = x + 0.1 * torch.randn(8) + float(np.random.uniform(-0.1, 0.1)) + random.uniform(-0.1, 0.1)
        return (x, self.y[i], i) if self.with_index else (x, self.y[i])


def result(model, optimizer, scheduler, state) -> dict:
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "values": {k: state[k] for k in ("step", "epoch", "iter_num", "losses", "batches")},
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": torch.from_numpy(np.random.get_state()[1].astype(np.int64)),
        "python_rng": torch.tensor(random.getstate()[1], dtype=torch.int64),
    }


def fabric_inner(model: nn.Module) -> nn.Module:
    """The user's module inside Fabric's wrapper."""
    return getattr(model, "_original_module", model)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiers", nargs="*", default=[])
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--shuffle", action="store_true")
    p.add_argument("--augment", action="store_true")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--stateful", action="store_true", help="torchdata's StatefulDataLoader")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL right after this optimizer step")
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--signal-at", type=int, default=None, help="SIGTERM to one rank after this step")
    p.add_argument("--signal-rank", type=int, default=1)
    p.add_argument("--signal-launcher", action="store_true", help="--signal-at sends SIGTERM to the parent (torchrun)")
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--s3", default=None, help="also snapshot to this s3:// URL (moto at --endpoint)")
    p.add_argument("--endpoint", default=None)
    p.add_argument("--s3-every", type=int, default=3)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step lasts longer (slow tiers keep up)")
    p.add_argument("--index-log", default=None, help="each rank logs the dataset indices of every batch it trains on")
    p.add_argument("--dump-weights", default=None, help="rank 0 writes the result after each step and after resume")
    p.add_argument("--own-sampler", action="store_true", help="a plain DataLoader with its own DistributedSampler")
    p.add_argument("--mtbf", default=None, help="FabricSnapshots(mtbf=...), for every=auto tiers")
    p.add_argument("--csv-logs", default=None, help="a CSVLogger in this directory, given to Fabric")
    p.add_argument("--signal", default="SIGTERM", help="the signal --signal-at and --slow-at send")
    p.add_argument("--slow-at", type=int, default=None, help="the signal comes inside this step, which then lasts")
    p.add_argument("--slow-seconds", type=float, default=0.0, help="... this many seconds longer (before its step)")
    p.add_argument("--sigterm-grace", type=float, default=None)
    p.add_argument("--perturb-at", type=int, default=None, help="rank 1 changes one weight by 1 ulp after this step")
    p.add_argument("--replica-check", type=int, default=None)
    p.add_argument("--on-replica-mismatch", default=None)
    args = p.parse_args()
    sent = getattr(signal, args.signal)

    loggers = None
    if args.csv_logs:
        from lightning.fabric.loggers import CSVLogger

        loggers = CSVLogger(args.csv_logs, name="run")
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=args.strategy, loggers=loggers)
    fabric.launch()
    fabric.seed_everything(1234)
    rank = fabric.global_rank

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(args.dropout), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    dataset = Squares(args.samples, args.augment, with_index=args.index_log is not None)
    own_sampler = None
    if args.own_sampler:
        from torch.utils.data import DistributedSampler

        own_sampler = DistributedSampler(
            dataset, num_replicas=fabric.world_size, rank=fabric.global_rank, shuffle=args.shuffle
        )
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=own_sampler, num_workers=args.workers)
    elif args.stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(dataset, batch_size=args.batch_size, shuffle=args.shuffle, num_workers=args.workers)
    else:
        loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=args.shuffle, num_workers=args.workers)
    if own_sampler is None:
        loader = fabric.setup_dataloaders(loader)

    state = {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "train_dataloader": loader,
        "step": 0,
        "epoch": 0,
        "iter_num": 0,
        "losses": [],
        "batches": [],
    }
    tiers: list = list(args.tiers)
    if args.s3:
        from lightning_snapshot.backends import ObjectStoreTier

        options = {
            "key": "testing-key",
            "secret": "testing-secret",
            "client_kwargs": {"endpoint_url": args.endpoint, "region_name": "us-east-1"},
        }
        tiers.append(ObjectStoreTier(args.s3, storage_options=options, every_n_train_steps=args.s3_every))
    options = {"mtbf": args.mtbf} if args.mtbf is not None else {}
    for name in ("sigterm_grace", "replica_check", "on_replica_mismatch"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    snapshots = FabricSnapshots(fabric, tiers, resume=not args.no_resume, **options)
    index_log = open(f"{args.index_log}.rank{rank}", "a", buffering=1) if args.index_log else None  # noqa: SIM115
    with snapshots:
        restored = snapshots.resume(state)
        if restored is not None:
            print(f"RESTORED step={restored} from={snapshots.restored_from[0]} rank={rank}", flush=True)
        if args.dump_weights and rank == 0:
            os.makedirs(args.dump_weights, exist_ok=True)
            torch.save(result(model, optimizer, scheduler, state), os.path.join(args.dump_weights, "resumed.pt"))
        for epoch in range(state["epoch"], args.epochs):
            if own_sampler is not None:
                own_sampler.set_epoch(epoch)
            for batch in loader:
                x, y = batch[0], batch[1]
                if index_log is not None:
                    index_log.write(f"{epoch} {state['step'] + 1} {' '.join(str(int(i)) for i in batch[2])}\n")
                state["iter_num"] += 1
                state["batches"].append(float(x.double().sum()))
                loss = nn.functional.mse_loss(model(x), y)
                fabric.backward(loss / args.accum)
                if state["iter_num"] % args.accum:
                    continue
                step = state["step"] + 1
                if args.slow_at == step and rank == args.signal_rank:
                    os.kill(os.getpid(), sent)  # (a step longer than the grace: the watchdog's case)
                    time.sleep(args.slow_seconds)
                optimizer.step()
                if args.kill_at == step and rank == args.kill_rank:
                    os.kill(os.getpid(), signal.SIGKILL)  # (after the optimizer step, before the step is counted)
                optimizer.zero_grad()
                if args.perturb_at == step and rank == 1:
                    with torch.no_grad():  # (one replica of the last layer's first weight, by the smallest step)
                        w = fabric_inner(model)[3].weight.view(-1)
                        w[0] = torch.nextafter(w[0], w[0] + 1)
                scheduler.step()
                state["step"] = step
                time.sleep(args.step_sleep)
                state["losses"].append(float(loss.detach()))
                if args.dump_weights and rank == 0:
                    dump = os.path.join(args.dump_weights, f"step-{step}.pt")
                    torch.save(result(model, optimizer, scheduler, state), dump)
                if args.signal_at == step and rank == args.signal_rank:
                    os.kill(os.getppid() if args.signal_launcher else os.getpid(), sent)
                snapshots.step(state)
            state["epoch"] = epoch + 1
    if loggers is not None:
        fabric.logger.finalize("success")
    out = args.out if rank == 0 else f"{args.out}.rank{rank}"
    torch.save(result(model, optimizer, scheduler, state), out)
    print(f"DONE step={state['step']} rank={rank}", flush=True)
    if fabric.world_size > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:
        print(f"EXITING status={e.code} rank={os.environ.get('RANK', '0')}", flush=True)
        sys.stdout.flush()
        raise
