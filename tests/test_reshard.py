"""Load-time resharding: sharded capture under ModelParallelStrategy (FSDP2), and loading a snapshot into another
strategy or world size, each rank reading only the bytes of its own shards.

End to end in real subprocesses (tests/scripts/reshard_train.py): every loaded model and optimizer state is compared
bitwise with the consolidated state the saving run wrote at the same step. In process: box reads against
simulated multi-rank snapshots, with the tier's byte counter.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_bitwise_equal, run_script

from lightning_snapshot import load_snapshot
from lightning_snapshot.backends import LocalTier
from lightning_snapshot.dist.comm import LocalComm
from lightning_snapshot.errors import CaptureError, ManifestError, SnapshotWriteError
from lightning_snapshot.format.manifest import MANIFEST_NAME, Manifest, step_dirname
from lightning_snapshot.persist.commit import _merge_tensors, merge_parts
from lightning_snapshot.persist.writer import SnapshotJob, committed_steps, write_part, write_snapshot
from lightning_snapshot.plan.planner import Box, shard_boxes
from lightning_snapshot.restore.loader import ReadStats, ShardTarget, read_manifest, read_section
from lightning_snapshot.staging import dtensor_box, stage

# the module-scoped fixtures below are shared by this file's tests: under pytest-xdist they run in one worker
pytestmark = pytest.mark.xdist_group("test_reshard")

_rng = random.Random()
MAX_AMPLIFICATION = 1.05


def run(*args: str, expect_kill: bool = False, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return run_script("reshard_train.py", *args, expect_kill=expect_kill, timeout=timeout)


def assert_state_equal(ref_path: Path, got_path: Path) -> int:
    """Model and optimizer state of two consolidated dumps are bitwise equal (and the learning rate)."""
    ref = torch.load(ref_path, weights_only=True)
    got = torch.load(got_path, weights_only=True)
    n = 0
    for section in ("model", "optimizer"):
        assert got[section].keys() == ref[section].keys(), section
        for k, v in ref[section].items():
            g = got[section][k]
            assert v.dtype == g.dtype and v.shape == g.shape, k
            assert torch.equal(v.view(torch.uint8) if v.dim() else v, g.view(torch.uint8) if g.dim() else g), (
                f"{section}/{k} differs from the consolidated state of the saving run"
            )
            n += 1
    assert torch.equal(ref["lr"], got["lr"])
    return n


def restore_stats(proc: subprocess.CompletedProcess[str]) -> dict[int, dict[str, int]]:
    stats = {}
    for m in re.finditer(
        r"RESTORE_STATS rank=(\d+) needed=(\d+) planned=(\d+) tier=(\d+) resharded=(\d+)", proc.stdout
    ):
        rank, needed, planned, tier, resharded = map(int, m.groups())
        stats[rank] = {"needed": needed, "planned": planned, "tier": tier, "resharded": resharded}
    return stats


def assert_reads_only_its_shards(
    proc: subprocess.CompletedProcess[str], world: int, sharded: bool = True
) -> list[float]:
    """Every rank read (as the tier counted) at most 1.05x the bytes it needed; ``sharded``: by box reads (a DDP or
    single-process target needs whole tensors, the whole of each is then what it needs)."""
    stats = restore_stats(proc)
    assert sorted(stats) == list(range(world)), proc.stdout
    ratios = []
    for rank, s in stats.items():
        assert s["resharded"] > 0 or not sharded, f"rank {rank} read no tensor by its shard"
        assert s["tier"] == s["planned"], f"rank {rank}: the tier counted {s['tier']}, the plan {s['planned']}"
        ratios.append(s["tier"] / s["needed"])
        assert s["tier"] <= MAX_AMPLIFICATION * s["needed"], (
            f"rank {rank} read {s['tier']} bytes for {s['needed']} needed ({s['tier'] / s['needed']:.3f}x)"
        )
    return ratios


@pytest.fixture(scope="module")
def mp_run(tmp_path_factory):
    """An uninterrupted ModelParallel(2) run: snapshots every 3 steps (9 and 12 kept), the consolidated state at
    steps 9 and 12, and the final state."""
    d = tmp_path_factory.mktemp("mp-save")
    (d / "dumps").mkdir()
    run(
        "--dir",
        str(d / "snaps"),
        "--out",
        str(d / "out.pt"),
        "--strategy",
        "mp",
        "--max-steps",
        "12",
        "--dump-steps",
        "9,12",
        "--dump-dir",
        str(d / "dumps"),
    )
    return d


# ---------------------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_model_parallel_snapshot_is_sharded_not_gathered(mp_run):
    tier = LocalTier(mp_run / "snaps")
    assert committed_steps(tier) == [12, 9]
    manifest = read_manifest(tier, 9)
    assert manifest.world_size == 2
    by_name = {t.name: t for t in manifest.tensors}
    for name in (
        "state_dict/net.0.weight",
        "state_dict/net.5.weight",
        "optimizer_states/0/state/net.3.weight/exp_avg_sq",
    ):
        entry = by_name[name]
        objects = {f.object for f in entry.fragments}
        assert len(entry.fragments) == 2 and len(objects) == 2, entry  # one shard per rank, each in its own object
        assert {manifest.object(o).rank for o in objects} == {0, 1}
    # the uneven shard: 5 rows over 2 ranks are 3 + 2, as DTensor's Shard(0) makes them
    w5 = by_name["state_dict/net.5.weight"]
    assert sorted((f.global_offsets, f.local_shape) for f in w5.fragments) == [((0, 0), (3, 256)), ((3, 0), (2, 256))]
    # each rank wrote about half the state
    shared = {o.rank: o.nbytes for o in manifest.objects if "-shared-" in o.key}
    assert 0.9 < shared[0] / shared[1] < 1.1, shared


@pytest.mark.slow
def test_model_parallel_sigkill_and_resume_is_bitwise_exact(tmp_path, mp_run):
    crash_at = _rng.randint(5, 11)
    snaps = tmp_path / "snaps"
    common = ("--dir", str(snaps), "--strategy", "mp", "--max-steps", "12")
    run(*common, "--out", str(tmp_path / "crashed.pt"), "--crash-at", str(crash_at), expect_kill=True)
    assert committed_steps(LocalTier(snaps)), "the killed run committed no snapshot"
    proc = run(*common, "--out", str(tmp_path / "resumed.pt"))
    assert proc.stdout.count("RESTORED step=") == 2, f"both ranks must resume: {proc.stdout}"
    try:
        assert_bitwise_equal(mp_run / "out.pt", tmp_path / "resumed.pt")
    except AssertionError as e:
        raise AssertionError(f"crash at global_step {crash_at}: {e}") from None
    ref1 = torch.load(mp_run / "out.pt.rank1", weights_only=True)
    got1 = torch.load(tmp_path / "resumed.pt.rank1", weights_only=True)
    assert torch.equal(ref1["rng"], got1["rng"]), "rank 1's RNG differs at the end of training"
    # same layout: every rank read exactly its own shards, and the few tensors both ranks need whole (the optimizer's
    # step counts) were read once in the job, by one of them (read once: tiers.md), so a rank may read a little less
    ratios = assert_reads_only_its_shards(proc, 2)
    assert all(0.999 < r <= 1.0 for r in ratios), ratios


@pytest.mark.slow
def test_model_parallel_snapshot_loads_in_one_process_as_full_tensors(mp_run):
    for step, ref_path in ((9, mp_run / "dumps" / "step-9.pt"), (12, mp_run / "out.pt")):
        ref = torch.load(ref_path, weights_only=True)
        state = load_snapshot(str(mp_run / "snaps"), step)
        assert state["global_step"] == step
        assert state["state_dict"].keys() == ref["model"].keys()
        for k, v in ref["model"].items():
            assert torch.equal(v, state["state_dict"][k]), k
        got = {f"{name}/{k}": v for name, st in state["optimizer_states"][0]["state"].items() for k, v in st.items()}
        assert got.keys() == ref["optimizer"].keys()
        for k, v in ref["optimizer"].items():
            assert torch.equal(v, got[k]), k
        assert state["optimizer_states"][0]["param_groups"][0]["lr"] == ref["lr"].item()


@pytest.fixture(scope="module")
def ram_base(tmp_path_factory):
    """The node memory of the RAM-tier runs of this module; their agents are stopped at the end."""
    from lightning_snapshot.agent import stop_agent

    base = tmp_path_factory.mktemp("shm")
    old = os.environ.get("LIGHTNING_SNAPSHOT_SHM_DIR")
    os.environ["LIGHTNING_SNAPSHOT_SHM_DIR"] = str(base)
    yield base
    for sock in list(base.glob("*/agent.sock")):  # (a stopped agent removes its directory)
        stop_agent(sock.parent)
    if old is None:
        del os.environ["LIGHTNING_SNAPSHOT_SHM_DIR"]
    else:
        os.environ["LIGHTNING_SNAPSHOT_SHM_DIR"] = old


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory, mp_run):
    """Saving runs of 9 steps (snapshot and consolidated state at step 9), cached per strategy, world size and tier:
    a function returning (tier arguments for reshard_train.py, the tier, the consolidated state at step 9)."""
    cache = {
        ("mp", 2, "local"): (
            ("--dir", str(mp_run / "snaps")),
            LocalTier(mp_run / "snaps"),
            mp_run / "dumps" / "step-9.pt",
        )
    }

    def get(strategy: str, world: int, tier: str, s3=None, ram=None) -> tuple[tuple[str, ...], object, Path]:
        key = (strategy, world, tier)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"{strategy}{world}-{tier}")
            (d / "dumps").mkdir()
            if tier == "s3":
                s3_server, bucket = s3
                url = f"s3://{bucket}/{strategy}{world}"
                args = ("--dir", str(d / "unused"), "--s3", url, "--endpoint", s3_server.endpoint)
                from train import s3_options

                from lightning_snapshot.backends import ObjectStoreTier

                backend = ObjectStoreTier(url, storage_options=s3_options(s3_server.endpoint))
            elif tier == "ram":
                from lightning_snapshot.backends import RamTier

                args = ("--dir", str(d / "unused"), "--ram", f"{strategy}{world}")
                backend = RamTier(name=f"{strategy}{world}", shm_dir=str(ram))
            else:
                args = ("--dir", str(d / "snaps"))
                backend = LocalTier(d / "snaps")
            run(
                *args,
                "--out",
                str(d / "out.pt"),
                "--strategy",
                strategy,
                "--devices",
                str(world),
                "--max-steps",
                "9",
                "--dump-steps",
                "9",
                "--dump-dir",
                str(d / "dumps"),
            )
            cache[key] = (args, backend, d / "dumps" / "step-9.pt")
        return cache[key]

    return get


LOADS = [  # (saved strategy, world size, tier) -> (loading strategy, world size)
    (("ddp", 2, "local"), ("mp", 2)),
    (("mp", 2, "local"), ("ddp", 2)),
    (("mp", 2, "local"), ("mp", 4)),  # the 5-row layer gives rank 3 an empty shard
    (("ddp", 4, "local"), ("mp", 2)),
    (("mp", 4, "local"), ("ddp", 2)),
    (("mp", 2, "s3"), ("mp", 4)),  # from the object store, with ranged reads
    (("ddp", 2, "ram"), ("mp", 4)),  # from the RAM tier (one node, a node-local copy)
    (("mp", 2, "ram"), ("single", 1)),
]


@pytest.mark.slow
@pytest.mark.parametrize("saved,load", LOADS, ids=[f"{s[0]}{s[1]}-{s[2]}-to-{lo[0]}{lo[1]}" for s, lo in LOADS])
def test_load_into_another_strategy_or_world_size(tmp_path, saved_runs, request, saved, load):
    """The loaded model and optimizer state equal, bitwise, the consolidated state of the saving run, and every rank
    reads, as counted by the tier itself, at most 1.05x the bytes it needs."""
    s3 = (request.getfixturevalue("s3_server"), request.getfixturevalue("bucket")) if saved[2] == "s3" else None
    ram = request.getfixturevalue("ram_base") if saved[2] == "ram" else None
    tier_args, backend, reference = saved_runs(*saved, s3=s3, ram=ram)
    manifest = read_manifest(backend, 9)
    assert manifest.world_size == saved[1]
    if saved[0] == "ddp":
        assert all(len(t.fragments) == 1 for t in manifest.tensors if t.alias_of is None)  # DDP: whole tensors
    else:
        w0 = next(t for t in manifest.tensors if t.name == "state_dict/net.0.weight")
        assert len(w0.fragments) == saved[1]  # one shard per rank
    strategy, world = load
    # the loading run resumes from step 9 of the saving run's tier (and snapshots to it from step 10 on)
    resume = (
        tier_args + ("--resume", "9")
        if saved[2] in ("s3", "ram")
        else ("--dir", str(tmp_path / "snaps"), "--resume", str(Path(tier_args[1]) / step_dirname(9)))
    )
    proc = run(
        *resume,
        "--out",
        str(tmp_path / "out.pt"),
        "--strategy",
        strategy,
        "--devices",
        str(world),
        "--max-steps",
        "10",
        "--dump-at-start",
        str(tmp_path / "start.pt"),
    )
    assert proc.stdout.count("RESTORED step=9") == world, proc.stdout
    if world != saved[1]:
        assert f"was taken with {saved[1]} process(es), this run has {world}" in proc.stderr
    assert assert_state_equal(reference, tmp_path / "start.pt") == 6 + 6 * 3
    ratios = assert_reads_only_its_shards(proc, world, sharded=strategy == "mp")
    print(f"{saved} -> {load} bytes read / needed per rank:", ratios)


@pytest.mark.slow
def test_tensor_parallel_to_fsdp(tmp_path):
    """Tensor parallel (Shard(0) column-wise, Shard(1) row-wise, Replicate biases) saved; FSDP2 (Shard(0)) loaded."""
    save = tmp_path / "tp"
    (save / "dumps").mkdir(parents=True)
    run(
        "--dir",
        str(save / "snaps"),
        "--out",
        str(save / "out.pt"),
        "--strategy",
        "mp",
        "--tp",
        "2",
        "--max-steps",
        "9",
        "--dump-steps",
        "9",
        "--dump-dir",
        str(save / "dumps"),
    )
    by_name = {t.name: t for t in read_manifest(LocalTier(save / "snaps"), 9).tensors}
    row_wise = by_name["state_dict/net.3.weight"]
    assert sorted((f.global_offsets, f.local_shape) for f in row_wise.fragments) == [
        ((0, 0), (256, 128)),
        ((0, 128), (256, 128)),
    ]
    assert len(by_name["state_dict/net.3.bias"].fragments) == 1  # replicated: written once
    proc = run(
        "--dir",
        str(tmp_path / "snaps"),
        "--out",
        str(tmp_path / "out.pt"),
        "--strategy",
        "mp",
        "--max-steps",
        "10",
        "--resume",
        str(save / "snaps" / step_dirname(9)),
        "--dump-at-start",
        str(tmp_path / "start.pt"),
    )
    assert proc.stdout.count("RESTORED step=9") == 2, proc.stdout
    assert_state_equal(save / "dumps" / "step-9.pt", tmp_path / "start.pt")
    print("TP(2) -> FSDP(2) bytes read / needed per rank:", assert_reads_only_its_shards(proc, 2))


def _assert_full_tensors_equal(snapshots: Path, step: int, reference: Path) -> int:
    """load_snapshot in this process (full tensors) equals, bitwise, the consolidated state of the saving run."""
    ref = torch.load(reference, weights_only=True)
    state = load_snapshot(str(snapshots), step)
    assert state["global_step"] == step
    got = {
        **{f"model/{k}": v for k, v in state["state_dict"].items()},
        **{
            f"optimizer/{name}/{k}": v
            for name, st in state["optimizer_states"][0]["state"].items()
            for k, v in st.items()
        },
    }
    want = {
        **{f"model/{k}": v for k, v in ref["model"].items()},
        **{f"optimizer/{k}": v for k, v in ref["optimizer"].items()},
    }
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert v.dtype == got[k].dtype and v.shape == got[k].shape, k
        assert torch.equal(v.view(torch.uint8) if v.dim() else v, got[k].view(torch.uint8) if v.dim() else got[k]), k
    assert state["optimizer_states"][0]["param_groups"][0]["lr"] == ref["lr"].item()
    return len(want)


@pytest.mark.slow
def test_fsdp2_x_tensor_parallel_2d_mesh_saves_boxes_and_loads_into_1d(tmp_path):
    """ModelParallel(data_parallel_size=2, tensor_parallel_size=2) on 4 processes: FSDP2 fully_shard over TP, whose
    column-wise parameters have placements (_StridedShard(0, sf=2), Shard(0)). Each rank saves its own box (the
    data-parallel chunk of its tensor-parallel chunk), unevenly for the 5-row output layer; the snapshot loads in
    one process as full tensors and into ModelParallel(2) (1-D FSDP2), bitwise equal to the consolidated state."""
    save = tmp_path / "2d"
    (save / "dumps").mkdir(parents=True)
    run(
        "--dir",
        str(save / "snaps"),
        "--out",
        str(save / "out.pt"),
        "--strategy",
        "mp",
        "--devices",
        "4",
        "--tp",
        "2",
        "--max-steps",
        "9",
        "--dump-steps",
        "9",
        "--dump-dir",
        str(save / "dumps"),
    )
    manifest = read_manifest(LocalTier(save / "snaps"), 9)
    assert manifest.world_size == 4
    by_name = {t.name: t for t in manifest.tensors}

    def boxes(name: str) -> list:
        return sorted((f.global_offsets, f.local_shape) for f in by_name[name].fragments)

    # column-wise, 5 rows: tp chunks 0:3 | 3:5, dp chunks inside: 0:2, 2:3 | 3:4, 4:5 (one per rank, none gathered)
    for name in ("state_dict/net.5.weight", "optimizer_states/0/state/net.5.weight/exp_avg_sq"):
        assert boxes(name) == [((0, 0), (2, 256)), ((2, 0), (1, 256)), ((3, 0), (1, 256)), ((4, 0), (1, 256))]
    assert boxes("state_dict/net.0.weight") == [((r, 0), (64, 32)) for r in (0, 64, 128, 192)]
    # row-wise: (Shard(0), Shard(1)); its bias (Shard(0), Replicate()) is written once per data-parallel shard
    assert boxes("state_dict/net.3.weight") == [((r, c), (128, 128)) for r in (0, 128) for c in (0, 128)]
    assert boxes("state_dict/net.3.bias") == [((0,), (128,)), ((128,), (128,))]

    # (a) one process, full tensors
    assert _assert_full_tensors_equal(save / "snaps", 9, save / "dumps" / "step-9.pt") == 6 + 6 * 3
    # (b) into ModelParallel(2), a 1-D FSDP2 mesh, through the callback
    proc = run(
        "--dir",
        str(tmp_path / "snaps"),
        "--out",
        str(tmp_path / "out.pt"),
        "--strategy",
        "mp",
        "--devices",
        "2",
        "--max-steps",
        "10",
        "--resume",
        str(save / "snaps" / step_dirname(9)),
        "--dump-at-start",
        str(tmp_path / "start.pt"),
    )
    assert proc.stdout.count("RESTORED step=9") == 2, proc.stdout
    assert "was taken with 4 process(es), this run has 2" in proc.stderr
    assert assert_state_equal(save / "dumps" / "step-9.pt", tmp_path / "start.pt") == 6 + 6 * 3
    print("FSDP2xTP(2x2) -> FSDP2(2) bytes read / needed per rank:", assert_reads_only_its_shards(proc, 2))


@pytest.mark.slow
def test_fsdp2_to_fsdp2_x_tensor_parallel_2d_mesh(tmp_path):
    """A 1-D ModelParallel(2) snapshot loads into a 2-D (dp=2, tp=2) FSDP2 x TP run: every rank's target box comes
    from the same _StridedShard geometry, bitwise equal to the consolidated state, each rank reading at most 1.05x
    the bytes it needs (512-byte checksum chunks: a row-wise target takes half of each saved row, 512 bytes)."""
    save = tmp_path / "1d"
    (save / "dumps").mkdir(parents=True)
    run(
        "--dir",
        str(save / "snaps"),
        "--out",
        str(save / "out.pt"),
        "--strategy",
        "mp",
        "--devices",
        "2",
        "--max-steps",
        "9",
        "--dump-steps",
        "9",
        "--dump-dir",
        str(save / "dumps"),
        "--chunk-bytes",
        "512",
    )
    proc = run(
        "--dir",
        str(tmp_path / "snaps"),
        "--out",
        str(tmp_path / "out.pt"),
        "--strategy",
        "mp",
        "--devices",
        "4",
        "--tp",
        "2",
        "--max-steps",
        "10",
        "--resume",
        str(save / "snaps" / step_dirname(9)),
        "--dump-at-start",
        str(tmp_path / "start.pt"),
    )
    assert proc.stdout.count("RESTORED step=9") == 4, proc.stdout
    assert assert_state_equal(save / "dumps" / "step-9.pt", tmp_path / "start.pt") == 6 + 6 * 3
    print("FSDP2(2) -> FSDP2xTP(2x2) bytes read / needed per rank:", assert_reads_only_its_shards(proc, 4))


@pytest.mark.slow
def test_model_parallel_to_one_process_through_the_callback(tmp_path, mp_run):
    proc = run(
        "--dir",
        str(tmp_path / "snaps"),
        "--out",
        str(tmp_path / "out.pt"),
        "--strategy",
        "single",
        "--max-steps",
        "10",
        "--resume",
        str(mp_run / "snaps" / step_dirname(9)),
        "--dump-at-start",
        str(tmp_path / "start.pt"),
    )
    assert "RESTORED step=9" in proc.stdout
    assert "was taken with 2 process(es), this run has 1" in proc.stderr
    assert_state_equal(mp_run / "dumps" / "step-9.pt", tmp_path / "start.pt")


# ---------------------------------------------------------------------------------------------------- in process


def _sharded_snapshot(
    root: Path,
    tensors: dict[str, torch.Tensor],
    world: int,
    chunk_bytes: int,
    mesh: tuple[int, ...] | None = None,
    placements: tuple = (("shard", 0),),
) -> Manifest:
    """Write a snapshot as ``world`` ranks of a mesh would, each staging its box of every tensor (a DTensor shard),
    and commit the merged manifest: the writer's own part and merge code, without processes."""
    backend = LocalTier(root)
    mesh = mesh or (world,)
    parts = []
    for rank in range(world):
        shard, shards = {}, {}
        for name, t in tensors.items():
            box = shard_boxes(t.shape, mesh, placements)[rank]
            if box.numel:  # empty shards are not written
                shard[name] = t[box.slices()].contiguous()
                shards[f"state_dict/{name}"] = (tuple(t.shape), box.offsets)
        staged = stage({"state_dict": shard})
        staged.shards = shards
        job = SnapshotJob(step=1, epoch=0, shared=staged, private=stage({"rank": rank}, "rank"))
        parts.append(write_part(backend, job, rank, "run", 64, chunk_bytes))
    parts[0]["state"] = {"state_dict": {name: {"$tensor": f"state_dict/{name}"} for name in tensors}}
    raw = merge_parts(parts, job.step, job.epoch, world, 64, chunk_bytes)
    text = json.dumps(raw)
    manifest = Manifest.from_json(text)
    backend.commit(f"{step_dirname(1)}/{MANIFEST_NAME}", text.encode())
    return manifest


