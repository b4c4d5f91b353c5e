"""The optimizer/scheduler compatibility check (lightning_snapshot.state.compat): a changed setup is refused before anything
is applied, with the classes, the keys and the fix; what Lightning's built-in callbacks change during fit is accepted.

The first part uses real torch optimizers and schedulers in a stand-in trainer (what the check reads of a trainer:
``optimizers``, ``lr_scheduler_configs``, ``callbacks``). The second part runs real Lightning fits and resumes
(tests/scripts/compat_runs.py) with StochasticWeightAveraging and BackboneFinetuning, and checks the states they
produce against stand-ins shown to describe exactly what the resumed trainer had at ``on_fit_start``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, StochasticWeightAveraging
from lightning.pytorch.core.optimizer import LRSchedulerConfig
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lightning_snapshot.errors import StateMismatchError
from lightning_snapshot.state import compat

# the module-scoped fixtures below are shared by this file's tests: under pytest-xdist they run in one worker
pytestmark = pytest.mark.xdist_group("test_compat")

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
WHERE = "snapshot of step 8 in the local tier '/snaps'"


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))


def _trainer(optimizers, schedulers=(), callbacks=()):
    return SimpleNamespace(
        optimizers=list(optimizers),
        lr_scheduler_configs=[s if isinstance(s, LRSchedulerConfig) else LRSchedulerConfig(s) for s in schedulers],
        callbacks=list(callbacks),
    )


def _train(net: nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    for _ in range(steps):
        opt.zero_grad()
        net(torch.ones(2, 4)).sum().backward()
        opt.step()


def _saved(trainer):
    """What a snapshot of ``trainer`` holds: the description and the two state lists."""
    return (
        json.loads(json.dumps(compat.describe(trainer))),  # stored as JSON: it must survive that
        [o.state_dict() for o in trainer.optimizers],
        [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
    )


def _adamw_steplr(steps: int = 2):
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    _train(net, opt, steps)
    return _trainer([opt], [sched])


def _refused(trainer, saved, opts, scheds) -> str:
    with pytest.raises(StateMismatchError) as info:
        compat.check(trainer, saved, opts, scheds, WHERE)
    msg = str(info.value)
    assert msg.startswith(WHERE)
    assert "resume=False" in msg and "snapshot directory" in msg  # the fix
    return msg


# ------------------------------------------------------------------------------------------------- describe
def test_describe_is_plain_json():
    net = _net()
    opt = torch.optim.AdamW([{"params": net[0].parameters()}, {"params": net[2].parameters(), "lr": 0.1}], lr=1e-2)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    d = compat.describe(_trainer([opt], [LRSchedulerConfig(plateau, monitor="val", interval="epoch")]))
    assert json.loads(json.dumps(d)) == d
    assert d["optimizers"] == [
        {
            "class": "torch.optim.adamw.AdamW",
            "param_groups": [{"keys": sorted(k for k in opt.param_groups[0] if k != "params"), "params": 2}] * 2,
        }
    ]
    assert d["schedulers"] == [
        {
            "class": "torch.optim.lr_scheduler.ReduceLROnPlateau",
            "plateau": True,
            "optimizer": 0,
            "interval": "epoch",
            "frequency": 1,
            "monitor": "val",
            "name": None,
        }
    ]


# ------------------------------------------------------------------------------------------------- accepted
@pytest.mark.parametrize("with_description", [True, False])
@pytest.mark.parametrize("steps", [0, 2])  # before the first step (no optimizer state yet) and after
def test_identical_setup_is_accepted(with_description, steps):
    saved, opts, scheds = _saved(_adamw_steplr(steps))
    live = _adamw_steplr(0)
    compat.check(live, saved if with_description else None, opts, scheds, WHERE)
    assert [c.scheduler for c, _ in compat.schedulers_to_load(live, scheds)] == [live.lr_scheduler_configs[0].scheduler]


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
        (torch.optim.Adam, {"amsgrad": True}),
        (torch.optim.RMSprop, {"momentum": 0.5, "centered": True}),
        (torch.optim.NAdam, {}),
        (torch.optim.Adagrad, {}),
        (torch.optim.Adafactor, {}),  # per-parameter state depends on the parameter's dimensionality
        (torch.optim.LBFGS, {}),  # its step needs a closure: no dry run, the rest of the check still applies
    ],
)
def test_same_optimizer_class_is_accepted(cls, kwargs):
    net = _net()
    opt = cls(net.parameters(), **kwargs)
    if cls is torch.optim.LBFGS:
        opt.step(lambda: net(torch.ones(2, 4)).sum())
    else:
        _train(net, opt)
    saved, opts, scheds = _saved(_trainer([opt]))
    live = _trainer([cls(_net().parameters(), **kwargs)])
    compat.check(live, saved, opts, scheds, WHERE)
    compat.check(live, None, opts, scheds, WHERE)


def test_other_hyperparameters_of_the_same_class_are_accepted():
    """torch restores the saved hyperparameters over the live ones (so does Lightning): SGD saved with momentum
    keeps its momentum buffers even if the new run configures none."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    _train(net, opt)
    saved, opts, scheds = _saved(_trainer([opt]))
    compat.check(_trainer([torch.optim.SGD(_net().parameters(), lr=0.5)]), saved, opts, scheds, WHERE)


