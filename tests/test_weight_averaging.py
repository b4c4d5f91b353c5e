"""Lightning's ``EMAWeightAveraging`` through a tensor state part: its averaged model takes the weights' path (staged
in the background, stored once under DDP, resharded on load), and a run killed with SIGKILL and resumed ends bitwise
equal to one that never stopped, the averaged weights swapped into the model at the end of fit included.

End to end in real subprocesses (tests/scripts/train.py ``--ema``); in process, a tensor part registered by the test,
written as 2 ranks would and restored into 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_bitwise_equal, assert_fresh, assert_resumed, run_train

from lightning_snapshot import load_snapshot
from lightning_snapshot.backends import LocalTier
from lightning_snapshot.fit.replicas import ReplicaChecker, named_tensors
from lightning_snapshot.format.manifest import MANIFEST_NAME, Manifest, step_dirname
from lightning_snapshot.persist.commit import merge_parts
from lightning_snapshot.persist.writer import SnapshotJob, committed_steps, write_part
from lightning_snapshot.plan.planner import shard_boxes
from lightning_snapshot.restore.loader import read_manifest, read_section
from lightning_snapshot.restore.targets import Templates, restore_targets
from lightning_snapshot.staging import stage
from lightning_snapshot.state.capture import optimized_key
from lightning_snapshot.state.parts import TENSOR_PARTS, CaptureContext, Part, Phase, Registry, RestoreContext

EMA = "EMAWeightAveraging"
PART = ("tensor_parts", "weight_averaging", EMA)


def _averaged(state: dict) -> dict:
    """The averaged model's state a snapshot holds (load_snapshot's dict)."""
    node = state
    for key in PART:
        node = node[key]
    return node


def _check_snapshot_of_ema(snaps: Path, step: int, world: int) -> None:
    """The snapshot holds the averaged model's parameters on the weights' path, each stored once (one fragment,
    whole), and none in the late state; its buffers in each rank's section (each rank's own)."""
    manifest = read_manifest(LocalTier(snaps), step)
    assert manifest.world_size == world
    entries = [t for t in manifest.tensors if t.name.startswith("tensor_parts/weight_averaging/")]
    assert entries and any(t.name.endswith("/n_averaged") for t in entries)
    for t in entries:
        assert len(t.fragments) == 1 and t.fragments[0].local_shape == t.global_shape, t
    for rank in range(world):
        section = manifest.rank_section(rank)
        assert section is not None
        # (only the averaged buffers, each rank's own: the averaged parameters are not copied into a rank's section)
        mine = [t.name for t in section.tensors if "module.net." in t.name]
        assert mine and all("running_" in n or "num_batches" in n for n in mine), mine
        own = section.state["late"]["lightning_snapshot"]
        assert "checkpoint_state_dict" not in own and "current_model_state" not in section.state["late"]


@pytest.mark.slow
def test_ema_sigkill_and_resume_is_bitwise_exact(tmp_path, reference_runs, crash_rng):
    args = ("--ema", "--shuffle", "--dropout", "0.2", "--val-every", "5")
    ref = reference_runs(*args)
    crash_at = crash_rng.randint(5, 18)
    snaps = tmp_path / "snaps"
    assert_fresh(run_train(snaps, tmp_path / "crashed.pt", *args, "--crash-at", str(crash_at), expect_kill=True))
    committed = committed_steps(LocalTier(snaps))
    assert committed, "the killed run committed no snapshot"
    _check_snapshot_of_ema(snaps, committed[0], 1)
    proc = run_train(snaps, tmp_path / "resumed.pt", *args)
    assert_resumed(proc, committed[0], snaps)
    assert "not created with WeightAveraging" not in proc.stderr + proc.stdout
    try:
        n = assert_bitwise_equal(ref, tmp_path / "resumed.pt", since=committed[0])
    except AssertionError as e:
        raise AssertionError(f"crash at global_step {crash_at}: {e}") from None
    got = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert got["averaged"]["n_averaged"].item() == 20 and n > 20
    assert got["callbacks"][EMA] == {"latest_update_step": 20}
    # (the end-of-fit swap: the model's weights are the averaged ones)
    assert all(torch.equal(v, got["averaged"][f"module.{k}"]) for k, v in got["model"].items())


@pytest.fixture(scope="module")
def ema_ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 2-rank DDP run with EMAWeightAveraging, uninterrupted, and the same run killed at step 7 and resumed."""
    root = tmp_path_factory.mktemp("ema_ddp")
    args = ("--ema", "--devices", "2", "--shuffle", "--dropout", "0.2", "--max-steps", "12", "--every", "2")
    run_train(root / "ref", root / "ref.pt", *args)
    snaps = root / "snaps"
    run_train(snaps, root / "crashed.pt", *args, "--crash-at", "7", expect_kill=True)
    committed = committed_steps(LocalTier(snaps))
    proc = run_train(snaps, root / "resumed.pt", *args)
    return {"root": root, "snaps": snaps, "ref": root / "ref", "proc": proc, "from": committed[0]}  # type: ignore