@pytest.mark.parametrize("src_world,dst_world", [(4, 3), (2, 5), (3, 1), (1, 4)])
def test_box_reads_from_sharded_snapshot_read_only_what_each_rank_needs(tmp_path, src_world, dst_world):
    chunk = 4096
    g = torch.Generator().manual_seed(src_world * 10 + dst_world)
    tensors = {
        "big": torch.randn(1000, 300, generator=g),
        "wide": torch.randn(64, 2048, generator=g).double(),
        "bias": torch.randn(37, generator=g),
        "ints": torch.randint(0, 1 << 40, (501, 7), generator=g),
    }
    manifest = _sharded_snapshot(tmp_path, tensors, src_world, chunk)
    backend = LocalTier(tmp_path)
    entries = [t for t in manifest.tensors if t.name.startswith("state_dict/")]
    assert len(next(t for t in entries if t.name == "state_dict/big").fragments) == src_world
    for rank in range(dst_world):
        targets, expect = {}, {}
        for name, t in tensors.items():
            box = shard_boxes(t.shape, (dst_world,), [("shard", 0)])[rank]
            out = torch.full(box.shape, -1, dtype=t.dtype)
            targets[f"state_dict/{name}"] = ShardTarget(box, out)
            expect[name] = t[box.slices()]
        stats = ReadStats()
        before = backend.bytes_read
        state = read_section(backend, manifest, entries, manifest.state, targets=targets, stats=stats)
        read = backend.bytes_read - before
        for name, want in expect.items():
            assert torch.equal(state["state_dict"][name], want), (name, rank)
        big = sum(e.numel() * e.element_size() for n, e in expect.items() if n in ("big", "wide", "ints"))
        assert stats.bytes_read == read
        # every byte needed, plus at most ~2 chunks per tensor and shard boundary: below 5% for these shards
        assert read <= MAX_AMPLIFICATION * stats.bytes_needed, (rank, read, stats.bytes_needed)
        assert stats.bytes_needed >= big


