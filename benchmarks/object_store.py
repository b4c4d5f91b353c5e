"""Object-store tier benchmark against a local S3-protocol server (moto, in its own process, on 127.0.0.1).

    python benchmarks/object_store.py            # ~1.5 GB snapshot
    python benchmarks/object_store.py --quick    # ~200 MB, under 2 minutes

Measures, in one run against the same server:

1. Upload throughput of a snapshot through ``ObjectStoreTier`` (staged in the arena, written by ``write_snapshot``:
   concurrent multipart from the staging buffer, manifest last) against a plain ``s3fs`` ``put_file`` of the same
   bytes from a local file, alternating, ``--repeats`` times each. Target: >= 0.8x.
2. Blocking stall per snapshot of a training run with the object-store tier added to the RAM tier, against the RAM
   tier alone (``RamTier``, node-local copy, with its snapshot agent; with a RAM tier the agent does the uploads, in
   its own process). Target: <= 1.1x.

Methods:

{methods}

Network traffic goes only to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # the harness and the library

import _harness as harness  # noqa: E402

from lightning_snapshot.backends import ObjectStoreTier, RamTier  # noqa: E402
from lightning_snapshot.backends.base import Backend  # noqa: E402
from lightning_snapshot.dist.comm import LocalComm  # noqa: E402
from lightning_snapshot.persist.writer import SnapshotJob, write_snapshot  # noqa: E402
from lightning_snapshot.staging import stage  # noqa: E402
from lightning_snapshot.staging.arena import HostArena  # noqa: E402

KEY, SECRET = "bench-key", "bench-secret"
UPLOAD_TARGET = 0.8  # ours / s3fs, at least
STALL_TARGET = 1.1  # RAM tier + object store / RAM tier only, at most


def start_server() -> tuple[subprocess.Popen, str]:
    port = harness.free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, endpoint
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start")


def options(endpoint: str) -> dict:
    return {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def state_of(nbytes: int) -> dict[str, torch.Tensor]:
    n = nbytes // 4 // 16
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(16)}


# ================================================================================================ 1. upload
@dataclass
class Upload:
    """What both upload methods need: the server, the staged snapshot and the same bytes in a local file."""

    endpoint: str
    fs: Any
    staged: Any
    file: str


def upload_ours(ctx: Upload, r: int) -> None:
    tier = ObjectStoreTier(f"s3://bench/ours-{r}", storage_options=options(ctx.endpoint))
    write_snapshot(tier, LocalComm(), SnapshotJob(1, 0, ctx.staged.state, stage({}, "rank")), "bench")


def upload_s3fs(ctx: Upload, r: int) -> None:
    ctx.fs.put_file(ctx.file, f"bench/plain-{r}/object.bin")


def upload_throughput(endpoint: str, nbytes: int, repeats: int) -> tuple[dict[str, float], int]:
    """Median MB/s of each upload method (alternating, ``repeats`` times each) and the snapshot's bytes."""
    import s3fs

    fs = s3fs.S3FileSystem(**options(endpoint))
    fs.call_s3("create_bucket", Bucket="bench")
    state = state_of(nbytes)
    arena = HostArena()
    rates: dict[str, list[float]] = {m: [] for m in UPLOADS.names}
    try:
        staged = arena.stage_async(state, lambda t: True, step=1)
        staged.wait()
        total = staged.state.nbytes
        with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR", "/tmp")) as f:
            f.write(staged.state.packed[:total])
            f.flush()
            ctx = Upload(endpoint, fs, staged, f.name)
            for r in range(repeats):
                for name in UPLOADS.names:
                    _, seconds = harness.timed(lambda name=name, r=r: UPLOADS.run(name, ctx, r))
                    rates[name].append(total / seconds / 1e6)
    finally:
        arena.close()
    return {m: statistics.median(v) for m, v in rates.items()}, total


UPLOADS = harness.Methods()
UPLOADS.add(
    "ObjectStoreTier",
    upload_ours,
    "lightning-snapshot ``ObjectStoreTier``: ``write_snapshot`` of the arena-staged snapshot (concurrent"
    " multipart from the staging buffer, manifest last)",
)
UPLOADS.add("s3fs put_file", upload_s3fs, "plain ``s3fs`` ``put_file`` of the same bytes from a local file")


# ================================================================================================ 2. training stall
def tiers_ram(endpoint: str, every: int, shm: str) -> list[Backend]:
    return [RamTier(every_n_train_steps=every, keep_last=1, name="bench", shm_dir=shm)]


def tiers_ram_s3(endpoint: str, every: int, shm: str) -> list[Backend]:
    return tiers_ram(endpoint, every, shm) + [
        ObjectStoreTier(
            "s3://bench-train/run", storage_options=options(endpoint), every_n_train_steps=every, keep_last=1
        )
    ]


