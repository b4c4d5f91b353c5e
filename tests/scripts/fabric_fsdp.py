"""FSDP2 (Fabric's ModelParallelStrategy, ``fully_shard`` per layer) with FabricSnapshots, and the load of its
snapshots into another strategy or world size; used by tests/test_fabric.py.

Usage (under torchrun for --strategy fsdp/ddp with --devices 2):
    python fabric_fsdp.py --dir SNAPDIR --out FULL.pt --strategy fsdp --devices 2 --until 6 [--kill-at 5]
        trains to step 6 (snapshots every 3 and at the end), then writes the full (gathered) weights and optimizer state
        by parameter name to FULL.pt (rank 0)
    python fabric_fsdp.py --dir SNAPDIR --out LOADED.pt --strategy single|ddp|fsdp [--devices N] --until 6
        resumes from the newest snapshot in SNAPDIR (step 6: no training) and writes what it holds the same way
"""

from __future__ import annotations

import argparse
import os
import signal

import lightning as L
import torch
from torch import nn

from lightning_snapshot.fabric import FabricSnapshots


def parallelize(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    dp = mesh["data_parallel"]
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def tensor_parallel(model: nn.Module, mesh) -> nn.Module:
    """Megatron-style: the first Linear split by its outputs, the second by its inputs; the last one replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(model, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Weights and each parameter's optimizer state, gathered, by parameter name (collective under FSDP2)."""

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    inner = getattr(model, "module", model)  # (Fabric's wrapper: the names of the module itself)
    names = [n for n, _ in inner.named_parameters()]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    by_param = {id(p): n for n, p in inner.named_parameters()}
    assert [by_param[id(p)] for p in params] == names
    opt = {}
    for p in params:
        st = optimizer.state.get(p, {})
        opt[by_param[id(p)]] = {k: full(v).detach().clone().cpu() for k, v in st.items()}
    # each optimizer state tensor (but AdamW's step count) laid out as its parameter: a DTensor shard under FSDP2
    layouts = [
        hasattr(v, "placements") == hasattr(p, "placements")
        and getattr(v, "placements", None) == getattr(p, "placements", None)
        for p in params
        for k, v in optimizer.state.get(p, {}).items()
        if k != "step"
    ]
    return {
        "layouts_match": all(layouts) and len(layouts) > 0,
        "model": {k: full(v).detach().clone().cpu() for k, v in model.state_dict().items()},
        "optimizer": opt,
        "lr": [g["lr"] for g in optimizer.param_groups],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", default="single", choices=["single", "ddp", "fsdp", "tp"])
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--until", type=int, default=6, help="train until this step (a resumed run: from its step)")
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL rank 1 (or the only rank) after this step")
    args = p.parse_args()

    if args.strategy == "fsdp":
        from lightning.fabric.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(parallelize, data_parallel_size=args.devices, tensor_parallel_size=1)
    elif args.strategy == "tp":
        from lightning.fabric.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(tensor_parallel, data_parallel_size=1, tensor_parallel_size=args.devices)
    else:
        strategy = "ddp" if args.strategy == "ddp" else "auto"
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(7)
    with fabric.init_module(empty_init=False):
        model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 6), nn.ReLU(), nn.Linear(6, 1))
    model = fabric.setup(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)  # (DTensors beside plain tensors: tp)
    optimizer = fabric.setup_optimizers(optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    with FabricSnapshots(fabric, f"{args.dir}?every=3") as snapshots:
        restored = snapshots.resume(state)
        if restored is not None:
            print(f"RESTORED step={restored} from={snapshots.restored_from[0]} rank={fabric.global_rank}", flush=True)
        while state["step"] < args.until:
            # (each step's data is a function of the step and the rank: a resumed run trains on the same)
            data_rank = 0 if args.strategy == "tp" else fabric.global_rank  # (tensor parallel: every rank the same)
            g = torch.Generator().manual_seed(1000 * data_rank + state["step"])
            x, y = torch.randn(4, 12, generator=g), torch.randn(4, 1, generator=g)
            fabric.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            state["step"] += 1
            if state["step"] == args.kill_at and fabric.global_rank == fabric.world_size - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            snapshots.step(state)
    result = full_state(model, optimizer)
    result["step"] = state["step"]
    if fabric.global_rank == 0:
        torch.save(result, args.out)
    print(f"DONE step={state['step']} rank={fabric.global_rank}", flush=True)
    if fabric.world_size > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