def test_box_reads_verify_every_chunk_they_read(tmp_path):
    t = torch.arange(4096, dtype=torch.float32).reshape(256, 16)
    manifest = _sharded_snapshot(tmp_path, {"w": t}, 2, 1024)
    frag = next(f for f in manifest.tensors[0].fragments if f.global_offsets == (128, 0))
    path = tmp_path / step_dirname(1) / frag.object
    data = bytearray(path.read_bytes())
    data[frag.offset + 3000] ^= 0xFF  # inside chunk 2 of the second fragment: rows 128 + [46, 64)
    path.write_bytes(bytes(data))
    backend = LocalTier(tmp_path)
    ok = ShardTarget(Box((0, 0), (128, 16)), torch.empty(128, 16))  # the first fragment only: untouched
    read_section(backend, manifest, manifest.tensors, manifest.state, targets={"state_dict/w": ok})
    assert torch.equal(ok.out, t[:128])
    bad = ShardTarget(Box((170, 0), (10, 16)), torch.empty(10, 16))
    with pytest.raises(Exception, match="checksum mismatch in tensor 'state_dict/w'"):
        read_section(backend, manifest, manifest.tensors, manifest.state, targets={"state_dict/w": bad})
    # rows 128 + [32, 64) are exactly chunks 2 and 3 of that fragment: read straight into the target, still verified
    aligned = ShardTarget(Box((160, 0), (32, 16)), torch.empty(32, 16))
    with pytest.raises(Exception, match="checksum mismatch in tensor 'state_dict/w'"):
        read_section(backend, manifest, manifest.tensors, manifest.state, targets={"state_dict/w": aligned})
    clean = ShardTarget(Box((192, 0), (64, 16)), torch.empty(64, 16))  # chunks 4-7: intact
    read_section(backend, manifest, manifest.tensors, manifest.state, targets={"state_dict/w": clean})
    assert torch.equal(clean.out, t[192:])
    # a whole-tensor read of the corrupted fragment (its rows go straight into the output) fails too
    with pytest.raises(Exception, match="checksum mismatch in tensor 'state_dict/w'"):
        read_section(backend, manifest, manifest.tensors, manifest.state)


