"""DDP with 3+ ranks resumes bitwise only when the restarted process all-reduces with the rebuilt bucket layout
(issue 12, item 3): lightning_snapshot.ddp_layout captures it and gives it back (see that module's docstring)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_script
from torch import nn

from lightning_snapshot.ddp_layout import apply_layout, capture_layout


def _differing(ref_path: Path, got_path: Path) -> list[str]:
    """Names of the weights / optimizer tensors that differ bitwise (the torch RNG is not compared: nothing in
    ddp4_train.py draws from it, and Lightning's checkpoint does not carry it)."""
    ref = torch.load(ref_path, weights_only=True)
    got = torch.load(got_path, weights_only=True)
    assert got["global_step"] == ref["global_step"]
    bad = []
    for section in ("model", "optimizer"):
        assert got[section].keys() == ref[section].keys()
        for k, v in ref[section].items():
            w = got[section][k]
            if not torch.equal(v.view(torch.uint8) if v.dim() else v, w.view(torch.uint8) if w.dim() else w):
                bad.append(f"{section}/{k}")
    if not torch.equal(ref["lr"], got["lr"]):
        bad.append("lr")
    return bad


@pytest.fixture(scope="module")
def ddp4_runs(tmp_path_factory):
    """An uninterrupted 12-step run on 4 CPU ranks, and a 4-step run that saved a checkpoint and the layout."""
    root = tmp_path_factory.mktemp("ddp4")
    run_script("ddp4_train.py", "--out", str(root / "ref.pt"))
    proc = run_script("ddp4_train.py", "--out", str(root / "stop.pt"), "--dir", str(root / "d"), "--stop-at", "4")
    return root, proc


@pytest.mark.slow
def test_ddp4_resume_with_layout_is_bitwise(ddp4_runs):
    root, stop = ddp4_runs
    layout = json.loads((root / "d" / "layout.json").read_text())
    assert f"LAYOUT {json.dumps(layout)}" in stop.stdout
    initial = list(range(len(layout["numels"])))
    # the rebuilt layout is not the initial one (one bucket in parameter order): that is what makes item 3 bite
    assert [i for b in layout["buckets"] for i in b] != initial
    run_script("ddp4_train.py", "--out", str(root / "res.pt"), "--dir", str(root / "d"), "--resume")
    assert _differing(root / "ref.pt", root / "res.pt") == []


@pytest.mark.slow
def test_ddp4_resume_without_layout_differs(ddp4_runs):
    """Negative control: the same resume without apply_layout is not bitwise (so the test above tests something)."""
    root, _ = ddp4_runs
    run_script("ddp4_train.py", "--out", str(root / "neg.pt"), "--dir", str(root / "d"), "--resume", "--no-apply")
    assert _differing(root / "ref.pt", root / "neg.pt") != []


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
        apply_layout(other, layout)
    wider = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2)))
    with pytest.raises(ValueError, match="parameter 4 has 32 elements here, 16 in the layout"):
        apply_layout(wider, layout)
    with pytest.raises(ValueError, match="exactly once"):
        apply_layout(_ddp(), {**layout, "buckets": [[0, 1, 2], [3, 4, 4]]})
    with pytest.raises(ValueError, match="version"):
        apply_layout(_ddp(), {"buckets": layout["buckets"]})
    with pytest.raises(ValueError, match="malformed"):
        apply_layout(_ddp(), {**layout, "buckets": [[0, 1, 2], []]})


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