def test_extra_saved_hyperparameters_are_accepted():
    """Schedulers and callbacks add keys to the groups (initial_lr, swa_lr, a user's own): harmless when loaded."""
    saved, opts, scheds = _saved(_adamw_steplr())
    for g in opts[0]["param_groups"]:
        g["swa_lr"] = 0.01
        g["name"] = "all"
    compat.check(_adamw_steplr(0), saved, opts, scheds, WHERE)


def test_placeholders_and_name_keys_are_accepted():
    """The check reads keys and structure only: tensors may be placeholders, and a sharded strategy keys the
    optimizer state by parameter name."""
    saved, opts, scheds = _saved(_adamw_steplr())
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    osd = opts[0]
    osd["state"] = {names[k]: {n: object() for n in v} for k, v in osd["state"].items()}
    osd["param_groups"] = [{**g, "params": [names[k] for k in g["params"]]} for g in osd["param_groups"]]
    compat.check(_adamw_steplr(0), saved, opts, scheds, WHERE)


def test_check_changes_nothing():
    """Nothing is applied or created: the live optimizer has no state after the check (torch creates it lazily),
    its groups are the same objects, global optimizer hooks see no step, the RNG has not moved."""
    saved, opts, scheds = _saved(_adamw_steplr())
    live = _adamw_steplr(0)
    opt = live.optimizers[0]
    groups = [dict(g) for g in opt.param_groups]
    calls = []
    handle = register_optimizer_step_pre_hook(lambda *a: calls.append(a))
    try:
        rng = torch.get_rng_state()
        compat.check(live, saved, opts, scheds, WHERE)
        with pytest.raises(StateMismatchError):
            compat.check(
                _trainer([torch.optim.SGD(_net().parameters(), lr=0.1, momentum=0.9)], live.lr_scheduler_configs),
                saved,
                opts,
                scheds,
                WHERE,
            )
        assert torch.equal(torch.get_rng_state(), rng)
    finally:
        handle.remove()
    assert calls == []
    assert len(opt.state) == 0
    assert [dict(g) for g in opt.param_groups] == groups


# ------------------------------------------------------------------------------------------------- refused
@pytest.mark.parametrize("with_description", [True, False])
def test_adamw_to_sgd_momentum_is_refused_naming_classes_and_keys(with_description):
    saved, opts, scheds = _saved(_adamw_steplr())
    net = _net()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    live = _trainer([sgd], [torch.optim.lr_scheduler.StepLR(sgd, step_size=1)])
    msg = _refused(live, saved if with_description else None, opts, scheds)
    if with_description:
        assert "torch.optim.AdamW in the snapshot but torch.optim.SGD now" in msg
    else:
        assert "does not record its class" in msg and "SGD" in msg
    # the hyperparameters SGD reads that the AdamW groups lack, and what they have instead
    assert "lack dampening, momentum, which SGD reads" in msg
    assert "betas" in msg
    # the per-parameter state: AdamW's against what SGD(momentum) keeps
    assert "exp_avg, exp_avg_sq, step where SGD with these hyperparameters keeps momentum_buffer" in msg


def test_adam_to_adamw_is_refused_by_class():
    """Same keys, different algorithm (torch would load it, and train AdamW as Adam)."""
    net = _net()
    opt = torch.optim.Adam(net.parameters())
    _train(net, opt)
    saved, opts, scheds = _saved(_trainer([opt]))
    msg = _refused(_trainer([torch.optim.AdamW(_net().parameters())]), saved, opts, scheds)
    assert "torch.optim.Adam in the snapshot but torch.optim.AdamW now" in msg