@pytest.mark.slow
def test_ema_ddp_two_ranks_sigkill_and_resume_is_bitwise_exact(ema_ddp):
    root = ema_ddp["root"]
    assert_resumed(ema_ddp["proc"], ema_ddp["from"], ema_ddp["snaps"], ranks=2)
    for suffix in ("", ".rank1"):
        assert_bitwise_equal(root / f"ref.pt{suffix}", root / f"resumed.pt{suffix}")
    _check_snapshot_of_ema(ema_ddp["snaps"], 12, 2)


@pytest.mark.slow
def test_ema_ddp_snapshot_loads_into_one_process(ema_ddp):
    """The 2-rank snapshot of the end of fit (taken before on_train_end swaps the averaged weights in) loads in one
    process: its averaged model is the one the run ended with, its weights the model's own."""
    ref = torch.load(ema_ddp["root"] / "ref.pt", weights_only=True)
    state = load_snapshot(str(ema_ddp["ref"]), 12)
    averaged = _averaged(state)
    assert averaged.keys() == {k for k in ref["averaged"] if "running_" not in k and "num_batches" not in k}
    for k, v in averaged.items():
        assert torch.equal(v, ref["averaged"][k]), k
    assert any(not torch.equal(state["state_dict"][k], v) for k, v in ref["model"].items())
    # the averaged buffers: each rank's own
    for rank, suffix in ((0, ""), (1, ".rank1")):
        want = torch.load(ema_ddp["root"] / f"ref.pt{suffix}", weights_only=True)["averaged"]
        buffers = load_snapshot(str(ema_ddp["ref"]), 12, rank=rank)["rank_state"]["weight_averaging_buffers"][EMA]
        assert buffers and all(torch.equal(v, want[k]) for k, v in buffers.items()), rank
    # a selection of it too
    only = load_snapshot(str(ema_ddp["ref"]), 12, keys=["/".join(PART)])
    assert torch.equal(_averaged(only)["n_averaged"], ref["averaged"]["n_averaged"])


# ---------------------------------------------------------------------------------------------------- in process


class Holder:
    """Test-only tensor state: a weight matrix (sharded like a DTensor when saved by 2 ranks) and a counter."""

    def __init__(self, w: torch.Tensor, count: torch.Tensor) -> None:
        self.w, self.count = w, count
        self.restored: object = "never"


def _write_two_ranks(root: Path, tree: dict, name: str) -> Manifest:
    """Write ``tree`` (the shared tensor state) as 2 ranks of a mesh would: the tensor ``name`` as each rank's
    Shard(0) box, the rest (replicated) by rank 0; merge and commit the manifest (the writer's own code)."""
    backend = LocalTier(root)
    part_tree = tree[TENSOR_PARTS]
    full = part_tree["holder"]["w"]
    parts = []
    for rank in range(2):
        box = shard_boxes(full.shape, (2,), [("shard", 0)])[rank]
        local = {"w": full[box.slices()].contiguous()}
        if rank == 0:
            local["count"] = part_tree["holder"]["count"]
        staged = stage({TENSOR_PARTS: {"holder": local}})
        staged.shards = {name: (tuple(full.shape), box.offsets)}
        job = SnapshotJob(step=1, epoch=0, shared=staged, private=stage({"rank": rank}, "rank"))
        parts.append(write_part(backend, job, rank, "run", 64, 4096))
    parts[0]["state"] = stage(tree).tree
    raw = merge_parts(parts, 1, 0, 2, 64, 4096)
    text = json.dumps(raw)
    backend.commit(f"{step_dirname(1)}/{MANIFEST_NAME}", text.encode())
    return Manifest.from_json(text)


