"""A step the snapshot agents wrote to a durable tier after the trainers died is kept in the RAM tier by each rank's
agent and committed there by the next restore's listing: on every node, and only once every rank's objects are held
on some node (two nodes of one rank each, as threads of one process; the real agent code and the real tier)."""

from __future__ import annotations

import logging

import torch
from thread_comm import run_ranks

from lightning_snapshot.agent import Agent, describe_staged
from lightning_snapshot.backends import LocalTier, RamTier
from lightning_snapshot.format.manifest import MANIFEST_NAME, step_dirname
from lightning_snapshot.persist.writer import SnapshotJob, committed_steps, write_snapshot
from lightning_snapshot.restore.loader import read_manifest
from lightning_snapshot.staging import stage
from lightning_snapshot.restore.objects import step_objects

STEP, RUN = 5, "run"
#: the engine's reading of a kept manifest into the objects of its step (what the restorer passes the RAM tier)
OBJECTS = step_objects("the manifest kept by the node agents")


def _states() -> list[tuple]:
    g = torch.Generator().manual_seed(0)
    # (each rank writes its share of the replicated state, and its own state)
    return [
        (
            stage({f"w{r}": torch.randn(1000 + r, generator=g)}, "shared"),
            stage({"rng": torch.randint(0, 1 << 30, (7,), generator=g)}, "rank"),
        )
        for r in range(2)
    ]


def _ram(tmp_path, node: int) -> RamTier:
    ram = RamTier(every_n_train_steps=1, keep_last=2, name="t", shm_dir=str(tmp_path / f"node{node}"))
    ram.bind(node_rank=node, num_nodes=2, local_rank=0, ranks_per_node=1, default_name="t")
    return ram


def _keep(ram: RamTier, durable: LocalTier, rank: int, states) -> None:
    """What the agent of ``rank``'s node does once it wrote ``STEP`` to ``durable`` after that trainer died."""
    shared, private = states[rank]
    hello = {"rank": rank, "world_size": 2, "run_id": RUN, "tiers": [durable.spec()]}
    entry = {
        "step": STEP,
        "epoch": 0,
        "ram": True,
        "tiers": [0],
        "shared": describe_staged(shared, inline=True),
        "private": describe_staged(private, inline=True),
    }
    Agent(ram.node_dir, idle_timeout=1.0)._keep_in_ram(hello, entry, None, 0)


def test_kept_step_is_committed_on_every_node_only_once_every_rank_s_objects_are_held(tmp_path, caplog):
    durable = LocalTier(tmp_path / "durable", keep_last=None)
    states = _states()
    # the agents' commit to the durable tier (the trainers committed nothing to the RAM tier)
    done = run_ranks(2, lambda comm: write_snapshot(durable, comm, SnapshotJob(STEP, 0, *states[comm.rank]), RUN))
    assert not [d for d in done if isinstance(d, BaseException)], done
    rams = [_ram(tmp_path, node) for node in range(2)]
    prefix = step_dirname(STEP)

    # rank 1's agent has not kept its part (yet): the step is committed nowhere
    _keep(rams[0], durable, 0, states)
    assert (rams[0].store.list(prefix)) == [
        f"{RUN}-proposed-manifest.json",
        f"{RUN}-rank-00000.bin",
        f"{RUN}-shared-00000.bin",
    ]
    with caplog.at_level(logging.WARNING):
        assert run_ranks(2, lambda comm: rams[comm.rank].collective_steps(comm, OBJECTS)) == [[], []]
    assert (
        f"step {STEP}, kept by the snapshot agents for trainers that died, stays uncommitted: {RUN}-rank-00001.bin"
        in caplog.text
    )
    assert all(committed_steps(ram) == [] for ram in rams)

    # once it has, the next listing commits it on both nodes, with the durable manifest's very bytes
    _keep(rams[1], durable, 1, states)
    assert run_ranks(2, lambda comm: rams[comm.rank].collective_steps(comm, OBJECTS)) == [[STEP], [STEP]]
    want = durable.read(f"{prefix}/{MANIFEST_NAME}")
    for node, ram in enumerate(rams):
        assert ram.store.read(f"{prefix}/{MANIFEST_NAME}") == want
        assert not [n for n in ram.store.list(prefix) if n.endswith("proposed-manifest.json")]
        for obj in read_manifest(ram, STEP).objects:  # each node holds its rank's objects, byte for byte
            if obj.rank == node:
                assert ram.store.read(f"{prefix}/{obj.key}") == durable.read(f"{prefix}/{obj.key}"), obj.key


def test_nothing_is_kept_when_the_ram_tier_holds_the_step_or_a_newer_one(tmp_path):
    durable = LocalTier(tmp_path / "durable", keep_last=None)
    states = _states()
    done = run_ranks(2, lambda comm: write_snapshot(durable, comm, SnapshotJob(STEP, 0, *states[comm.rank]), RUN))
    assert not [d for d in done if isinstance(d, BaseException)], done
    ram = _ram(tmp_path, 0)
    ram.store.commit(f"{step_dirname(STEP + 1)}/{MANIFEST_NAME}", durable.read(f"{step_dirname(STEP)}/{MANIFEST_NAME}"))
    _keep(ram, durable, 0, states)
    assert ram.store.list(step_dirname(STEP)) == []


def test_a_step_the_trainers_committed_on_some_node_is_left_as_it_is(tmp_path):
    """The trainers' commit reached node 0 (its first rank published the manifest) but not node 1, whose trainer died
    first and whose agent kept the step: the listing finds it committed and does not commit it again."""
    durable = LocalTier(tmp_path / "durable", keep_last=None)
    states = _states()
    done = run_ranks(2, lambda comm: write_snapshot(durable, comm, SnapshotJob(STEP, 0, *states[comm.rank]), RUN))
    assert not [d for d in done if isinstance(d, BaseException)], done
    rams = [_ram(tmp_path, node) for node in range(2)]
    prefix = step_dirname(STEP)
    trainers = b'{"the trainers": "manifest"}'  # (never parsed here: only compared)
    rams[0].store.commit(f"{prefix}/{MANIFEST_NAME}", trainers)
    _keep(rams[1], durable, 1, states)
    assert run_ranks(2, lambda comm: rams[comm.rank].collective_steps(comm, OBJECTS)) == [[STEP], [STEP]]
    assert rams[0].store.read(f"{prefix}/{MANIFEST_NAME}") == trainers
    assert not rams[1].store.exists(f"{prefix}/{MANIFEST_NAME}")  # (a restore gives it node 0's)
