"""Object-store tier benchmark against a local S3-protocol server (moto, in its own process, on 127.0.0.1).

    python benchmarks/object_store.py            # ~1.5 GB snapshot
    python benchmarks/object_store.py --quick    # ~200 MB, under 2 minutes

Measures, in one run against the same server:

1. Upload throughput of a snapshot through ``ObjectStoreTier`` (staged in the arena, written by ``write_snapshot``:
   concurrent multipart from the staging buffer, manifest last) against a plain ``s3fs`` ``put_file`` of the same
   bytes from a local file. Target: >= 0.8x.
2. Blocking stall per snapshot of a training run with the object-store tier added to the RAM tier, against the RAM
   tier alone (``RamTier``, node-local copy, with its snapshot agent; with a RAM tier the agent does the uploads, in
   its own process). Target: <= 1.1x.

Network traffic goes only to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lightning_snapshot.staging.arena import HostArena  # noqa: E402
from lightning_snapshot.backends import ObjectStoreTier, RamTier  # noqa: E402
from lightning_snapshot.backends.base import Backend  # noqa: E402
from lightning_snapshot.comm import LocalComm  # noqa: E402
from lightning_snapshot.staging import stage  # noqa: E402
from lightning_snapshot.writer import SnapshotJob, write_snapshot  # noqa: E402

KEY, SECRET = "bench-key", "bench-secret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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


def upload_throughput(endpoint: str, nbytes: int, repeats: int) -> tuple[float, float, int]:
    import s3fs

    fs = s3fs.S3FileSystem(**options(endpoint))
    fs.call_s3("create_bucket", Bucket="bench")
    state = state_of(nbytes)
    arena = HostArena()
    ours, plain = [], []
    try:
        staged = arena.stage_async(state, lambda t: True, step=1)
        staged.wait()
        total = staged.state.nbytes
        with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR", "/tmp")) as f:
            f.write(staged.state.packed[:total])
            f.flush()
            for r in range(repeats):
                tier = ObjectStoreTier(f"s3://bench/ours-{r}", storage_options=options(endpoint))
                t0 = time.perf_counter()
                write_snapshot(tier, LocalComm(), SnapshotJob(1, 0, staged.state, stage({}, "rank")), "bench")
                ours.append(total / (time.perf_counter() - t0) / 1e6)
                t0 = time.perf_counter()
                fs.put_file(f.name, f"bench/plain-{r}/object.bin")
                plain.append(total / (time.perf_counter() - t0) / 1e6)
    finally:
        arena.close()
    return statistics.median(ours), statistics.median(plain), total


def training_stall(endpoint: str, steps: int, every: int, width: int) -> dict[str, float]:
    import lightning as L
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_snapshot import SnapshotCallback

    class Rec(L.pytorch.loggers.Logger):
        name, version = "rec", 0

        def __init__(self):
            super().__init__()
            self.stalls: list[float] = []

        def log_metrics(self, metrics, step=None):
            if "snapshot/stall_ms" in metrics:
                self.stalls.append(metrics["snapshot/stall_ms"])

        def log_hyperparams(self, *a, **k):
            pass

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
    from lightning_snapshot.backends.ram.agent import stop_agent

    results = {}
    shm = tempfile.mkdtemp(prefix="bench-ram-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        for name in ("RAM tier only", "RAM tier + object store"):
            ram = RamTier(every_n_train_steps=every, keep_last=1, name="bench", shm_dir=shm)
            tiers: list[Backend] = [ram]
            if name != "RAM tier only":
                tiers.append(ObjectStoreTier("s3://bench-train/run", storage_options=options(endpoint),
                                             every_n_train_steps=every, keep_last=1))
            rec = Rec()
            L.seed_everything(0, verbose=False)
            trainer = L.Trainer(accelerator="cpu", max_steps=steps, callbacks=[SnapshotCallback(tiers, resume=False)],
                                logger=rec, log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False)
            trainer.fit(Model(), DataLoader(TensorDataset(torch.randn(64 * steps, width)), batch_size=64))
            results[name] = statistics.median(rec.stalls)
    finally:
        stop_agent(os.path.join(shm, "bench"))
        import shutil

        shutil.rmtree(shm, ignore_errors=True)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="~200 MB and a short training run (under 2 minutes)")
    p.add_argument("--bytes", type=int, default=None, help="snapshot size for the upload test")
    p.add_argument("--repeats", type=int, default=None)
    args = p.parse_args()
    nbytes = args.bytes or ((200 << 20) if args.quick else (1500 << 20))
    repeats = args.repeats or (2 if args.quick else 3)
    proc, endpoint = start_server()
    try:
        ours, plain, total = upload_throughput(endpoint, nbytes, repeats)
        stalls = training_stall(endpoint, steps=30 if args.quick else 60, every=5, width=1024 if args.quick else 2048)
    finally:
        proc.terminate()
        proc.wait()
    print(f"\nUpload of a {total / 1e9:.2f} GB snapshot to moto on 127.0.0.1 (median of {repeats})")
    print(f"{'method':<42}{'MB/s':>10}{'ratio':>10}")
    print(f"{'lightning-snapshot ObjectStoreTier':<42}{ours:>10.1f}{1.0:>10.2f}")
    print(f"{'s3fs put_file (same bytes, same server)':<42}{plain:>10.1f}{plain / ours:>10.2f}")
    print(f"ours / s3fs = {ours / plain:.2f}x (target >= 0.8x)")
    print("\nMedian blocking stall per snapshot (training thread)")
    base = stalls["RAM tier only"]
    for name, v in stalls.items():
        print(f"{name:<42}{v:>10.2f} ms{v / base:>8.2f}x")
    print(f"object store / RAM tier only = {stalls['RAM tier + object store'] / base:.2f}x (target <= 1.1x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