def test_a_registered_tensor_part_is_resharded_from_two_ranks_to_one(tmp_path):
    saved = Holder(torch.arange(40 * 6, dtype=torch.float32).reshape(40, 6), torch.tensor(7))
    live = Holder(torch.zeros(40, 6), torch.tensor(0))
    holders = [saved]

    def restore(ctx: RestoreContext, state: object) -> None:
        holders[0].restored = state

    registry = Registry()  # (the engine's registry holds the built-in parts, which want a trainer)
    part = registry.register(
        Part(
            "holder",
            lambda ctx: {"w": holders[0].w, "count": holders[0].count},
            restore,
            Phase.LOAD,
            tensors=True,
            stable=lambda ctx: [holders[0].w],
        )
    )
    assert part.path == (TENSOR_PARTS, "holder")
    ctx = CaptureContext(None, None, consumed=0, epoch=0, boundary=False, token=None, memo={})
    tree, stable = registry.capture_tensors(ctx)
    assert len(stable) == 1 and stable[0] is saved.w and tree[TENSOR_PARTS]["holder"]["w"] is saved.w
    manifest = _write_two_ranks(tmp_path, tree, f"{TENSOR_PARTS}/holder/w")
    entry = next(t for t in manifest.tensors if t.name == f"{TENSOR_PARTS}/holder/w")
    assert sorted(f.global_offsets for f in entry.fragments) == [(0, 0), (20, 0)]  # (2 ranks' shards)
    # one process: the live tensors are the read's targets, the part's restore gets them
    holders[0] = live
    live_tree, _ = registry.capture_tensors(ctx)
    targets = restore_targets(None, Templates({}, None), manifest.state, "test", live_tree)
    assert targets[f"{TENSOR_PARTS}/holder/w"] is live.w
    state = read_section(LocalTier(tmp_path), manifest, manifest.tensors, manifest.state, targets=targets)
    rctx = RestoreContext(None, None, 1, "test")
    registry.restore(Phase.LOAD, rctx, state, None)
    assert isinstance(live.restored, dict)
    assert live.restored["w"].data_ptr() == live.w.data_ptr()  # (read in place)
    assert torch.equal(live.w, saved.w)
    assert torch.equal(live.restored["count"], saved.count)
    # a tensors=True part is shared, and its path under the tensor parts
    with pytest.raises(ValueError, match="shared, not per rank"):
        Part("x", lambda c: None, lambda c, s: None, Phase.LOAD, tensors=True, per_rank=True)
    with pytest.raises(ValueError, match="must start with"):
        Part("x", lambda c: None, lambda c, s: None, Phase.LOAD, tensors=True, path=("state_dict", "x"))


def test_a_tensor_parts_stable_tensors_are_replica_checked():
    """The replica check compares a tensor part's stable tensors with the weights (named by their place in the part's
    state), and names the rank whose copy differs."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    averaged = torch.nn.Linear(3, 2)
    tree = {TENSOR_PARTS: {"avg": {"key": averaged.state_dict(keep_vars=True)}}}
    stable = list(averaged.parameters())
    checker = ReplicaChecker(1)
    names, tensors = checker.select(
        model, [opt], set(), optimized_key([opt]), None, extra=lambda: named_tensors(tree, stable)
    )
    assert names[-2:] == [f"{TENSOR_PARTS}/avg/key/weight", f"{TENSOR_PARTS}/avg/key/bias"]
    assert tensors[-1] is averaged.bias

    def all_gather(mine: list[int]) -> list[list[int]]:
        other = list(mine)
        other[-1] += 1  # rank 1's copy of the averaged bias differs
        return [mine, other, list(mine)]

    result = checker.check(3, names, tensors, all_gather)
    assert [(m.tensor, m.ranks) for m in result.disagree] == [(f"{TENSOR_PARTS}/avg/key/bias", (1,))]