def test_box_reads_cast_into_targets_of_another_dtype(tmp_path):
    t = torch.randn(40, 8, dtype=torch.float64)
    manifest = _sharded_snapshot(tmp_path, {"w": t}, 3, 256)
    out = torch.empty(13, 8, dtype=torch.float32)
    state = read_section(
        LocalTier(tmp_path),
        manifest,
        manifest.tensors,
        manifest.state,
        targets={"state_dict/w": ShardTarget(Box((14, 0), (13, 8)), out)},
    )
    assert state["state_dict"]["w"] is out and torch.equal(out, t[14:27].float())


def test_whole_tensor_load_assembles_the_shards_of_every_rank(tmp_path):
    tensors = {"w": torch.randn(7, 5), "v": torch.randn(3)}
    _sharded_snapshot(tmp_path, tensors, 4, 64)  # 7 rows over 4: 2, 2, 2, 1; v: 1, 1, 1, 0
    # a 2x2 mesh, Shard(1) x Shard(0): blocks
    blocks = {"w": torch.randn(7, 5), "v": torch.randn(3, 6)}
    _sharded_snapshot(tmp_path / "2d", blocks, 4, 64, (2, 2), (("shard", 1), ("shard", 0)))
    state2 = load_snapshot(str(tmp_path / "2d"), 1)
    for name, t in blocks.items():
        assert torch.equal(state2["state_dict"][name], t)
    state = load_snapshot(str(tmp_path), 1)
    for name, t in tensors.items():
        assert torch.equal(state["state_dict"][name], t)