def test_sgd_without_momentum_state_into_adam_is_refused():
    """A saved SGD without momentum has no per-parameter state; Adam's missing hyperparameters still show."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    _train(net, opt)
    _, opts, scheds = _saved(_trainer([opt]))
    msg = _refused(_trainer([torch.optim.Adam(_net().parameters())]), None, opts, scheds)
    assert "lack" in msg and "betas" in msg and "eps" in msg


@pytest.mark.parametrize("saved_n, live_n", [(1, 2), (2, 1)])
def test_number_of_optimizers_is_refused(saved_n, live_n):
    def setup(n):
        net = _net()
        opts = [torch.optim.AdamW(net[0].parameters()), torch.optim.SGD(net[2].parameters(), lr=0.1)][:n]
        if n == 1:
            opts = [torch.optim.AdamW(net.parameters())]
        return _trainer(opts)

    saved, opts, scheds = _saved(setup(saved_n))
    msg = _refused(setup(live_n), saved, opts, scheds)
    assert f"the snapshot has {saved_n} optimizer(s)" in msg
    assert f"now returns {live_n}" in msg
    assert "torch.optim.AdamW" in msg


@pytest.mark.parametrize("with_description", [True, False])
def test_scheduler_class_change_is_refused(with_description):
    saved, opts, scheds = _saved(_adamw_steplr())
    opt = torch.optim.AdamW(_net().parameters(), lr=1e-2)
    live = _trainer([opt], [torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)])
    msg = _refused(live, saved if with_description else None, opts, scheds)
    if with_description:
        assert "LR scheduler 0 is torch.optim.StepLR in the snapshot but torch.optim.CosineAnnealingLR now" in msg
    else:
        assert "gamma, step_size where the live CosineAnnealingLR has T_max, eta_min" in msg


def test_plateau_change_is_refused_without_description():
    saved, opts, scheds = _saved(_adamw_steplr())
    opt = torch.optim.AdamW(_net().parameters(), lr=1e-2)
    live = _trainer([opt], [LRSchedulerConfig(torch.optim.lr_scheduler.ReduceLROnPlateau(opt), monitor="x")])
    assert "ReduceLROnPlateau" in _refused(live, None, opts, scheds)


@pytest.mark.parametrize("with_description", [True, False])
def test_one_vs_zero_schedulers_is_refused(with_description):
    saved, opts, scheds = _saved(_adamw_steplr())
    opt = torch.optim.AdamW(_net().parameters(), lr=1e-2)
    msg = _refused(_trainer([opt]), saved if with_description else None, opts, scheds)
    assert "the snapshot has 1 LR scheduler(s), the trainer now 0" in msg
    if with_description:
        assert "StepLR" in msg
    # and the other way round: a scheduler added since
    net = _net()
    plain = torch.optim.AdamW(net.parameters(), lr=1e-2)
    _train(net, plain)
    saved, opts, scheds = _saved(_trainer([plain]))
    msg = _refused(_adamw_steplr(0), saved if with_description else None, opts, scheds)
    assert "the snapshot has 0 LR scheduler(s), configure_optimizers() now 1 (added: torch.optim.StepLR)" in msg


@pytest.mark.parametrize("with_finetuning", [False, True])
def test_group_count_change_is_refused_unless_re_added(with_finetuning):
    net = _net()
    opt = torch.optim.Adam([{"params": net[2].parameters()}, {"params": net[0].parameters(), "lr": 1e-3}])
    _train(net, opt)
    saved, opts, scheds = _saved(_trainer([opt]))
    callbacks = [BackboneFinetuning()] if with_finetuning else []
    live = _trainer([torch.optim.Adam(_net()[2].parameters())], callbacks=callbacks)
    msg = _refused(live, saved, opts, scheds)
    assert "the snapshot has 2 parameter group(s) of [2, 2] parameters, the optimizer 1 of [2]" in msg
    assert ("BackboneFinetuning adds parameter groups during fit" in msg) == with_finetuning


def test_params_per_group_change_is_refused():
    saved, opts, scheds = _saved(_adamw_steplr())
    net = _net()
    opt = torch.optim.AdamW(net[0].parameters(), lr=1e-2)
    live = _trainer([opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1)])
    assert "1 parameter group(s) of [4] parameters, the optimizer 1 of [2]" in _refused(live, saved, opts, scheds)


def test_saved_swalr_without_swa_is_refused_with_a_hint():
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    swalr = torch.optim.swa_utils.SWALR(opt, swa_lr=0.01)
    _train(net, opt)
    saved, opts, scheds = _saved(_trainer([opt], [swalr]))
    live_opt = torch.optim.SGD(_net().parameters(), lr=0.1)
    # no SWA callback, the user's StepLR back in its place
    live = _trainer([live_opt], [torch.optim.lr_scheduler.StepLR(live_opt, step_size=1)])
    assert "SWALR is StochasticWeightAveraging's scheduler" in _refused(live, saved, opts, scheds)
    assert "SWALR is StochasticWeightAveraging's scheduler" in _refused(live, None, opts, scheds)
    # SWA present but its state not loaded before its on_fit_start (so it did not clear the schedulers)
    live.callbacks.append(StochasticWeightAveraging(swa_lrs=0.01))
    assert "must be loaded before its on_fit_start" in _refused(live, saved, opts, scheds)
    # no scheduler now, and no SWA to restore the saved SWALR
    assert "not restored: torch.optim.swa_utils.SWALR" in _refused(_trainer([live_opt]), saved, opts, scheds)


def test_missing_state_dict_is_refused():
    saved, _, scheds = _saved(_adamw_steplr())
    assert "no optimizer state_dict" in _refused(_adamw_steplr(0), saved, [{"state": {}}], scheds)


# ------------------------------------------------------------------------------------------------- real Lightning runs
def _run(tmp: Path, *args: str) -> dict:
    out = tmp / "result.pt"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "compat_runs.py"), "--dir", str(tmp), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """swa (resumed from epoch 1, after SWALR replaced StepLR; and within epoch 1 from step 6), finetune (resumed
    from epoch 1, after the backbone's group was added), plain resumed as sgd (AdamW+StepLR -> SGD+cosine)."""
    root = tmp_path_factory.mktemp("compat")
    return {
        "swa": _run(root / "swa", "--setup", "swa", "--mid-step", "6"),
        "finetune": _run(root / "finetune", "--setup", "finetune"),
        "changed": _run(root / "changed", "--setup", "plain", "--resume-setup", "sgd"),
    }


def _model(setup: str):
    sys.path.insert(0, str(SCRIPTS))
    try:
        from compat_runs import Model
    finally:
        sys.path.remove(str(SCRIPTS))
    torch.manual_seed(0)
    return Model(setup)


@pytest.mark.slow
def test_lightning_resumes_accepted_in_the_real_runs(runs):
    for name in ("swa", "finetune"):
        resumed = runs[name]["resumed"]
        assert "fit_error" not in resumed
        assert resumed["check"] == "ok", resumed["check"]
        assert resumed["check_without_description"] == "ok", resumed["check_without_description"]
        assert resumed["pairs"] == []  # SWA cleared the schedulers; finetune has none
    changed = runs["changed"]["resumed"]
    assert "torch.optim.AdamW in the snapshot but torch.optim.SGD now" in changed["check"]
    assert "lack dampening, momentum" in changed["check"] and "momentum_buffer" in changed["check"]
    assert "torch.optim.StepLR in the snapshot but torch.optim.CosineAnnealingLR now" in changed["check"]
    # what Lightning itself does with that checkpoint: loads it, then fails in SGD's first step
    assert changed["fit_error"] == "KeyError: 'momentum'"


@pytest.mark.slow
def test_swa_states_against_the_resumed_trainer(runs):
    """The checkpoint of epoch 1 holds SWALR (SWA swapped it for StepLR) and groups with swa_lr; the resumed trainer
    at on_fit_start has SGD and no scheduler (SWA cleared it, holding SWALR's state itself)."""
    run = runs["swa"]
    ckpt = run["ckpt"]
    assert [d["class"] for d in ckpt["compat_description"]["schedulers"]] == ["torch.optim.swa_utils.SWALR"]
    assert "swa_lr" in ckpt["optimizer_states"][0]["param_groups"][0]
    # a stand-in for the resumed trainer, built the way Lightning built it
    model = _model("swa")
    config = model.configure_optimizers()
    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2, annealing_epochs=2)
    swa.load_state_dict(ckpt["callbacks"]["StochasticWeightAveraging"])
    live = _trainer([config["optimizer"]], [config["lr_scheduler"]], [swa])
    swa._clear_schedulers(live)  # what its on_fit_start does with a scheduler state
    assert compat.describe(live) == run["resumed"]["fit_start"]["description"]
    for saved in (ckpt["compat_description"], None):
        compat.check(live, saved, ckpt["optimizer_states"], ckpt["lr_schedulers"], WHERE)
    assert compat.schedulers_to_load(live, ckpt["lr_schedulers"]) == []
    # every epoch-end state of the first run (StepLR before the swap, SWALR after) against its own setup
    for record in run["first"]["records"]:
        fresh = _model("swa").configure_optimizers()
        swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2, annealing_epochs=2)
        swa_state = record["lr_schedulers"][0] if "anneal_epochs" in record["lr_schedulers"][0] else None
        swa._scheduler_state = swa_state
        live = _trainer([fresh["optimizer"]], [] if swa_state else [fresh["lr_scheduler"]], [swa])
        compat.check(live, record["description"], record["optimizer_states"], record["lr_schedulers"], WHERE)
    # without SWA, the same checkpoint is refused
    fresh = _model("swa").configure_optimizers()
    msg = _refused(
        _trainer([fresh["optimizer"]], [fresh["lr_scheduler"]]),
        ckpt["compat_description"],
        ckpt["optimizer_states"],
        ckpt["lr_schedulers"],
    )
    assert "torch.optim.swa_utils.SWALR" in msg and "StochasticWeightAveraging" in msg


