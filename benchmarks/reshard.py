"""Resharded load benchmark: lightning-snapshot against torch.distributed.checkpoint (DCP), in one run.

    python benchmarks/reshard.py            # 8 layers of 2048 x 2048: ~400 MB of weights + AdamW state
    python benchmarks/reshard.py --quick    # 4 layers of 1024 x 1024: ~50 MB, under 2 minutes

1. ``save``: a Lightning run under ``ModelParallelStrategy`` (FSDP2 ``fully_shard``) on 2 processes (gloo, CPU)
   trains 2 steps with a ``SnapshotCallback`` (local tier) and then saves the very same model and optimizer state
   with ``torch.distributed.checkpoint.save`` (sharded, as Lightning's own ModelParallel checkpoints are).
2. ``load``: for each target layout (FSDP2 on 2 processes: the same topology; FSDP2 on 4 processes and one plain
   process: resharded), fresh processes build the model and optimizer in that layout and fill their state in place,
   timed from a barrier to a barrier (the slowest rank), with each method below. Alternating, ``--reps`` times
   each, with a warm page cache and with the timed method's files evicted from it first
   (``posix_fadvise(DONTNEED)``: a cold read from the disk). Both results are compared bitwise.

{methods}

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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # the harness and the library

import _harness as harness  # noqa: E402

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
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=STEP,
        callbacks=[snapshots, DcpSave()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
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


class Loader:
    """What one rank's loads need: the options, the targets of both methods and the counters of ours."""

    def __init__(self, args: argparse.Namespace, ours_t: dict, dcp_sd: dict) -> None:
        from lightning_snapshot.restore.loader import ReadStats

        self.args, self.ours_t, self.dcp_sd = args, ours_t, dcp_sd
        self.stats = ReadStats()
        self.counted = 0


def load_ours(ctx: Loader) -> None:
    from lightning_snapshot.backends import LocalTier
    from lightning_snapshot.restore.loader import ReadStats, read_manifest, read_section

    backend = LocalTier(ctx.args.snap)
    manifest = read_manifest(backend, STEP)
    st = ReadStats()
    read_section(backend, manifest, manifest.tensors, manifest.state, targets=ctx.ours_t, stats=st)
    ctx.stats.bytes_needed, ctx.stats.bytes_read = st.bytes_needed, st.bytes_read
    ctx.counted = backend.bytes_read


def load_dcp(ctx: Loader) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(ctx.dcp_sd, checkpoint_id=ctx.args.dcp)


METHODS = harness.Methods()
METHODS.add(
    "ours",
    load_ours,
    "lightning-snapshot: each rank reads its boxes (``read_manifest`` + ``read_section`` with the DTensors as"
    " targets, as the callback's restore does, every chunk read verified by its checksum)",
)
METHODS.add("dcp", load_dcp, "``dcp.load`` on a state dict of the same DTensors")
__doc__ = METHODS.document(__doc__)


def worker(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)

    def barrier() -> None:
        if world > 1:
            dist.barrier()

    ours_t, dcp_sd = templates(args, world)
    ours_t, dcp_sd = clone(ours_t), clone(dcp_sd)  # separate storage: the two loads never alias
    ctx = Loader(args, ours_t, dcp_sd)
    times: dict[str, list[float]] = {f"{m}_{mode}": [] for mode in ("warm", "cold") for m in METHODS.names}
    for name in METHODS.names:  # warm-up (imports, page cache)
        METHODS.run(name, ctx)
    for rep in range(args.reps):
        order = METHODS.names if rep % 2 == 0 else METHODS.names[::-1]
        for mode in ("cold", "warm"):
            for name in order:
                if mode == "cold" and rank == 0:
                    # only this method's files: evicting the other's too would make its next "warm" read cold
                    harness.evict(args.snap if name == "ours" else args.dcp)
                barrier()
                t0 = time.perf_counter()
                METHODS.run(name, ctx)
                barrier()
                times[f"{name}_{mode}"].append(time.perf_counter() - t0)
    # both filled the same tensors of this layout: bitwise equal?
    same = True
    for n, st in dcp_sd["optim"]["state"].items():
        for k, v in st.items():
            same &= torch.equal(local(v), local(ours_t[f"optimizer_states/0/state/{n}/{k}"]))
    for k, v in dcp_sd["model"].items():
        same &= torch.equal(local(v), local(ours_t[f"state_dict/{k}"]))
    result = {"rank": rank, "times": times, "needed": ctx.stats.bytes_needed, "read": ctx.counted, "same": bool(same)}
    gathered = [result]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        Path(args.result).write_text(json.dumps(gathered))


def load(args: argparse.Namespace) -> None:
    port = harness.free_port()
    if args.world == 1:
        worker(0, 1, args, port)
    else:
        torch.multiprocessing.spawn(worker, args=(args.world, args, port), nprocs=args.world, join=True)


