"""DDP with 3+ ranks resumes bitwise only when the restarted process all-reduces with the rebuilt bucket layout
(issue 12, item 3): lightning_snapshot.state.ddp_layout captures it, SnapshotCallback stores it in every rank's state of a
snapshot and gives it back in on_fit_start (see ddp_layout's docstring)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import assert_bitwise_equal, run_train
from torch import nn

from lightning_snapshot.backends import LocalTier
from lightning_snapshot.callback import DDP_LAYOUT_ENV
from lightning_snapshot.persist.writer import committed_steps
from lightning_snapshot.restore.loader import read_manifest
from lightning_snapshot.state.ddp_layout import apply_layout, capture_layout, check_layout

# the module-scoped fixtures below are shared by this file's tests: under pytest-xdist they run in one worker
pytestmark = pytest.mark.xdist_group("test_ddp_layout")

# ---------------------------------------------------------------------- 4 ranks, real SIGKILL, SnapshotCallback
#: train.py's model (Linear, BatchNorm, Linear: 6 parameters, so the gradient-ready order is a real permutation),
#: 4 CPU ranks on gloo, 8 steps per epoch, snapshots at steps 3, 6, 9, 12
DDP4 = ("--devices", "4", "--max-steps", "12", "--every", "3", "--batch-size", "2")
CRASH_AT = 5  # not a snapshot step; the only snapshot before it is step 3's (Crash waits until it is committed)


def _assert_all_ranks_equal(ref, got, ranks: int) -> None:
    assert_bitwise_equal(ref, got)
    for r in range(1, ranks):
        assert_bitwise_equal(ref.with_name(f"{ref.name}.rank{r}"), got.with_name(f"{got.name}.rank{r}"))


def _layouts(snaps, step: int) -> list:
    manifest = read_manifest(LocalTier(snaps), step)
    return [manifest.rank_section(r).state["ddp_layout"] for r in range(manifest.world_size)]


@pytest.fixture(scope="module")
def ddp4_killed(tmp_path_factory):
    """The snapshots of a 4-rank run SIGKILLed at step 5 (a pristine copy: every test resumes from its own)."""
    root = tmp_path_factory.mktemp("ddp4")
    run_train(root / "snaps", root / "crashed.pt", *DDP4, "--crash-at", str(CRASH_AT), expect_kill=True)
    assert committed_steps(LocalTier(root / "snaps")) == [3]
    return root / "snaps"


def _resume(killed, tmp_path, *args: str, step: int = 3):
    snaps = tmp_path / "snaps"
    if not snaps.exists():
        shutil.copytree(killed, snaps)
    out = tmp_path / "resumed.pt"
    proc = run_train(snaps, out, *DDP4, *args)
    assert proc.stdout.count(f"RESTORED step={step} ") == 4, f"every rank must resume from step {step}: {proc.stdout}"
    return out, proc


@pytest.mark.slow
def test_ddp4_sigkill_and_resume_is_bitwise_exact(ddp4_killed, tmp_path, reference_runs):
    layouts = _layouts(ddp4_killed, 3)
    assert all(layout == layouts[0] for layout in layouts), layouts
    # the rebuilt layout is not DDP's first-step layout (one bucket in parameter order): that is what makes 3+ ranks
    # differ without it
    assert [i for b in layouts[0]["buckets"] for i in b] != list(range(len(layouts[0]["numels"])))
    # The restarted process trains one step and ends (a snapshot of step 4, its first step: the layout it was given
    # back is stored again before its own rebuild), and a third process continues from there to the end.
    _resume(ddp4_killed, tmp_path, "--max-steps", "4")
    assert _layouts(tmp_path / "snaps", 4) == layouts
    out, _ = _resume(ddp4_killed, tmp_path, step=4)
    _assert_all_ranks_equal(reference_runs(*DDP4), out, 4)


@pytest.fixture(scope="module")
def ddp4_resumed_without_layout(ddp4_killed, tmp_path_factory):
    """The same resume with the layout turned off (``LIGHTNING_SNAPSHOT_DDP_LAYOUT=0``)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(DDP_LAYOUT_ENV, "0")
        out, _ = _resume(ddp4_killed, tmp_path_factory.mktemp("ddp4-off"))
    return out


@pytest.mark.slow
def test_ddp4_resume_without_the_layout_is_not_bitwise(ddp4_resumed_without_layout, reference_runs):
    """Negative control: the comparison above detects the difference the layout makes, so that test can fail."""
    with pytest.raises(AssertionError, match=r"result/model/.* differs"):
        assert_bitwise_equal(reference_runs(*DDP4), ddp4_resumed_without_layout)


