"""The replica check's parts, in one process: the checksum sees a change of one ulp in every dtype, the verdict names
the rank that differs, the rotation covers every tensor in ``slices`` snapshots, newly trained parameters and tensors
that disagreed are compared at the next checks, the plan keeps no replaced tensor alive, the manifest records the
outcome (and rejects a malformed record), and a resume skips a snapshot whose replicas disagreed.
The end-to-end checks with real DDP processes are in tests/test_replicas.py (this file has another name: pytest
imports test modules by their base name)."""

from __future__ import annotations

import gc
import json
import math
import re
import weakref

import pytest
import torch

from lightning_snapshot.config import SnapshotConfig
from lightning_snapshot.errors import ConfigError, ManifestError
from lightning_snapshot.fit.replicas import MAX_NAMED, ReplicaChecker, checksums, verdict
from lightning_snapshot.format.manifest import Manifest, ReplicaRecord
from lightning_snapshot.restore.policy import Candidate, plan_resume


def _one_ulp(t: torch.Tensor, index: int = 0) -> torch.Tensor:
    out = t.clone()
    flat = out.view(-1)
    if out.is_floating_point():
        flat[index] = torch.nextafter(flat[index], torch.tensor(math.inf, dtype=out.dtype))
    elif out.dtype == torch.bool:
        flat[index] = ~flat[index]
    else:
        flat[index] += 1
    return out


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool]
)
def test_a_change_of_one_ulp_changes_the_checksum(dtype):
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(257, generator=g) * 100).to(dtype)
    for index in (0, 128, 256):
        changed = _one_ulp(base, index)
        assert not torch.equal(base, changed)
        a, b = checksums([base, changed])
        assert a != b, (dtype, index)
    assert checksums([base]) == checksums([base.clone()])


def test_checksums_of_complex_empty_and_strided_tensors():
    m = torch.randn(6, 5)
    t = m.t()  # not contiguous: the same values as its contiguous copy give the same checksum
    assert checksums([t]) == checksums([t.contiguous()])
    assert checksums([t]) != checksums([_one_ulp(t.contiguous(), 7)])
    c = torch.randn(4, dtype=torch.complex64)
    c2 = c.clone()
    c2[1] = complex(c2[1].real, float(torch.nextafter(c2[1].imag, torch.tensor(math.inf))))
    assert checksums([c]) != checksums([c2])
    base = torch.randn(11)
    assert base[1:].data_ptr() % 8  # a view at an odd offset: the same checksum as the same values aligned
    assert checksums([base[1:]]) == checksums([base[1:].clone()])
    assert checksums([torch.zeros(0), torch.zeros((), dtype=torch.int64)]) == [0, 0]
    assert checksums([]) == []


@pytest.mark.parametrize("batch_bytes", [64, 1 << 20], ids=["many-batches", "one-batch"])
def test_a_batched_checksum_is_each_tensor_own_and_sees_one_ulp_in_any_batch(monkeypatch, batch_bytes):
    """Tensors checksummed in batches (as on a GPU, where tensors up to BATCH_BYTES are) each get their own value,
    whatever batch they fall in and however many empty tensors sit among them; one ulp changes that tensor's alone."""
    import lightning_snapshot.fit.replicas as replicas

    monkeypatch.setattr(replicas, "SMALL_BYTES", 1 << 20)
    monkeypatch.setattr(replicas, "BATCH_BYTES", batch_bytes)
    g = torch.Generator().manual_seed(1)
    tensors = [torch.zeros(0), torch.zeros(0, dtype=torch.int64)] + [
        (torch.randn(n, generator=g) * 1e3).to(dtype)
        for n, dtype in [
            (3, torch.float32),
            (0, torch.float32),
            (40, torch.float32),
            (9, torch.bfloat16),
            (17, torch.int8),
            (5, torch.float64),
            (33, torch.float32),
            (1, torch.float32),
        ]
    ]
    own = [checksums([t])[0] for t in tensors]  # each alone: a batch of one
    assert checksums(tensors) == own
    for k, t in enumerate(tensors):
        if t.numel():
            changed = checksums(tensors[:k] + [_one_ulp(t, t.numel() - 1)] + tensors[k + 1 :])
            assert [i for i, (a, b) in enumerate(zip(own, changed)) if a != b] == [k]


