"""Resharded load benchmark: lightning-snapshot against torch.distributed.checkpoint (DCP), in one run.

    python benchmarks/reshard.py            # 8 layers of 2048 x 2048: ~400 MB of weights + AdamW state
    python benchmarks/reshard.py --quick    # 4 layers of 1024 x 1024: ~50 MB, under 2 minutes

1. ``save``: a Lightning run under ``ModelParallelStrategy`` (FSDP2 ``fully_shard``) on 2 processes (gloo, CPU)
   trains 2 steps with a ``SnapshotCallback`` (local tier) and then saves the very same model and optimizer state
   with ``torch.distributed.checkpoint.save`` (sharded, as Lightning's own ModelParallel checkpoints are).
2. ``load``: for each target layout (FSDP2 on 2 processes: the same topology; FSDP2 on 4 processes and one plain
   process: resharded), fresh processes build the model and optimizer in that layout and fill their state in place,
   timed from a barrier to a barrier (the slowest rank): lightning-snapshot reads each rank's boxes
   (``read_manifest`` + ``read_section`` with the DTensors as targets, as the callback's restore does, every chunk
   read verified by its checksum), DCP runs ``dcp.load`` on a state dict of the same DTensors. Alternating, ``--reps``
   times each, with a warm page cache and with the timed method's files evicted from it first
   (``posix_fadvise(DONTNEED)``: a cold read from the disk). Both results are compared bitwise.

Prints a table with the ratios: ours / DCP for the same load, and our resharded load / our same-topology load.
Target: our resharded load <= 1.0x DCP's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

STEP = 2
QUICK = {"layers": 4, "width": 1024}
FULL = {"layers": 8, "width": 2048}


class Net(nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        mods: list[nn.Module] = []
        for _ in range(layers):
            mods += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def shard(model: nn.Module, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


# ------------------------------------------------------------------------------------------------ save (Lightning)


def save(args: argparse.Namespace) -> None:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_snapshot import SnapshotCallback
    from lightning_snapshot.backends import LocalTier

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net(args.layers, args.width).net  # parameter names net.0.weight, ... as in Net

        def configure_model(self) -> None:
            shard(self, self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.net(x).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class DcpSave(L.Callback):
        def on_train_end(self, trainer, pl_module):
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

            msd = get_model_state_dict(pl_module)
            osd = get_optimizer_state_dict(pl_module, trainer.optimizers[0])
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=args.dcp)

    L.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(64, args.width))
    snapshots = SnapshotCallback(LocalTier(args.snap, every_n_train_steps=STEP), chunk_bytes=args.chunk_bytes)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEP,
                        callbacks=[snapshots, DcpSave()], logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Module(), DataLoader(data, batch_size=4))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# ------------------------------------------------------------------------------------------------ load


def templates(args: argparse.Namespace, world: int) -> tuple[dict, dict]:
    """(our targets by snapshot entry name, DCP's state dict) over the same tensors of this rank's layout."""
    model = Net(args.layers, args.width)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        shard(model, init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # creates the optimizer state (zeros) to be overwritten
    names = {id(p): n for n, p in model.named_parameters()}
    model_sd = {k: v for k, v in model.state_dict().items()}
    optim_sd = {names[id(p)]: st for p, st in opt.state.items()}
    ours = {f"state_dict/{k}": v for k, v in model_sd.items()}
    ours.update({f"optimizer_states/0/state/{n}/{k}": v for n, st in optim_sd.items() for k, v in st.items()})
    return ours, {"model": model_sd, "optim": {"state": optim_sd}}


def clone(obj):
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    return obj.detach().clone()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def evict(folders: list[str]) -> None:
    for folder in folders:
        for path in Path(folder).rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)  # dirty pages are not dropped
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def worker(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from lightning_snapshot.backends import LocalTier
    from lightning_snapshot.loader import ReadStats, read_manifest, read_section

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)

    def barrier() -> None:
        if world > 1:
            dist.barrier()

    ours_t, dcp_sd = templates(args, world)
    ours_t, dcp_sd = clone(ours_t), clone(dcp_sd)  # separate storage: the two loads never alias
    stats = ReadStats()
    counted = [0]

    def load_ours() -> None:
        backend = LocalTier(args.snap)
        manifest = read_manifest(backend, STEP)
        st = ReadStats()
        read_section(backend, manifest, manifest.tensors, manifest.state, targets=ours_t, stats=st)
        stats.bytes_needed, stats.bytes_read = st.bytes_needed, st.bytes_read
        counted[0] = backend.bytes_read

    def load_dcp() -> None:
        dcp.load(dcp_sd, checkpoint_id=args.dcp)

    times: dict[str, list[float]] = {"ours_warm": [], "dcp_warm": [], "ours_cold": [], "dcp_cold": []}
    methods = {"ours": load_ours, "dcp": load_dcp}
    load_ours(), load_dcp()  # warm-up (imports, page cache)
    for rep in range(args.reps):
        order = ["ours", "dcp"] if rep % 2 == 0 else ["dcp", "ours"]
        for mode in ("cold", "warm"):
            for name in order:
                if mode == "cold" and rank == 0:
                    # only this method's files: evicting the other's too would make its next "warm" read cold
                    evict([args.snap if name == "ours" else args.dcp])
                barrier()
                t0 = time.perf_counter()
                methods[name]()
                barrier()
                times[f"{name}_{mode}"].append(time.perf_counter() - t0)
    # both filled the same tensors of this layout: bitwise equal?
    same = True
    for (n, st) in dcp_sd["optim"]["state"].items():
        for k, v in st.items():
            same &= torch.equal(local(v), local(ours_t[f"optimizer_states/0/state/{n}/{k}"]))
    for k, v in dcp_sd["model"].items():
        same &= torch.equal(local(v), local(ours_t[f"state_dict/{k}"]))
    result = {"rank": rank, "times": times, "needed": stats.bytes_needed, "read": counted[0], "same": bool(same)}
    gathered = [result]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        Path(args.result).write_text(json.dumps(gathered))


def load(args: argparse.Namespace) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if args.world == 1:
        worker(0, 1, args, port)
    else:
        torch.multiprocessing.spawn(worker, args=(args.world, args, port), nprocs=args.world, join=True)


# ------------------------------------------------------------------------------------------------ driver


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", default="run", choices=["run", "save", "load"])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--chunk-bytes", type=int, default=1 << 20,
                   help="SnapshotCallback(chunk_bytes=...): checksum chunk, the unit of a partial read (default 1 MiB)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--snap")
    p.add_argument("--dcp")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--result")
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed at the end)")
    args = p.parse_args()
    size = QUICK if args.quick else FULL
    args.layers = args.layers or size["layers"]
    args.width = args.width or size["width"]
    args.reps = args.reps or (3 if args.quick else 5)
    if args.command == "save":
        return save(args)
    if args.command == "load":
        return load(args)

    tmp = tempfile.TemporaryDirectory(prefix="reshard-bench-", dir=args.dir)
    root = Path(tmp.name)
    common = ["--layers", str(args.layers), "--width", str(args.width), "--chunk-bytes", str(args.chunk_bytes),
              "--reps", str(args.reps), "--snap", str(root / "snap"), "--dcp", str(root / "dcp")]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    params = args.layers * (args.width * args.width + args.width)
    print(f"model: {args.layers} x Linear({args.width}, {args.width}), {params / 1e6:.1f}M parameters,"
          f" {params * 12 / 1e6:.0f} MB of weights + AdamW state; chunk {args.chunk_bytes >> 10} KiB;"
          f" {args.reps} reps; {os.cpu_count()} CPU cores", flush=True)
    t0 = time.monotonic()
    subprocess.run([sys.executable, os.path.abspath(__file__), "save", *common], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    print(f"saved by Lightning ModelParallel(2) (snapshot) and dcp.save in {time.monotonic() - t0:.1f} s", flush=True)
    rows = {}
    for world, label in ((2, "FSDP2(2) -> FSDP2(2), same topology"), (4, "FSDP2(2) -> FSDP2(4), resharded"),
                         (1, "FSDP2(2) -> 1 process, resharded")):
        out = root / f"result-{world}.json"
        subprocess.run([sys.executable, os.path.abspath(__file__), "load", *common, "--world", str(world),
                        "--result", str(out)], check=True, env=env)
        rows[world] = (label, json.loads(out.read_text()))
    med = {}
    for world, (_label, ranks) in rows.items():
        t = ranks[0]["times"]  # every rank measured between the same barriers
        med[world] = {k: statistics.median(v) for k, v in t.items()}
    print()
    print("| load | ours warm | DCP warm | ours/DCP | ours cold | DCP cold | ours/DCP | ours vs same topology"
          " (warm, cold) | read/needed (max rank) | bitwise equal |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for world, (label, ranks) in rows.items():
        m = med[world]
        amp = max(r["read"] / r["needed"] for r in ranks if r["needed"])
        vs = "1.00x, 1.00x" if world == 2 else (f"{m['ours_warm'] / med[2]['ours_warm']:.2f}x,"
                                               f" {m['ours_cold'] / med[2]['ours_cold']:.2f}x")
        print(f"| {label} | {m['ours_warm']:.3f} s | {m['dcp_warm']:.3f} s | {m['ours_warm'] / m['dcp_warm']:.2f}x"
              f" | {m['ours_cold']:.3f} s | {m['dcp_cold']:.3f} s | {m['ours_cold'] / m['dcp_cold']:.2f}x | {vs}"
              f" | {amp:.3f} | {'yes' if all(r['same'] for r in ranks) else 'NO'} |")
    print(f"\n(median of {args.reps}; total {time.monotonic() - t0:.0f} s)")
    tmp.cleanup()


if __name__ == "__main__":
    main()