TRAININGS = harness.Methods(baseline="RAM tier only")
TRAININGS.add("RAM tier only", tiers_ram, "``RamTier`` (node-local copy, with its snapshot agent): the baseline")
TRAININGS.add(
    "RAM tier + object store",
    tiers_ram_s3,
    "the same plus ``ObjectStoreTier`` on moto (the agent uploads, in its own process)",
)


def training_stall(
    endpoint: str, steps: int, every: int, width: int, server: int
) -> dict[str, tuple[float, harness.Noise]]:
    """Median ``snapshot/stall_ms`` and the noise of a training run with each tier set (the CPU of the ``server``
    process counts as the benchmark's own; that of the RAM tier's agent as another process's)."""
    import lightning as L
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_snapshot import SnapshotCallback

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    import s3fs

    s3fs.S3FileSystem(**options(endpoint)).call_s3("create_bucket", Bucket="bench-train")
    from lightning_snapshot.agent import stop_agent

    results = {}
    shm = tempfile.mkdtemp(prefix="bench-ram-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        for name in TRAININGS.names:
            tiers = TRAININGS.run(name, endpoint, every, shm)
            rec = harness.memory_logger()
            L.seed_everything(0, verbose=False)
            trainer = L.Trainer(
                accelerator="cpu",
                max_steps=steps,
                callbacks=[SnapshotCallback(tiers, resume=False)],
                logger=rec,
                log_every_n_steps=1,
                enable_progress_bar=False,
                enable_model_summary=False,
            )
            with harness.NoiseMeter(pids=[server]) as meter:
                trainer.fit(Model(), DataLoader(TensorDataset(torch.randn(64 * steps, width)), batch_size=64))
            results[name] = (statistics.median(rec.values("snapshot/stall_ms")), meter.noise)
    finally:
        stop_agent(os.path.join(shm, "bench"))
        shutil.rmtree(shm, ignore_errors=True)
    return results


# ================================================================================================ main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="~200 MB and a short training run (under 2 minutes)")
    p.add_argument("--bytes", type=int, default=None, help="snapshot size for the upload test")
    p.add_argument("--repeats", type=int, default=None)
    harness.add_arguments(p)
    args = p.parse_args(argv)
    nbytes = args.bytes or ((200 << 20) if args.quick else (1500 << 20))
    repeats = args.repeats or (2 if args.quick else 3)
    steps, width = (30, 1024) if args.quick else (60, 2048)
    out = harness.Report("object-store", args)
    out.header(bytes=nbytes, repeats=repeats, steps=steps, every=5, width=width)
    proc, endpoint = start_server()
    try:
        with harness.NoiseMeter(pids=[proc.pid]) as meter:  # (moto's CPU is the benchmark's own)
            rates, total = upload_throughput(endpoint, nbytes, repeats)
        stalls = training_stall(endpoint, steps=steps, every=5, width=width, server=proc.pid)
    finally:
        proc.terminate()
        proc.wait()

    ours, plain = rates["ObjectStoreTier"], rates["s3fs put_file"]
    noise = meter.noise
    table = harness.Table(
        f"Upload of a {total / 1e9:.2f} GB snapshot to moto on 127.0.0.1 (median of {repeats};"
        f" other processes used {noise.share:.0%} of the CPUs)",
        ["method", "MB/s", "ratio"],
        key="upload",
        notes=[flag for flag in [noise.flag()] if flag],
    )
    table.add(
        "lightning-snapshot ObjectStoreTier",
        f"{ours:.1f}",
        f"{1.0:.2f}",
        data={"method": "ObjectStoreTier", "MBps": ours, "ratio": 1.0},
    )
    table.add(
        "s3fs put_file (same bytes, same server)",
        f"{plain:.1f}",
        f"{plain / ours:.2f}",
        data={"method": "s3fs put_file", "MBps": plain, "ratio": plain / ours},
    )
    out.table(table)

    base = stalls[TRAININGS.baseline][0]
    table = harness.Table(
        "Median blocking stall per snapshot (training thread)",
        ["tiers", "stall ms", "x RAM only", "noise"],
        key="stall",
    )
    for name, (v, n) in stalls.items():
        table.add(
            name,
            f"{v:.2f}",
            f"{v / base:.2f}x",
            f"{n.share:.0%}",
            data={"tiers": name, "stall_ms": v, "ratio": v / base, "noise": n.share, "unreliable": n.unreliable},
        )
        if n.flag():
            table.notes.append(f"{name}: {n.flag()}")
    out.table(table)

    up = ours / plain
    out.targets.check(up >= UPLOAD_TARGET, f"ours / s3fs = {up:.2f}x >= {UPLOAD_TARGET}x", up, UPLOAD_TARGET)
    st = stalls["RAM tier + object store"][0] / base
    out.targets.check(
        st <= STALL_TARGET, f"object store / RAM tier only = {st:.2f}x <= {STALL_TARGET}x", st, STALL_TARGET
    )
    return out.finish(upload_MBps=rates, stall_ms={k: v for k, (v, _) in stalls.items()})


__doc__ = UPLOADS.document(__doc__, TRAININGS)

if __name__ == "__main__":
    sys.exit(main())
