"""A trainer that dies right after handing a staged snapshot to its node's snapshot agent *before* its checksums were
taken (as the CUDA path does: the agent is told once the bytes are in the arena, while the hash threads still run).

Stages a fixed state (seeded) into a HostArena, attaches to the agent of ``--node-dir`` (started here) with a
LocalTier at ``--local`` as the durable tier, sends the ``staged`` message with no checksums, and SIGKILLs itself.
The agent must write it to the local tier on its own, with checksums it takes itself.

Usage: python agent_handoff.py --node-dir DIR --local DIR
"""

from __future__ import annotations

import argparse
import os
import signal

import torch

from lightning_snapshot.agent import AgentClient, ensure_agent
from lightning_snapshot.backends import LocalTier
from lightning_snapshot.persist.threads import PersistJob
from lightning_snapshot.staging import stage
from lightning_snapshot.staging.arena import HostArena

STEP = 8


def expected_state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "state_dict": {"w": torch.randn(300, 700, generator=g), "b": torch.randn(33, generator=g).to(torch.bfloat16)},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(300, 700, generator=g)}}, "param_groups": []}],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--node-dir", required=True)
    p.add_argument("--local", required=True)
    a = p.parse_args()
    ensure_agent(a.node_dir, idle_timeout=60)
    local = LocalTier(a.local, every_n_train_steps=1, keep_last=2)
    client = AgentClient(a.node_dir, rank=0, world_size=1, run_id="handoff", tiers=[local])
    arena = HostArena(chunk_bytes=1 << 16)
    handle = arena.stage_async(expected_state(), lambda t: True, STEP)
    assert handle is not None
    handle.wait_copied()
    assert handle.state.checksums is None  # (only wait() puts them there)
    job = PersistJob(STEP, 0, handle, stage({"rng": torch.get_rng_state()}, "rank"), [local])
    client.staged(job)
    print("STAGED", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
