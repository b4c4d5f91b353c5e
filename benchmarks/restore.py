"""Restore benchmark: DDP with 4 ranks restoring the same state from moto's S3 server, three ways, in one run.

    python benchmarks/restore.py            # 256 MB of state, 3 repeats
    python benchmarks/restore.py --quick    # 64 MB, 2 repeats (about a minute)

The server runs in this process (benchmarks/_s3.py) and counts the bytes it serves per object, so "bytes read from
the bucket per job" is the bucket's own figure. The state (16 float32 tensors) is saved once as a lightning-snapshot
snapshot, twice (one copy per method of ours, so that the server's count tells them apart) and once with
``torch.distributed.checkpoint.save`` (``FsspecWriter``). Then 4 fresh processes (a gloo group, as the callback's tier
groups are) load it into preallocated tensors with each method, alternating, ``--repeats`` times each, timed from a
barrier to a barrier (the slowest rank), and check every rank's tensors bitwise against the state:

{methods}

Target: the read-once restore reads at most 1.05x the state from the bucket per job (the per-rank path: about 4x).
The load is measured at the loader (``read_manifest`` + ``read_section``), the part of the callback's restore that
these methods change; the rest of a restore (the candidates, applying the state) is the same for all of them.
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # the harness and the library

import _harness as harness  # noqa: E402
from object_store import options, state_of  # noqa: E402  (the object-store benchmark's server options and state)

WORLD = 4
AMPLIFICATION_TARGET = 1.05
PREFIX = {"per-rank": "bench/today", "read-once": "bench/once", "dcp": "bench/dcp"}


# ------------------------------------------------------------------------------------------------ the methods


class Loader:
    """What one rank's loads need: the tier group, the server and the targets (one set per method)."""

    def __init__(self, args: argparse.Namespace, comm, targets: dict[str, dict[str, torch.Tensor]]) -> None:
        self.args, self.comm, self.targets = args, comm, targets
        self.read: dict[str, int] = {}


def _ours(ctx: Loader, method: str, shared: bool) -> None:
    from lightning_snapshot.backends import ObjectStoreTier
    from lightning_snapshot.restore.loader import ReadStats, read_manifest, read_section
    from lightning_snapshot.restore.read_once import ReadOnce

    backend = ObjectStoreTier(f"s3://{PREFIX[method]}", storage_options=options(ctx.args.endpoint))
    manifest = read_manifest(backend, 1)
    reader = ReadOnce(ctx.comm, "the benchmark snapshot") if shared else None
    if reader is not None:
        reader.start(None)
    stats = ReadStats()
    targets = {f"state_dict/{k}": v for k, v in ctx.targets[method].items()}
    read_section(backend, manifest, manifest.tensors, manifest.state, targets=targets, stats=stats, shared=reader)
    ctx.read[method] = stats.bytes_read


def load_per_rank(ctx: Loader) -> None:
    _ours(ctx, "per-rank", shared=False)


def load_read_once(ctx: Loader) -> None:
    _ours(ctx, "read-once", shared=True)


def load_dcp(ctx: Loader) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    reader = FsspecReader(f"s3://{PREFIX['dcp']}", **options(ctx.args.endpoint))
    dcp.load({"state_dict": ctx.targets["dcp"]}, storage_reader=reader)


METHODS = harness.Methods(baseline="per-rank")
METHODS.add(
    "per-rank",
    load_per_rank,
    "lightning-snapshot before this release (``LIGHTNING_SNAPSHOT_READ_ONCE=0``): every rank reads and verifies"
    " the whole replicated state itself",
)
METHODS.add(
    "read-once",
    load_read_once,
    "lightning-snapshot: each checksum chunk is read and verified by one rank and broadcast to the others over"
    " the gloo group (``read_once.ReadOnce``)",
)
METHODS.add(
    "dcp",
    load_dcp,
    "``torch.distributed.checkpoint.load`` with ``FsspecReader`` of a ``dcp.save`` of the same state (every"
    " rank loads the replicated tensors it needs)",
)
__doc__ = METHODS.document(__doc__)


# ------------------------------------------------------------------------------------------------ the ranks


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    import torch.distributed as dist

    from lightning_snapshot.dist.comm import GroupComm

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    comm = GroupComm(dist.new_group(backend="gloo"))
    state = state_of(args.bytes)
    targets = {m: {k: torch.empty_like(v) for k, v in state.items()} for m in METHODS.names}
    ctx = Loader(args, comm, targets)
    times: dict[str, list[float]] = {m: [] for m in METHODS.names}
    for rep in range(args.repeats):
        order = METHODS.names if rep % 2 == 0 else METHODS.names[::-1]
        for name in order:
            for t in targets[name].values():
                t.zero_()
            dist.barrier()
            t0 = time.perf_counter()
            METHODS.run(name, ctx)
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    same = {m: all(torch.equal(targets[m][k], v) for k, v in state.items()) for m in METHODS.names}
    result = {"rank": rank, "times": times, "read": ctx.read, "same": same}
    gathered: list = [None] * WORLD
    dist.all_gather_object(gathered, result)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(args.result).write_text(json.dumps(gathered))


def load(args: argparse.Namespace) -> None:
    torch.multiprocessing.spawn(worker, args=(args, harness.free_port()), nprocs=WORLD, join=True)