def test_merge_refuses_overlapping_or_disagreeing_shards(tmp_path):
    def part(rank: int, offsets, shape, dtype="float32", global_shape=(4, 2)):
        frag = {
            "object": f"o{rank}",
            "offset": 0,
            "nbytes": 4 * shape[0] * shape[1],
            "global_offsets": list(offsets),
            "local_shape": list(shape),
            "checksums": ["0" * 16],
        }
        return {
            "rank": rank,
            "objects": [],
            "tensors": [
                {"type": "tensor", "name": "w", "dtype": dtype, "global_shape": list(global_shape), "fragments": [frag]}
            ],
            "state": {"w": {"$tensor": "w"}} if rank == 0 else None,
            "rank_section": {},
        }

    merged = _merge_tensors([part(0, (0, 0), (2, 2)), part(1, (2, 0), (2, 2))])
    assert len(merged) == 1 and len(merged[0]["fragments"]) == 2
    with pytest.raises(SnapshotWriteError, match="two ranks wrote the same shared tensor 'w'"):
        _merge_tensors([part(0, (0, 0), (3, 2)), part(1, (2, 0), (2, 2))])
    with pytest.raises(SnapshotWriteError, match="ranks disagree about shared tensor 'w'"):
        _merge_tensors([part(0, (0, 0), (2, 2)), part(1, (2, 0), (2, 2), dtype="float64")])
    with pytest.raises(SnapshotWriteError, match="ranks disagree"):
        _merge_tensors([part(0, (0, 0), (2, 2)), part(1, (2, 0), (2, 2), global_shape=(5, 2))])


