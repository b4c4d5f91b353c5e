"""Healthy snapshots and the crash-loop breaker (issue 15, items 1 and 2).

In-process: the manifest's ``health`` field (written from the staged bytes, parsed as untrusted input), the restore
records next to a snapshot, and the pure selection logic. In real processes: a NaN injected after step N makes the
later snapshots unhealthy and the resume starts from N, bitwise equal to a run that never saw the NaN; a 2-rank DDP
job that crashes right after every restore takes the snapshot before after ``max_restores`` attempts.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_bitwise_equal, assert_resumed, run_train

from lightning_snapshot import SnapshotCallback
from lightning_snapshot.backends.local import LocalTier
from lightning_snapshot.cli.main import main as cli_main
from lightning_snapshot.dist.comm import LocalComm
from lightning_snapshot.errors import ConfigError, ManifestError
from lightning_snapshot.format.manifest import RESTORES_NAME, Manifest, health_group, step_dirname
from lightning_snapshot.persist.writer import SnapshotJob, apply_retention, committed_steps, write_snapshot
from lightning_snapshot.restore.loader import read_manifest, read_section
from lightning_snapshot.restore.policy import (
    Candidate,
    plan_resume,
)
from lightning_snapshot.restore.records import manifest_digest, read_candidate, read_restores, record_restore
from lightning_snapshot.staging import stage


def _write(
    tier: LocalTier,
    step: int,
    *,
    weight: torch.Tensor | None = None,
    exp_avg: torch.Tensor | None = None,
    run_id: str = "run1",
) -> Manifest:
    shared = {
        "state_dict": {
            "a.weight": torch.ones(3, 2) if weight is None else weight,
            "a.steps": torch.arange(4),
            "b.weight": torch.ones(5, dtype=torch.bfloat16),
        },
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(3, 2) if exp_avg is None else exp_avg}},
                "param_groups": [{"lr": 0.1}],
            },
            {"state": {0: {"exp_avg": torch.zeros(2, dtype=torch.complex64)}}, "param_groups": [{"lr": 0.2}]},
        ],
    }
    job = SnapshotJob(step, 0, shared=stage(shared), private=stage({"rng": torch.zeros(2)}, "rank"))
    return write_snapshot(tier, LocalComm(), job, run_id=run_id)


# ------------------------------------------------------------------------------------------------ the manifest field


def test_health_is_recorded_per_group_with_the_first_nonfinite_tensor(tmp_path, capsys):
    tier = LocalTier(tmp_path)
    healthy = _write(tier, 2)
    assert healthy.health == {"state_dict": None, "optimizer_states/0": None, "optimizer_states/1": None}
    assert healthy.first_nonfinite is None and healthy.health_text == "healthy"
    bad_weight = torch.ones(3, 2)
    bad_weight[1, 0] = float("inf")
    bad_avg = torch.zeros(3, 2)
    bad_avg[2, 1] = float("nan")
    sick = _write(tier, 4, weight=bad_weight, exp_avg=bad_avg)
    assert sick.health == {
        "state_dict": "state_dict/a.weight",
        "optimizer_states/0": "optimizer_states/0/state/0/exp_avg",
        "optimizer_states/1": None,
    }
    assert sick.first_nonfinite == ("state_dict", "state_dict/a.weight")
    # the field travels through the format: parsed back from the file, verified like any snapshot
    again = read_manifest(tier, 4)
    assert again.health == sick.health
    read_section(tier, again, again.tensors, again.state)
    # list and inspect show it
    assert cli_main(["list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert [line.split()[5] for line in out.splitlines()[1:]] == ["NaN/inf", "healthy"]  # (size: "348 B")
    assert cli_main(["inspect", str(tmp_path), "--step", "4"]) == 0
    out = capsys.readouterr().out
    assert (
        "health: NaN/inf (state_dict: NaN/inf (first in 'state_dict/a.weight'); optimizer_states/0: NaN/inf"
        " (first in 'optimizer_states/0/state/0/exp_avg'); optimizer_states/1: finite)"
    ) in out


def test_manifest_without_health_is_unknown_and_counts_as_healthy(tmp_path, capsys):
    tier = LocalTier(tmp_path)
    _write(tier, 2)
    path = tmp_path / step_dirname(2) / "manifest.json"
    raw = json.loads(path.read_text())
    del raw["health"]  # a manifest written before health was recorded
    path.write_text(json.dumps(raw))
    m = read_manifest(tier, 2)
    assert m.health is None and m.first_nonfinite is None and m.health_text == "unknown"
    candidate, _ = read_candidate(tier, 2, 0)
    assert candidate.nonfinite is None
    assert cli_main(["inspect", str(tmp_path)]) == 0
    assert "health: unknown (written before lightning-snapshot recorded health" in capsys.readouterr().out


@pytest.mark.parametrize(
    "value,message",
    [
        ([], "field health: expected an object mapping tensor groups to null or a tensor name, got list"),
        ({"../x": None}, "field health: group name '../x' is not a tensor group"),
        (
            {"state_dict": 3},
            "field health.state_dict: expected null (all values finite) or the name of a shared tensor"
            " of this manifest, got 3",
        ),
        ({"state_dict": "state_dict/nope"}, "got 'state_dict/nope'; the manifest is corrupted: use another snapshot"),
    ],
)
def test_bad_health_values_are_rejected_with_a_clear_error(tmp_path, value, message):
    _write(LocalTier(tmp_path), 2)
    raw = json.loads((tmp_path / step_dirname(2) / "manifest.json").read_text())
    raw["health"] = value
    with pytest.raises(ManifestError) as e:
        Manifest.from_json(json.dumps(raw), where="manifest of step 2")
    assert str(e.value).startswith("manifest of step 2: field health")
    assert message in str(e.value)


def test_health_groups():
    assert health_group("state_dict/net.0.weight") == "state_dict"
    assert health_group("optimizer_states/12/state/3/exp_avg") == "optimizer_states/12"
    assert health_group("weird name/x") == "other"


# ------------------------------------------------------------------------------------------------ restore records


def test_restore_records_are_counted_per_commit_and_leave_the_format_alone(tmp_path):
    tier = LocalTier(tmp_path, keep_last=2)
    _write(tier, 2)
    _write(tier, 4)
    _, manifest_id = read_candidate(tier, 4, 0)
    assert manifest_id == manifest_digest((tmp_path / step_dirname(4) / "manifest.json").read_bytes())
    assert read_restores(tier, 4, manifest_id) == 0
    record_restore(tier, 4, manifest_id, 1)
    record_restore(tier, 4, manifest_id, 2)
    assert read_restores(tier, 4, manifest_id) == 2
    assert read_candidate(tier, 4, 0)[0] == Candidate(4, 0, None, 2)
    # the record is no part of the snapshot: listing, verification and a rewrite of another step leave it alone
    assert committed_steps(tier) == [4, 2]
    m = read_manifest(tier, 4)
    read_section(tier, m, m.tensors, m.state)
    assert RESTORES_NAME not in {o.key for o in m.objects}
    # the same step committed again (a new snapshot of it): the old count does not apply to it
    _write(tier, 4, run_id="run2")
    assert (tmp_path / step_dirname(4) / RESTORES_NAME).exists()
    assert read_candidate(tier, 4, 0)[0].restores == 0
    # retention removes it with its step
    _write(tier, 6)
    _write(tier, 8)
    apply_retention(tier, 8)
    assert committed_steps(tier) == [8, 6] and not (tmp_path / step_dirname(4)).exists()


def test_retention_keeps_the_newest_healthy_snapshot(tmp_path):
    tier = LocalTier(tmp_path, keep_last=1)
    nan = torch.full((3, 2), float("nan"))
    _write(tier, 2)
    for step in (4, 6):
        _write(tier, step, weight=nan)
        apply_retention(tier, step)
    assert committed_steps(tier) == [6, 2]
    _write(tier, 8)  # healthy again: the older healthy one goes
    apply_retention(tier, 8)
    assert committed_steps(tier) == [8]


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b'{"restores": -1, "manifest": "x"}',
        b'{"restores": true}',
        b"[1, 2]",
        b'{"restores": 2}',
        b" " * 5000,
    ],
)
def test_malformed_restore_records_count_zero(tmp_path, content, caplog):
    tier = LocalTier(tmp_path)
    _write(tier, 2)
    _, manifest_id = read_candidate(tier, 2, 0)
    (tmp_path / step_dirname(2) / RESTORES_NAME).write_bytes(content)
    assert read_restores(tier, 2, manifest_id) == 0
    assert "ignoring the malformed restore record step-000000000002/restores.json" in caplog.text


# ------------------------------------------------------------------------------------------------ selection logic


def test_plan_skips_unhealthy_snapshots_with_one_warning():
    cands = [
        Candidate(8, 0, ("state_dict", "state_dict/w")),
        Candidate(8, 1, ("state_dict", "state_dict/w")),
        Candidate(6, 0, ("optimizer_states/0", "optimizer_states/0/state/0/exp_avg")),
        Candidate(4, 0),
        Candidate(2, 0),
    ]
    plan = plan_resume(cands, max_restores=3, resume_unhealthy=False)
    assert [c.step for c in plan.candidates] == [4, 2]
    assert plan.warnings == (
        "lightning-snapshot: skipping the unhealthy snapshot of step 8: tensor 'state_dict/w' of 'state_dict' holds a"
        " NaN or an infinity (also unhealthy: step 6). Resuming from the newest healthy snapshot (step 4); pass"
        " SnapshotCallback(resume_unhealthy=True) to resume from unhealthy snapshots anyway",
    )
    assert plan.problem is None
    opted_out = plan_resume(cands, max_restores=3, resume_unhealthy=True)
    assert opted_out.candidates == tuple(cands) and opted_out.warnings == ()


def test_plan_breaks_a_crash_loop_with_the_largest_count_over_tiers():
    cands = [Candidate(8, 0, restores=1), Candidate(8, 1, restores=3), Candidate(6, 0, restores=2), Candidate(4, 1)]
    plan = plan_resume(cands, max_restores=3, resume_unhealthy=False)
    assert [(c.step, c.tier) for c in plan.candidates] == [(6, 0), (4, 1)]
    (warning,) = plan.warnings
    assert warning.startswith(
        "lightning-snapshot: the snapshot of step 8 was restored 3 times (max_restores=3) and"
        " no newer snapshot was committed since: the run crashes after restoring it, so this"
        " resume takes the snapshot before it (step 6)"
    )
    assert "Delete step-000000000008/restores.json in its tiers to try it again, or raise max_restores" in warning
    assert plan_resume(cands, max_restores=None, resume_unhealthy=False).candidates == tuple(cands)
    assert [c.step for c in plan_resume(cands, max_restores=2, resume_unhealthy=False).candidates] == [4]


def test_plan_with_nothing_left_says_why():
    plan = plan_resume(
        [Candidate(4, 0, ("state_dict", "state_dict/w")), Candidate(2, 0, restores=5)],
        max_restores=3,
        resume_unhealthy=False,
    )
    assert plan.candidates == ()
    assert plan.problem is not None and plan.problem.startswith("every committed snapshot was skipped: ")
    assert plan.problem.endswith("(or pass resume=False to start fresh)")
    assert plan_resume([], max_restores=3, resume_unhealthy=False) == plan_resume(
        [], max_restores=1, resume_unhealthy=True
    )


def test_fit_with_only_unhealthy_snapshots_stops_and_says_why(tmp_path):
    import lightning as L
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_snapshot.errors import SnapshotNotFoundError

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 3)

        def training_step(self, batch, batch_idx):
            return self.a(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    _write(LocalTier(tmp_path), 4, weight=torch.full((3, 2), float("nan")))
    trainer = L.Trainer(
        max_steps=1,
        callbacks=[SnapshotCallback(str(tmp_path))],
        logger=False,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(SnapshotNotFoundError) as e, pytest.warns(UserWarning, match="unhealthy snapshot of step 4"):
        trainer.fit(Tiny(), DataLoader(TensorDataset(torch.ones(4, 2)), batch_size=2))
    assert str(e.value).startswith(
        "lightning-snapshot cannot resume: every committed snapshot was skipped:"
        " lightning-snapshot: skipping the unhealthy snapshot of step 4: tensor"
        " 'state_dict/a.weight'"
    )
    assert str(e.value).endswith("(or pass resume=False to start fresh)")


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"max_restores": 0}, "max_restores must be an integer >= 1 (or None"),
        ({"max_restores": True}, "max_restores must be an integer >= 1 (or None"),
        ({"resume_unhealthy": "yes"}, "resume_unhealthy must be True or False, got 'yes'"),
    ],
)
def test_options_are_validated(tmp_path, kw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        SnapshotCallback(str(tmp_path), **kw)


# ------------------------------------------------------------------------------------------------ real processes


@pytest.mark.slow
def test_nan_after_step_n_resumes_from_n_bitwise_equal_to_a_run_without_the_nan(tmp_path, reference_runs):
    """A NaN enters the gradient of the optimizer step after step 6 (so the state of steps 7.. holds NaNs and the
    snapshot of step 9 is unhealthy); the run is SIGKILLed at step 10, once step 9 is committed. The restarted run
    (without the NaN) skips step 9 with one warning and resumes from step 6. The reference: the same schedule run
    uninterrupted without the NaN (train.py's defaults: 20 steps, a snapshot every 3; the same reference run as
    test_resume's "no-shuffle" case), whose state up to step 6 is the crashed run's (the NaN came after it, and the
    injection draws no random numbers), so from step 6 both follow the same schedule and must end bitwise equal."""
    snaps = tmp_path / "snaps"
    run_train(
        snaps, tmp_path / "crashed.pt", "--nan-at", "6", "--crash-at", "10", "--crash-after-newest", expect_kill=True
    )
    tier = LocalTier(snaps)
    # (step 3 may still be there: the kill comes as soon as step 9's manifest is committed, maybe before retention)
    assert committed_steps(tier)[:2] == [9, 6]
    assert read_manifest(tier, 9).first_nonfinite == ("state_dict", "state_dict/net.0.weight")
    assert read_manifest(tier, 6).health_text == "healthy"
    proc = run_train(snaps, tmp_path / "resumed.pt")
    assert_resumed(proc, 6, snaps)
    warning = (
        "lightning-snapshot: skipping the unhealthy snapshot of step 9: tensor 'state_dict/net.0.weight' of"
        " 'state_dict' holds a NaN or an infinity. Resuming from the newest healthy snapshot (step 6)"
    )
    assert proc.stderr.count(warning) == 1, proc.stderr
    assert_bitwise_equal(reference_runs(), tmp_path / "resumed.pt")
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in resumed["model"].values() if v.is_floating_point())


@pytest.mark.slow
def test_ddp_trainer_crashing_after_every_restore_falls_back_after_max_restores(tmp_path):
    """2 DDP ranks (gloo, real processes). A first run commits steps 4 and 6; then every run SIGKILLs itself right
    after its restore. With max_restores=2, the first two restarts restore step 6 (recorded durably next to it), the
    third takes step 4 on both ranks, with one warning saying why."""
    args = ("--devices", "2", "--max-steps", "6", "--every", "2", "--max-restores", "2")
    snaps = tmp_path / "snaps"
    run_train(snaps, tmp_path / "first.pt", *args)
    tier = LocalTier(snaps)
    assert committed_steps(tier) == [6, 4]
    again = (*args[:3], "10", *args[4:], "--crash-after-restore")
    for attempt in (1, 2):
        proc = run_train(snaps, tmp_path / "crashed.pt", *again, expect_kill=True)
        assert sorted(proc.stdout.count(f"RESTORED step=6 from={snaps} rank={r}") for r in (0, 1)) == [1, 1], (
            proc.stdout
        )
        record = json.loads((snaps / step_dirname(6) / RESTORES_NAME).read_text())
        assert record["restores"] == attempt
    proc = run_train(snaps, tmp_path / "crashed.pt", *again, expect_kill=True)
    assert sorted(proc.stdout.count(f"RESTORED step=4 from={snaps} rank={r}") for r in (0, 1)) == [1, 1], proc.stdout
    assert (
        proc.stderr.count(
            "lightning-snapshot: the snapshot of step 6 was restored 2 times (max_restores=2) and"
            " no newer snapshot was committed since"
        )
        == 1
    ), proc.stderr
    assert json.loads((snaps / step_dirname(4) / RESTORES_NAME).read_text())["restores"] == 1
    assert json.loads((snaps / step_dirname(6) / RESTORES_NAME).read_text())["restores"] == 2
    assert committed_steps(tier) == [6, 4]