# ------------------------------------------------------------------------------------------------ driver


def save(endpoint: str, nbytes: int) -> int:
    """The state as two lightning-snapshot snapshots (step 1) and one DCP checkpoint; returns the snapshot's bytes."""
    import s3fs
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from lightning_snapshot.backends import ObjectStoreTier
    from lightning_snapshot.dist.comm import LocalComm
    from lightning_snapshot.persist.writer import SnapshotJob, write_snapshot
    from lightning_snapshot.staging import stage

    s3fs.S3FileSystem(**options(endpoint)).call_s3("create_bucket", Bucket="bench")
    state = state_of(nbytes)
    total = 0
    for method in ("per-rank", "read-once"):
        tier = ObjectStoreTier(f"s3://{PREFIX[method]}", storage_options=options(endpoint))
        job = SnapshotJob(1, 0, stage({"state_dict": state}), stage({}, "rank"))
        manifest = write_snapshot(tier, LocalComm(), job, "bench")
        total = sum(o.nbytes for o in manifest.objects)
    dcp.save(
        {"state_dict": state}, storage_writer=FsspecWriter(f"s3://{PREFIX['dcp']}", **options(endpoint)), no_dist=True
    )
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", default="run", choices=["run", "load"])
    p.add_argument("--quick", action="store_true", help="64 MB, 2 repeats")
    p.add_argument("--bytes", type=int, default=None, help="bytes of state (default 256 MB; --quick 64 MB)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--endpoint")
    p.add_argument("--result")
    harness.add_arguments(p, markdown=True)
    args = p.parse_args(argv)
    args.bytes = args.bytes or ((64 << 20) if args.quick else (256 << 20))
    args.repeats = args.repeats or (2 if args.quick else 3)
    if args.command == "load":
        load(args)
        return 0
    return run(args)


def run(args: argparse.Namespace) -> int:
    from _s3 import start_counting_server

    out = harness.Report("restore", args)
    out.header(state=f"{args.bytes / 1e6:.0f} MB (16 float32 tensors)", ranks=WORLD, repeats=args.repeats)
    server, counter, endpoint = start_counting_server()
    try:
        t0 = time.monotonic()
        total = save(endpoint, args.bytes)
        out.say(f"saved (two snapshots and a DCP checkpoint) in {time.monotonic() - t0:.1f} s")
        saved = {m: counter.bytes_served(PREFIX[m] + "/") for m in METHODS.names}  # (the save's own reads)
        with tempfile.TemporaryDirectory(prefix="restore-bench-") as tmp:
            result = Path(tmp) / "result.json"
            env = {**os.environ, "PYTHONWARNINGS": "ignore"}
            with harness.NoiseMeter() as meter:  # (the server's CPU is this process's: the benchmark's own)
                subprocess.run(
                    [
                        sys.executable,
                        os.path.abspath(__file__),
                        "load",
                        "--bytes",
                        str(args.bytes),
                        "--repeats",
                        str(args.repeats),
                        "--endpoint",
                        endpoint,
                        "--result",
                        str(result),
                    ],
                    check=True,
                    env=env,
                )
            ranks = json.loads(result.read_text())
        served = {m: (counter.bytes_served(PREFIX[m] + "/") - saved[m]) / args.repeats for m in METHODS.names}
    finally:
        server.stop()
    med = {m: statistics.median(ranks[0]["times"][m]) for m in METHODS.names}  # (rank 0's: between barriers)
    base = med[METHODS.baseline]
    noise = meter.noise
    table = harness.Table(
        f"Restore of {total / 1e6:.0f} MB by DDP({WORLD}) from moto on 127.0.0.1 (seconds, median of {args.repeats};"
        f" other processes used {noise.share:.0%} of the CPUs)",
        ["method", "wall s", "x per-rank", "bucket bytes / job", "x state", "bitwise equal"],
        key="restore",
        notes=[flag for flag in [noise.flag()] if flag],
    )
    for m in METHODS.names:
        same = all(r["same"][m] for r in ranks)
        table.add(
            m,
            f"{med[m]:.2f}",
            f"{med[m] / base:.2f}x",
            f"{served[m] / 1e6:.1f} MB",
            f"{served[m] / total:.2f}x",
            "yes" if same else "NO",
            data={
                "method": m,
                "seconds": med[m],
                "ratio": med[m] / base,
                "bucket_bytes": served[m],
                "amplification": served[m] / total,
                "bitwise_equal": same,
            },
        )
        out.targets.check(same, f"{m}: every rank's tensors bitwise equal to the state")
    out.table(table)
    amp = served["read-once"] / total
    out.targets.check(
        amp <= AMPLIFICATION_TARGET,
        f"read-once: {amp:.3f}x the state read from the bucket per job <= {AMPLIFICATION_TARGET}x",
        amp,
        AMPLIFICATION_TARGET,
    )
    speed = med["read-once"] / base
    versus_dcp = med["read-once"] / med["dcp"]
    out.targets.info(f"read-once wall time {speed:.2f}x the per-rank path's, {versus_dcp:.2f}x DCP's")
    return out.finish(seconds=med, bucket_bytes=served, state_bytes=total)


if __name__ == "__main__":
    sys.exit(main())