# ------------------------------------------------------------------------------------------------ driver


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", default="run", choices=["run", "save", "load"])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument(
        "--chunk-bytes",
        type=int,
        default=1 << 20,
        help="SnapshotCallback(chunk_bytes=...): checksum chunk, the unit of a partial read (default 1 MiB)",
    )
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--snap")
    p.add_argument("--dcp")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--result")
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed at the end)")
    harness.add_arguments(p, markdown=True)
    args = p.parse_args(argv)
    size = QUICK if args.quick else FULL
    args.layers = args.layers or size["layers"]
    args.width = args.width or size["width"]
    args.reps = args.reps or (3 if args.quick else 5)
    if args.command == "save":
        save(args)
        return 0
    if args.command == "load":
        load(args)
        return 0

    tmp = tempfile.TemporaryDirectory(prefix="reshard-bench-", dir=args.dir)
    try:
        return run(args, Path(tmp.name))
    finally:
        tmp.cleanup()


LAYOUTS = (
    (2, "FSDP2(2) -> FSDP2(2), same topology"),
    (4, "FSDP2(2) -> FSDP2(4), resharded"),
    (1, "FSDP2(2) -> 1 process, resharded"),
)
COLUMNS = [
    "load",
    "ours warm",
    "DCP warm",
    "ours/DCP",
    "ours cold",
    "DCP cold",
    "ours/DCP",
    "ours vs same topology (warm, cold)",
    "read/needed (max rank)",
    "bitwise equal",
]


def run(args: argparse.Namespace, root: Path) -> int:
    """Save once, load in every layout (fresh processes), print the table and the targets."""
    common = [
        "--layers",
        str(args.layers),
        "--width",
        str(args.width),
        "--chunk-bytes",
        str(args.chunk_bytes),
        "--reps",
        str(args.reps),
        "--snap",
        str(root / "snap"),
        "--dcp",
        str(root / "dcp"),
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    params = args.layers * (args.width * args.width + args.width)
    out = harness.Report("reshard", args)
    out.header(
        model=f"{args.layers} x Linear({args.width}, {args.width}), {params / 1e6:.1f}M parameters,"
        f" {params * 12 / 1e6:.0f} MB of weights + AdamW state",
        chunk=f"{args.chunk_bytes >> 10} KiB",
        reps=args.reps,
    )
    t0 = time.monotonic()
    subprocess.run(
        [sys.executable, os.path.abspath(__file__), "save", *common], check=True, env=env, stdout=subprocess.DEVNULL
    )
    out.say(f"saved by Lightning ModelParallel(2) (snapshot) and dcp.save in {time.monotonic() - t0:.1f} s")
    rows = {}
    for world, label in LAYOUTS:
        result = root / f"result-{world}.json"
        with harness.NoiseMeter() as meter:
            subprocess.run(
                [
                    sys.executable,
                    os.path.abspath(__file__),
                    "load",
                    *common,
                    "--world",
                    str(world),
                    "--result",
                    str(result),
                ],
                check=True,
                env=env,
            )
        rows[world] = (label, json.loads(result.read_text()), meter.noise)
    # every rank measured between the same barriers: rank 0's figures are the slowest rank's
    med = {
        world: {k: statistics.median(v) for k, v in ranks[0]["times"].items()} for world, (_, ranks, _) in rows.items()
    }
    table = harness.Table(f"Load (seconds, median of {args.reps})", COLUMNS, key="load")
    for world, (label, ranks, noise) in rows.items():
        m = med[world]
        amp = max(r["read"] / r["needed"] for r in ranks if r["needed"])
        vs = (
            "1.00x, 1.00x"
            if world == 2
            else (f"{m['ours_warm'] / med[2]['ours_warm']:.2f}x, {m['ours_cold'] / med[2]['ours_cold']:.2f}x")
        )
        same = all(r["same"] for r in ranks)
        table.add(
            label,
            f"{m['ours_warm']:.3f} s",
            f"{m['dcp_warm']:.3f} s",
            f"{m['ours_warm'] / m['dcp_warm']:.2f}x",
            f"{m['ours_cold']:.3f} s",
            f"{m['dcp_cold']:.3f} s",
            f"{m['ours_cold'] / m['dcp_cold']:.2f}x",
            vs,
            f"{amp:.3f}",
            "yes" if same else "NO",
            data={
                "load": label,
                "world": world,
                **{f"{k}_s": v for k, v in m.items()},
                "read_over_needed": amp,
                "bitwise_equal": same,
                "noise": noise.share,
                "unreliable": noise.unreliable,
            },
        )
        if noise.flag():
            table.notes.append(f"{label}: {noise.flag()}")
        if world != 2:
            for mode in ("warm", "cold"):
                r = m[f"ours_{mode}"] / m[f"dcp_{mode}"]
                out.targets.check(r <= 1.0, f"{label}, {mode}: ours {r:.2f}x DCP's load <= 1.0x", r, 1.0)
        out.targets.check(same, f"{label}: ours and DCP loaded bitwise equal state")
    out.table(table)
    return out.finish(results={str(w): ranks for w, (_, ranks, _) in rows.items()})


if __name__ == "__main__":
    sys.exit(main())