def test_the_verdict_names_the_rank_that_differs_from_the_majority():
    v = verdict(12, ["a", "b", "c"], [[1, 5, 9], [1, 5, 9], [1, 6, 9], [1, 5, 9]])
    assert not v.ok and v.checked == 3 and v.world_size == 4
    assert [(m.tensor, m.ranks) for m in v.disagree] == [("b", (2,))]
    text = v.describe()
    assert "step 12" in text and "'b' (rank 2)" in text and "1 of 3 tensors" in text and "BackboneFinetuning" in text
    # two ranks: no majority, the lowest rank's value is the reference
    assert [m.ranks for m in verdict(1, ["a"], [[1], [2]]).disagree] == [(1,)]
    assert verdict(1, ["a"], [[3], [3]]).ok


def test_the_record_names_at_most_max_named_tensors_and_counts_them_all():
    names = [f"t{i}" for i in range(MAX_NAMED + 5)]
    v = verdict(3, names, [[0] * len(names), [1] * len(names)])
    rec = v.record()
    assert rec["checked"] == rec["disagree_count"] == len(names)
    assert len(rec["disagree"]) == MAX_NAMED and "and 5 more" in v.describe()


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(8))
        self.register_buffer("running", torch.zeros(8))


def _trained(opt) -> tuple:
    from lightning_snapshot.state.capture import optimized_key

    return optimized_key([opt])


def _model_and_optimizer():
    torch.manual_seed(0)
    model = _Model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    loss = sum(p.sum() for p in model.parameters())
    loss.backward()
    opt.step()
    return model, opt


def test_every_tensor_is_compared_within_slices_snapshots_and_buffers_never():
    model, opt = _model_and_optimizer()
    for slices in (1, 2, 3, 4, 7):
        checker = ReplicaChecker(slices)
        seen: list[set[str]] = []
        for _ in range(2 * slices):
            names, tensors = checker.select(model, [opt], set(), _trained(opt))
            assert len(names) == len(tensors)
            seen.append(set(names))
        all_names = set().union(*seen)
        assert "running" not in all_names and "layers.0.weight" in all_names
        assert "optimizer 0 exp_avg of layers.7.bias" in all_names
        assert len(all_names) == 16 + 16 * 3  # parameters, and step, exp_avg, exp_avg_sq of each
        for start in range(slices):  # any `slices` consecutive checks cover everything
            assert set().union(*seen[start : start + slices]) == all_names, (slices, start)
        if slices > 1:
            assert all(len(s) < len(all_names) for s in seen)


def test_ignored_parameters_are_not_compared():
    model, opt = _model_and_optimizer()
    names, _ = ReplicaChecker(1).select(model, [opt], {"layers.3.weight"}, _trained(opt))
    assert not any("layers.3.weight" in n for n in names) and "layers.3.bias" in names


