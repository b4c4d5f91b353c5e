"""Consolidated export: safetensors and torch files equal the snapshot, streaming, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from test_bad_input import fit

from lightning_snapshot import load_snapshot
from lightning_snapshot.backends import LocalTier
from lightning_snapshot.cli.export import export_snapshot
from lightning_snapshot.cli.main import main
from lightning_snapshot.dist.comm import LocalComm
from lightning_snapshot.errors import ManifestError
from lightning_snapshot.persist.writer import SnapshotJob, write_snapshot
from lightning_snapshot.staging import stage


def test_safetensors_and_torch_exports_equal_the_snapshot(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    snaps = tmp_path / "snaps"
    fit(snaps, 6)
    ref = load_snapshot(str(snaps))
    assert main(["export", str(snaps), str(tmp_path / "w.safetensors"), "--quiet"]) == 0
    weights = safetensors.load_file(str(tmp_path / "w.safetensors"))
    assert weights.keys() == ref["state_dict"].keys()
    assert all(torch.equal(weights[k], ref["state_dict"][k]) for k in weights)

    assert main(["export", str(snaps), str(tmp_path / "full.pt"), "--format", "torch", "--step", "3", "--quiet"]) == 0
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    ref3 = load_snapshot(str(snaps), step=3)
    assert full["global_step"] == 3 and full["loops"] == ref3["loops"]
    for pid, state in ref3["optimizer_states"][0]["state"].items():
        for k, v in state.items():
            assert torch.equal(full["optimizer_states"][0]["state"][pid][k], v)


def test_tied_weights_are_exported_under_both_names(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    w = torch.randn(5, 3)
    state = {"state_dict": {"embed.weight": w, "head.weight": w}}
    write_snapshot(LocalTier(tmp_path), LocalComm(), SnapshotJob(1, 0, stage(state), stage({}, "rank")), "r")
    export_snapshot(str(tmp_path), tmp_path / "out.safetensors", progress=False)
    out = safetensors.load_file(str(tmp_path / "out.safetensors"))
    assert torch.equal(out["embed.weight"], w) and torch.equal(out["head.weight"], w)


_PEAK = """
import resource, sys, torch
from lightning_snapshot.cli.export import export_snapshot
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
export_snapshot(sys.argv[1], sys.argv[2], fmt=sys.argv[3], progress=False)
print(before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_streams_one_tensor_at_a_time(tmp_path, fmt):
    tensor_mb, count = 32, 12  # 384 MB of weights
    state = {"state_dict": {f"layer{i}.weight": torch.full((tensor_mb << 18,), float(i)) for i in range(count)}}
    write_snapshot(LocalTier(tmp_path / "snaps"), LocalComm(), SnapshotJob(1, 0, stage(state), stage({}, "rank")), "r")
    del state
    out = tmp_path / f"out.{fmt}"
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK, str(tmp_path / "snaps"), str(out), fmt],
        capture_output=True,
        text=True,
        check=True,
    )
    before_kb, peak_kb = map(int, proc.stdout.split())
    grew_mb = (peak_kb - before_kb) / 1024
    # a whole-model export would grow by ~384 MB; streaming stays within a few tensors
    assert grew_mb < 4 * tensor_mb, f"export grew resident memory by {grew_mb:.0f} MB"
    assert out.stat().st_size >= count * (tensor_mb << 20)


def test_a_missing_fragment_names_the_tensor(tmp_path):
    state = {"state_dict": {"a": torch.ones(4, 4), "b": torch.zeros(2)}}
    write_snapshot(LocalTier(tmp_path), LocalComm(), SnapshotJob(1, 0, stage(state), stage({}, "rank")), "r")
    path = tmp_path / "step-000000000001" / "manifest.json"
    m = json.loads(path.read_text())
    entry = next(t for t in m["tensors"] if t["name"] == "state_dict/a")
    entry["fragments"] = []
    path.write_text(json.dumps(m))
    with pytest.raises(ManifestError, match=r"state_dict/a.*missing region"):
        export_snapshot(str(tmp_path), tmp_path / "out.safetensors", progress=False)


def test_unknown_format_is_refused(tmp_path):
    from lightning_snapshot.errors import ConfigError

    with pytest.raises(ConfigError, match="safetensors, torch"):
        export_snapshot(str(tmp_path), tmp_path / "x", fmt="onnx")


def test_load_snapshot_reads_only_the_keys_asked_for_and_fills_a_state_dict_in_place(tmp_path):
    snaps = tmp_path / "snaps"
    _, _, model = fit(snaps, 6)
    tier = LocalTier(snaps)
    full = load_snapshot(tier)
    part = load_snapshot(tier, keys=["state_dict", "optimizer_states/0/param_groups"])
    assert set(part) == {"state_dict", "optimizer_states"}
    assert part["optimizer_states"]["0"]["param_groups"] == full["optimizer_states"][0]["param_groups"]
    assert all(torch.equal(part["state_dict"][k], v) for k, v in full["state_dict"].items())
    target = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    out = load_snapshot(tier, keys=["state_dict"], into=target)
    for k, v in target.items():
        assert out["state_dict"][k] is not None and torch.equal(v, full["state_dict"][k])
        assert out["state_dict"][k].data_ptr() == v.data_ptr()  # read straight into the given tensor
    from lightning_snapshot.errors import SnapshotNotFoundError

    with pytest.raises(SnapshotNotFoundError, match="no 'nothing'"):
        load_snapshot(tier, keys=["nothing"])