def test_manifest_with_overlapping_fragments_is_refused(tmp_path):
    manifest = _sharded_snapshot(tmp_path, {"w": torch.randn(4, 3)}, 2, 64)
    raw = json.loads(manifest.to_json())
    frags = raw["tensors"][0]["fragments"]
    # same element count, but [0:2] and [1:3] overlap and row 3 is missing
    frags[1]["global_offsets"] = [1, 0]
    with pytest.raises(ManifestError, match="overlap"):
        Manifest.from_json(json.dumps(raw))


class _FakeMesh:
    def __init__(self, shape, coord):
        self.shape, self._coord = tuple(shape), list(coord)

    def get_coordinate(self):
        return self._coord

    def size(self):
        return int(torch.tensor(self.shape).prod())


def _fake_dtensor(global_shape, mesh_shape, coord, placements):
    mesh = _FakeMesh(mesh_shape, coord)
    index = 0
    for c, m in zip(coord, mesh_shape):
        index = index * m + c
    box = shard_boxes(global_shape, mesh_shape, placements)[index]
    local = torch.zeros(box.shape)
    return SimpleNamespace(
        device_mesh=mesh, placements=placements, shape=torch.Size(global_shape), to_local=lambda: local
    )


def test_dtensor_box_writers_and_refused_placements():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    # 2-D mesh (dp=2, tp=2), Shard(0) on dp, Replicate on tp: the tp coordinate-0 rank of each dp group writes
    writers = {}
    for dp in range(2):
        for tp in range(2):
            box, writer = dtensor_box(_fake_dtensor((6, 4), (2, 2), (dp, tp), (Shard(0), Replicate())))
            writers[(dp, tp)] = (box, writer)
    assert [k for k, (_, w) in writers.items() if w] == [(0, 0), (1, 0)]
    assert writers[(1, 1)][0] == Box((3, 0), (3, 4))
    # 2-D Shard(0) x Shard(1): every rank writes its own block
    assert all(
        dtensor_box(_fake_dtensor((6, 4), (2, 2), (a, b), (Shard(0), Shard(1))))[1] for a in range(2) for b in range(2)
    )
    # an empty shard writes nothing (5 rows over 4 ranks: 2, 2, 1, 0)
    assert dtensor_box(_fake_dtensor((5, 2), (4,), (3,), (Shard(0),))) == (Box((5, 0), (0, 2)), False)
    # 2-D FSDP2 x TP (dp=2, tp=2), 5 rows: every rank writes its own box (tp chunk 0:3 | 3:5, dp chunk inside)
    fsdp_tp = (_StridedShard(0, split_factor=2), Shard(0))
    got = {(a, b): dtensor_box(_fake_dtensor((5, 4), (2, 2), (a, b), fsdp_tp)) for a in range(2) for b in range(2)}
    assert got == {
        (0, 0): (Box((0, 0), (2, 4)), True),
        (0, 1): (Box((3, 0), (1, 4)), True),
        (1, 0): (Box((2, 0), (1, 4)), True),
        (1, 1): (Box((4, 0), (1, 4)), True),
    }
    # a local shard of another shape than the geometry gives is refused
    wrong = SimpleNamespace(
        device_mesh=_FakeMesh((2, 2), (1, 1)),
        placements=fsdp_tp,
        shape=torch.Size((5, 4)),
        to_local=lambda: torch.zeros(2, 4),
    )
    with pytest.raises(CaptureError, match=r"local shard has shape \(2, 4\).*gives \(1, 4\)"):
        dtensor_box(wrong, "net.5.weight")
    # torch's strided semantics on a 1-D mesh: rank 0 holds rows 0, 1, 3, 4 of 6: not a box, refused by name
    strided = SimpleNamespace(
        device_mesh=_FakeMesh((2,), (0,)),
        placements=(_StridedShard(0, split_factor=2),),
        shape=torch.Size((6, 4)),
        to_local=lambda: torch.zeros(4, 4),
    )
    with pytest.raises(
        CaptureError,
        match=r"tensor 'w' is a DTensor with placements \(_StridedShard\(dim=0, sf=2\),\)"
        r".*not one box.*redistribute",
    ):
        dtensor_box(strided, "w")