def test_a_newly_trained_parameter_is_compared_at_the_next_checks_and_a_disagreeing_one_until_it_agrees():
    model = _Model()
    for p in model.layers[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    checker = ReplicaChecker(8)
    checker.select(model, [opt], set(), _trained(opt))
    for p in model.layers[0].parameters():  # an unfreeze: BackboneFinetuning adds a parameter group
        p.requires_grad_(True)
    opt.add_param_group({"params": list(model.layers[0].parameters())})
    for _ in range(8):  # compared at each of the next max(2, slices) checks
        names, _ = checker.select(model, [opt], set(), _trained(opt))
        assert "layers.0.weight" in names
    later = [checker.select(model, [opt], set(), _trained(opt))[0] for _ in range(8)]
    assert sum("layers.0.weight" in n for n in later) == 1  # then only in its slice (once in 8)
    # a tensor that disagreed is compared at every check until it agrees
    names, tensors = checker.select(model, [opt], set(), _trained(opt))
    checker.check(5, names, tensors, lambda own: [own, [v + (n == names[0]) for v, n in zip(own, names)]])
    stuck = names[0]
    for _ in range(8):
        names, tensors = checker.select(model, [opt], set(), _trained(opt))
        assert stuck in names
        checker.check(6, names, tensors, lambda own: [own, [v + (n == stuck) for v, n in zip(own, names)]])
    names, tensors = checker.select(model, [opt], set(), _trained(opt))
    checker.check(7, names, tensors, lambda own: [own, own])
    assert sum(stuck in checker.select(model, [opt], set(), _trained(opt))[0] for _ in range(7)) <= 1


def test_the_plan_keeps_no_replaced_tensor_alive():
    model, opt = _model_and_optimizer()
    checker = ReplicaChecker(2)
    token = object()
    checker.select(model, [opt], set(), _trained(opt), token)
    old = opt.state[model.layers[0].weight]["exp_avg"]
    ref = weakref.ref(old)
    opt.state[model.layers[0].weight]["exp_avg"] = old.clone()  # replaced (a callback resets the state)
    del old
    gc.collect()
    assert ref() is None, "the replica check's plan kept a replaced tensor alive"


def test_the_plan_is_reused_while_the_capture_plan_holds_and_made_again_after():
    model, opt = _model_and_optimizer()
    checker = ReplicaChecker(1)
    token = object()
    names, _ = checker.select(model, [opt], set(), _trained(opt), token)
    model.extra = torch.nn.Linear(2, 2)  # a new parameter: the capture plan no longer holds (a new token)
    again, _ = checker.select(model, [opt], set(), _trained(opt), token)
    assert again == names  # (same token: the plan made for it)
    fresh, _ = checker.select(model, [opt], set(), _trained(opt), object())
    assert "extra.weight" in fresh and "extra.weight" not in names


# ------------------------------------------------------------------------------------------- the manifest


def _manifest_json(replicas) -> str:
    d = {
        "format_version": 1,
        "step": 4,
        "epoch": 0,
        "world_size": 2,
        "created_unix": 1.0,
        "library_version": "x",
        "checksum": "xxh3_64",
        "chunk_bytes": 64,
        "alignment": 64,
        "objects": [],
        "tensors": [],
        "state": {},
        "ranks": [{"rank": 0, "state": {}, "tensors": []}],
        "health": {},
    }
    if replicas is not None:
        d["replicas"] = replicas
    return json.dumps(d)


def test_the_manifest_records_the_outcome_and_round_trips():
    ok = Manifest.from_json(_manifest_json({"checked": 10, "disagree_count": 0, "disagree": []}))
    assert ok.replicas == ReplicaRecord(10, 0, ()) and ok.healthy and ok.health_text == "healthy"
    bad = Manifest.from_json(
        _manifest_json({"checked": 10, "disagree_count": 3, "disagree": [{"tensor": "net.4.weight", "ranks": [1]}]})
    )
    assert bad.replicas_disagree and not bad.healthy and bad.health_text == "replicas disagree"
    assert Manifest.from_json(bad.to_json()) == bad
    none = Manifest.from_json(_manifest_json(None))
    assert none.replicas is None and none.healthy


@pytest.mark.parametrize(
    ("replicas", "field"),
    [
        ([], "replicas"),
        ({"checked": 1, "disagree_count": 0}, "replicas"),
        ({"checked": -1, "disagree_count": 0, "disagree": []}, "replicas.checked"),
        ({"checked": 1, "disagree_count": 2, "disagree": []}, "replicas.disagree_count"),
        (
            {"checked": 2, "disagree_count": 1, "disagree": [{"tensor": "a", "ranks": [2]}]},
            "replicas.disagree[0].ranks[0]",
        ),
        ({"checked": 2, "disagree_count": 1, "disagree": [{"tensor": 3, "ranks": [1]}]}, "replicas.disagree[0].tensor"),
        ({"checked": 2, "disagree_count": 1, "disagree": [{"tensor": "a", "ranks": []}]}, "replicas.disagree[0].ranks"),
        ({"checked": 2, "disagree_count": 0, "disagree": [{"tensor": "a", "ranks": [1]}]}, "replicas.disagree"),
    ],
)
def test_a_malformed_replica_record_is_rejected_naming_the_field(replicas, field):
    with pytest.raises(ManifestError, match=re.escape(f"field {field}:")):
        Manifest.from_json(_manifest_json(replicas), where="the manifest")


def test_a_resume_skips_a_snapshot_whose_replicas_disagreed_and_says_why():
    plan = plan_resume(
        [Candidate(8, 0, replicas="net.4.weight"), Candidate(6, 0)], max_restores=None, resume_unhealthy=False
    )
    assert [c.step for c in plan.candidates] == [6]
    assert "step 8: the ranks' replicas of 'net.4.weight' disagreed" in plan.warnings[0]
    assert "Resuming from the newest healthy snapshot (step 6)" in plan.warnings[0]
    assert "resume_unhealthy=True" in plan.warnings[0]
    kept = plan_resume([Candidate(8, 0, replicas="w"), Candidate(6, 0)], max_restores=None, resume_unhealthy=True)
    assert [c.step for c in kept.candidates] == [8, 6]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"replica_check": 0}, "replica_check must be an integer >= 1"),
        ({"replica_check": True}, "replica_check must be an integer >= 1"),
        ({"on_replica_mismatch": "ignore"}, "on_replica_mismatch must be one of 'warn', 'raise', 'skip'"),
    ],
)
def test_bad_replica_options_name_the_option(tmp_path, options, message):
    base = dict(
        resume=True,
        on_error="raise",
        max_host_bytes=None,
        chunk_bytes=1 << 20,
        sigterm_grace=25.0,
        collective_timeout=300.0,
        shutdown_timeout=30.0,
        resume_unhealthy=False,
        max_restores=3,
        mtbf=None,
    )
    with pytest.raises(ConfigError, match=message):
        SnapshotConfig.create(str(tmp_path), **base, **options)
    assert SnapshotConfig.create(str(tmp_path), **base, replica_check=None).replica_check is None