@pytest.mark.slow
def test_finetune_states_against_the_resumed_trainer(runs):
    """The checkpoint of epoch 1 holds two groups (BackboneFinetuning added the backbone's); the resumed trainer has
    them again once BackboneFinetuning's on_fit_start ran on its loaded state, and one without that state."""
    run = runs["finetune"]
    ckpt = run["ckpt"]
    assert [len(g["params"]) for g in ckpt["optimizer_states"][0]["param_groups"]] == [2, 2]

    def live(load_state: bool):
        model = _model("finetune")
        cb = BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5)
        cb.freeze_before_training(model)  # its setup
        trainer = _trainer([model.configure_optimizers()], callbacks=[cb])
        if load_state:
            cb.load_state_dict(ckpt["callbacks"]["BackboneFinetuning"])
        cb.on_fit_start(trainer, model)
        return trainer

    trainer = live(load_state=True)
    assert compat.describe(trainer) == run["resumed"]["fit_start"]["description"]
    for saved in (ckpt["compat_description"], None):
        compat.check(trainer, saved, ckpt["optimizer_states"], ckpt["lr_schedulers"], WHERE)
    msg = _refused(live(load_state=False), ckpt["compat_description"], ckpt["optimizer_states"], ckpt["lr_schedulers"])
    assert "2 parameter group(s) of [2, 2] parameters, the optimizer 1 of [2]" in msg
    assert "BackboneFinetuning adds parameter groups during fit" in msg
    # the epoch-end states of the first run: one group at epoch 0, two after
    assert [[len(g["params"]) for g in r["optimizer_states"][0]["param_groups"]] for r in run["first"]["records"]] == [
        [2],
        [2, 2],
        [2, 2],
        [2, 2],
    ]


@pytest.mark.slow
def test_swa_within_epoch_resume_reinstates_swalr(runs):
    """Resumed from step 6 (inside epoch 1, after SWA's epoch start installed SWALR): the epoch's start hooks do not
    run again, so without compat.reinstate_epoch_start_schedulers the epoch ends without the SWALR step and every
    later learning rate is an epoch behind; with it the learning rates and scheduler states follow the run that was
    not interrupted."""
    run = runs["swa"]
    first, mid, plain = run["first"], run["mid"], run["mid_plain"]
    assert mid["reinstated"] == ["StochasticWeightAveraging"]
    assert mid["lrs"] == first["lrs"][6:]
    assert plain["lrs"] != first["lrs"][6:]
    by_epoch = {r["epoch"]: r["lr_schedulers"] for r in first["records"]}
    for record in mid["records"]:
        assert record["lr_schedulers"] == by_epoch[record["epoch"]]


def test_reinstate_does_nothing_without_swa_state():
    assert (
        compat.reinstate_epoch_start_schedulers(_trainer([], callbacks=[StochasticWeightAveraging(0.01)]), None) == []
    )
