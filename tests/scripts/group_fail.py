"""Two processes over gloo (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by the test): rank 1 exits right after the
default group formed; rank 0 then forms the tiers' groups (``comm.new_gloo_groups``, a 3 s timeout) and prints the
error it gets as ``ERROR: <message>`` (or ``FORMED``)."""

import datetime
import os
import sys

import torch.distributed as dist

from lightning_snapshot.dist.groups import new_gloo_groups
from lightning_snapshot.errors import SnapshotError

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
if dist.get_rank() == 1:
    dist.barrier()
    os._exit(0)  # (gone before the groups of the tiers are formed)
dist.barrier()
try:
    new_gloo_groups(["the local tier /data/snap"], datetime.timedelta(seconds=3), "0123456789ab")
    print("FORMED", flush=True)
except SnapshotError as e:
    print(f"ERROR: {e}", flush=True)
sys.stdout.flush()
os._exit(0)