def test_a_slice_without_tensors_calls_no_collective():
    """More slices than tensors: some checks compare nothing; every rank selects the same (empty) set, so none calls
    the collective (an all_gather of nothing)."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    checker = ReplicaChecker(8)
    called = []
    empty = 0
    for step in range(8):
        names, tensors = checker.select(model, [opt], set(), _trained(opt))
        result = checker.check(step, names, tensors, lambda own: called.append(own) or [own, own])
        assert result.ok and result.checked == len(names)
        empty += not names
    assert empty >= 6 and len(called) == 8 - empty


def test_a_batch_of_one_byte_values_keeps_its_running_sum_within_batch_bytes(monkeypatch):
    """A batch's running sum holds one 64-bit integer per element whatever the dtype: batches of int8 or bool values
    are cut by elements, not bytes (else a 32 MiB batch of bytes needs 544 MiB of temporaries, on a GPU too)."""
    import lightning_snapshot.fit.replicas as replicas

    monkeypatch.setattr(replicas, "BATCH_BYTES", 1 << 16)
    made: list[int] = []
    batched = replicas._batched
    monkeypatch.setattr(replicas, "_batched", lambda ts: (made.append(sum(t.numel() for t in ts) * 8), batched(ts))[1])
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randint(-100, 100, (4096,), dtype=torch.int8, generator=g) for _ in range(40)]
    tensors += [torch.rand(1000, generator=g) > 0.5 for _ in range(10)]
    own = [checksums([t])[0] for t in tensors]  # each alone: a batch of one
    assert checksums(tensors) == own
    assert len(made) > 2 and max(made) <= 1 << 16
