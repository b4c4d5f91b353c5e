"""Simulated multi-node RAM tier without Lightning: one process per "node", each with its own memory directory.

Usage (one process per node; NODE_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by the launcher):
  ram_nodes.py save --base B --erasure K+M --local L --step S --mb X   write a deterministic state (X MB per rank) to
                                                                       the RAM tier and, for reference, to local tier L
  ram_nodes.py load --base B --erasure K+M --step S --out O            rebuild step S from the RAM tier and write the
                                                                       state every rank read to O.rank<r> (torch.save)
  ram_nodes.py local-save --base B --step S --mb X       the same state to a node-local LocalTier B/disk<r>
  ram_nodes.py local-load --base B --step S --out O      restore it (any number of nodes) and write what each rank read
  ram_nodes.py local-die --base B --step S               write to it while the last rank exits mid-write; the others
                                                       print "WRITE FAILED: <message>" and exit 1
Node r's memory lives in B/node<r>. Prints "LOADED" or "FAILED: <message>".
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from lightning_snapshot.backends import LocalTier, RamTier
from lightning_snapshot.dist.comm import GroupComm
from lightning_snapshot.errors import SnapshotError
from lightning_snapshot.format.manifest import step_dirname
from lightning_snapshot.persist.writer import SnapshotJob, write_snapshot
from lightning_snapshot.restore.loader import read_manifest, read_section
from lightning_snapshot.restore.objects import needed_objects
from lightning_snapshot.staging import stage


def state(rank: int, mb: float) -> dict:
    g = torch.Generator().manual_seed(1234)
    n = int(mb * (1 << 20) / 4)
    return {
        "weights": {
            "a": torch.randn(n // 2, generator=g),
            "b": torch.randn(3, 5, generator=g).to(torch.bfloat16),
            "big": torch.randn(n // 2, generator=g),
        },
        "step": 7,
        "rank_note": f"rank {rank}",
    }


def restore(tier, comm: GroupComm, step: int, out: str, section: int) -> None:
    """Restore ``step`` through the tier's collective ``restore``; save the shared state and rank ``section``'s
    tensor to ``out``; print LOADED or FAILED: <why>."""
    try:

        def read():
            manifest = read_manifest(tier, step)
            mine = manifest.rank_section(section)
            return (
                read_section(tier, manifest, manifest.tensors, manifest.state),
                read_section(tier, manifest, mine.tensors, mine.state),
            )

        where = f"manifest of {step_dirname(step)} in the {tier.tier} tier {tier.url}"
        shared, mine = tier.restore(comm, step, read, needed_objects(comm.world_size, where))
        torch.save({"shared": shared, "rank": mine["t"]}, out)
        print("LOADED", flush=True)
    except SnapshotError as e:
        print(f"FAILED: {e}", flush=True)


def local(a: argparse.Namespace, node: int, world: int, comm: GroupComm) -> int:
    tier = LocalTier(a.base + "/disk{node_rank}", every_n_train_steps=1)
    tier.bind(node_rank=node, num_nodes=world, local_rank=0, ranks_per_node=1)
    tier.settle_layout(comm, "run0")
    if a.mode in ("local-save", "local-die"):
        shared = stage(state(0, a.mb)["weights"], "shared") if node == 0 else stage({}, "shared")
        job = SnapshotJob(a.step, 0, shared, stage({"t": torch.arange(4) + node}, "rank"))

        def prepare():
            if a.mode == "local-die" and node == world - 1:
                os._exit(3)  # this rank dies in the middle of the snapshot

        try:
            write_snapshot(tier, comm, job, "run0", prepare=prepare)
        except SnapshotError as e:
            print(f"WRITE FAILED: {e}", flush=True)
            # (not through the interpreter's exit: a gloo group whose peer died can abort the process in its
            # destructor, "terminate called without an active exception", seen once in CI)
            sys.stderr.flush()
            os._exit(1)
        print("SAVED", flush=True)
    else:
        restore(tier, comm, a.step, f"{a.out}.rank{node}", 0)  # (a world-size change reads rank 0's section)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "load", "local-save", "local-load", "local-die"])
    p.add_argument("--base", required=True)
    p.add_argument("--erasure", default=None)
    p.add_argument("--local", default=None)
    p.add_argument("--step", type=int, default=10)
    p.add_argument("--mb", type=float, default=2.0)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    node, world = int(os.environ["NODE_RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=node, world_size=world)
    comm = GroupComm(dist.new_group(backend="gloo"))
    if a.mode.startswith("local-"):
        return local(a, node, world, comm)
    ram = RamTier(every_n_train_steps=1, keep_last=2, erasure=a.erasure, name="run", shm_dir=f"{a.base}/node{node}")
    ram.bind(node_rank=node, num_nodes=world, local_rank=0, ranks_per_node=1, default_name="run")
    if a.mode == "save":
        s = state(node, a.mb)
        shared = stage(s["weights"], "shared") if node == 0 else stage({}, "shared")
        job = SnapshotJob(a.step, 0, shared, stage({"note": s["rank_note"], "t": torch.arange(4) + node}, "rank"))
        write_snapshot(ram, comm, job, "run0")
        if a.local:
            write_snapshot(LocalTier(a.local), comm, job, "run0")
        print(f"SAVED held_bytes={ram.held_bytes()}", flush=True)
    else:
        restore(ram, comm, a.step, f"{a.out}.rank{node}", node)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