def test_write_snapshot_records_the_arena_chunk_size(tmp_path):
    from lightning_snapshot.staging.arena import HostArena

    arena = HostArena(chunk_bytes=256)
    try:
        staged = arena.stage_async({"w": torch.randn(100, 10)}, lambda t: True, step=1)
        manifest = write_snapshot(
            LocalTier(tmp_path),
            LocalComm(),
            SnapshotJob(1, 0, staged.state, stage({}, "rank")),
            "run",
            prepare=staged.wait,
        )
        assert manifest.chunk_bytes == 256
        assert len(manifest.tensors[0].fragments[0].checksums) == 4000 // 256 + 1
        assert torch.equal(load_snapshot(str(tmp_path), 1)["w"], staged.state.tensors["w"])
    finally:
        arena.close()


# ---------------------------------------------------------------------------------------------------- data position


def _recorded(path: Path, world: int) -> list[list]:
    return [json.loads(Path(f"{path}.rank{r}").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def ddp_90(tmp_path_factory):
    """DDP(2) over 90 samples, batch 4: 45 samples and 12 batches per rank and epoch; stopped at step 6 (mid-epoch,
    48 samples of the epoch consumed by the two ranks together), snapshots at 3 and 6."""
    d = tmp_path_factory.mktemp("ddp-90")
    run(
        "--dir",
        str(d / "snaps"),
        "--out",
        str(d / "out.pt"),
        "--strategy",
        "ddp",
        "--max-steps",
        "6",
        "--samples",
        "90",
        "--record",
        str(d / "batches"),
    )
    return d


@pytest.mark.slow
@pytest.mark.parametrize("strategy,world", [("single", 1), ("mp", 4)])
def test_world_size_change_continues_from_the_saved_global_sample(tmp_path, ddp_90, strategy, world):
    n, batch = 90, 4
    # the epoch's global order: Lightning's DistributedSampler (seed 42 + epoch 0), the same for every world size
    order = torch.randperm(n, generator=torch.Generator().manual_seed(42)).tolist()
    saved = _recorded(ddp_90 / "batches", 2)
    for rank in range(2):  # the saving run: global samples r, r + 2, ... on rank r
        assert [i for b in saved[rank] for i in b[3]] == order[rank:48:2]
    left = order[48:]  # 42 samples
    per_rank = math.ceil(len(left) / world)  # a remainder that does not divide is padded with the first samples left
    padded = left + left[: per_rank * world - len(left)]
    epoch_batches = math.ceil(per_rank / batch)
    max_steps = 6 + epoch_batches + 1  # the rest of epoch 0, and the first batch of epoch 1
    proc = run(
        "--dir",
        str(tmp_path / "snaps"),
        "--out",
        str(tmp_path / "out.pt"),
        "--strategy",
        strategy,
        "--devices",
        str(world),
        "--max-steps",
        str(max_steps),
        "--samples",
        str(n),
        "--resume",
        str(ddp_90 / "snaps" / step_dirname(6)),
        "--record",
        str(tmp_path / "batches"),
    )
    assert proc.stdout.count("RESTORED step=6") == world, proc.stdout
    assert "the data continues from the saved global sample" in proc.stderr
    loader_len = math.ceil(math.ceil(n / world) / batch)  # batches per rank and epoch at the new world size
    seen = []
    for rank, batches in enumerate(_recorded(tmp_path / "batches", world)):
        epoch0 = [b for b in batches if b[0] == 0]
        want = padded[rank::world]
        assert [i for b in epoch0 for i in b[3]] == want, f"rank {rank} did not continue the global order"
        assert [len(b[3]) for b in epoch0] == [len(want[i : i + batch]) for i in range(0, len(want), batch)]
        assert [b[1] for b in epoch0] == list(range(6, 6 + epoch_batches)), "global steps"
        # the epoch ends at the loader's length, and the next one starts at batch 0 of epoch 1
        assert epoch0[-1][2] == loader_len - 1 and [b[:3] for b in batches[len(epoch0) :]] == [
            [1, 6 + epoch_batches, 0]
        ]
        seen += want
    assert set(seen) == set(left), "every sample left in the epoch is trained on, and no consumed one again"