@pytest.mark.slow
def test_ddp4_layout_that_does_not_fit_is_ignored_with_a_warning(ddp4_killed, tmp_path, ddp4_resumed_without_layout):
    """A stored layout is untrusted input: one that does not fit the model is named in a warning and the resume goes
    on without it, ending exactly as a resume without any layout (the negative control)."""
    killed = tmp_path / "killed"
    shutil.copytree(ddp4_killed, killed)
    path = killed / f"step-{committed_steps(LocalTier(killed))[0]:012d}" / "manifest.json"
    doc = json.loads(path.read_text())
    for section in doc["ranks"]:
        section["state"]["ddp_layout"]["numels"][0] += 1
    path.write_text(json.dumps(doc))
    out, proc = _resume(killed, tmp_path)
    assert (
        "holds a DDP gradient-bucket layout that is not applied (the DDP bucket layout does not fit this model:"
        " parameter 0 has 128 elements here, 129 in the layout); the resume goes on without it"
    ) in proc.stderr
    _assert_all_ranks_equal(ddp4_resumed_without_layout, out, 4)


# ---------------------------------------------------------------------- in one process (world size 1, gloo)
@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _ddp(bucket_cap_mb: float = 0.0001):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)


def _step(ddp) -> None:
    ddp(torch.randn(4, 8)).sum().backward()


def _live_buckets(ddp) -> list[list[int]]:
    params = ddp._build_params_for_reducer()[0]
    index = {id(p): i for i, p in enumerate(params)}
    return [[index[id(p)] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]


def test_capture_and_apply_round_trip(one_rank):
    ddp = _ddp()
    assert capture_layout(nn.Linear(2, 2)) is None
    assert capture_layout(ddp) is None  # not rebuilt yet
    _step(ddp)
    assert capture_layout(ddp) is None  # rebuild pending (DDP does it in the next forward)
    _step(ddp)
    layout = capture_layout(ddp)
    assert layout is not None and json.loads(json.dumps(layout)) == layout
    assert layout["buckets"] == _live_buckets(ddp) and len(layout["buckets"]) > 1
    fresh = _ddp()
    assert _live_buckets(fresh) == [list(range(len(layout["numels"])))]  # DDP's first-step layout
    apply_layout(fresh, layout)
    assert _live_buckets(fresh) == layout["buckets"]
    assert capture_layout(fresh) == layout
    for _ in range(3):  # the reducer rebuilds once more, to the same layout
        _step(fresh)
        assert _live_buckets(fresh) == layout["buckets"]
    assert fresh._has_rebuilt_buckets and capture_layout(fresh) == layout
    with pytest.raises(ValueError, match="before the DDP module's first forward"):
        apply_layout(fresh, layout)
    apply_layout(nn.Linear(2, 2), layout)  # not DDP: nothing to do
    apply_layout(_ddp(), None)


def test_capture_can_do_the_pending_rebuild(one_rank):
    ddp = _ddp()
    _step(ddp)
    layout = capture_layout(ddp, rebuild_pending=True)
    assert layout is not None and layout["buckets"] == _live_buckets(ddp) and ddp._has_rebuilt_buckets
    _step(ddp)
    assert capture_layout(ddp) == layout


def test_apply_refuses_a_layout_that_does_not_fit(one_rank):
    ddp = _ddp()
    _step(ddp)
    _step(ddp)
    layout = capture_layout(ddp)
    other = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 17), nn.Linear(17, 1)))
    with pytest.raises(ValueError, match="6 parameters requiring grad; this model has 4"):
        check_layout(other, layout)  # the same checks, changing nothing
    with pytest.raises(ValueError, match="6 parameters requiring grad; this model has 4"):
        apply_layout(other, layout)
    fresh = _ddp()
    check_layout(fresh, layout)
    assert _live_buckets(fresh) == [list(range(6))]
    check_layout(fresh, None)
    check_layout(nn.Linear(2, 2), "not a layout")  # not DDP: nothing to check
    for junk in ("x", [1], {"version": 1, "buckets": "x"}, {**layout, "numels": None}):
        with pytest.raises(ValueError):
            check_layout(fresh, junk)
    wider = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    )
    with pytest.raises(ValueError, match="parameter 4 has 32 elements here, 16 in the layout"):
        apply_layout(wider, layout)
    with pytest.raises(ValueError, match="exactly once"):
        apply_layout(_ddp(), {**layout, "buckets": [[0, 1, 2], [3, 4, 4]]})
    with pytest.raises(ValueError, match="version"):
        apply_layout(_ddp(), {"buckets": layout["buckets"]})
    with pytest.raises(ValueError, match="malformed"):
        apply_layout(_ddp(), {**layout, "buckets": [[0, 1, 2], []]})
    with pytest.raises(ValueError, match="malformed DDP bucket layout: dtypes="):  # (was a StopIteration)
        apply_layout(_ddp(), {**layout, "dtypes": layout["dtypes"][:-1]})


def test_apply_carries_a_python_comm_hook_over_and_refuses_a_builtin_one(one_rank):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = _ddp()
    _step(ddp)
    _step(ddp)
    layout = capture_layout(ddp)
    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    fresh = _ddp()
    if not hasattr(fresh, "_comm_hooks"):
        pytest.skip("this torch does not keep Python comm hooks in DistributedDataParallel._comm_hooks")
    fresh.register_comm_hook(None, counting_hook)
    apply_layout(fresh, layout)
    _step(fresh)
    assert sorted(calls) == list(range(len(layout["buckets"])))  # the hook runs once per (saved) bucket
    builtin = _ddp()
    builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    with pytest.raises(ValueError, match="cannot carry the comm hook"):
        apply_layout(builtin, layout)
